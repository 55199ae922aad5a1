"""route-sim part 1, the course's exercise: ``tokens`` random tokens routed once by a fresh router; loads, CV,
MaxVio, capacity drops and the Switch aux penalty recorded; both dispatches (loop and sorted) run and checked
against each other and against a dense float64 reference (:mod:`route_checks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tfmoe.components import moe
from tfmoe.components import moe_reference as ref
from tfmoe.contract.recorder import Recorder
from tfmoe.contract.tables import Rows
from tfmoe.experiments.route_sim import checks
from tfmoe.experiments.route_sim.plots import course_plot
from tfmoe.rules import finite

if TYPE_CHECKING:
    from tfmoe.experiments.route_sim.settings import Settings


COURSE_QUANTITIES = ("course.cv", "course.maxvio", "course.dropped_fraction", "course.balance_loss",
                     "course.z_loss", "course.router_entropy")


@dataclass
class CourseResult:
    load: torch.Tensor  # (E,)
    capacity: int | None
    keep: torch.Tensor  # (N,k)
    processed: torch.Tensor  # (E,)
    cv: float
    maxvio: float
    dropped_fraction: float
    balance_loss: float


def course_case(s: Settings, rec: Recorder) -> CourseResult:
    """Route ``s.tokens`` random tokens once; record, save, plot and check."""
    gen = torch.Generator().manual_seed(rec.seed)
    x = torch.randn(s.tokens, s.d_model, generator=gen).to(rec.device, rec.dtype)  # (N,D)
    torch.manual_seed(rec.seed)
    layer = moe.MoELayer(s.d_model, s.d_hidden, s.n_experts, s.top_k, s.capacity_factor, s.score_func)
    layer = layer.to(rec.device, rec.dtype).eval()
    with torch.no_grad():
        routing = layer.router(x)
        idx, weight = routing.topk_idx, routing.topk_weight.to(rec.dtype)
        load = moe.expert_load(idx, s.n_experts)  # (E,) before capacity
        capacity = moe.expert_capacity(s.tokens, s.top_k, s.n_experts, s.capacity_factor)
        keep = moe.capacity_keep(idx, s.n_experts, capacity)  # (N,k)
        out_loop, processed_loop = moe.dispatch_loop(x, idx, weight, keep, layer.experts)
        out_sorted, processed_sorted = moe.dispatch_sorted(x, idx, weight, keep, layer.experts)
        cv, maxvio = float(moe.load_cv(load)), float(moe.load_maxvio(load))
        dropped = int((~keep).sum())
        balance = float(moe.switch_aux_loss(routing.probs, idx, s.aux_loss_coef))
        zl = float(moe.router_z_loss(routing.logits, s.z_loss_coef))
        entropy = float(moe.router_entropy(routing.probs))
        ref64 = ref.dense_mixture(x, idx, weight, keep, layer.experts, torch.float64)
        plain = ref.dense_mixture(x, idx, weight, keep, layer.experts, rec.dtype)

    # the course case's own address, apart from the training simulation's per-strategy, per-step rows:
    # `--expect "course.cv ~ 0.19 ± 0.05"`, `--expect "course.load[expert=0] < 40"`
    rec.metric("course.cv", cv)
    rec.metric("course.maxvio", maxvio)
    rec.metric("course.dropped_fraction", dropped / (s.tokens * s.top_k))
    rec.metric("course.balance_loss", balance)
    rec.metric("course.z_loss", zl)
    rec.metric("course.router_entropy", entropy)
    for e in range(s.n_experts):
        rec.metric("course.load", int(load[e]), expert=e)
        rec.metric("course.kept", int(processed_sorted[e]), expert=e)
        rec.metric("course.dropped", int(load[e]) - int(processed_sorted[e]), expert=e)
    rec.tensor("router_probs", routing.probs)
    rec.tensor("topk_idx", idx)
    rec.tensor("topk_weight", routing.topk_weight)
    rec.tensor("expert_load", load)
    rec.tensor("kept_load", processed_sorted)

    saved = rec.tensors_saved
    checks.check_loads_sum(rec, "loads_sum", load, s.tokens, s.top_k)
    checks.check_cv_maxvio(rec, "cv_maxvio_recomputed", saved["topk_idx"], s.n_experts,
                           checks.recorded(rec, "course.cv"), checks.recorded(rec, "course.maxvio"))
    checks.check_capacity(rec, "capacity_respected.loop", processed_loop, load, capacity)
    checks.check_capacity(rec, "capacity_respected.sorted", processed_sorted, load, capacity)
    checks.check_dropped_plus_kept(rec, "dropped_plus_kept.loop", processed_loop, keep, s.tokens, s.top_k)
    checks.check_dropped_plus_kept(rec, "dropped_plus_kept.sorted", processed_sorted, keep, s.tokens, s.top_k)
    checks.check_aux_formula(rec, "aux_loss_formula", saved["router_probs"], saved["topk_idx"], s.aux_loss_coef,
                             checks.recorded(rec, "course.balance_loss"))
    checks.check_aux_balanced(rec, "aux_loss_balanced_value", s.n_experts, s.top_k)
    finite.check_finite(rec, "course.finite", COURSE_QUANTITIES, what="the course case")  # nothing is trained here
    label = "capacity" if capacity is not None else "dropless"
    checks.check_dispatch_agree(rec, f"dispatch_agree.{label}", out_loop, out_sorted)
    checks.check_dispatch_dense(rec, f"dispatch_vs_dense.{label}", out_sorted, ref64, plain)
    if capacity is not None:  # the same routing again without a capacity limit
        all_kept = torch.ones_like(keep)
        with torch.no_grad():
            dl_loop, _ = moe.dispatch_loop(x, idx, weight, all_kept, layer.experts)
            dl_sorted, _ = moe.dispatch_sorted(x, idx, weight, all_kept, layer.experts)
            dl_ref = ref.dense_mixture(x, idx, weight, all_kept, layer.experts, torch.float64)
            dl_plain = ref.dense_mixture(x, idx, weight, all_kept, layer.experts, rec.dtype)
        checks.check_dispatch_agree(rec, "dispatch_agree.dropless", dl_loop, dl_sorted)
        checks.check_dispatch_dense(rec, "dispatch_vs_dense.dropless", dl_sorted, dl_ref, dl_plain)

    loads_rows(s, load, processed_sorted, capacity).print_to(rec.console)
    rec.print(f"CV {cv:.3f}   MaxVio {maxvio:.3f}   dropped {dropped}/{s.tokens * s.top_k}   "
              f"aux loss {balance:.5f} (balanced value {s.aux_loss_coef:g})")
    rec.plot("course_loads", course_plot(load, processed_sorted, capacity, s.tokens, s.top_k))
    return CourseResult(load, capacity, keep, processed_sorted, cv, maxvio,
                        dropped / (s.tokens * s.top_k), balance)


def loads_rows(s: Settings, load: torch.Tensor, kept: torch.Tensor, capacity: int | None) -> Rows:
    """Per expert: assignments before capacity, kept, dropped."""
    rows = Rows(f"course case: {s.tokens} tokens, {s.n_experts} experts, top-{s.top_k}, "
                f"capacity {capacity if capacity is not None else 'none (dropless)'}",
                ("expert", "load", "kept", "dropped"))
    for e in range(s.n_experts):
        rows.add(e, int(load[e]), int(kept[e]), int(load[e]) - int(kept[e]))
    return rows
