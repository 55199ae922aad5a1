"""chunked: chunked exact attention vs SDPA on the layer's q, k, v, and its memory/time probe at a large T."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tfmoe.adapters import ContractError
from tfmoe.components.chunked_attention import naive_attention, naive_attention_bytes
from tfmoe.components.comparison import compare, max_abs_err
from tfmoe.components.reference_attention import plain_attention as independent_plain_attention
from tfmoe.components.references import project, reference_dtype, rows_with_a_key
from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.attn_check.layer import LayerUnderTest, record_comparison
from tfmoe.rules.memory import peak_memory_bytes

if TYPE_CHECKING:
    from tfmoe.experiments.attn_check.settings import ModuleSettings


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _probe_qkv(B: int, H: int, T: int, Dh: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cpu").manual_seed(1234)
    return tuple(torch.randn(B, H, T, Dh, generator=gen).to(device=device, dtype=dtype) for _ in range(3))


def chunked_probe(s: ModuleSettings, rec: Recorder, chunked_fn: Callable[..., torch.Tensor], B: int, H: int,
                  T: int, Dh: int, dtype: torch.dtype, block_size: int, measure_naive: bool) -> None:
    """8b. chunked vs SDPA (rel <= 1e-5 in fp32) at a size where memory matters; peak memory and time of
    naive, chunked and SDPA. Needs no layer (mode=chunked runs only this)."""
    device = rec.device
    q, k, v = _probe_qkv(B, H, T, Dh, device, dtype)
    causal = s.causal

    def run_chunked() -> torch.Tensor:
        return chunked_fn(q, k, v, causal=causal, key_padding_mask=None, block_size=block_size)

    def run_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def run_naive() -> torch.Tensor:
        return naive_attention(q, k, v, causal=causal)

    with torch.no_grad():
        out_chunked, out_sdpa = run_chunked(), run_sdpa()
        variants = [("chunked", run_chunked), ("sdpa", run_sdpa)] + ([("naive", run_naive)] if measure_naive else [])
        peaks, times = {}, {}
        for name, fn in variants:
            peaks[name] = peak_memory_bytes(fn, device)
            times[name] = rec.time(f"attention_{name}", fn, repeats=s.timing_repeats, warmup=1, variant=name, T=T)
            rec.metric("peak_mem_bytes", peaks[name], variant=name, T=T)
            rec.metric("time_ms", times[name], variant=name, T=T)
    naive_bytes = peaks.get("naive") or naive_attention_bytes(B, H, T, T, dtype)
    if not measure_naive:
        rec.note(f"naive peak memory at T={T} is the estimate 3·B·H·T²·4 bytes = {gib(naive_bytes)} (not run)")
    for name in ("chunked", "naive"):
        if name in times:
            rec.metric("time_ratio_vs_sdpa", times[name] / max(times["sdpa"], 1e-9), variant=name, T=T)
    err = max_abs_err(out_chunked, out_sdpa)
    scale = float(out_sdpa.detach().double().abs().max())
    rel = err / scale if scale > 0 else err
    rec.metric("max_rel_err", rel, comparison=f"chunked_vs_sdpa_T{T}", dtype=str(dtype).removeprefix("torch."))
    rel_limit = 1e-5 if dtype in (torch.float32, torch.float64) else 4 * torch.finfo(dtype).eps
    rec.check_le("chunked_match_large", rel, rel_limit,
                 f"chunked (block {block_size}) vs SDPA at B={B}, H={H}, T={T}, Dh={Dh}, "
                 f"{str(dtype).removeprefix('torch.')}, causal={causal}: max rel err {rel:.3g}",
                 evidence={"q": q, "k": k, "v": v} if q.numel() <= 1_000_000 else None)
    ratio = peaks["chunked"] / max(naive_bytes, 1)
    rec.metric("memory_ratio_chunked_vs_naive", ratio, T=T)
    how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler(profile_memory=True)"
    rec.check_le("chunked_memory", ratio, s.memory_ratio_max,
                 f"peak memory ({how}) at T={T}: chunked {gib(peaks['chunked'])}, naive {gib(naive_bytes)}"
                 f"{'' if measure_naive else ' (estimate)'}, SDPA {gib(peaks['sdpa'])}",
                 evidence={"q": q, "k": k, "v": v, "probe_B_H_T_Dh_block": torch.tensor([B, H, T, Dh, block_size])})


def check_chunked(layer: LayerUnderTest) -> None:
    """8a. chunked exact attention on the module's own q, k, v (several key blocks) vs SDPA, dtype rule."""
    s = layer.s
    with torch.no_grad():
        q, k, v = project(layer.x, layer.proj().to(layer.dtype))  # (B,H,T,Dh) at the run dtype (RoPE, kv heads mapped)
        out = layer.chunked_fn(q, k, v, causal=s.causal, key_padding_mask=layer.pm_arg, block_size=s.block_size)
        rd = reference_dtype(layer.dtype)
        ref = F.scaled_dot_product_attention(q.to(rd), k.to(rd), v.to(rd), attn_mask=layer.mask)
        # the yardstick shares nothing with the kernel under test: not its file's naive path, not tfmoe's masks
        # functions (the reference's own visibility mask, the kernel battery's first-principles plain attention)
        visible = None if layer.mask is None else layer.mask.to(torch.bool)
        plain = independent_plain_attention(q, k, v, visible, scale=1.0 / math.sqrt(q.shape[-1]))
    if out.shape != ref.shape:
        raise ContractError(f"chunked output shape {tuple(out.shape)} != {tuple(ref.shape)}")
    # every query that sees a key: the chunked path is a kernel, padded queries included (padded_query_policy is
    # about the layer's output)
    valid = rows_with_a_key(layer.mask, s.B, s.T)[:, None, :].expand(-1, s.n_heads, -1)  # (B,H,T)
    c = compare(out, ref, plain, layer.dtype, valid)
    record_comparison(layer, "chunked_match", "chunked_vs_sdpa", c,
                       f"{s.chunked_impl} with block_size={s.block_size} ({math.ceil(s.T / s.block_size)} key blocks) "
                       "on the module's q, k, v", {"q": q, "k": k, "v": v, "out": out, "ref": ref})
    chunked_probe(s, layer.rec, layer.chunked_fn, 1, s.probe_heads, s.probe_T, s.probe_d_head,
                  layer.dtype if layer.device.type == "cuda" else torch.float32, s.probe_block_size, measure_naive=True)

