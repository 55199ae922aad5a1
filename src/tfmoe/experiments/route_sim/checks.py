"""route-sim's checks of one routing's bookkeeping: loads, CV/MaxVio, capacity, kept + dropped, the Switch aux
loss and the two dispatches. Used by the course case (:mod:`route_course`) and the layer battery
(:mod:`route_layer`); each recomputes with :mod:`tfmoe.components.moe_reference`, never with the package's
statistics it judges."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tfmoe.components import moe
from tfmoe.components import moe_reference as ref
from tfmoe.contract.recorder import Recorder


def recorded(rec: Recorder, name: str, strategy: str | None = None, step: int | None = None) -> float:
    """The value the run recorded (last matching metrics row; the course case's rows have no strategy)."""
    for row in reversed(rec.metrics_rows):
        if row["name"] == name and row.get("strategy") == strategy and row.get("step") == step:
            return row["value"]
    raise KeyError(f"no recorded metric {name} strategy={strategy} step={step}")


# ------------------------------------------------------------------------------ loads and statistics
def check_loads_sum(rec: Recorder, name: str, load: torch.Tensor, tokens: int, top_k: int) -> bool:
    total = int(load.sum())
    return rec.check(name, total == tokens * top_k, abs(total - tokens * top_k), 0.0,
                     f"sum of per-expert loads = {total}, tokens*k = {tokens * top_k}",
                     evidence={"expert_load": load})


def check_cv_maxvio(rec: Recorder, name: str, topk_idx: torch.Tensor, n_experts: int,
                    cv_recorded: float, maxvio_recorded: float) -> bool:
    cv, maxvio = ref.recompute_cv_maxvio(topk_idx, n_experts)
    err = max(abs(cv - cv_recorded), abs(maxvio - maxvio_recorded))
    return rec.check_le(name, err, 1e-12,
                        f"from saved topk_idx: cv={cv:.6f} maxvio={maxvio:.6f}; recorded cv={cv_recorded:.6f} "
                        f"maxvio={maxvio_recorded:.6f}", evidence={"topk_idx": topk_idx})


# ------------------------------------------------------------------------------ capacity
def check_capacity(rec: Recorder, name: str, processed: torch.Tensor, load: torch.Tensor,
                   capacity: int | None) -> bool:
    """Rows each expert actually ran on <= its capacity (dropless: <= its load)."""
    limit = load.cpu() if capacity is None else torch.full_like(load.cpu(), capacity)
    excess = int((processed.cpu() - limit).max())
    what = "its load (dropless)" if capacity is None else f"capacity {capacity}"
    return rec.check(name, excess <= 0, excess, 0.0, f"max over experts of processed rows - {what}",
                     evidence={"processed": processed, "expert_load": load})


def check_dropped_plus_kept(rec: Recorder, name: str, processed: torch.Tensor, keep: torch.Tensor,
                            tokens: int, top_k: int) -> bool:
    kept, dropped = int(processed.sum()), int((~keep).sum())
    err = abs(kept + dropped - tokens * top_k)
    return rec.check(name, err == 0, err, 0.0,
                     f"kept (rows the experts ran) {kept} + dropped {dropped} vs tokens*k {tokens * top_k}",
                     evidence={"processed": processed, "keep": keep})


# ------------------------------------------------------------------------------ the Switch aux loss
def check_aux_formula(rec: Recorder, name: str, probs: torch.Tensor, topk_idx: torch.Tensor, coef: float,
                      recorded_value: float) -> bool:
    expected = ref.aux_loss_reference(probs, topk_idx, coef)
    tol = 1e-5 * abs(expected) + 1e-12  # recorded value is fp32 arithmetic
    err = abs(recorded_value - expected)
    return rec.check_le(name, err, tol,
                        f"balance_loss recorded {recorded_value:.8g} vs float64 recomputation {expected:.8g}",
                        evidence={"router_probs": probs, "topk_idx": topk_idx})


def check_aux_balanced(rec: Recorder, name: str, n_experts: int, top_k: int,
                       aux_fn: Callable[..., torch.Tensor] | None = None) -> bool:
    """Under perfectly uniform routing E*sum f_i*P_i must be exactly 1 (so the loss equals alpha)."""
    aux_fn = aux_fn or moe.switch_aux_loss
    probs, topk_idx = ref.uniform_routing(n_experts, top_k)
    value = float(aux_fn(probs, topk_idx, coef=1.0))
    err = abs(value - 1.0)
    return rec.check_le(name, err, 1e-6,
                        f"aux loss with coef=1 under uniform routing = {value:.8g}, balanced value 1 "
                        f"(HF's Mixtral form would give k={top_k})")


# ------------------------------------------------------------------------------ dispatch
def check_dispatch_agree(rec: Recorder, name: str, out_loop: torch.Tensor, out_sorted: torch.Tensor) -> bool:
    """Loop and sorted dispatch: bit-identical on CPU (same arithmetic order); elsewhere a tight tolerance
    (index_add_ on GPU accumulates in a scheduling-dependent order)."""
    diff = float((out_loop.double() - out_sorted.double()).abs().max()) if out_loop.numel() else 0.0
    if out_loop.device.type == "cpu":
        tol = 0.0
    else:
        tol = 4 * torch.finfo(out_loop.dtype).eps * max(float(out_loop.double().abs().max()), 1e-30)
    return rec.check_le(name, diff, tol, "max |loop - sorted| over the layer output",
                        evidence={"out_loop": out_loop, "out_sorted": out_sorted})


def check_dispatch_dense(rec: Recorder, name: str, out: torch.Tensor, ref64: torch.Tensor,
                         plain: torch.Tensor) -> bool:
    """Dispatch output vs a float64 dense reference, within 2x the error of the same mixture computed
    densely in the run's dtype (with a floor of a few ulps of the output's scale)."""
    err = float((out.double() - ref64).abs().max())
    plain_err = float((plain.double() - ref64).abs().max())
    floor = 4 * torch.finfo(out.dtype).eps * max(float(ref64.abs().max()), 1e-30)
    tol = max(2 * plain_err, floor)
    return rec.check_le(name, err, tol,
                        f"max |dispatch - float64 dense reference|; plain {out.dtype} dense error {plain_err:.3g}",
                        evidence={"out": out, "reference": ref64})
