"""A Transformer block as in the course (pre-norm, causal MHA, FFN d->4d->d with GELU), configurable:
``norm_position`` pre|post, ``norm`` layernorm|rmsnorm, ``ffn`` gelu|swiglu.

Stage names (used by ``taps``): input, norm1, attn_out, resid1, norm2, ffn_out, resid2.
Pre-Norm:  norm1 = N1(x); attn_out = Attn(norm1); resid1 = x + attn_out;
           norm2 = N2(resid1); ffn_out = FFN(norm2); resid2 = resid1 + ffn_out  -> output resid2
Post-Norm: attn_out = Attn(x); resid1 = x + attn_out; norm1 = N1(resid1);
           ffn_out = FFN(norm1); resid2 = norm1 + ffn_out; norm2 = N2(resid2)  -> output norm2
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tfmoe.components.attention import KVCache, MultiHeadSelfAttention

NORM_POSITIONS = ("pre", "post")
NORMS = ("layernorm", "rmsnorm")
FFNS = ("gelu", "swiglu")


def upcast(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32 for a norm's statistics; fp32 and fp64 stay as they are (fp64 must not drop to fp32)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · g over the hidden axis; no mean subtraction; computed in (at least) fp32."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = upcast(x)
        y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.weight.to(x32.dtype)).to(x.dtype)


class LayerNorm32(nn.LayerNorm):
    """LayerNorm computed in (at least) fp32 and cast back (stable in fp16/bf16, exact in fp64)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = upcast(x)
        w = None if self.weight is None else self.weight.to(x32.dtype)
        b = None if self.bias is None else self.bias.to(x32.dtype)
        return F.layer_norm(x32, self.normalized_shape, w, b, self.eps).to(x.dtype)


def make_norm(kind: str, d: int, eps: float = 1e-5) -> nn.Module:
    if kind == "layernorm":
        return LayerNorm32(d, eps=eps)
    if kind == "rmsnorm":
        return RMSNorm(d, eps=eps)
    raise ValueError(f"unknown norm {kind!r}: choose one of {NORMS}")


def swiglu_hidden(d_model: int, multiple_of: int = 8) -> int:
    """2/3 · 4d rounded up to a multiple of ``multiple_of``, so the parameters match a 4d GELU FFN (LLaMA's rule;
    tfmoe rounds to a multiple of 8, LLaMA's released models to 256: pass d_ff explicitly to match one)."""
    h = int(2 * 4 * d_model / 3)
    return multiple_of * math.ceil(h / multiple_of)


class FeedForward(nn.Module):
    """Position-wise FFN. gelu: d -> d_ff -> d. swiglu: (silu(x W1) * x W3) W2 with hidden = swiglu_hidden(d)."""

    def __init__(self, d_model: int, d_ff: int | None = None, kind: str = "gelu", bias: bool = True):
        super().__init__()
        if kind not in FFNS:
            raise ValueError(f"unknown ffn {kind!r}: choose one of {FFNS}")
        self.kind = kind
        if kind == "gelu":
            d_ff = 4 * d_model if d_ff is None else d_ff
            self.fc1 = nn.Linear(d_model, d_ff, bias=bias)
            self.fc2 = nn.Linear(d_ff, d_model, bias=bias)
        else:
            hidden = swiglu_hidden(d_model) if d_ff is None else d_ff
            self.w1 = nn.Linear(d_model, hidden, bias=False)
            self.w3 = nn.Linear(d_model, hidden, bias=False)
            self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B,T,D) -> (B,T,D)
        if self.kind == "gelu":
            return self.fc2(F.gelu(self.fc1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int | None = None, norm_position: str = "pre",
                 norm: str = "layernorm", ffn: str = "gelu", causal: bool = True, dropout: float = 0.0,
                 eps: float = 1e-5):
        super().__init__()
        if norm_position not in NORM_POSITIONS:
            raise ValueError(f"unknown norm_position {norm_position!r}: choose one of {NORM_POSITIONS}")
        self.norm_position = norm_position
        self.norm1 = make_norm(norm, d_model, eps)
        self.attn = MultiHeadSelfAttention(d_model, n_heads, causal=causal, dropout=dropout)
        self.norm2 = make_norm(norm, d_model, eps)
        self.ffn = FeedForward(d_model, d_ff, ffn)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                taps: dict[str, torch.Tensor] | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """x (B,T,D) -> (B,T,D). ``taps``, when given, receives every stage's activation (graph kept)."""
        t = taps if taps is not None else {}
        t["input"] = x
        if self.norm_position == "pre":
            t["norm1"] = self.norm1(x)
            t["attn_out"] = self.drop(self.attn(t["norm1"], padding_mask, cache=cache)[0])
            t["resid1"] = x + t["attn_out"]
            t["norm2"] = self.norm2(t["resid1"])
            t["ffn_out"] = self.drop(self.ffn(t["norm2"]))
            t["resid2"] = t["resid1"] + t["ffn_out"]
            return t["resid2"]
        t["attn_out"] = self.drop(self.attn(x, padding_mask, cache=cache)[0])
        t["resid1"] = x + t["attn_out"]
        t["norm1"] = self.norm1(t["resid1"])
        t["ffn_out"] = self.drop(self.ffn(t["norm1"]))
        t["resid2"] = t["norm1"] + t["ffn_out"]
        t["norm2"] = self.norm2(t["resid2"])
        return t["norm2"]
