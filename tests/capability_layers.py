"""Layers written for the capability model's rules (tfmoe.rules.capabilities, issue 28): an adapter whose
parameters() returns a whole residual block (layer norms and MLP the attention never reads), one that detaches a
projection (a real bug: no gradient reaches it), and a user adapter that declares no GQA and would otherwise crash
in tfmoe's own shapes check."""

from __future__ import annotations

import torch
import torch.nn as nn

from tfmoe.adapters import AttentionAdapter, Projections, seeded
from tfmoe.components.references import fused_projections


class Block(nn.Module):
    """A pre-norm residual block whose attention has the course's fused qkv / out layout."""

    def __init__(self, d_model: int, n_heads: int, causal: bool):
        super().__init__()
        self.n_heads, self.causal = n_heads, causal
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def attention(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))  # (B,H,T,Dh)
        vis = torch.ones(T, T, dtype=torch.bool, device=x.device)
        if self.causal:
            vis = vis.tril()
        vis = vis[None, None]
        if padding_mask is not None:
            vis = vis & padding_mask[:, None, None, :]
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        w = scores.masked_fill(~vis, torch.finfo(scores.dtype).min).softmax(-1)
        return self.out((w @ self.values(v)).transpose(1, 2).reshape(B, T, D))

    def values(self, v: torch.Tensor) -> torch.Tensor:
        return v

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x), padding_mask)
        return x + self.mlp(self.ln_2(x))


class BlockAttentionAdapter(AttentionAdapter):
    """Judges the block's attention; parameters() follows the docs' dict(module.named_parameters()) and so also
    names the layer norms and the MLP, which the attention never reads."""

    block = Block
    takes_dropout = False
    returns_weights = False  # forward returns (output, None)

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        with seeded(seed):
            module = self.block(d_model, n_heads, causal)
        return module.to(device=device, dtype=dtype).eval()

    def forward(self, module, x, padding_mask, *, causal, cache=None):
        return module.attention(x, padding_mask), None

    def parameters(self, module):
        return dict(module.named_parameters())

    def projections(self, params, n_heads, n_kv_heads) -> Projections:
        return fused_projections(params["qkv.weight"], params["out.weight"], n_heads)

    def set_projections(self, module, p):
        raise NotImplementedError


class DetachedOutBlock(Block):
    """A real bug: the output projection is applied through a detached weight, so no gradient reaches it."""

    def attention(self, x, padding_mask):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))  # (B,H,T,Dh)
        vis = torch.ones(T, T, dtype=torch.bool, device=x.device)
        vis = (vis.tril() if self.causal else vis)[None, None]
        if padding_mask is not None:
            vis = vis & padding_mask[:, None, None, :]
        w = ((q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5).masked_fill(~vis, torch.finfo(x.dtype).min).softmax(-1)
        return (w @ v).transpose(1, 2).reshape(B, T, D) @ self.out.weight.detach().T  # bug: .detach()


class DetachedOutAdapter(BlockAttentionAdapter):
    block = DetachedOutBlock


class NoGqaAdapter(BlockAttentionAdapter):
    """A user adapter whose layer has one fused qkv: it says so with supports_gqa = False (read by the capability
    model: n_kv_heads < n_heads is exit 2, not tfmoe's crash in its own shapes check)."""

    supports_gqa = False


class LacksDeclaredAdapter(BlockAttentionAdapter):
    """The same, declared the new way: ``lacks``."""

    lacks = ("gqa", "padding_mask")

    def forward(self, module, x, padding_mask, *, causal, cache=None):
        if padding_mask is not None:
            raise NotImplementedError("no padding mask")
        return module.attention(x, None), None
