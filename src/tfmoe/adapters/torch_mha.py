"""``impl=torch:mha``: ``torch.nn.MultiheadAttention(d_model, n_heads, dropout, bias=True, batch_first=True)``.

Its masks mean the opposite of tfmoe's: ``key_padding_mask`` (B, T) and ``attn_mask`` (T, T) are True where
attention is *blocked*; the adapter translates (key_padding_mask = ~padding_mask, attn_mask = the strict upper
triangle when causal) and asks for per-head weights (need_weights=True, average_attn_weights=False).
Biases are drawn at random (PyTorch initialises them to 0, which would hide a bias bug)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from tfmoe.adapters.base import AttentionAdapter, checked_output, copy_linear, seeded
from tfmoe.components.references import Projections
from tfmoe.contract.errors import BadInput


class TorchMHA(AttentionAdapter):
    spec = "torch:mha"
    supports_gqa = False

    @property
    def name(self) -> str:
        return "nn.MultiheadAttention"

    def build(self, d_model: int, n_heads: int, *, n_kv_heads: int, causal: bool, dropout: float,
              seed: int | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if n_kv_heads != n_heads:
            raise BadInput(f"impl=torch:mha: nn.MultiheadAttention has no grouped kv heads: n_kv_heads={n_kv_heads} "
                           f"!= n_heads={n_heads}; drop n_kv_heads")
        with seeded(seed):
            module = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, bias=True, batch_first=True)
            bound = 1 / math.sqrt(d_model)
            with torch.no_grad():
                module.in_proj_bias.uniform_(-bound, bound)
                module.out_proj.bias.uniform_(-bound, bound)
        return module.to(device=device, dtype=dtype).eval()

    def forward(self, module: nn.Module, x: torch.Tensor, padding_mask: torch.Tensor | None, *, causal: bool,
                cache: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = x.shape[1]
        blocked = ~torch.ones(T, T, dtype=torch.bool, device=x.device).tril() if causal else None  # True = blocked
        key_blocked = None if padding_mask is None else ~padding_mask.bool()
        return checked_output(module(x, x, x, attn_mask=blocked, key_padding_mask=key_blocked, need_weights=True,
                                     average_attn_weights=False), "nn.MultiheadAttention")

    def parameters(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {"in_proj_weight": module.in_proj_weight, "in_proj_bias": module.in_proj_bias,
                "out_proj.weight": module.out_proj.weight, "out_proj.bias": module.out_proj.bias}

    def projections(self, params: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> Projections:
        w_q, w_k, w_v = params["in_proj_weight"].chunk(3, dim=0)
        b_q, b_k, b_v = params["in_proj_bias"].chunk(3, dim=0)
        return Projections(w_q, w_k, w_v, params["out_proj.weight"], n_heads, n_heads, b_q, b_k, b_v,
                           params["out_proj.bias"])

    def set_projections(self, module: nn.Module, p: Projections) -> None:
        with torch.no_grad():
            module.in_proj_weight.copy_(torch.cat([p.w_q, p.w_k, p.w_v]))
            zeros = torch.zeros(p.w_q.shape[0], dtype=module.in_proj_bias.dtype, device=module.in_proj_bias.device)
            module.in_proj_bias.copy_(torch.cat([b if b is not None else zeros for b in (p.b_q, p.b_k, p.b_v)]))
        copy_linear(module.out_proj, p.w_o, p.b_o)

    def hooks(self, module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        return None, None  # MultiheadAttention calls F.linear on its weights: no layer to hook
