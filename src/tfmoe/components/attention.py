"""Multi-head attention as in the course's listing, plus a KV cache.

Interface (course): ``MultiHeadSelfAttention(d_model, n_heads, causal)``; ``qkv`` = Linear(d, 3d, bias=False),
``out`` = Linear(d, d, bias=False); ``forward(x, padding_mask=None) -> (output, attn_weights)`` with
padding_mask (B, T) True = real token.

Policy for fully masked query rows (every key hidden, e.g. a query whose row is all padding keys):
their attention weights are set to 0, so their context vector is 0 (PyTorch's SDPA gives NaN or
zeros depending on version/backend; see ``tfmoe attn-check``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from tfmoe.components.masks import combine_masks


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far: each (B, H, T_cached, Dh)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(Dh)) over keys, computed in fp32 at least (fp64 stays fp64); fully masked rows -> 0.

    q (B,H,Tq,Dh), k (B,H,Tk,Dh), mask broadcastable to (B,H,Tq,Tk) with True = visible.
    Returns weights (B,H,Tq,Tk) in fp32 (fp64 for fp64 inputs).
    """
    acc = torch.promote_types(q.dtype, torch.float32)  # upcast fp16/bf16, never downcast fp64
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B,H,Tq,Tk)
    if mask is None:
        return torch.softmax(scores, dim=-1)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # fully masked rows are NaN here
    return torch.where(mask.any(dim=-1, keepdim=True), weights, torch.zeros_like(weights))


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, causal: bool = False, dropout: float = 0.0):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.causal = causal
        self.dropout = nn.Dropout(dropout)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        B, T, _ = t.shape
        return t.view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B,H,T,Dh)

    def merge_heads(self, t: torch.Tensor) -> torch.Tensor:
        B, H, T, Dh = t.shape
        return t.transpose(1, 2).reshape(B, T, H * Dh)  # (B,T,D)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B,T,D) -> (output (B,T,D), attn_weights (B,H,T,T_k) in fp32, fp64 for fp64 x).

        With ``cache``, x holds only the new tokens: their keys/values are appended and the queries
        attend to every cached key (causally by absolute position); padding_mask then covers all keys.
        """
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)  # (B,T,D) each
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)  # (B,H,T,Dh)
        offset = 0
        if cache is not None:
            offset = cache.length
            k, v = cache.append(k, v)  # (B,H,T_k,Dh)
        mask = combine_masks(T, k.shape[2], self.causal, padding_mask, device=x.device, offset=offset)
        weights = attention_weights(q, k, mask)  # (B,H,T,T_k) fp32
        ctx = self.dropout(weights).to(v.dtype) @ v  # (B,H,T,Dh)
        return self.out(self.merge_heads(ctx)), weights


class MultiHeadCrossAttention(nn.Module):
    """Encoder-decoder attention: queries from the decoder (B,T_tgt,D), keys/values from memory (B,T_src,D)."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.kv = nn.Linear(d_model, 2 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, memory: torch.Tensor,
                memory_padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, D = x.shape
        S = memory.shape[1]
        q = self.q(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B,H,T,Dh)
        k, v = self.kv(memory).split(D, dim=-1)
        k = k.view(B, S, self.n_heads, self.d_head).transpose(1, 2)  # (B,H,S,Dh)
        v = v.view(B, S, self.n_heads, self.d_head).transpose(1, 2)
        mask = combine_masks(T, S, False, memory_padding_mask, device=x.device)
        weights = attention_weights(q, k, mask)  # (B,H,T,S)
        ctx = weights.to(v.dtype) @ v  # (B,H,T,Dh)
        return self.out(ctx.transpose(1, 2).reshape(B, T, D)), weights

