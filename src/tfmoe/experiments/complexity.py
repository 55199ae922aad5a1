"""`tfmoe complexity`: parameters, FLOPs and memory of a Transformer block — analytic, counted, measured (§2.7).

For each (T, D) group: the analytic model (:mod:`tfmoe.complexity_model`) against what PyTorch reports for the
package's own :class:`~tfmoe.components.block.TransformerBlock`: parameter count, FlopCounterMode FLOPs
(forward and forward+backward), KV-cache bytes, bytes saved for backward; then the time of every component,
its FLOP/s as a fraction of this machine's measured matmul peak, prefill vs decode per token, and the peak
memory of a training step next to the estimate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils import benchmark, flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from tfmoe import complexity_model as cm
from tfmoe.components.attention import KVCache
from tfmoe.components.block import TransformerBlock
from tfmoe.errors import BadInput
from tfmoe.memory import available_memory_bytes, peak_memory_bytes
from tfmoe.recorder import Recorder
from tfmoe.runner import check_threads
from tfmoe.validate import require_int, require_number

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
# Components timed per group: name -> the analytic FLOPs it performs (None: not a FLOP-bound op).
STATS = ("median", "best", "cpu")  # wall-clock median, wall-clock best-of, process-CPU-clock median
TIMED = ("layernorm", "qkv", "scores", "softmax", "attn_v", "out_proj", "ffn_fc1", "gelu", "ffn_fc2", "ffn")
# No component can really run faster than the machine's own square-matmul peak measured in the same run; a
# few % over it is normal (the peak is itself a median, and a GEMM with better cache reuse can beat it:
# 96-107 % seen on an idle core). Far above it, the timings are distorted (threads waiting for a shared core
# make the peak matmul look slow, scheduler ticks quantise short calls).
PLAUSIBLE_PEAK_FRACTION = 1.15


@dataclass(frozen=True)
class Settings:
    """Every value a complexity run reads, validated by :func:`settings`."""

    dtype: str  # the run's dtype name (a key of DTYPE_BYTES)
    dtype_bytes: int
    groups: tuple[tuple[int, int], ...]  # (T, D) pairs, measured in order
    H: int
    d_ff: int | None
    B: int
    n_layers: int
    vocab: int
    n_experts: int
    top_k: int
    min_run_time: float
    warmup: int
    peak_matmul_n: int
    memory_fraction: float
    threads: int | None

    def shape(self, T: int, D: int) -> cm.BlockShape:
        return cm.BlockShape(B=self.B, T=T, D=D, H=self.H, d_ff=self.d_ff)


@dataclass(frozen=True)
class Outcome:
    """A check's verdict before it is recorded: ``observed`` vs ``threshold`` and a one-line ``detail``."""

    passed: bool
    observed: float
    threshold: float
    detail: str


# ------------------------------------------------------------------------------------------ input


def settings(cfg: DictConfig) -> Settings:
    """The run's settings from the composed config; BadInput names the problem and the fix.

    Touches no device and allocates nothing (the memory refusal, which needs the device, is in :func:`run`).
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
    return Settings(dtype=dtype, dtype_bytes=cm.DTYPE_BYTES[dtype], threads=threads, groups=tuple(groups), H=H, d_ff=d_ff, B=require_int(cfg, "B"), n_layers=require_int(cfg, "n_layers"),
                    vocab=require_int(cfg, "vocab"), n_experts=n_experts, top_k=top_k,
                    min_run_time=require_number(cfg, "min_run_time", positive=True), warmup=require_int(cfg, "warmup", 0),
                    peak_matmul_n=require_int(cfg, "peak_matmul_n"), memory_fraction=float(fraction))


def estimated_run_bytes(shape: cm.BlockShape, dtype_bytes: int, peak_matmul_n: int) -> int:
    """What one group needs at most: the block, a training step (saved activations, grads, score-sized
    temporaries), two extra score matrices (fp32; fp64 in fp64 runs) of the timing inputs, and the peak-matmul operands."""
    return (cm.block_params(shape)["total"] * dtype_bytes + cm.training_peak_estimate_bytes(shape, dtype_bytes)
            + 2 * cm.score_elements(shape) * cm.accumulate_bytes(dtype_bytes) + 3 * peak_matmul_n ** 2 * dtype_bytes)


def refuse_oversized(settings: Settings, dtype_bytes: int, available: int) -> None:
    """BadInput (with the estimate) when a group would not fit in ``memory_fraction`` of ``available``."""
    budget = settings.memory_fraction * available
    for T, D in settings.groups:
        need = estimated_run_bytes(settings.shape(T, D), dtype_bytes, settings.peak_matmul_n)
        if need > budget:
            raise BadInput(f"T={T} D={D} needs about {need / 2**30:.2f} GiB (estimate) but only "
                           f"{budget / 2**30:.2f} GiB ({settings.memory_fraction:.0%} of available) is free: "
                           f"lower T, D or B")


# -------------------------------------------------------------------------------- counted FLOPs
def build_block(shape: cm.BlockShape, dtype: torch.dtype, device: torch.device | str) -> TransformerBlock:
    """The package's block for ``shape`` (pre-norm, LayerNorm, GELU, causal), in ``dtype`` on ``device``."""
    with torch.device(device):
        block = TransformerBlock(shape.D, shape.H, d_ff=shape.d_ff, causal=True)
    return block.to(dtype)


def counted_flops(block: torch.nn.Module, x: torch.Tensor, backward: bool = False,
                  custom_mapping: dict[Any, Any] | None = None) -> int:
    """FlopCounterMode's total for ``block(x)`` (and its backward when ``backward``)."""
    with FlopCounterMode(display=False, custom_mapping=custom_mapping) as counter:
        y = block(x)
        if backward:
            y.float().sum().backward()
    return int(counter.get_total_flops())


def counted_block_flops(shape: cm.BlockShape, dtype: torch.dtype, backward: bool) -> int:
    """Count on the meta device: the same module and ops, shapes only, no arithmetic (counts need no data)."""
    block = build_block(shape, dtype, "meta")
    x = torch.empty(shape.B, shape.T, shape.D, device="meta", dtype=dtype, requires_grad=backward)
    return counted_flops(block, x, backward)


class _OpLog(TorchDispatchMode):
    """Records the aten op packets a piece of code dispatches to."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def sdpa_forward_flops(q_shape: Any, k_shape: Any, v_shape: Any, *args: Any, **kwargs: Any) -> int:
    """custom_mapping formula (FlopCounterMode passes shapes): QKᵀ + weights·V, every (query, key) pair."""
    return flop_counter.sdpa_flop_count(q_shape, k_shape, v_shape)


def sdpa_backward_flops(grad_shape: Any, q_shape: Any, k_shape: Any, v_shape: Any, *args: Any, **kwargs: Any) -> int:
    """custom_mapping formula for the backward kernel: 5 matmuls (the scores are recomputed)."""
    return flop_counter.sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)


def sdpa_custom_mapping(ops: Iterable[Any]) -> dict[Any, Callable[..., int]]:
    """FLOP formulas for the SDPA kernels in ``ops`` that FlopCounterMode does not know (and their backward)."""
    mapping: dict[Any, Callable[..., int]] = {}
    for op in ops:
        name = op.__name__
        if "scaled_dot_product" not in name or op in flop_counter.flop_registry:
            continue
        if name.endswith("_backward"):
            mapping[op] = sdpa_backward_flops
            continue
        mapping[op] = sdpa_forward_flops
        backward = getattr(torch.ops.aten, f"{name}_backward", None)
        if backward is not None:
            mapping[backward] = sdpa_backward_flops
    return mapping


def sdpa_flop_report(device: torch.device, dtype: torch.dtype,
                     mapping: dict[Any, Callable[..., int]] | None = None) -> dict[str, Any]:
    """What FlopCounterMode reports for F.scaled_dot_product_attention here, without and with a custom mapping.

    ``mapping=None`` builds one for the uncounted kernels SDPA dispatched to (:func:`sdpa_custom_mapping`).
    """
    B, H, T, Dh = 1, 2, 8, 4
    q, k, v = (torch.randn(B, H, T, Dh, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    log = _OpLog()
    with log:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    kernels = [op for op in dict.fromkeys(log.ops) if "scaled_dot_product" in op.__name__]
    mapping = sdpa_custom_mapping(kernels) if mapping is None else mapping
    counts = {}
    for label, cmap in (("default", None), ("mapped", mapping)):
        with FlopCounterMode(display=False, custom_mapping=cmap) as fc:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        forward = int(fc.get_total_flops())
        with FlopCounterMode(display=False, custom_mapping=cmap) as fc:
            out.sum().backward()
        counts[label] = (forward, int(fc.get_total_flops()))
    analytic = 2 * 2 * B * T * T * H * Dh  # QKᵀ + weights·V
    return {"kernels": [op.__name__ for op in kernels], "registered": [op.__name__ for op in mapping],
            "default_forward": counts["default"][0], "default_backward": counts["default"][1],
            "mapped_forward": counts["mapped"][0], "mapped_backward": counts["mapped"][1], "analytic": analytic}


# ------------------------------------------------------------------------------ measured memory
def saved_activation_bytes(block: torch.nn.Module, x: torch.Tensor, backward: bool = False) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``block(x)`` (parameters excluded);
    with ``backward``, the backward pass runs too (a whole training step)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    if backward:
        y.float().sum().backward()
    return sum(storages.values())


# ------------------------------------------------------------------------------------- checks
def exact_outcome(what: str, analytic: int, observed: int) -> Outcome:
    """analytic == observed exactly; ``observed`` is the difference."""
    diff = observed - analytic
    return Outcome(diff == 0, float(diff), 0.0, f"{what}: analytic {analytic:,} vs observed {observed:,}")


def params_outcome(block: torch.nn.Module, shape: cm.BlockShape) -> Outcome:
    return exact_outcome("parameters", cm.block_params(shape)["total"], sum(p.numel() for p in block.parameters()))


def kv_cache_outcome(block: TransformerBlock, shape: cm.BlockShape, x: torch.Tensor,
                     formula: Callable[..., int] = cm.kv_cache_bytes) -> tuple[Outcome, KVCache]:
    """Prefill ``x`` through ``block`` with a fresh KV cache; its tensors' bytes vs the formula."""
    cache = KVCache()
    with torch.inference_mode():
        block(x, cache=cache)
    return exact_outcome("KV-cache bytes", formula(shape, x.shape[1], x.element_size()), cache.nbytes()), cache


def timings_outcome(times_ms: dict[str, float]) -> Outcome:
    """Every measured time is finite and > 0."""
    bad = {k: v for k, v in times_ms.items() if not (math.isfinite(v) and v > 0)}
    worst = min(times_ms.values(), default=float("nan"), key=lambda v: v if math.isfinite(v) else -math.inf)
    return Outcome(not bad and bool(times_ms), float(worst), 0.0,
                   f"{len(times_ms)} timings; not finite or <= 0: {bad or 'none'}")


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


def moe_params_built(shape: cm.BlockShape, n_experts: int, top_k: int, seed: int = 0,
                     layer_fn: Callable[..., torch.nn.Module] | None = None) -> dict[str, int]:
    """Parameters of a block whose FFN is the package's :class:`~tfmoe.components.moe.MoELayer`, counted on the
    built module: ``total`` every parameter; ``active`` the parameters one token's forward + backward touches
    (those that receive a gradient: attention, norms, router and the experts the token was routed to)."""
    from tfmoe.components.moe import MoELayer

    layer_fn = layer_fn or MoELayer
    torch.manual_seed(seed)
    block = TransformerBlock(shape.D, shape.H, d_ff=shape.d_ff, causal=True)
    block.ffn = _MixtureOnly(layer_fn(shape.D, shape.hidden, n_experts, top_k, residual=False))
    total = sum(p.numel() for p in block.parameters())
    block(torch.randn(1, 1, shape.D)).sum().backward()  # one token, dropless
    active = sum(p.numel() for p in block.parameters() if p.grad is not None)
    return {"total": total, "active": active}


class _MixtureOnly(torch.nn.Module):
    """An MoE layer in the FFN's place: the block adds the residual itself, so it takes the mixture alone."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).out


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


def kv_per_token_outcome(per_token: int, cache_bytes: int, shape: cm.BlockShape, n_layers: int) -> Outcome:
    """The recorded KV bytes per token equal the built one-layer cache's bytes / (B·T) times the layers."""
    measured = cache_bytes * n_layers / (shape.B * shape.T)
    return Outcome(per_token == measured, float(per_token - measured), 0.0,
                   f"kv_cache_bytes_per_token {per_token:,} vs the built cache's {cache_bytes:,} bytes / "
                   f"(B={shape.B} x T={shape.T}) x {n_layers} layers = {measured:,.0f}")


def moe_compute_outcome(n_experts: int, top_k: int, d_model: int = 32, d_hidden: int = 64, tokens: int = 64,
                        layer_fn: Callable[..., torch.nn.Module] | None = None, seed: int = 0) -> Outcome:
    """MoE grows parameters without growing per-token compute: FlopCounterMode's count of a real MoE layer's
    forward with 2E experts exceeds the count with E experts by the router's growth (2·N·D·E) alone, while
    the parameters grow by E experts. ``layer_fn(d_model, d_hidden, n_experts, top_k)`` builds the layer."""
    from tfmoe.components.moe import MoELayer

    build = layer_fn or (lambda d, h, e, k: MoELayer(d, h, e, k))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_model, generator=g)  # (N,D)
    counts, params = [], []
    for e in (n_experts, 2 * n_experts):
        torch.manual_seed(seed)
        layer = build(d_model, d_hidden, e, top_k).eval()
        with torch.no_grad():
            counts.append(counted_flops(layer, x))
        params.append(sum(p.numel() for p in layer.parameters()))
    router_growth = 2 * tokens * d_model * n_experts
    extra = counts[1] - counts[0] - router_growth
    passed = extra == 0 and params[1] > params[0]
    return Outcome(passed, float(abs(extra)), 0.0,
                   f"E={n_experts} -> {2 * n_experts}, k={top_k}, N={tokens} tokens, D={d_model}: counted forward FLOPs "
                   f"{counts[0]:,} -> {counts[1]:,} (router growth 2·N·D·E = {router_growth:,}; observed = the rest of "
                   f"the growth, must be 0); parameters {params[0]:,} -> {params[1]:,}")


def sdpa_outcome(report: dict[str, Any]) -> Outcome:
    """With the custom mapping, FlopCounterMode's SDPA forward count equals QKᵀ + weights·V."""
    return exact_outcome(f"SDPA forward FLOPs (kernels {report['kernels']}, registered {report['registered']})",
                         report["analytic"], report["mapped_forward"])


# ------------------------------------------------------------------------------------- timing
def time_fn(rec: Recorder, stage: str, fn: Callable[[], Any], min_run_time: float, warmup: int,
            **tags: Any) -> tuple[float, float, float]:
    """Median wall ms, best wall ms and median process-CPU ms of one call of ``fn`` (after ``warmup`` calls).

    ``torch.utils.benchmark.Timer.blocked_autorange`` runs ``fn`` in blocks (block size chosen so the timer's
    own overhead is < 0.1 %) for at least ``min_run_time`` s and reports per-call time per block; it runs
    twice: with its default wall clock (which synchronizes an accelerator) and with ``time.process_time``
    (this process's CPU time, all threads). On a CPU shared with other processes the wall clock also counts
    the time spent waiting for a core; the CPU clock does not. On CUDA ``cpu_ms`` is NaN. One timings row:
    ``wall_ms`` = wall median, plus ``best_ms`` (fastest block), ``cpu_ms``, ``repeats`` (wall blocks) and
    ``calls_per_block``.
    """
    for _ in range(warmup):
        fn()

    def measure(clock: Callable[[], float] | None) -> benchmark.Measurement:
        kwargs = {} if clock is None else {"timer": clock}
        timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(), **kwargs)
        return timer.blocked_autorange(min_run_time=min_run_time)

    wall = measure(None)
    med, best = wall.median * 1e3, min(wall.times) * 1e3
    cpu = float("nan") if rec.device.type == "cuda" else measure(time.process_time).median * 1e3
    rec.timing(stage, med, repeats=len(wall.times), best_ms=best, cpu_ms=cpu,
               calls_per_block=wall.number_per_run, **tags)
    return med, best, cpu


def peak_matmul_flops(rec: Recorder, n: int, min_run_time: float, warmup: int,
                      **tags: Any) -> tuple[float, float, float]:
    """FLOP/s (median wall, best wall, median CPU clock) of an n x n @ n x n matmul in the run's dtype:
    the machine's practical peak."""
    a = torch.randn(n, n, device=rec.device, dtype=rec.dtype)
    b = torch.randn(n, n, device=rec.device, dtype=rec.dtype)
    times = time_fn(rec, "peak_matmul", lambda: a @ b, min_run_time, max(1, warmup), n=n, **tags)
    return tuple(2 * n ** 3 / (ms / 1e3) for ms in times)  # type: ignore[return-value]


def component_inputs(block: TransformerBlock, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensor each component consumes in the block's own forward (inference mode)."""
    attn = block.attn
    with torch.inference_mode():
        h = block.norm1(x)  # (B,T,D)
        q, k, v = (attn.split_heads(t) for t in attn.qkv(h).split(x.shape[-1], dim=-1))  # (B,H,T,Dh)
        acc = torch.promote_types(q.dtype, torch.float32)  # as attention_weights: fp32, fp64 stays fp64
        q32, k32 = q.to(acc), k.to(acc)
        scores = (q32 @ k32.transpose(-2, -1)) / math.sqrt(attn.d_head)  # (B,H,T,T) fp32
        weights = torch.softmax(scores, dim=-1).to(v.dtype)
        ctx = attn.merge_heads(weights @ v)  # (B,T,D)
        h2 = block.norm2(x + attn.out(ctx))
        u = block.ffn.fc1(h2)  # (B,T,d_ff)
        g = F.gelu(u)
    return {"x": x, "h": h, "q32": q32, "k32": k32, "v": v, "scores": scores, "weights": weights, "ctx": ctx,
            "h2": h2, "u": u, "g": g}


def component_fns(block: TransformerBlock, i: dict[str, torch.Tensor]) -> dict[str, Callable[[], Any]]:
    ffn = block.ffn
    return {
        "layernorm": lambda: block.norm1(i["x"]),
        "qkv": lambda: block.attn.qkv(i["h"]),
        "scores": lambda: i["q32"] @ i["k32"].transpose(-2, -1),
        "softmax": lambda: torch.softmax(i["scores"], dim=-1),
        "attn_v": lambda: i["weights"] @ i["v"],
        "out_proj": lambda: block.attn.out(i["ctx"]),
        "ffn_fc1": lambda: ffn.fc1(i["h2"]),
        "gelu": lambda: F.gelu(i["u"]),
        "ffn_fc2": lambda: ffn.fc2(i["g"]),
        "ffn": lambda: ffn(i["h2"]),
    }


def component_flops(shape: cm.BlockShape) -> dict[str, int | None]:
    f = cm.forward_flops(shape)
    half_ffn = f["ffn"] // 2
    return {"layernorm": None, "qkv": f["qkv"], "scores": f["scores"], "softmax": f["softmax"],
            "attn_v": f["attn_v"], "out_proj": f["out_proj"], "ffn_fc1": half_ffn, "gelu": None,
            "ffn_fc2": half_ffn, "ffn": f["ffn"], "prefill": f["matmul"]}


# ----------------------------------------------------------------------------------------- run
def run(s: Settings, rec: Recorder) -> None:
    """Refuse sizes the device cannot hold, then measure every group."""
    import psutil

    refuse_oversized(s, s.dtype_bytes, available_memory_bytes(rec.device))
    dtype_name = DTYPE_NAMES.get(rec.dtype, s.dtype)
    load_before = psutil.getloadavg()[0]
    _run_groups(rec, s, s.dtype_bytes, dtype_name, load_before)  # the runner applies `threads` (conf: 1) around run()


def _run_groups(rec: Recorder, s: Settings, e: int, dtype_name: str, load_before: float) -> None:
    import psutil

    # SDPA: what FlopCounterMode sees, and the custom mapping that fixes it.
    sdpa = sdpa_flop_report(rec.device, rec.dtype)
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
    rec.summary(summary_markdown(rows, s, dtype_name, sdpa, (load_before, load_after)))
    rec.print(rich_table(rows))


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
    built = moe_params_built(shape, s.n_experts, s.top_k, rec.seed)
    rec.metric("params_moe_total_built", built["total"], **moe_tags)
    rec.metric("params_moe_active_built", built["active"], **moe_tags)
    check("moe_params_match", moe_match_outcome(moe, built))
    check("moe_active_lt_total", moe_outcome(built, s.n_experts, s.top_k))

    # counted
    fwd = counted_block_flops(shape, rec.dtype, backward=False)
    fwd_bwd = counted_block_flops(shape, rec.dtype, backward=True)
    rec.metric("flops_counted_forward_block", fwd, **tag)
    rec.metric("flops_counted_fwd_bwd_block", fwd_bwd, **tag)
    check("flops_forward_match", exact_outcome("forward matmul FLOPs", f["matmul"], fwd))
    check("flops_fwd_bwd_match", exact_outcome("forward+backward matmul FLOPs", 3 * f["matmul"], fwd_bwd))

    torch.manual_seed(rec.seed)
    block = build_block(shape, rec.dtype, rec.device)
    x = torch.randn(shape.B, T, D, device=rec.device, dtype=rec.dtype)
    check("params_match", params_outcome(block, shape))
    kv, cache = kv_cache_outcome(block, shape, x)
    check("kv_cache_bytes_match", kv)
    check("kv_cache_per_token_match", kv_per_token_outcome(kv_per_token, cache.nbytes(), shape, s.n_layers))
    rec.metric("kv_cache_bytes", cache.nbytes(), **tag)
    del cache
    saved_box: list[int] = []

    def train_step() -> None:
        saved_box.append(saved_activation_bytes(block, x, backward=True))

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
    before = peak_matmul_flops(rec, s.peak_matmul_n, s.min_run_time, s.warmup, when="before", **tag)
    inputs = component_inputs(block, x)
    flops_of = component_flops(shape)
    times: dict[str, tuple[float, float, float]] = {}
    with torch.inference_mode():
        fns = component_fns(block, inputs)
        fns["prefill"] = lambda: block(x, cache=KVCache())
        base = KVCache()
        block(x[:, :-1], cache=base)
        fns["decode"] = lambda: block(x[:, -1:], cache=KVCache(base.k, base.v))
        for comp, fn in fns.items():
            times[comp] = time_fn(rec, f"component.{comp}", fn, s.min_run_time, s.warmup, component=comp, **tag)
    flops_of["decode"] = cm.forward_flops(cm.BlockShape(shape.B, 1, D, shape.H, shape.d_ff), T_k=T)["matmul"]
    after = peak_matmul_flops(rec, s.peak_matmul_n, s.min_run_time, s.warmup, when="after", **tag)
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

        warning = (f"timings of T={T} D={D} are NOT trustworthy: {plausible.detail}; {torch.get_num_threads()} "
                   f"torch threads on {psutil.cpu_count()} CPUs, 1-min load average {psutil.getloadavg()[0]:.1f}. "
                   "Rerun with threads=1 on a quiet machine; the FLOP/parameter/memory checks are unaffected.")
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


# ------------------------------------------------------------------------------------ reports
def _attn_sq(f: dict[str, int]) -> int:
    return f["scores"] + f["attn_v"]


def _fraction(r: dict[str, Any], comp: str, stat: int = 0) -> float:
    """Achieved FLOP/s of ``comp`` over the matmul peak: wall median (0), wall best (1), CPU-clock median (2)."""
    return r["flops_of"][comp] / (r["times"][comp][stat] / 1e3) / r["peak"][stat]


def rich_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="complexity: one block per (T, D) group")
    for col in ("T", "D", "params", "fwd GFLOP", "T² share", "xover T", "prefill ms/tok", "decode ms/tok",
                "FFN %peak wall/cpu", "peak MiB (est)"):
        table.add_column(col, justify="right")
    for r in rows:
        f = r["flops"]
        table.add_row(str(r["T"]), str(r["D"]), f"{r['params']:,}", f"{f['matmul'] / 1e9:.2f}",
                      f"{_attn_sq(f) / f['matmul']:.0%}", f"{cm.crossover_T(r['shape']):.0f}",
                      f"{r['times']['prefill'][0] / r['T']:.3f}", f"{r['times']['decode'][0]:.3f}",
                      f"{_fraction(r, 'ffn'):.0%}/{_fraction(r, 'ffn', 2):.0%}", f"{r['peak_mem'] / 2**20:.0f} ({r['estimate'] / 2**20:.0f})")
    return table


def summary_markdown(rows: list[dict[str, Any]], s: Settings, dtype_name: str, sdpa: dict[str, Any],
                     load: tuple[float, float]) -> str:
    lines = [
        f"Block: B={s.B}, H={s.H}, d_ff={'4·D' if s.d_ff is None else s.d_ff}, {dtype_name}; "
        f"timings (torch.utils.benchmark.Timer.blocked_autorange, >= {s.min_run_time} s per clock, after {s.warmup} "
        f"warm-up): wall median, wall best and CPU-clock median of the per-call time per block; 1-min load average {load[0]:.1f} -> "
        f"{load[1]:.1f}. SDPA kernels {sdpa['kernels']}: FlopCounterMode counts {sdpa['default_forward']} "
        f"forward FLOPs by default, {sdpa['mapped_forward']} with custom_mapping (analytic {sdpa['analytic']}).",
        "",
        f"Timings plausible (every peak_fraction <= {PLAUSIBLE_PEAK_FRACTION:.0%}): "
        + ("; ".join(f"T={r['T']} D={r['D']} {'yes' if r['plausible'].passed else '**NO** - ' + r['plausible'].detail}"
                     for r in rows)) + f" ({torch.get_num_threads()} torch threads).",
        "",
        "| T | D | params | fwd matmul FLOPs (analytic = counted) | T² attn share | crossover T | softmax FLOPs "
        "| bias FLOPs | score elems | KV B/token (L layers) | prefill ms/token | decode ms/token "
        "| saved act. MiB | step peak MiB (estimate) |",
        "|" + "---|" * 14,
    ]
    for r in rows:
        f = r["flops"]
        same = "=" if r["counted"] == f["matmul"] else f"≠ {r['counted']:,}"
        lines.append(
            f"| {r['T']} | {r['D']} | {r['params']:,} | {f['matmul']:,} {same} | {_attn_sq(f) / f['matmul']:.1%} "
            f"| {cm.crossover_T(r['shape']):.0f} | {f['softmax']:,} | {f['bias']:,} "
            f"| {cm.score_elements(r['shape']):,} | {r['kv_per_token']:,} "
            f"| {r['times']['prefill'][0] / r['T']:.4f} | {r['times']['decode'][0]:.3f} "
            f"| {r['saved'] / 2**20:.2f} | {r['peak_mem'] / 2**20:.1f} ({r['estimate'] / 2**20:.1f}) |")
    comps = [c for c in TIMED if c != "block"] + ["prefill", "decode"]
    lines += ["", "Median wall ms per component [fraction of the matmul peak: wall median / wall best / CPU clock]:",
              "",
              "| T | D | peak GFLOP/s (median / best / CPU) | " + " | ".join(comps) + " |", "|" + "---|" * (len(comps) + 3)]
    for r in rows:
        cells = []
        for comp in comps:
            med = r["times"][comp][0]
            frac = "" if r["flops_of"].get(comp) is None else \
                f" [{_fraction(r, comp):.0%} / {_fraction(r, comp, 1):.0%} / {_fraction(r, comp, 2):.0%}]"
            cells.append(f"{med:.3f}{frac}")
        lines.append(f"| {r['T']} | {r['D']} | {' / '.join(f'{p / 1e9:.0f}' for p in r['peak'])} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _clock(times: tuple[float, float, float]) -> float:
    """The CPU-clock median where measured (not disturbed by waiting for a shared core), else the wall median."""
    return times[2] if math.isfinite(times[2]) else times[0]


def groups_figure(rows: list[dict[str, Any]]) -> Any:
    """Share of analytic forward FLOPs vs share of measured time (CPU clock where measured) per component."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5))
    ax_f, ax_t = fig.subplots(1, 2, sharey=True)
    parts = [("qkv", ("qkv",)), ("QKᵀ", ("scores",)), ("softmax", ("softmax",)), ("·V", ("attn_v",)),
             ("out proj", ("out_proj",)), ("FFN", ("ffn",))]
    labels = [f"T={r['T']}\nD={r['D']}" for r in rows]
    for ax, source, title in ((ax_f, "flops", "analytic forward FLOPs"), (ax_t, "times", "measured time (CPU clock)")):
        bottoms = [0.0] * len(rows)
        for name, comps in parts:
            vals = []
            for r in rows:
                d = r["flops"] if source == "flops" else {c: _clock(v) for c, v in r["times"].items()}
                total = sum(d[c] for _, cs in parts for c in cs)
                vals.append(sum(d[c] for c in comps) / total)
            ax.bar(labels, vals, bottom=bottoms, label=name)
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
        ax.set_title(title)
        ax.set_ylim(0, 1)
    ax_f.set_ylabel("share of the block")
    ax_t.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.suptitle("Where a block's work goes: T² attention terms grow past the FFN at T > d_ff")
    fig.tight_layout()
    return fig


def sweep_plots(df: Any) -> dict[str, Any]:
    """Top: analytic attention-score FLOPs (QKᵀ + ·V, ∝ T²) vs FFN FLOPs (∝ T) against T, one colour per D,
    crossover ★ at T = d_ff. Bottom: the measured times of the same two parts in each sweep job (CPU-clock
    median where recorded, else wall median)."""
    import numpy as np
    from matplotlib.figure import Figure

    df = df[df["T"].notna() & df["D"].notna()]
    flops = df[df["name"] == "flops_forward"].pivot_table(index=["D", "T"], columns="component", values="value")
    timed = df[df["name"] == "time_ms"]
    stat = "cpu" if "stat" in timed and timed[timed["stat"] == "cpu"]["value"].notna().any() else "median"
    if "stat" in timed:
        timed = timed[timed["stat"] == stat]
    times = timed.pivot_table(index=["D", "T"], columns="component", values="value")
    cross = df[df["name"] == "crossover_T"].groupby("D")["value"].first()
    fig = Figure(figsize=(8, 8))
    ax, ax_t = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    colors = {d: f"C{i}" for i, d in enumerate(sorted(flops.index.get_level_values("D").unique()))}
    t_all = flops.index.get_level_values("T")
    for D, color in colors.items():
        sub = flops.loc[D].sort_index()
        T0 = float(sub.index[0])
        attn0 = float(sub["scores"].iloc[0] + sub["attn_v"].iloc[0])
        ffn0 = float(sub["ffn"].iloc[0])
        x_T = float(cross.get(D, np.nan))
        lo = min(float(t_all.min()), x_T if math.isfinite(x_T) else np.inf) / 1.5
        hi = max(float(t_all.max()), x_T if math.isfinite(x_T) else 0) * 1.5
        grid = np.geomspace(lo, hi, 100)
        ax.plot(grid, attn0 * (grid / T0) ** 2, color=color, lw=2, label=f"D={int(D)}: attention QKᵀ+·V (T²)")
        ax.plot(grid, ffn0 * grid / T0, color=color, lw=1.2, ls=":", label=f"D={int(D)}: FFN (T)")
        ax.scatter(sub.index, sub["scores"] + sub["attn_v"], color=color, zorder=3)
        ax.scatter(sub.index, sub["ffn"], color=color, marker="s", zorder=3)
        if math.isfinite(x_T):
            ax.plot([x_T], [ffn0 * x_T / T0], marker="*", ms=15, color=color, mec="k", zorder=4)
            ax.annotate(f"T={x_T:.0f}", (x_T, ffn0 * x_T / T0), textcoords="offset points", xytext=(7, -12),
                        fontsize=8)
        if D in times.index.get_level_values("D"):
            tsub = times.loc[D].sort_index()
            ax_t.plot(tsub.index, tsub[["scores", "softmax", "attn_v"]].sum(axis=1), color=color, lw=2,
                      marker="o", label=f"D={int(D)}: attention QKᵀ+softmax+·V")
            ax_t.plot(tsub.index, tsub["ffn"], color=color, lw=1.2, ls=":", marker="s", label=f"D={int(D)}: FFN")
    for a in (ax, ax_t):
        a.set_xscale("log")
        a.set_yscale("log")
        a.grid(True, which="major", alpha=0.3)
    ax.set_ylabel("forward FLOPs (analytic; dots = sweep jobs)")
    ax.set_title("Attention T² FLOPs vs FFN FLOPs per block; ★ = crossover T = d_ff")
    ax.legend(fontsize=7, loc="upper left")
    ax_t.set_xlabel("T (tokens)")
    ax_t.set_ylabel(f"measured ms ({'CPU clock' if stat == 'cpu' else 'wall'} median)")
    ax_t.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return {"sweep_attention_vs_ffn": fig}
