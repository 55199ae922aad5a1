"""complexity's checks: the analytic model (:mod:`tfmoe.components.complexity_model`) against what PyTorch
reports (:mod:`tfmoe.experiments.complexity.measure`). Each check is a pure function returning an
:class:`Outcome`; each has a test in tests/test_complexity.py that plants a bug and sees it fail.

- exact counts: parameters, FLOPs, KV-cache and saved-activation bytes (:func:`exact_outcome` and friends);
- MoE: the analytic MoE block against a built one, sparsity, compute flat in the number of experts;
- SDPA: FlopCounterMode with the custom mapping counts QKᵀ + weights·V;
- timings: valid (a check) and plausible against the machine's peak (a metric and a warning, not a check).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from tfmoe.components import complexity_model as cm
from tfmoe.components.attention import KVCache
from tfmoe.components.block import TransformerBlock
from tfmoe.experiments.complexity.measure import counted_flops

# No component can really run faster than the machine's own square-matmul peak measured in the same run; a
# few % over it is normal (the peak is itself a median, and a GEMM with better cache reuse can beat it:
# 96-107 % seen on an idle core). Far above it, the timings are distorted (threads waiting for a shared core
# make the peak matmul look slow, scheduler ticks quantise short calls).
PLAUSIBLE_PEAK_FRACTION = 1.15


@dataclass(frozen=True)
class Outcome:
    """A check's verdict before it is recorded: ``observed`` vs ``threshold`` and a one-line ``detail``."""

    passed: bool
    observed: float
    threshold: float
    detail: str


# ------------------------------------------------------------------------------------ exact counts
def exact_outcome(what: str, analytic: int, observed: int) -> Outcome:
    """analytic == observed exactly; ``observed`` is the difference."""
    diff = observed - analytic
    return Outcome(diff == 0, float(diff), 0.0, f"{what}: analytic {analytic:,} vs observed {observed:,}")


def params_outcome(block: torch.nn.Module, shape: cm.BlockShape) -> Outcome:
    return exact_outcome("parameters", cm.block_params(shape)["total"], sum(p.numel() for p in block.parameters()))


def kv_cache_outcome(block: TransformerBlock, shape: cm.BlockShape, x: torch.Tensor,
                     formula: Callable[..., int] = cm.kv_cache_bytes) -> tuple[Outcome, KVCache]:
    """Prefill ``x`` through ``block`` with a fresh KV cache; its tensors' bytes vs the formula. At B = 1 (the
    default run's, and claims --run's) a formula without B would pass, so the check also prefills a batch of
    two (``x`` twice) and requires the formula at B = 2 as well. Returns the cache of ``x`` itself."""
    def prefill(inp: torch.Tensor) -> tuple[int, int, KVCache]:
        cache = KVCache()
        with torch.inference_mode():
            block(inp, cache=cache)
        s = replace(shape, B=inp.shape[0])
        return formula(s, inp.shape[1], inp.element_size()), cache.nbytes(), cache

    analytic, observed, cache = prefill(x)
    if x.shape[0] >= 2:
        return exact_outcome(f"KV-cache bytes (B={x.shape[0]})", analytic, observed), cache
    analytic2, observed2, _ = prefill(torch.cat([x, x]))
    diff = abs(observed - analytic) + abs(observed2 - analytic2)
    return Outcome(diff == 0, float(diff), 0.0,
                   f"KV-cache bytes: B={x.shape[0]}: analytic {analytic:,} vs observed {observed:,}; B=2 (judged "
                   f"too: B=1 cannot show a formula without B): analytic {analytic2:,} vs observed {observed2:,}"
                   ), cache


def kv_per_token_outcome(per_token: int, cache_bytes: int, shape: cm.BlockShape, n_layers: int) -> Outcome:
    """The recorded KV bytes per token equal the built one-layer cache's bytes / (B·T) times the layers."""
    measured = cache_bytes * n_layers / (shape.B * shape.T)
    return Outcome(per_token == measured, float(per_token - measured), 0.0,
                   f"kv_cache_bytes_per_token {per_token:,} vs the built cache's {cache_bytes:,} bytes / "
                   f"(B={shape.B} x T={shape.T}) x {n_layers} layers = {measured:,.0f}")


# ------------------------------------------------------------------------------------------- MoE
def moe_match_outcome(analytic: dict[str, int], built: dict[str, int]) -> Outcome:
    """The analytic MoE block model (total and active parameters) equals the counts of the built layer."""
    diff = abs(analytic["total"] - built["total"]) + abs(analytic["active"] - built["active"])
    return Outcome(diff == 0, float(diff), 0.0,
                   f"analytic total {analytic['total']:,} / active {analytic['active']:,} vs built MoE block "
                   f"total {built['total']:,} / active (parameters one token's gradient reaches) {built['active']:,}")


def moe_outcome(built: dict[str, int], n_experts: int, top_k: int) -> Outcome:
    """On the built MoE block: active < total when top_k < n_experts (active == total when every expert is used)."""
    passed = built["active"] < built["total"] if top_k < n_experts else built["active"] == built["total"]
    return Outcome(passed, built["active"] / built["total"], 1.0,
                   f"E={n_experts}, k={top_k}: one token touches {built['active']:,} of the built block's "
                   f"{built['total']:,} parameters")


def moe_compute_outcome(n_experts: int, top_k: int, d_model: int = 32, d_hidden: int = 64, tokens: int = 64,
                        layer_fn: Callable[..., torch.nn.Module] | None = None, seed: int = 0) -> Outcome:
    """MoE grows parameters without growing per-token compute, on a real MoE layer's forward counted by
    FlopCounterMode, at E and 2E experts: (1) the count grows by the router's growth (2·N·D·E) alone while the
    parameters grow; (2) at each E the count is exactly N·k·(one expert's FLOPs) + the router's FLOPs, both
    counted by FlopCounterMode on the layer's own ``experts[0]`` (one token) and ``router`` (all N tokens),
    so a layer that runs top-k plus an always-on expert (flat in E too) fails. ``layer_fn(d_model, d_hidden,
    n_experts, top_k)`` builds the layer (dropless, with ``router`` and ``experts`` as tfmoe's MoELayer)."""
    from tfmoe.components.moe import MoELayer

    build = layer_fn or (lambda d, h, e, k: MoELayer(d, h, e, k))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_model, generator=g)  # (N,D)
    counts, params, expected, parts = [], [], [], []
    for e in (n_experts, 2 * n_experts):
        torch.manual_seed(seed)
        layer = build(d_model, d_hidden, e, top_k).eval()
        with torch.no_grad():
            counts.append(counted_flops(layer, x))
            expert = counted_flops(layer.experts[0], x[:1])  # one expert on one token
            router = counted_flops(layer.router, x)
        expected.append(tokens * top_k * expert + router)
        parts.append(f"E={e}: counted {counts[-1]:,} vs N·k·{expert:,} + router {router:,} = {expected[-1]:,}")
        params.append(sum(p.numel() for p in layer.parameters()))
    router_growth = 2 * tokens * d_model * n_experts
    extra = counts[1] - counts[0] - router_growth
    off = [c - x_ for c, x_ in zip(counts, expected, strict=True)]
    passed = extra == 0 and params[1] > params[0] and off == [0, 0]
    return Outcome(passed, float(abs(extra) + sum(abs(o) for o in off)), 0.0,
                   f"E={n_experts} -> {2 * n_experts}, k={top_k}, N={tokens} tokens, D={d_model}: counted forward FLOPs "
                   f"{counts[0]:,} -> {counts[1]:,} (router growth 2·N·D·E = {router_growth:,}; the rest of the "
                   f"growth {extra:,}, must be 0); " + "; ".join(parts)
                   + (f" (off by {off[0]:,} / {off[1]:,}: each token runs more than its top-k experts)"
                      if any(off) else "") + f"; parameters {params[0]:,} -> {params[1]:,}")


# ------------------------------------------------------------------------------------------ SDPA
def sdpa_outcome(report: dict[str, Any]) -> Outcome:
    """With the custom mapping, FlopCounterMode's SDPA forward count equals QKᵀ + weights·V."""
    return exact_outcome(f"SDPA forward FLOPs (kernels {report['kernels']}, registered {report['registered']})",
                         report["analytic"], report["mapped_forward"])


# --------------------------------------------------------------------------------------- timings
def timings_outcome(times_ms: dict[str, float]) -> Outcome:
    """Every measured time is finite and > 0."""
    bad = {k: v for k, v in times_ms.items() if not (math.isfinite(v) and v > 0)}
    worst = min(times_ms.values(), default=float("nan"), key=lambda v: v if math.isfinite(v) else -math.inf)
    return Outcome(not bad and bool(times_ms), float(worst), 0.0,
                   f"{len(times_ms)} timings; not finite or <= 0: {bad or 'none'}")


def rerun_advice(threads: int, cpus: int | None, load: float) -> str:
    """What to change before rerunning implausible timings, from what was measured, and never a setting that is
    already so: ``threads=1`` only when more threads ran; a quieter machine only when the 1-min load average says
    the CPUs were busy (>= 1, or >= half the CPUs); otherwise that neither explains it."""
    busy = load >= max(1.0, 0.5 * (cpus or 1))
    fixes = ([f"set threads=1 (this run used {threads})"] if threads > 1 else []) + (
        [f"run on a quieter machine (1-min load average {load:.1f} on {cpus} CPUs)"] if busy else [])
    if fixes:
        return "Rerun: " + " and ".join(fixes)
    return (f"threads is already 1 and the 1-min load average ({load:.1f} on {cpus} CPUs) shows no other load: "
            "rerun to see whether it persists")


def timings_plausibility(fractions: dict[str, float], limit: float = PLAUSIBLE_PEAK_FRACTION) -> Outcome:
    """Are the timings physically possible? Every finite ``peak_fraction`` (keyed ``component.stat``) <= ``limit``.

    Recorded as the metric ``timings_plausible`` and a warning, not as a check: it fails because of the
    machine (other processes, more threads than free cores), not because of the code under test, and a check
    that fails on machine noise would make ``tfmoe all`` flaky.
    """
    finite = {k: v for k, v in fractions.items() if math.isfinite(v)}
    if not finite:
        return Outcome(False, float("nan"), limit, "no finite peak_fraction to judge")
    worst = max(finite, key=lambda k: finite[k])
    over = [f"{k} {v:.0%}" for k, v in sorted(finite.items(), key=lambda kv: -kv[1]) if v > limit]
    listed = ", ".join(over[:5]) + (f" and {len(over) - 5} more" if len(over) > 5 else "")
    return Outcome(not over, finite[worst], limit,
                   f"max peak_fraction {finite[worst]:.0%} ({worst}); above {limit:.0%}: {listed or 'none'}")
