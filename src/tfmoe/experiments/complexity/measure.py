"""complexity's measurements: what PyTorch itself reports for the package's block.

Counted FLOPs (``torch.utils.flop_counter.FlopCounterMode``, on the meta device where no data is needed, with
custom formulas for the SDPA kernels it does not count), bytes autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``), and timings (``torch.utils.benchmark.Timer``) of every
component of the block's forward, one at a time, next to the analytic FLOPs each performs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import benchmark, flop_counter
from torch.utils._python_dispatch import TorchDispatchMode  # no public alias: see _OpLog
from torch.utils.flop_counter import FlopCounterMode

from tfmoe.components import complexity_model as cm
from tfmoe.components.block import TransformerBlock
from tfmoe.contract.recorder import Recorder

STATS = ("median", "best", "cpu")  # wall-clock median, wall-clock best-of, process-CPU-clock median
# Components timed one at a time per group, on the inputs they take in the block's own forward.
TIMED = ("layernorm", "qkv", "scores", "softmax", "attn_v", "out_proj", "ffn_fc1", "gelu", "ffn_fc2", "ffn")


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
    """Records the aten op packets a piece of code dispatches to.

    TorchDispatchMode comes from ``torch.utils._python_dispatch``: PyTorch has no public alias for it (its own
    public FlopCounterMode subclasses it from there, and the "extending PyTorch" docs use that path). The public
    alternatives cannot answer "which kernel did SDPA dispatch to": FlopCounterMode reports only ops it has a
    formula for (the point is to find the ones it lacks), and torch.profiler sees the kernels but prints its
    kineto start/stop lines on stderr on every use (they would land in the CLI's output) and records the
    composite op too.
    """

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


# ----------------------------------------------------------------------- parameters of an MoE block
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
