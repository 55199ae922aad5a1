"""Language-model stacks built from the package's blocks: ids (B,T) -> logits (B,T,V).

- ``TinyCausalLM``: nanoGPT's layout (learned positions, KV caches for decoding), trained by `decode`.
- ``TransformerStack``: sinusoidal positions and a stack built to look inside (per-block taps), for `block-stats`.

Imports flow one way: masks -> attention -> block -> lm (positions sit beside attention).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tfmoe.components.attention import KVCache, MultiHeadSelfAttention
from tfmoe.components.block import RMSNorm, TransformerBlock, make_norm
from tfmoe.components.positions import sinusoidal_positions


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


class TransformerStack(nn.Module):
    """ids (B,T) -> logits (B,T,V): token embedding + sinusoidal positions + ``n_layers`` blocks
    + final norm + LM head. Built to look inside: ``hidden(x, taps)`` fills one taps dict per block.

    ``final_norm`` defaults to True for Pre-Norm and False for Post-Norm (a Post-Norm block already ends
    in a norm; this is the layout of Xiong et al. 2020).
    """

    def __init__(self, vocab_size: int, d_model: int, n_heads: int, n_layers: int,
                 norm_position: str = "pre", norm: str = "layernorm", ffn: str = "gelu", eps: float = 1e-5,
                 causal: bool = True, dropout: float = 0.0, final_norm: bool | None = None):
        super().__init__()
        self.d_model = d_model
        self.tok_emb = nn.Embedding(vocab_size, d_model)  # V x D
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, n_heads, norm_position=norm_position, norm=norm, ffn=ffn,
                             causal=causal, dropout=dropout, eps=eps)
            for _ in range(n_layers)
        )
        final_norm = (norm_position == "pre") if final_norm is None else final_norm
        self.norm_f = make_norm(norm, d_model, eps) if final_norm else nn.Identity()
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B,T) -> token embedding + sinusoidal position (B,T,D)."""
        x = self.tok_emb(idx)  # (B,T,D)
        return x + sinusoidal_positions(idx.shape[1], self.d_model).to(x.device, x.dtype)

    def hidden(self, x: torch.Tensor, taps: list[dict[str, torch.Tensor]] | None = None) -> torch.Tensor:
        """x (B,T,D) -> final hidden states (B,T,D). ``taps`` receives one stage dict per block."""
        for block in self.blocks:
            t: dict[str, torch.Tensor] | None = None
            if taps is not None:
                t = {}
                taps.append(t)
            x = block(x, taps=t)
        return self.norm_f(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(self.embed(idx)))  # (B,T,V)


def xavier_init_(stack: nn.Module) -> None:
    """Xiong et al. 2020's initialisation: Xavier-uniform weight matrices (W_Q, W_K, W_V each on its own
    (D,D) slice of the fused qkv), zero biases, unit/zero norm affine, N(0,1) token embeddings."""
    for module in stack.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm | RMSNorm):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 1.0)
    for module in stack.modules():  # second pass: the fused qkv is three (D,D) matrices
        if isinstance(module, MultiHeadSelfAttention):
            with torch.no_grad():
                for w in module.qkv.weight.split(module.d_model, dim=0):  # (D,D) each
                    nn.init.xavier_uniform_(w)
