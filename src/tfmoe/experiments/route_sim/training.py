"""route-sim part 2, the training simulation: an MoE layer (output x + expert mixture, so a dropped token passes
through unchanged) trained with Adam on clustered inputs, the router initialised so that experts 0..k-1 win every
token; each balancing strategy on identical data and init; per step CV, MaxVio, dropped fraction, balance loss,
router entropy and task loss, with the bookkeeping checked at every step (:func:`check_training`)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from tfmoe.components import moe
from tfmoe.components import moe_reference as ref
from tfmoe.contract.recorder import Recorder
from tfmoe.contract.tables import Rows
from tfmoe.experiments.route_sim import checks
from tfmoe.rules import finite

if TYPE_CHECKING:
    from tfmoe.experiments.route_sim.settings import Settings

STEP_METRICS = ("cv", "maxvio", "dropped_fraction", "tokens_dropped_fraction", "balance_loss", "z_loss",
                "applied_loss", "router_entropy", "task_loss")


@dataclass
class ClusterTask:
    """Tokens x = offset + centers[c] + 0.5*noise, target y = maps[c] @ x: clusters reward specialised
    experts; the shared offset is what the skewed router init keys on. The layer outputs x + mixture, so
    its experts must learn (maps[c] - I) x, and a dropped token is left with the error (maps[c] - I) x."""

    offset: torch.Tensor  # (D,)
    centers: torch.Tensor  # (C,D)
    maps: torch.Tensor  # (C,D,D)

    @classmethod
    def make(cls, d_model: int, clusters: int, seed: int) -> ClusterTask:
        g = torch.Generator().manual_seed(seed)
        offset = torch.randn(d_model, generator=g)
        offset = 3.0 * offset / offset.norm()
        centers = 1.5 * torch.randn(clusters, d_model, generator=g)
        maps = torch.randn(clusters, d_model, d_model, generator=g) / math.sqrt(d_model)
        return cls(offset, centers, maps)

    def sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.randint(0, self.centers.shape[0], (n,), generator=gen)  # (n,)
        x = self.offset + self.centers[c] + 0.5 * torch.randn(n, self.offset.numel(), generator=gen)  # (n,D)
        y = torch.einsum("nij,nj->ni", self.maps[c], x)  # (n,D)
        return x, y


def initial_state(s: Settings, task: ClusterTask, seed: int) -> dict[str, torch.Tensor]:
    """Shared init for every strategy: a fresh layer whose router gives experts 0..k-1 a head start of
    ``init_skew`` logits on a token at the shared offset."""
    torch.manual_seed(seed)
    layer = moe.MoELayer(s.d_model, s.d_hidden, s.n_experts, s.top_k, s.capacity_factor, s.score_func)
    with torch.no_grad():
        layer.router.gate.weight[: s.top_k] += s.init_skew * task.offset / task.offset.norm() ** 2
    return copy.deepcopy(layer.state_dict())


@dataclass
class StrategyTrace:
    """What one strategy's run leaves for plots, the summary and the checks."""

    strategy: str
    capacity: int | None = None
    history: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in STEP_METRICS})
    worst_load_sum_error: int = 0
    worst_capacity_excess: int | None = None
    worst_total_error: int = 0
    worst_cv_maxvio_error: float = 0.0  # max over steps of |recorded - numpy recomputation from topk_idx|
    final_topk_idx: torch.Tensor | None = None
    final_load: torch.Tensor | None = None
    steps_done: int = 0


def train_strategy(s: Settings, rec: Recorder, strategy: str, task: ClusterTask,
                   state: dict[str, torch.Tensor],
                   on_step: Callable[[str, int], None] | None = None) -> StrategyTrace:
    """Train router + experts for ``s.steps`` steps under one strategy; metrics are recorded every step
    (so an interrupted run keeps the steps done so far). Task loss = MSE(x + mixture, y): dropped
    assignments leave the token on the residual path. Runs in fp32: the dynamics are the subject."""
    device = rec.device
    layer = moe.MoELayer(s.d_model, s.d_hidden, s.n_experts, s.top_k, s.capacity_factor, s.score_func,
                         noisy=strategy == "noisy_topk", dispatch=s.dispatch)
    layer.load_state_dict(state, strict=False)  # noise gate (noisy_topk only) keeps its zero init
    layer = layer.to(device).train()
    opt = torch.optim.Adam(layer.parameters(), lr=s.lr)
    data_gen = torch.Generator().manual_seed(rec.seed + 1)  # same batches for every strategy
    noise_gen = torch.Generator(device=device).manual_seed(rec.seed + 2)
    n, k = s.train_tokens, s.top_k
    trace = StrategyTrace(strategy, moe.expert_capacity(n, k, s.n_experts, s.capacity_factor))
    for step in rec.progress(range(s.steps), total=s.steps, description=f"route-sim {strategy}"):
        xb, yb = task.sample(n, data_gen)
        xb, yb = xb.to(device), yb.to(device)
        res = layer(xb, noise_gen)
        r = res.routing
        task_loss = F.mse_loss(res.out, yb)
        balance = moe.switch_aux_loss(r.probs, r.topk_idx, s.aux_loss_coef)
        zl = moe.router_z_loss(r.logits, s.z_loss_coef)
        applied = {"aux_loss": balance, "z_loss": zl}.get(strategy, torch.zeros((), device=device))
        opt.zero_grad(set_to_none=True)
        (task_loss + applied).backward()
        opt.step()
        with torch.no_grad():
            load = moe.expert_load(r.topk_idx, s.n_experts).cpu()  # (E,) before capacity
            if strategy == "aux_free":
                moe.update_selection_bias(layer.router.selection_bias, load, s.bias_update_rate)
            processed = res.processed.cpu()
            dropped = int((~res.keep).sum())
            values = {
                "cv": float(moe.load_cv(load)), "maxvio": float(moe.load_maxvio(load)),
                "dropped_fraction": dropped / (n * k),
                "tokens_dropped_fraction": int((~res.keep.any(dim=-1)).sum()) / n,  # all k dropped: out = x
                "balance_loss": float(balance), "z_loss": float(zl),
                "applied_loss": float(applied), "router_entropy": float(moe.router_entropy(r.probs)),
                "task_loss": float(task_loss),
            }
        for name, value in values.items():
            rec.metric(name, value, step=step, strategy=strategy)
            trace.history[name].append(value)
        limit = load if trace.capacity is None else torch.full_like(load, trace.capacity)
        excess = int((processed - limit).max())
        trace.worst_capacity_excess = excess if trace.worst_capacity_excess is None else max(
            trace.worst_capacity_excess, excess)
        trace.worst_load_sum_error = max(trace.worst_load_sum_error, abs(int(load.sum()) - n * k))
        trace.worst_total_error = max(trace.worst_total_error, abs(int(processed.sum()) + dropped - n * k))
        cv_ref, maxvio_ref = ref.recompute_cv_maxvio(r.topk_idx, s.n_experts)  # numpy, this step's assignments
        err = max(abs(cv_ref - values["cv"]), abs(maxvio_ref - values["maxvio"]))
        trace.worst_cv_maxvio_error = max(trace.worst_cv_maxvio_error, err if math.isfinite(err) else math.inf)
        trace.final_topk_idx, trace.final_load = r.topk_idx.detach().cpu(), load
        trace.steps_done = step + 1
        if on_step is not None:
            on_step(strategy, step)
    return trace


def train_strategies(s: Settings, rec: Recorder,
                     on_step: Callable[[str, int], None] | None = None) -> dict[str, StrategyTrace]:
    """Every strategy on identical data and init. KeyboardInterrupt propagates (the runner records the
    steps done so far and exits 130)."""
    task = ClusterTask.make(s.d_model, s.clusters, rec.seed + 3)
    state = initial_state(s, task, rec.seed + 4)
    traces: dict[str, StrategyTrace] = {}
    for strategy in s.strategies:
        traces[strategy] = train_strategy(s, rec, strategy, task, state, on_step)
    return traces


def check_training(s: Settings, rec: Recorder, traces: dict[str, StrategyTrace]) -> None:
    """Per strategy, over every step: every recorded quantity finite (the first non-finite step and quantity
    named; ``expect_divergence`` inverts it), loads sum to N*k, no expert above capacity, kept + dropped = N*k,
    recorded CV/MaxVio = a numpy recomputation from that step's assignments; and the final step's CV/MaxVio
    recomputed from its saved assignments (only the final step's topk_idx is saved)."""
    n, k = s.train_tokens, s.top_k
    for name, t in traces.items():
        finite.check_finite(rec, f"train.finite.{name}", STEP_METRICS, expect_divergence=s.expect_divergence,
                            what=f"{t.steps_done} steps", strategy=name)
        rec.check(f"train.loads_sum.{name}", t.worst_load_sum_error == 0, t.worst_load_sum_error, 0.0,
                  f"max over {t.steps_done} steps of |sum of loads - tokens*k|")
        rec.check(f"train.capacity_respected.{name}", (t.worst_capacity_excess or 0) <= 0,
                  t.worst_capacity_excess, 0.0,
                  f"max over steps of processed rows - capacity {t.capacity if t.capacity else '(dropless: load)'}")
        rec.check(f"train.dropped_plus_kept.{name}", t.worst_total_error == 0, t.worst_total_error, 0.0,
                  f"max over steps of |kept + dropped - {n * k}|")
        rec.check(f"train.cv_maxvio_every_step.{name}", t.worst_cv_maxvio_error <= 1e-12, t.worst_cv_maxvio_error,
                  1e-12, f"max over {t.steps_done} steps of |recorded CV or MaxVio - numpy float64 recomputation "
                  "from that step's topk_idx|")
        rec.tensor(f"train.{name}.topk_idx", t.final_topk_idx)
        rec.tensor(f"train.{name}.expert_load", t.final_load)
        last = t.steps_done - 1
        checks.check_cv_maxvio(rec, f"train.cv_maxvio_recomputed.{name}", rec.tensors_saved[f"train.{name}.topk_idx"],
                               s.n_experts, checks.recorded(rec, "cv", name, last),
                               checks.recorded(rec, "maxvio", name, last))


def tail_mean(values: list[float], frac: float = 0.1) -> float:
    n = max(1, int(len(values) * frac))
    return float(np.mean(values[-n:]))


SUMMARY_ROWS = (  # (row label, metric, format) of the strategies table
    ("CV", "cv", ".3f"), ("CV, first step", "cv", ".3f"), ("MaxVio", "maxvio", ".3f"),
    ("dropped", "dropped_fraction", ".3f"), ("tokens dropped", "tokens_dropped_fraction", ".3f"),
    ("balance_loss", "balance_loss", ".5f"), ("router entropy", "router_entropy", ".3f"),
    ("task loss", "task_loss", ".4f"),
)


def strategies_rows(s: Settings, traces: dict[str, StrategyTrace]) -> Rows:
    """One column per strategy (so the table stays readable at 80 columns whatever the names), one row per
    measure: the mean over the last 10% of steps, and CV at the first step."""
    ran = {name: t for name, t in traces.items() if t.history["cv"]}
    rows = Rows(f"training simulation, mean of the last 10% of {s.steps} steps", ("measure", *ran))
    for label, metric, fmt in SUMMARY_ROWS:
        first = label.endswith("first step")
        rows.add(label, *(format(t.history[metric][0] if first else tail_mean(t.history[metric]), fmt)
                          for t in ran.values()))
    return rows
