"""A user's attention layer in another layout, and the adapter that lets attn-check judge it
(docs/checking-your-own-layers.md, "An attention module"). The layer keeps its projections as (D, H, Dh) einsum tensors, takes the key mask and the
causal flag at call time, applies RoPE itself and returns no weights."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from tfmoe.adapters import AttentionAdapter, Projections, Rope, seeded


class EinsumRopeAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, theta: float = 500.0):
        super().__init__()
        dh = d_model // n_heads
        self.n_heads, self.n_kv, self.theta = n_heads, n_kv_heads, theta
        self.wq = nn.Parameter(torch.randn(d_model, n_heads, dh) / math.sqrt(d_model))
        self.wk = nn.Parameter(torch.randn(d_model, n_kv_heads, dh) / math.sqrt(d_model))
        self.wv = nn.Parameter(torch.randn(d_model, n_kv_heads, dh) / math.sqrt(d_model))
        self.wo = nn.Parameter(torch.randn(n_heads, dh, d_model) / math.sqrt(d_model))

    def rope(self, t: torch.Tensor) -> torch.Tensor:  # (B,T,H,Dh), rotate-half layout
        T, dh = t.shape[1], t.shape[-1]
        inv = self.theta ** (-torch.arange(0, dh, 2, dtype=t.dtype, device=t.device) / dh)
        ang = torch.arange(T, dtype=t.dtype, device=t.device)[:, None] * inv  # (T, Dh/2)
        cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
        a, b = t[..., : dh // 2], t[..., dh // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        q = self.rope(torch.einsum("btd,dhe->bthe", x, self.wq))
        k = self.rope(torch.einsum("btd,dhe->bthe", x, self.wk))
        v = torch.einsum("btd,dhe->bthe", x, self.wv)
        group = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        s = torch.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(q.shape[-1])
        T = x.shape[1]
        hidden = torch.zeros(T, T, dtype=torch.bool, device=x.device)
        if is_causal:
            hidden = hidden | torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        hidden = hidden[None, None] | (self.key_hidden(key_mask, T, x.device))
        w = s.masked_fill(hidden, torch.finfo(s.dtype).min).softmax(-1)
        return torch.einsum("bhqk,bkhe,hed->bqd", w, v, self.wo)

    def key_hidden(self, key_mask: torch.Tensor | None, T: int, device: torch.device) -> torch.Tensor:
        if key_mask is None:
            return torch.zeros(1, 1, 1, T, dtype=torch.bool, device=device)
        return ~key_mask[:, None, None, :]


class QueryMaskedEinsum(EinsumRopeAttention):
    """The same layer with one bug: the key mask hides query rows instead of key columns."""

    def key_hidden(self, key_mask, T, device):
        if key_mask is None:
            return torch.zeros(1, 1, 1, T, dtype=torch.bool, device=device)
        return ~key_mask[:, None, :, None]


class EinsumAdapter(AttentionAdapter):
    """The protocol for EinsumRopeAttention: build, forward, parameters, projections (nn.Linear layout + RoPE)."""

    layer = EinsumRopeAttention
    returns_weights = False  # the layer returns its output only
    takes_dropout = False

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        with seeded(seed):
            module = self.layer(d_model, n_heads, n_kv_heads)
        return module.to(device=device, dtype=dtype).eval()

    def forward(self, module, x, padding_mask, *, causal, cache=None):
        return module(x, key_mask=padding_mask, is_causal=causal), None

    def parameters(self, module):
        return dict(module.named_parameters())

    def projections(self, params, n_heads, n_kv_heads):
        D, _, dh = params["wq"].shape
        def linear(w):  # (D, H, Dh) -> (H·Dh, D)
            return w.reshape(D, -1).T
        return Projections(linear(params["wq"]), linear(params["wk"]), linear(params["wv"]),
                           params["wo"].reshape(-1, D).T, n_heads, n_kv_heads, rope=Rope(500.0, dh))


class BuggyEinsumAdapter(EinsumAdapter):
    layer = QueryMaskedEinsum
