"""tfmoe route-sim — course §2.6: MoE routing you can watch.

Question: how unevenly does a top-k router spread tokens over experts (loads, CV, MaxVio), what does a
capacity limit drop, and which balancing strategy (Switch aux loss, router z-loss, noisy top-k,
aux-loss-free bias) undoes a router that has collapsed onto a few experts — at what cost?

Part 1, the course's exercise: ``tokens`` random tokens routed once (default 100 tokens, 8 experts, top-2):
loads, CV, MaxVio, capacity drops, the Switch aux penalty; both dispatches (loop and sorted) run and
compared with each other and with a dense float64 reference.
Part 2, a training simulation: an MoE layer (output x + expert mixture, so a dropped token passes through
unchanged) trained with Adam on clustered inputs, the router initialised so that experts 0..k-1 win every
token; each strategy on identical data and init; per step CV, MaxVio, dropped fraction, balance loss,
router entropy, task loss.

``balance_loss`` is the Switch aux loss alpha*E*sum_i f_i*P_i (f_i = load_i/(N*k), P_i = mean router
probability) measured for every strategy as a common yardstick; it is added to the training loss only
under ``aux_loss``. ``z_loss`` likewise is measured always and applied only under ``z_loss``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from omegaconf import DictConfig, ListConfig
from rich.table import Table

from tfmoe.components import moe
from tfmoe.errors import BadInput
from tfmoe.recorder import Recorder
from tfmoe.validate import require_int, require_number

COEF_FIX = "pass a coefficient >= 0 (0 switches it off)"

STEP_METRICS = ("cv", "maxvio", "dropped_fraction", "tokens_dropped_fraction", "balance_loss", "z_loss",
                "applied_loss", "router_entropy", "task_loss")


# ------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class Params:
    tokens: int
    n_experts: int
    top_k: int
    capacity_factor: float | None
    score_func: str
    d_model: int
    d_hidden: int
    dispatch: str
    strategies: tuple[str, ...]
    steps: int
    train_tokens: int
    clusters: int
    init_skew: float
    lr: float
    aux_loss_coef: float
    z_loss_coef: float
    bias_update_rate: float






def _choice(cfg: DictConfig, key: str, options: tuple[str, ...]) -> str:
    value = cfg.get(key)
    if value not in options:
        raise BadInput(f"{key}={value!r} is unknown: use one of {', '.join(options)}")
    return str(value)


def params_from_cfg(cfg: DictConfig) -> Params:
    """Validate every key; bad input -> BadInput naming the problem and the fix."""
    n_experts = require_int(cfg, "n_experts", 1)
    top_k = cfg.get("top_k")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise BadInput(f"top_k={top_k!r} is not an integer: pass top_k between 1 and n_experts={n_experts}")
    if not 1 <= top_k <= n_experts:
        raise BadInput(f"top_k={top_k} is outside 1..n_experts={n_experts}: pass top_k between 1 and {n_experts}")
    cf = cfg.get("capacity_factor")
    if cf is not None:
        if isinstance(cf, (int, float)) and not isinstance(cf, bool) and cf <= 0:
            raise BadInput(f"capacity_factor={cf} must be > 0: pass a positive factor (1.0 = exactly the mean "
                           "load), or null for dropless routing")
        cf = require_number(cfg, "capacity_factor", minimum=0.0, positive=True)
    strategies = cfg.get("strategies")
    if isinstance(strategies, str):
        strategies = [strategies]
    if not isinstance(strategies, (list, tuple, ListConfig)) or len(strategies) == 0:
        raise BadInput(f"strategies={strategies!r} is not a non-empty list: pass e.g. strategies=[none,aux_loss]")
    for s in strategies:
        if s not in moe.STRATEGIES:
            raise BadInput(f"strategy {s!r} is unknown: use any of {', '.join(moe.STRATEGIES)}")
    if len(set(strategies)) != len(strategies):
        raise BadInput(f"strategies={list(strategies)} lists a strategy twice: list each once")
    return Params(
        tokens=require_int(cfg, "tokens", 1), n_experts=n_experts, top_k=top_k, capacity_factor=cf,
        score_func=_choice(cfg, "score_func", moe.SCORE_FUNCS), d_model=require_int(cfg, "d_model", 1),
        d_hidden=require_int(cfg, "d_hidden", 1), dispatch=_choice(cfg, "dispatch", moe.DISPATCHES),
        strategies=tuple(str(s) for s in strategies), steps=require_int(cfg, "steps", 0),
        train_tokens=require_int(cfg, "train_tokens", 1), clusters=require_int(cfg, "clusters", 1),
        init_skew=require_number(cfg, "init_skew", minimum=0.0, fix=COEF_FIX), lr=require_number(cfg, "lr", minimum=0.0, positive=True),
        aux_loss_coef=require_number(cfg, "aux_loss_coef", minimum=0.0, fix=COEF_FIX), z_loss_coef=require_number(cfg, "z_loss_coef", minimum=0.0, fix=COEF_FIX),
        bias_update_rate=require_number(cfg, "bias_update_rate", minimum=0.0, fix=COEF_FIX),
    )


# --------------------------------------------------------------- independent references
def recompute_cv_maxvio(topk_idx: torch.Tensor, n_experts: int) -> tuple[float, float]:
    """CV (population std / mean) and MaxVio from saved assignments, in numpy float64."""
    load = np.bincount(topk_idx.cpu().numpy().reshape(-1), minlength=n_experts).astype(np.float64)
    mean = load.mean()
    return float(load.std() / mean), float((load.max() - mean) / mean)


def aux_loss_reference(probs: torch.Tensor, topk_idx: torch.Tensor, coef: float) -> float:
    """coef * E * sum_i f_i * P_i from saved probabilities and assignments, in numpy float64."""
    p = probs.cpu().double().numpy()
    idx = topk_idx.cpu().numpy()
    n, e = p.shape
    f = np.bincount(idx.reshape(-1), minlength=e) / (n * idx.shape[1])
    return float(coef * e * np.sum(f * p.mean(axis=0)))


def uniform_routing(n_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A perfectly uniform routing: probs all 1/E, token t -> experts t, t+1, ..., t+k-1 (mod E), so every
    expert gets exactly k of the E*k assignments. Returns probs (E,E) and topk_idx (E,k)."""
    probs = torch.full((n_experts, n_experts), 1.0 / n_experts)
    topk_idx = (torch.arange(n_experts)[:, None] + torch.arange(top_k)[None, :]) % n_experts
    return probs, topk_idx


def dense_mixture(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, keep: torch.Tensor,
                  experts: Any, dtype: torch.dtype) -> torch.Tensor:
    """Reference without gather/scatter: every expert on every token, combined with the (N,E) matrix of
    kept weights, in ``dtype`` (float64 for the reference, the run's dtype for the plain baseline)."""
    n, e = x.shape[0], len(experts)
    gate = torch.zeros(n, e, dtype=dtype, device=x.device)
    gate.scatter_(1, topk_idx, topk_weight.to(dtype) * keep.to(dtype))  # (N,E)
    xd = x.to(dtype)
    out = torch.zeros(xd.shape, dtype=dtype, device=x.device)
    for i, expert in enumerate(experts):
        ex = copy.deepcopy(expert).to(dtype)
        out += gate[:, i, None] * ex(xd)
    return out


# ------------------------------------------------------------------------------ checks
def check_loads_sum(rec: Recorder, name: str, load: torch.Tensor, tokens: int, top_k: int) -> bool:
    total = int(load.sum())
    return rec.check(name, total == tokens * top_k, abs(total - tokens * top_k), 0.0,
                     f"sum of per-expert loads = {total}, tokens*k = {tokens * top_k}",
                     evidence={"expert_load": load})


def check_cv_maxvio(rec: Recorder, name: str, topk_idx: torch.Tensor, n_experts: int,
                    cv_recorded: float, maxvio_recorded: float) -> bool:
    cv, maxvio = recompute_cv_maxvio(topk_idx, n_experts)
    err = max(abs(cv - cv_recorded), abs(maxvio - maxvio_recorded))
    return rec.check_le(name, err, 1e-12,
                     f"from saved topk_idx: cv={cv:.6f} maxvio={maxvio:.6f}; recorded cv={cv_recorded:.6f} "
                     f"maxvio={maxvio_recorded:.6f}", evidence={"topk_idx": topk_idx})


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


def check_aux_formula(rec: Recorder, name: str, probs: torch.Tensor, topk_idx: torch.Tensor, coef: float,
                      recorded: float) -> bool:
    ref = aux_loss_reference(probs, topk_idx, coef)
    tol = 1e-5 * abs(ref) + 1e-12  # recorded value is fp32 arithmetic
    err = abs(recorded - ref)
    return rec.check_le(name, err, tol,
                     f"balance_loss recorded {recorded:.8g} vs float64 recomputation {ref:.8g}",
                     evidence={"router_probs": probs, "topk_idx": topk_idx})


def check_aux_balanced(rec: Recorder, name: str, n_experts: int, top_k: int,
                       aux_fn: Callable[..., torch.Tensor] | None = None) -> bool:
    """Under perfectly uniform routing E*sum f_i*P_i must be exactly 1 (so the loss equals alpha)."""
    aux_fn = aux_fn or moe.switch_aux_loss
    probs, topk_idx = uniform_routing(n_experts, top_k)
    value = float(aux_fn(probs, topk_idx, coef=1.0))
    err = abs(value - 1.0)
    return rec.check_le(name, err, 1e-6,
                     f"aux loss with coef=1 under uniform routing = {value:.8g}, balanced value 1 "
                     f"(HF's Mixtral form would give k={top_k})")


def check_dispatch_agree(rec: Recorder, name: str, out_loop: torch.Tensor, out_sorted: torch.Tensor) -> bool:
    """Loop and sorted dispatch: bit-identical on CPU (same arithmetic order); elsewhere a tight tolerance
    (index_add_ on GPU accumulates in a scheduling-dependent order)."""
    diff = float((out_loop.double() - out_sorted.double()).abs().max()) if out_loop.numel() else 0.0
    if out_loop.device.type == "cpu":
        tol = 0.0
    else:
        tol = 4 * torch.finfo(out_loop.dtype).eps * max(float(out_loop.double().abs().max()), 1e-30)
    return rec.check_le(name, diff, tol,
                     "max |loop - sorted| over the layer output",
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


def _recorded(rec: Recorder, name: str, strategy: str, step: int | None = None) -> float:
    """The value the run recorded (last matching metrics row)."""
    for row in reversed(rec.metrics_rows):
        if row["name"] == name and row.get("strategy") == strategy and row.get("step") == step:
            return row["value"]
    raise KeyError(f"no recorded metric {name} strategy={strategy} step={step}")


# ----------------------------------------------------------------- part 1: course's case
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


def course_case(p: Params, rec: Recorder) -> CourseResult:
    """The course's exercise: route ``tokens`` random tokens once; record, save, plot and check."""
    return _course_case(p, rec)


def _course_case(p: Params, rec: Recorder) -> CourseResult:
    gen = torch.Generator().manual_seed(rec.seed)
    x = torch.randn(p.tokens, p.d_model, generator=gen).to(rec.device, rec.dtype)  # (N,D)
    torch.manual_seed(rec.seed)
    layer = moe.MoELayer(p.d_model, p.d_hidden, p.n_experts, p.top_k, p.capacity_factor, p.score_func)
    layer = layer.to(rec.device, rec.dtype).eval()
    with torch.no_grad():
        routing = layer.router(x)
        idx, weight = routing.topk_idx, routing.topk_weight.to(rec.dtype)
        load = moe.expert_load(idx, p.n_experts)  # (E,) before capacity
        capacity = moe.expert_capacity(p.tokens, p.top_k, p.n_experts, p.capacity_factor)
        keep = moe.capacity_keep(idx, p.n_experts, capacity)  # (N,k)
        out_loop, processed_loop = moe.dispatch_loop(x, idx, weight, keep, layer.experts)
        out_sorted, processed_sorted = moe.dispatch_sorted(x, idx, weight, keep, layer.experts)
        cv, maxvio = float(moe.load_cv(load)), float(moe.load_maxvio(load))
        dropped = int((~keep).sum())
        balance = float(moe.switch_aux_loss(routing.probs, idx, p.aux_loss_coef))
        zl = float(moe.router_z_loss(routing.logits, p.z_loss_coef))
        entropy = float(moe.router_entropy(routing.probs))
        ref64 = dense_mixture(x, idx, weight, keep, layer.experts, torch.float64)
        plain = dense_mixture(x, idx, weight, keep, layer.experts, rec.dtype)

    tags = {"strategy": "none"}
    rec.metric("cv", cv, **tags)
    rec.metric("maxvio", maxvio, **tags)
    rec.metric("dropped_fraction", dropped / (p.tokens * p.top_k), **tags)
    rec.metric("balance_loss", balance, **tags)
    rec.metric("z_loss", zl, **tags)
    rec.metric("router_entropy", entropy, **tags)
    rec.tensor("router_probs", routing.probs)
    rec.tensor("topk_idx", idx)
    rec.tensor("topk_weight", routing.topk_weight)
    rec.tensor("expert_load", load)
    rec.tensor("kept_load", processed_sorted)

    saved = rec.tensors_saved
    check_loads_sum(rec, "loads_sum", load, p.tokens, p.top_k)
    check_cv_maxvio(rec, "cv_maxvio_recomputed", saved["topk_idx"], p.n_experts,
                    _recorded(rec, "cv", "none"), _recorded(rec, "maxvio", "none"))
    check_capacity(rec, "capacity_respected.loop", processed_loop, load, capacity)
    check_capacity(rec, "capacity_respected.sorted", processed_sorted, load, capacity)
    check_dropped_plus_kept(rec, "dropped_plus_kept.loop", processed_loop, keep, p.tokens, p.top_k)
    check_dropped_plus_kept(rec, "dropped_plus_kept.sorted", processed_sorted, keep, p.tokens, p.top_k)
    check_aux_formula(rec, "aux_loss_formula", saved["router_probs"], saved["topk_idx"], p.aux_loss_coef,
                      _recorded(rec, "balance_loss", "none"))
    check_aux_balanced(rec, "aux_loss_balanced_value", p.n_experts, p.top_k)
    label = "capacity" if capacity is not None else "dropless"
    check_dispatch_agree(rec, f"dispatch_agree.{label}", out_loop, out_sorted)
    check_dispatch_dense(rec, f"dispatch_vs_dense.{label}", out_sorted, ref64, plain)
    if capacity is not None:  # the same routing again without a capacity limit
        all_kept = torch.ones_like(keep)
        with torch.no_grad():
            dl_loop, _ = moe.dispatch_loop(x, idx, weight, all_kept, layer.experts)
            dl_sorted, _ = moe.dispatch_sorted(x, idx, weight, all_kept, layer.experts)
            dl_ref = dense_mixture(x, idx, weight, all_kept, layer.experts, torch.float64)
            dl_plain = dense_mixture(x, idx, weight, all_kept, layer.experts, rec.dtype)
        check_dispatch_agree(rec, "dispatch_agree.dropless", dl_loop, dl_sorted)
        check_dispatch_dense(rec, "dispatch_vs_dense.dropless", dl_sorted, dl_ref, dl_plain)

    table = Table(title=f"course case: {p.tokens} tokens, {p.n_experts} experts, top-{p.top_k}, "
                        f"capacity {capacity if capacity is not None else 'none (dropless)'}")
    for col in ("expert", "load", "kept", "dropped"):
        table.add_column(col, justify="right")
    for e in range(p.n_experts):
        kept_e = int(processed_sorted[e])
        table.add_row(str(e), str(int(load[e])), str(kept_e), str(int(load[e]) - kept_e))
    rec.print(table)
    rec.print(f"CV {cv:.3f}   MaxVio {maxvio:.3f}   dropped {dropped}/{p.tokens * p.top_k}   "
              f"aux loss {balance:.5f} (balanced value {p.aux_loss_coef:g})")
    rec.plot("course_loads", _course_plot(load, processed_sorted, capacity, p))
    return CourseResult(load, capacity, keep, processed_sorted, cv, maxvio,
                        dropped / (p.tokens * p.top_k), balance)


def _course_plot(load: torch.Tensor, kept: torch.Tensor, capacity: int | None, p: Params) -> Figure:
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    experts = np.arange(p.n_experts)
    ax.bar(experts, kept.numpy(), label="kept")
    ax.bar(experts, (load.cpu() - kept).numpy(), bottom=kept.numpy(), label="dropped", color="tab:red")
    mean = p.tokens * p.top_k / p.n_experts
    ax.axhline(mean, color="k", ls="--", lw=1, label=f"mean load {mean:g}")
    if capacity is not None:
        ax.axhline(capacity, color="tab:orange", lw=1, label=f"capacity {capacity}")
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments")
    ax.set_xticks(experts)
    ax.set_title(f"{p.tokens} tokens, top-{p.top_k}: CV {float(moe.load_cv(load)):.3f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------- part 2: training simulation
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


def initial_state(p: Params, task: ClusterTask, seed: int) -> dict[str, torch.Tensor]:
    """Shared init for every strategy: a fresh layer whose router gives experts 0..k-1 a head start of
    ``init_skew`` logits on a token at the shared offset."""
    torch.manual_seed(seed)
    layer = moe.MoELayer(p.d_model, p.d_hidden, p.n_experts, p.top_k, p.capacity_factor, p.score_func)
    with torch.no_grad():
        layer.router.gate.weight[: p.top_k] += p.init_skew * task.offset / task.offset.norm() ** 2
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


def train_strategy(p: Params, rec: Recorder, strategy: str, task: ClusterTask,
                   state: dict[str, torch.Tensor],
                   on_step: Callable[[str, int], None] | None = None) -> StrategyTrace:
    """Train router + experts for ``p.steps`` steps under one strategy; metrics are recorded every step
    (so an interrupted run keeps the steps done so far). Task loss = MSE(x + mixture, y): dropped
    assignments leave the token on the residual path. Runs in fp32: the dynamics are the subject."""
    device = rec.device
    layer = moe.MoELayer(p.d_model, p.d_hidden, p.n_experts, p.top_k, p.capacity_factor, p.score_func,
                         noisy=strategy == "noisy_topk", dispatch=p.dispatch)
    layer.load_state_dict(state, strict=False)  # noise gate (noisy_topk only) keeps its zero init
    layer = layer.to(device).train()
    opt = torch.optim.Adam(layer.parameters(), lr=p.lr)
    data_gen = torch.Generator().manual_seed(rec.seed + 1)  # same batches for every strategy
    noise_gen = torch.Generator(device=device).manual_seed(rec.seed + 2)
    n, k = p.train_tokens, p.top_k
    trace = StrategyTrace(strategy, moe.expert_capacity(n, k, p.n_experts, p.capacity_factor))
    for step in rec.progress(range(p.steps), total=p.steps, description=f"route-sim {strategy}"):
        xb, yb = task.sample(n, data_gen)
        xb, yb = xb.to(device), yb.to(device)
        res = layer(xb, noise_gen)
        r = res.routing
        task_loss = F.mse_loss(res.out, yb)
        balance = moe.switch_aux_loss(r.probs, r.topk_idx, p.aux_loss_coef)
        zl = moe.router_z_loss(r.logits, p.z_loss_coef)
        applied = {"aux_loss": balance, "z_loss": zl}.get(strategy, torch.zeros((), device=device))
        opt.zero_grad(set_to_none=True)
        (task_loss + applied).backward()
        opt.step()
        with torch.no_grad():
            load = moe.expert_load(r.topk_idx, p.n_experts).cpu()  # (E,) before capacity
            if strategy == "aux_free":
                moe.update_selection_bias(layer.router.selection_bias, load, p.bias_update_rate)
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
        cv_ref, maxvio_ref = recompute_cv_maxvio(r.topk_idx, p.n_experts)  # numpy, this step's assignments
        err = max(abs(cv_ref - values["cv"]), abs(maxvio_ref - values["maxvio"]))
        trace.worst_cv_maxvio_error = max(trace.worst_cv_maxvio_error, err if math.isfinite(err) else math.inf)
        trace.final_topk_idx, trace.final_load = r.topk_idx.detach().cpu(), load
        trace.steps_done = step + 1
        if on_step is not None:
            on_step(strategy, step)
    return trace


def train_strategies(p: Params, rec: Recorder,
                     on_step: Callable[[str, int], None] | None = None) -> dict[str, StrategyTrace]:
    """Every strategy on identical data and init. KeyboardInterrupt propagates (the runner records the
    steps done so far and exits 130)."""
    task = ClusterTask.make(p.d_model, p.clusters, rec.seed + 3)
    state = initial_state(p, task, rec.seed + 4)
    traces: dict[str, StrategyTrace] = {}
    for strategy in p.strategies:
        traces[strategy] = train_strategy(p, rec, strategy, task, state, on_step)
    return traces


def check_training(p: Params, rec: Recorder, traces: dict[str, StrategyTrace]) -> None:
    """Per strategy, over every step: loads sum to N*k, no expert above capacity, kept + dropped = N*k,
    recorded CV/MaxVio = a numpy recomputation from that step's assignments; and the final step's CV/MaxVio
    recomputed from its saved assignments (only the final step's topk_idx is saved)."""
    n, k = p.train_tokens, p.top_k
    for s, t in traces.items():
        rec.check(f"train.loads_sum.{s}", t.worst_load_sum_error == 0, t.worst_load_sum_error, 0.0,
                  f"max over {t.steps_done} steps of |sum of loads - tokens*k|")
        rec.check(f"train.capacity_respected.{s}", (t.worst_capacity_excess or 0) <= 0,
                  t.worst_capacity_excess, 0.0,
                  f"max over steps of processed rows - capacity {t.capacity if t.capacity else '(dropless: load)'}")
        rec.check(f"train.dropped_plus_kept.{s}", t.worst_total_error == 0, t.worst_total_error, 0.0,
                  f"max over steps of |kept + dropped - {n * k}|")
        rec.check(f"train.cv_maxvio_every_step.{s}", t.worst_cv_maxvio_error <= 1e-12, t.worst_cv_maxvio_error,
                  1e-12, f"max over {t.steps_done} steps of |recorded CV or MaxVio - numpy float64 recomputation "
                  "from that step's topk_idx|")
        rec.tensor(f"train.{s}.topk_idx", t.final_topk_idx)
        rec.tensor(f"train.{s}.expert_load", t.final_load)
        last = t.steps_done - 1
        check_cv_maxvio(rec, f"train.cv_maxvio_recomputed.{s}", rec.tensors_saved[f"train.{s}.topk_idx"],
                        p.n_experts, _recorded(rec, "cv", s, last), _recorded(rec, "maxvio", s, last))


# --------------------------------------------------------------------------- reporting
def _tail_mean(values: list[float], frac: float = 0.1) -> float:
    n = max(1, int(len(values) * frac))
    return float(np.mean(values[-n:]))


def _training_plots(p: Params, traces: dict[str, StrategyTrace]) -> dict[str, Figure]:
    figs: dict[str, Figure] = {}
    fig = Figure(figsize=(10, 4))
    ax_cv, ax_mv = fig.subplots(1, 2)
    for s, t in traces.items():
        ax_cv.plot(t.history["cv"], label=s, lw=1)
        ax_mv.plot(t.history["maxvio"], label=s, lw=1)
    ax_cv.set(xlabel="step", ylabel="CV of loads", title="CV per step")
    ax_mv.set(xlabel="step", ylabel="MaxVio", title="MaxVio per step")
    ax_cv.legend(fontsize=8)
    fig.tight_layout()
    figs["cv_maxvio"] = fig

    fig = Figure(figsize=(10, 4))
    ax_drop, ax_loss = fig.subplots(1, 2)
    for s, t in traces.items():
        (line,) = ax_drop.plot(t.history["dropped_fraction"], label=s, lw=1)
        ax_drop.plot(t.history["tokens_dropped_fraction"], color=line.get_color(), ls=":", lw=1)
        ax_loss.plot(t.history["task_loss"], label=s, lw=1)
    ax_drop.set(xlabel="step", ylabel="dropped fraction", title="dropped: assignments (solid), whole tokens (dotted)")
    ax_loss.set(xlabel="step", ylabel="task MSE", yscale="log", title="task loss (the cost side)")
    ax_drop.legend(fontsize=8)
    fig.tight_layout()
    figs["train_cost"] = fig

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    width = 0.8 / max(1, len(traces))
    experts = np.arange(p.n_experts)
    for i, (s, t) in enumerate(traces.items()):
        ax.bar(experts + i * width, t.final_load.numpy(), width, label=s)
    ax.axhline(p.train_tokens * p.top_k / p.n_experts, color="k", ls="--", lw=1, label="balanced")
    ax.set(xlabel="expert", ylabel="assignments (final step)", title="final-step loads per strategy")
    ax.set_xticks(experts + 0.4 - width / 2, [str(e) for e in experts])
    ax.legend(fontsize=8)
    fig.tight_layout()
    figs["final_loads"] = fig
    return figs


def sweep_plots(df: Any) -> dict[str, Figure]:
    """After a multirun: final-step CV per strategy and job (course-case CV where no training ran)."""
    if df is None or "name" not in df or "strategy" not in df:
        return {}
    cv = df[df["name"] == "cv"]
    if "step" in cv:
        trained = cv[cv["step"].notna()]
        if len(trained):
            cv = trained[trained["step"] == trained.groupby(["job", "strategy"])["step"].transform("max")]
    if cv.empty or "job" not in cv:
        return {}
    table = cv.pivot_table(index="job", columns="strategy", values="value", aggfunc="last")
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    width = 0.8 / max(1, len(table.columns))
    xs = np.arange(len(table.index))
    for i, s in enumerate(table.columns):
        ax.bar(xs + i * width, table[s].to_numpy(), width, label=str(s))
    ax.set_xticks(xs + 0.4 - width / 2, [str(j) for j in table.index])
    ax.set(xlabel="job", ylabel="CV (final step)", title="route-sim sweep: final CV per strategy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return {"sweep_final_cv": fig}


def _summary(p: Params, course: CourseResult, traces: dict[str, StrategyTrace]) -> str:
    cap = course.capacity if course.capacity is not None else "none (dropless)"
    lines = [
        f"## Course case: {p.tokens} tokens, {p.n_experts} experts, top-{p.top_k}, {p.score_func} router",
        "",
        f"Loads (assignments per expert, before capacity): {course.load.tolist()}; kept: "
        f"{course.processed.tolist()}; capacity {cap}.",
        f"CV {course.cv:.4f}, MaxVio {course.maxvio:.4f}, dropped fraction {course.dropped_fraction:.4f}, "
        f"Switch aux loss {course.balance_loss:.6f} (balanced value {p.aux_loss_coef:g}).",
        "",
    ]
    if traces:
        lines += [
            f"## Training simulation: {p.steps} steps x {p.train_tokens} tokens, init_skew {p.init_skew:g}",
            "",
            "Mean over the last 10% of steps (first step in brackets):",
            "",
            "| strategy | CV | MaxVio | dropped | tokens dropped | balance_loss | entropy | task loss |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for s, t in traces.items():
            h = t.history
            if not h["cv"]:
                continue
            lines.append(
                f"| {s} | {_tail_mean(h['cv']):.3f} ({h['cv'][0]:.3f}) | {_tail_mean(h['maxvio']):.3f} | "
                f"{_tail_mean(h['dropped_fraction']):.3f} | {_tail_mean(h['tokens_dropped_fraction']):.3f} | "
                f"{_tail_mean(h['balance_loss']):.5f} | "
                f"{_tail_mean(h['router_entropy']):.3f} | {_tail_mean(h['task_loss']):.4f} |")
        lines += ["", "dropped: fraction of assignments over capacity; tokens dropped: fraction of tokens with "
                  "all k assignments dropped (their output is their input). balance_loss is the Switch aux loss "
                  "measured under every strategy; it is trained on only under `aux_loss`."]
    return "\n".join(lines)


def run(cfg: DictConfig, rec: Recorder) -> None:
    from tfmoe.experiments import route_layer

    p = params_from_cfg(cfg)
    battery = route_layer.params_from_cfg(cfg)
    lut = route_layer.run_battery(battery, rec)
    rec.print(route_layer.battery_table(rec, lut))
    if battery.impl is not None:  # a user's or a transformers layer: the battery is the whole run
        rec.summary(route_layer.battery_summary(rec, lut))
        return
    rec.note("aux loss normalisation: alpha*E*sum_i f_i*P_i with f_i = load_i/(tokens*k) (balanced value alpha, "
             "Megatron-LM form; HF Mixtral's is k*alpha); CV uses the population std over experts")
    rec.note("capacity priority: 1st choices in token order, then 2nd choices, ...; dropped assignments "
             "contribute 0 to the mixture and the layer outputs x + mixture (a fully dropped token passes "
             f"through unchanged); training simulation in fp32 with {p.dispatch} dispatch")
    course = course_case(p, rec)
    traces: dict[str, StrategyTrace] = {}
    if p.steps > 0:
        traces = train_strategies(p, rec)
        check_training(p, rec, traces)
        for name, fig in _training_plots(p, traces).items():
            rec.plot(name, fig)
        table = Table(title=f"training simulation, mean of the last 10% of {p.steps} steps")
        for col in ("strategy", "CV", "MaxVio", "dropped", "tok. dropped", "balance_loss", "entropy",
                    "task loss"):
            table.add_column(col, justify="right")
        for s, t in traces.items():
            h = t.history
            table.add_row(s, *(f"{_tail_mean(h[m]):.4f}" for m in
                               ("cv", "maxvio", "dropped_fraction", "tokens_dropped_fraction",
                                "balance_loss", "router_entropy", "task_loss")))
        rec.print(table)
    rec.summary(route_layer.battery_summary(rec, lut) + "\n\n" + _summary(p, course, traces))
