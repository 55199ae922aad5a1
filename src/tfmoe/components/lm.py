"""A tiny causal language model built from the package's blocks (nanoGPT layout)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from tfmoe.components.attention import KVCache
from tfmoe.components.block import TransformerBlock, make_norm


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


class TinyCausalLM(nn.Module):
    """ids (B,T) -> logits (B,T,V): token embedding + learned positions + n_layers blocks + final norm + head.

    ``causal=False`` exists only to plant a bug (a "decoder" whose positions see the future)."""

    def __init__(self, vocab_size: int, d_model: int = 32, n_heads: int = 4, n_layers: int = 2,
                 max_len: int = 128, norm_position: str = "pre", norm: str = "layernorm", ffn: str = "gelu",
                 dropout: float = 0.0, causal: bool = True):
        super().__init__()
        self.vocab_size, self.max_len = vocab_size, max_len
        self.d_model, self.n_layers = d_model, n_layers
        self.tok_emb = nn.Embedding(vocab_size, d_model)  # V x D parameters
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, n_heads, norm_position=norm_position, norm=norm, ffn=ffn,
                             causal=causal, dropout=dropout)
            for _ in range(n_layers)
        )
        self.norm_f = make_norm(norm, d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, padding_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                caches: list[KVCache] | None = None) -> torch.Tensor:
        """idx (B,T) -> logits (B,T,V). With ``caches`` (one per block) idx holds only new tokens."""
        B, T = idx.shape
        offset = caches[0].length if caches else 0
        if offset + T > self.max_len and position_ids is None:
            raise ValueError(f"sequence of {offset + T} tokens exceeds max_len={self.max_len}")
        if position_ids is None:
            position_ids = torch.arange(offset, offset + T, device=idx.device).expand(B, T)
        x = self.tok_emb(idx) + self.pos_emb(position_ids)  # (B,T,D)
        for i, block in enumerate(self.blocks):
            x = block(x, padding_mask, cache=None if caches is None else caches[i])
        return self.head(self.norm_f(x))  # (B,T,V)

    def new_caches(self) -> list[KVCache]:
        """One empty KV cache per block, for incremental decoding."""
        return [KVCache() for _ in self.blocks]
