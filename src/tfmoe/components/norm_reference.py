"""Normalisation written out from its definition: the reference block-stats judges the package's norms by.

Trust rule: it shares no code with what it judges (``components/block.py``'s LayerNorm32 calls F.layer_norm,
RMSNorm its own rsqrt): every mean here is a sum over the hidden axis / D, no torch statistics or norm op,
and it imports nothing from tfmoe (tests/test_block_stats.py checks that).
"""

from __future__ import annotations

import torch


def mean_last(x: torch.Tensor) -> torch.Tensor:
    """Mean over the hidden axis by hand: sum / D. (..., D) -> (...)."""
    return x.sum(dim=-1) / x.shape[-1]


def plain_norm(kind: str, x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm (``kind="layernorm"``) or RMSNorm ("rmsnorm") before affine, on x upcast to at least fp32 like
    the module, cast back: the same-dtype baseline a norm must match within 2x (FlashAttention's rule)."""
    xu = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # (B,T,D)
    if kind == "layernorm":
        centred = xu - mean_last(xu)[..., None]
        y = centred / torch.sqrt(mean_last(centred * centred)[..., None] + eps)
    else:
        y = xu / torch.sqrt(mean_last(xu * xu)[..., None] + eps)
    return y.to(x.dtype)


def norm_deviation(kind: str, x: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-token deviation (B,T) of ``y`` from what a normalisation of ``x`` must give, in fp64; every mean and
    variance computed here by hand (sums over the hidden axis / D, biased).
    layernorm: max(|mean(y)|, |std(y) - sqrt(var/(var+eps))|); rmsnorm: |rms(y) - sqrt(ms/(ms+eps))|."""
    x64, y64 = x.double(), y.double()
    if kind == "layernorm":
        var = mean_last((x64 - mean_last(x64)[..., None]) ** 2)  # (B,T)
        want_std = torch.sqrt(var / (var + eps))
        y_mean = mean_last(y64)
        y_std = torch.sqrt(mean_last((y64 - y_mean[..., None]) ** 2))
        return torch.maximum(y_mean.abs(), (y_std - want_std).abs())
    ms = mean_last(x64 * x64)  # (B,T)
    return (torch.sqrt(mean_last(y64 * y64)) - torch.sqrt(ms / (ms + eps))).abs()
