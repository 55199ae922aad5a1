"""Position information for attention, which by itself is permutation-equivariant (course §2.1).

- ``sinusoidal_positions`` / ``SinusoidalPositions``: the fixed sin/cos table of "Attention Is All You Need",
  added to the embeddings.
- RoPE (rotary position embedding, Su et al. 2021): rotates each query/key pair of features by an angle
  proportional to the token's position, so q·k depends on the *relative* position only. Half-split
  layout (GPT-NeoX / LLaMA): feature i is paired with feature i + Dh/2.
- ``position_ids_from_mask``: positions counted over real tokens only (left padding).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from tfmoe.components.attention import KVCache, MultiHeadSelfAttention, attention_weights
from tfmoe.components.masks import combine_masks


def sinusoidal_positions(T: int, d_model: int, offset: int = 0) -> torch.Tensor:
    """(T, D) fixed sin/cos position encodings of "Attention Is All You Need"."""
    pos = torch.arange(offset, offset + T, dtype=torch.float32).unsqueeze(1)  # (T,1)
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(T, d_model)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div[: d_model // 2])
    return pe


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,T) 1=real/0=pad -> positions counted over real tokens only (left padding keeps positions 0..n-1)."""
    m = attention_mask.long()
    return (m.cumsum(dim=-1) - 1).clamp(min=0)  # (B,T)


class SinusoidalPositions(nn.Module):
    """x (B,T,D) -> x + PE[offset : offset+T] (fixed table, no parameters)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        pe = sinusoidal_positions(x.shape[1], self.d_model, offset).to(device=x.device, dtype=x.dtype)  # (T,D)
        return x + pe  # (B,T,D)


def rope_angles(T: int, d_head: int, base: float = 10000.0, offset: int = 0,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles m·θ_i, each (T, Dh/2), for positions m = offset..offset+T-1
    and frequencies θ_i = base^(-2i/Dh)."""
    if d_head % 2 != 0:
        raise ValueError(f"RoPE needs an even head size, got d_head={d_head}: choose d_model/n_heads even")
    inv_freq = base ** (-torch.arange(0, d_head, 2, dtype=torch.float32, device=device) / d_head)  # (Dh/2,)
    pos = torch.arange(offset, offset + T, dtype=torch.float32, device=device)  # (T,)
    angles = torch.outer(pos, inv_freq)  # (T, Dh/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (x_i, x_{i+Dh/2}) by the angle of each position. x (B,H,T,Dh), cos/sin (T,Dh/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()  # (B,H,T,Dh/2)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # (B,H,T,Dh)
    return out.to(x.dtype)


class RoPESelfAttention(MultiHeadSelfAttention):
    """MultiHeadSelfAttention with RoPE applied to queries and keys (values are not rotated)."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, dropout: float = 0.0,
                 base: float = 10000.0):
        super().__init__(d_model, n_heads, causal=causal, dropout=dropout)
        if self.d_head % 2 != 0:
            raise ValueError(f"RoPE needs an even head size, got d_head={self.d_head}")
        self.base = base

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)  # (B,T,D) each
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)  # (B,H,T,Dh)
        offset = 0 if cache is None else cache.length
        cos, sin = rope_angles(T, self.d_head, self.base, offset, device=x.device)  # (T,Dh/2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # (B,H,T_k,Dh)
        mask = combine_masks(T, k.shape[2], self.causal, padding_mask, device=x.device, offset=offset)
        weights = attention_weights(q, k, mask)  # (B,H,T,T_k) fp32
        ctx = self.dropout(weights).to(v.dtype) @ v  # (B,H,T,Dh)
        return self.out(self.merge_heads(ctx)), weights
