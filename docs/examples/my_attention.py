"""An attention layer of your own, in the course's interface (the layer tfmoe's example test judges).

Replace it with yours: ``MyAttention(d_model, n_heads, causal=True, dropout=0.0)`` with ``qkv`` = Linear(D, 3D,
bias=False) and ``out`` = Linear(D, D, bias=False); ``forward(x, padding_mask=None) -> (output, weights)``. Another
layout needs an adapter (docs/checking-your-own-layers.md, "Check your own attention").
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MyAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, causal: bool = True, dropout: float = 0.0):
        super().__init__()
        self.n_heads, self.d_head, self.causal, self.p = n_heads, d_model // n_heads, causal, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.n_heads, self.d_head).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, T, T)
        visible = torch.ones(T, T, dtype=torch.bool, device=x.device)
        if self.causal:
            visible = visible.tril()
        visible = visible[None, None]
        if padding_mask is not None:  # (B, T), True = a real token: padded keys are hidden
            visible = visible & padding_mask.bool()[:, None, None, :]
        up = torch.promote_types(scores.dtype, torch.float32)  # softmax in fp32 at least (fp64 stays fp64)
        weights = scores.to(up).masked_fill(~visible, float("-inf")).softmax(dim=-1)
        weights = torch.nan_to_num(weights, nan=0.0)  # a query that sees no key gets zeros
        context = F.dropout(weights, self.p, self.training).to(v.dtype) @ v  # (B, H, T, Dh)
        return self.out(context.transpose(1, 2).reshape(B, T, D)), weights
