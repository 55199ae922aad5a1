"""`tfmoe complexity`: parameters, FLOPs and memory of a Transformer block — analytic, counted, measured (§2.7).

For each (T, D) group: the analytic model (:mod:`tfmoe.components.complexity_model`) against what PyTorch reports for the
package's own :class:`~tfmoe.components.block.TransformerBlock`: parameter count, FlopCounterMode FLOPs
(forward and forward+backward), KV-cache bytes, bytes saved for backward; then the time of every component,
its FLOP/s as a fraction of this machine's measured matmul peak, prefill vs decode per token, and the peak
memory of a training step next to the estimate.

This module is the recipe (Settings, settings(cfg), run); the parts it orchestrates:
:mod:`~tfmoe.experiments.complexity.measure` (counted FLOPs, saved bytes, timings),
:mod:`~tfmoe.experiments.complexity.checks` (the checks), :mod:`~tfmoe.experiments.complexity.report`
(tables, figures, ``sweep_plots``), and the cost model :mod:`tfmoe.components.complexity_model`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import DictConfig

from tfmoe.components import complexity_model as cm
from tfmoe.components.attention import KVCache
from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.contract.runtime import check_threads
from tfmoe.experiments.complexity import measure
from tfmoe.experiments.complexity.checks import (
    PLAUSIBLE_PEAK_FRACTION,
    Outcome,
    exact_outcome,
    kv_cache_outcome,
    kv_per_token_outcome,
    moe_compute_outcome,
    moe_match_outcome,
    moe_outcome,
    params_outcome,
    rerun_advice,
    sdpa_outcome,
    timings_outcome,
    timings_plausibility,
)
from tfmoe.experiments.complexity.measure import STATS
from tfmoe.experiments.complexity.report import groups_figure, summary_markdown, sweep_plots, terminal_rows
from tfmoe.experiments.complexity.settings import Settings
from tfmoe.rules import memory
from tfmoe.rules.memory import Knob, available_memory_bytes, peak_memory_bytes
from tfmoe.rules.validate import require_int, require_number

__all__ = ["Settings", "run", "settings", "sweep_plots", "tag_values"]


def tag_values(s: Settings) -> dict[str, tuple[int, ...]]:
    """The tag values a run with these settings records: each measured group's T and D (an expectation naming
    another T or D is refused before the run)."""
    return {"T": tuple(dict.fromkeys(T for T, _ in s.groups)), "D": tuple(dict.fromkeys(D for _, D in s.groups))}

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


# ------------------------------------------------------------------------------------------ input
def settings(cfg: DictConfig) -> Settings:
    """The run's settings from the composed config; BadInput names the problem and the fix.

    Touches no device and allocates nothing; a CPU run's sizes are judged against the host's available memory here,
    another device's in :func:`run`.
    """
    if str(cfg.get("dtype")) not in cm.DTYPE_BYTES:
        raise BadInput(f"dtype={cfg.get('dtype')!r} is unknown: use one of {', '.join(cm.DTYPE_BYTES)}")
    T, D = cfg.get("T"), cfg.get("D")
    if (T is None) != (D is None):
        raise BadInput(f"T={T} and D={D}: give both T and D for one group, or neither to run `groups`")
    raw = [(T, D)] if T is not None else [tuple(g) for g in (cfg.get("groups") or [])]
    if not raw:
        raise BadInput("no (T, D) group to measure: pass T=... D=... or a non-empty groups list")
    H = require_int(cfg, "n_heads")
    groups: list[tuple[int, int]] = []
    for g in raw:
        if len(g) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in g):
            raise BadInput(f"group {list(g)} is not a pair of integers [T, D]: write e.g. [512, 256]")
        t, d = g
        if t <= 0:
            raise BadInput(f"T={t} must be a positive number of tokens: pass e.g. T=512")
        if d <= 0:
            raise BadInput(f"D={d} must be a positive model width: pass e.g. D=256")
        if d % H:
            raise BadInput(f"D={d} is not divisible by n_heads={H}: pick D a multiple of {H} or change n_heads")
        groups.append((t, d))
    d_ff = cfg.get("d_ff")
    if d_ff is not None and (isinstance(d_ff, bool) or not isinstance(d_ff, int) or d_ff <= 0):
        raise BadInput(f"d_ff={d_ff!r} must be a positive integer or null (= 4·D): pass e.g. d_ff=1024")
    n_experts = require_int(cfg, "n_experts")
    top_k = require_int(cfg, "top_k")
    if top_k > n_experts:
        raise BadInput(f"top_k={top_k} is larger than n_experts={n_experts}: pass top_k between 1 and {n_experts}")
    fraction = cfg.get("memory_fraction")
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise BadInput(f"memory_fraction={fraction!r} must be in (0, 1]: pass e.g. memory_fraction=0.8")
    threads = check_threads(cfg)  # the same rule the runner applies
    dtype = str(cfg.get("dtype"))
    s = Settings(dtype=dtype, dtype_bytes=cm.DTYPE_BYTES[dtype], threads=threads, groups=tuple(groups), H=H, d_ff=d_ff, B=require_int(cfg, "B"), n_layers=require_int(cfg, "n_layers"),
                    vocab=require_int(cfg, "vocab"), n_experts=n_experts, top_k=top_k,
                    min_run_time=require_number(cfg, "min_run_time", positive=True), warmup=require_int(cfg, "warmup", 0),
                    peak_matmul_n=require_int(cfg, "peak_matmul_n"), memory_fraction=float(fraction))
    if str(cfg.get("device")) == "cpu":  # the host's RAM is the device's: refused before the run starts
        refuse_oversized(s, s.dtype_bytes, memory.host_available_bytes(), "the host's")
    return s


def estimated_run_bytes(shape: cm.BlockShape, dtype_bytes: int, peak_matmul_n: int, n_experts: int = 0) -> int:
    """What one group needs at most: the block, a training step (saved activations, grads, score-sized
    temporaries), two extra score matrices (fp32; fp64 in fp64 runs) of the timing inputs, the peak-matmul
    operands, and the MoE layer built to count its parameters (n_experts FFNs of the block's width)."""
    return (cm.block_params(shape)["total"] * dtype_bytes + cm.training_peak_estimate_bytes(shape, dtype_bytes)
            + 2 * cm.score_elements(shape) * cm.accumulate_bytes(dtype_bytes) + 3 * peak_matmul_n ** 2 * dtype_bytes
            + n_experts * 2 * shape.D * (shape.d_ff or 4 * shape.D) * 4)


def refuse_oversized(settings: Settings, dtype_bytes: int, available: int, where: str = "the device's") -> None:
    """BadInput (exit 2) when the largest group would not fit in ``memory_fraction`` of ``available``, naming the size
    that dominates the estimate and a value of it that fits every group (T or D of a group of ``groups``: the T and D
    to pass for that group alone)."""
    s = settings

    def group_bytes(T: int, D: int, z: dict[str, int]) -> int:
        shape = cm.BlockShape(B=z["B"], T=T, D=D, H=s.H, d_ff=z.get("d_ff"))
        return estimated_run_bytes(shape, dtype_bytes, z["peak_matmul_n"], z["n_experts"])

    shared = {"B": Knob(s.B), "peak_matmul_n": Knob(s.peak_matmul_n), "n_experts": Knob(s.n_experts, minimum=s.top_k)}
    if s.d_ff is not None:
        shared["d_ff"] = Knob(s.d_ff)
    now = {k: kb.value for k, kb in shared.items()}
    worst = max(range(len(s.groups)), key=lambda i: group_bytes(*s.groups[i], now))
    T, D = s.groups[worst]
    knobs = {"T": Knob(T), "D": Knob(D, s.H, s.H), **shared}

    def estimate(z: dict[str, int]) -> int:  # the worst group at the sizes z, the others at theirs
        return max(group_bytes(z["T"], z["D"], z) if i == worst else group_bytes(t, d, z)
                   for i, (t, d) in enumerate(s.groups))

    memory.refuse_oversized(estimate, knobs, available, where, f"complexity (group T={T} D={D})",
                            s.memory_fraction, pinned={"T": T, "D": D})


# ----------------------------------------------------------------------------------------- run
def run(s: Settings, rec: Recorder) -> None:
    """Refuse sizes the device cannot hold, then measure every group."""
    import psutil

    refuse_oversized(s, s.dtype_bytes, available_memory_bytes(rec.device), f"{rec.device}'s")
    dtype_name = DTYPE_NAMES.get(rec.dtype, s.dtype)
    load_before = psutil.getloadavg()[0]
    _run_groups(rec, s, s.dtype_bytes, dtype_name, load_before)  # the runner applies `threads` (conf: 1) around run()


def _run_groups(rec: Recorder, s: Settings, e: int, dtype_name: str, load_before: float) -> None:
    import psutil

    # SDPA: what FlopCounterMode sees, and the custom mapping that fixes it.
    sdpa = measure.sdpa_flop_report(rec.device, rec.dtype)
    tags0 = {"T": s.groups[0][0], "D": s.groups[0][1]}
    for key in ("default_forward", "default_backward", "mapped_forward", "mapped_backward", "analytic"):
        rec.metric(f"flops_sdpa_probe_{key}", sdpa[key], **tags0)
    rec.note(f"SDPA on {rec.device} dispatches to {sdpa['kernels']}; FlopCounterMode counts "
             f"{sdpa['default_forward']} forward FLOPs for it (analytic {sdpa['analytic']}); registered via "
             f"custom_mapping: {sdpa['registered'] or 'nothing needed'} -> {sdpa['mapped_forward']}. "
             "The block's own FLOPs are counted on its explicit-matmul attention path (no SDPA).")
    o = sdpa_outcome(sdpa)
    rec.check("sdpa_counted_with_custom_mapping", o.passed, o.observed, o.threshold, o.detail)
    o = moe_compute_outcome(s.n_experts, s.top_k, seed=rec.seed)
    rec.check("moe_compute_flat_in_experts", o.passed, o.observed, o.threshold, o.detail)

    rows = []
    for T, D in rec.progress(s.groups, total=len(s.groups), description="groups"):
        rows.append(measure_group(rec, s, cm.BlockShape(B=s.B, T=T, D=D, H=s.H, d_ff=s.d_ff), e))

    load_after = psutil.getloadavg()[0]
    for row in rows:
        rec.metric("load_average_1min", load_before, when="start", T=row["T"], D=row["D"])
        rec.metric("load_average_1min", load_after, when="end", T=row["T"], D=row["D"])
    rec.note(f"{torch.get_num_threads()} torch threads on {psutil.cpu_count()} CPUs; 1-min load average "
             f"{load_before:.1f} at start, {load_after:.1f} at end (other processes share the CPUs: compare "
             "best_ms with wall_ms in timings.parquet)")
    rec.plot("complexity_groups", groups_figure(rows))
    block = f"B={s.B}, H={s.H}, d_ff={'4·D' if s.d_ff is None else s.d_ff}, {dtype_name}"
    timing = (f"torch.utils.benchmark.Timer.blocked_autorange, >= {s.min_run_time} s per clock, after {s.warmup} "
              "warm-up")
    rec.summary(summary_markdown(rows, block, timing, sdpa, (load_before, load_after)))
    terminal_rows(rows).print_to(rec.console)


def measure_group(rec: Recorder, s: Settings, shape: cm.BlockShape, e: int) -> dict[str, Any]:
    """All analytic, counted and measured numbers for one (T, D) group."""
    T, D = shape.T, shape.D
    tag = {"T": T, "D": D}
    suffix = f".T{T}_D{D}"

    def check(name: str, o: Outcome) -> None:
        rec.check(name + suffix, o.passed, o.observed, o.threshold, o.detail)

    # analytic
    f = cm.forward_flops(shape)
    params = cm.block_params(shape)
    for comp in cm.COMPONENTS:
        rec.metric("flops_forward", f[comp], component=comp, growth=cm.GROWTH[comp], **tag)
    rec.metric("flops_forward_block", f["matmul"], **tag)
    rec.metric("flops_backward_block", cm.backward_matmul_flops(shape), **tag)
    rec.metric("flops_softmax_block", f["softmax"], **tag)
    rec.metric("flops_bias_block", f["bias"], **tag)
    rec.metric("params_block", params["total"], **tag)
    rec.metric("params_block_weights", params["weights"], **tag)
    rec.metric("crossover_T", cm.crossover_T(shape), **tag)
    rec.metric("crossover_T_all_linear", cm.crossover_T_all_linear(shape), **tag)
    rec.metric("crossover_T_causal", cm.crossover_T_causal(shape), **tag)
    rec.metric("score_elements", cm.score_elements(shape), **tag)
    for name, nbytes in cm.score_bytes(shape).items():
        rec.metric("score_bytes", nbytes, dtype=name, **tag)
    kv_per_token = cm.kv_cache_bytes_per_token(shape, e, s.n_layers)  # per token, whatever B
    rec.metric("kv_cache_bytes_per_token", kv_per_token, n_layers=s.n_layers, **tag)
    model = cm.model_params(shape, s.n_layers, s.vocab)
    rec.metric("params_model", model["total"], n_layers=s.n_layers, **tag)
    rec.metric("params_model_bytes", model["total"] * e, n_layers=s.n_layers, **tag)
    rec.metric("kv_cache_bytes_model", cm.kv_cache_bytes(shape, T, e, s.n_layers), n_layers=s.n_layers, **tag)
    rec.metric("flops_forward_per_token_model", cm.model_forward_flops_per_token(shape, s.n_layers, s.vocab),
               n_layers=s.n_layers, **tag)
    rec.metric("flops_forward_per_token_kaplan",
               cm.kaplan_forward_flops_per_token(model["non_embedding_weights"], s.n_layers, T, D),
               n_layers=s.n_layers, **tag)
    moe = cm.moe_block_params(shape, s.n_experts, s.top_k)
    moe_tags = {"n_experts": s.n_experts, "top_k": s.top_k, **tag}
    rec.metric("params_moe_total", moe["total"], **moe_tags)
    rec.metric("params_moe_active", moe["active"], **moe_tags)
    built = measure.moe_params_built(shape, s.n_experts, s.top_k, rec.seed)
    rec.metric("params_moe_total_built", built["total"], **moe_tags)
    rec.metric("params_moe_active_built", built["active"], **moe_tags)
    check("moe_params_match", moe_match_outcome(moe, built))
    check("moe_active_lt_total", moe_outcome(built, s.n_experts, s.top_k))

    # counted
    fwd = measure.counted_block_flops(shape, rec.dtype, backward=False)
    fwd_bwd = measure.counted_block_flops(shape, rec.dtype, backward=True)
    rec.metric("flops_counted_forward_block", fwd, **tag)
    rec.metric("flops_counted_fwd_bwd_block", fwd_bwd, **tag)
    check("flops_forward_match", exact_outcome("forward matmul FLOPs", f["matmul"], fwd))
    check("flops_fwd_bwd_match", exact_outcome("forward+backward matmul FLOPs", 3 * f["matmul"], fwd_bwd))

    torch.manual_seed(rec.seed)
    block = measure.build_block(shape, rec.dtype, rec.device)
    x = torch.randn(shape.B, T, D, device=rec.device, dtype=rec.dtype)
    check("params_match", params_outcome(block, shape))
    kv, cache = kv_cache_outcome(block, shape, x)
    check("kv_cache_bytes_match", kv)
    check("kv_cache_per_token_match", kv_per_token_outcome(kv_per_token, cache.nbytes(), shape, s.n_layers))
    rec.metric("kv_cache_bytes", cache.nbytes(), **tag)
    del cache
    saved_box: list[int] = []

    def train_step() -> None:
        saved_box.append(measure.saved_activation_bytes(block, x, backward=True))

    peak_mem = peak_memory_bytes(train_step, rec.device)
    block.zero_grad(set_to_none=True)
    saved = saved_box[0]
    act = cm.training_activation_bytes(shape, e)
    rec.metric("activation_bytes_saved_measured", saved, **tag)
    rec.metric("activation_bytes_analytic", act, **tag)
    check("activation_bytes_match", exact_outcome("bytes saved for backward", act, saved))
    estimate = cm.training_peak_estimate_bytes(shape, e) - params["total"] * e  # params existed before
    rec.metric("memory_peak_step_measured_bytes", peak_mem, **tag)
    rec.metric("memory_peak_step_estimate_bytes", estimate, **tag)
    rec.metric("params_bytes", params["total"] * e, **tag)

    # measured: the machine's peak (before and after the components; the faster window counts, as other
    # processes can only slow a measurement down), every component (median and best-of), prefill, decode
    before = measure.peak_matmul_flops(rec, s.peak_matmul_n, s.min_run_time, s.warmup, when="before", **tag)
    inputs = measure.component_inputs(block, x)
    flops_of = measure.component_flops(shape)
    times: dict[str, tuple[float, float, float]] = {}
    with torch.inference_mode():
        fns = measure.component_fns(block, inputs)
        fns["prefill"] = lambda: block(x, cache=KVCache())
        base = KVCache()
        block(x[:, :-1], cache=base)
        fns["decode"] = lambda: block(x[:, -1:], cache=KVCache(base.k, base.v))
        for comp, fn in fns.items():
            times[comp] = measure.time_fn(rec, f"component.{comp}", fn, s.min_run_time, s.warmup, component=comp, **tag)
    flops_of["decode"] = cm.forward_flops(cm.BlockShape(shape.B, 1, D, shape.H, shape.d_ff), T_k=T)["matmul"]
    after = measure.peak_matmul_flops(rec, s.peak_matmul_n, s.min_run_time, s.warmup, when="after", **tag)
    peak = tuple(max(b, a) for b, a in zip(before, after, strict=True))
    for stat, value in zip(STATS, peak, strict=True):
        rec.metric("matmul_peak_flops", value, stat=stat, n=s.peak_matmul_n, **tag)
    for comp, measured in times.items():
        for stat, ms, top in zip(STATS, measured, peak, strict=True):
            rec.metric("time_ms", ms, component=comp, stat=stat, **tag)
            if flops_of.get(comp) is not None and math.isfinite(ms):
                rec.metric("flops_per_s", flops_of[comp] / (ms / 1e3), component=comp, stat=stat, **tag)
                rec.metric("peak_fraction", flops_of[comp] / (ms / 1e3) / top, component=comp, stat=stat, **tag)
    fractions = {f"{comp}.{stat}": flops_of[comp] / (ms / 1e3) / top
                 for comp, measured in times.items() if flops_of.get(comp) is not None
                 for stat, ms, top in zip(STATS, measured, peak, strict=True) if math.isfinite(ms) and ms > 0}
    plausible = timings_plausibility(fractions)
    rec.metric("peak_fraction_max", plausible.observed, **tag)
    rec.metric("timings_plausible", float(plausible.passed), limit=PLAUSIBLE_PEAK_FRACTION, **tag)
    if not plausible.passed:
        import psutil

        threads, cpus, load = torch.get_num_threads(), psutil.cpu_count(), psutil.getloadavg()[0]
        warning = (f"timings of T={T} D={D} are NOT trustworthy: {plausible.detail}; {threads} torch threads on "
                   f"{cpus} CPUs, 1-min load average {load:.1f}. {rerun_advice(threads, cpus, load)}; the "
                   "FLOP/parameter/memory checks are unaffected.")
        rec.note(warning)
        rec.print(f"[bold yellow]warning:[/] {warning}")
    rec.metric("time_per_token_ms", times["prefill"][0] / T, mode="prefill", **tag)
    rec.metric("time_per_token_ms", times["decode"][0], mode="decode", cache_len=T - 1, **tag)
    finite = (0, 1, 2) if rec.device.type == "cpu" else (0, 1)
    check("timings_valid", timings_outcome({f"{k}.{STATS[i]}": v[i] for k, v in times.items() for i in finite}))

    return {"T": T, "D": D, "shape": shape, "flops": f, "params": params["total"], "counted": fwd,
            "times": times, "peak": peak, "flops_of": flops_of, "kv_per_token": kv_per_token,
            "saved": saved, "act": act, "peak_mem": peak_mem, "estimate": estimate, "moe": moe,
            "plausible": plausible}
