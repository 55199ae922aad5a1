"""``impl=timm:attention`` / ``timm:attention-unfused``: timm's ``Attention`` (``timm.layers``, the ViT block's
attention) with ``qkv_bias=True`` and ``fused_attn`` on (``F.scaled_dot_product_attention``) or off (its own
``q·kᵀ`` softmax path). One fused ``qkv`` ``nn.Linear(D, 3D)`` (rows q, k, v) and ``proj``; no GQA, no RoPE;
the scale ``head_dim ** -0.5``; no weights returned.

Masks: ``is_causal=True`` when nothing is padded, else one bool ``attn_mask`` (B, 1, T, T), True = attend, holding
the causal triangle and the key padding (timm's unfused path ignores ``attn_mask`` when ``is_causal`` is set, and
SDPA refuses both). A query that sees no key gives zeros when fused (SDPA) and NaN unfused (a softmax over -inf):
``fully_masked_policy=nan`` declares the latter.

timm imports torchvision (``timm.layers`` needs ``torchvision.ops.misc``): a torchvision built for the installed
torch must be there (PyPI's torchvision wheels are CUDA builds, which do not import beside a CPU torch)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from tfmoe.adapters.base import AttentionAdapter, checked_output, copy_linear, require_tested_release, seeded
from tfmoe.components.references import Projections
from tfmoe.contract.errors import BadInput

SUPPORTED = "timm 1.0.31 (the `timm` extra) and a torchvision built for the installed torch"
VARIANTS = {"attention": True, "attention-unfused": False}  # spec -> fused_attn


def _torchvision_hint(exc: Exception) -> str | None:
    if not isinstance(exc, RuntimeError):  # torchvision whose C ops do not load beside this torch
        return None
    return (f"impl=timm:...: `import timm` failed in torchvision ({exc}): timm needs a torchvision built for torch "
            f"{torch.__version__} (PyPI's torchvision is a CUDA build; on a CPU torch install the matching CPU "
            "torchvision from PyTorch's CPU wheel index)")


def require_timm() -> Any:
    return require_tested_release("timm", "timm", "timm.layers", "1.0.31", SUPPORTED, "timm", _torchvision_hint)


class TimmAttention(AttentionAdapter):
    library = "timm"  # an exception inside it is the adapter's error, not the layer's (tfmoe.rules.faults)
    supported = "==1.0.31"
    returns_weights = False
    takes_dropout = True
    supports_gqa = False

    def __init__(self, variant: str):
        if variant not in VARIANTS:
            raise BadInput(f"impl=timm:{variant}: unknown timm layer: use timm:attention (fused_attn, SDPA) or "
                           "timm:attention-unfused")
        self.spec = f"timm:{variant}"
        self.fused = VARIANTS[variant]
        self.layers = require_timm()

    @property
    def name(self) -> str:
        return f"timm Attention ({'fused' if self.fused else 'unfused'})"

    def build(self, d_model: int, n_heads: int, *, n_kv_heads: int, causal: bool, dropout: float,
              seed: int | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if n_kv_heads != n_heads:
            raise BadInput(f"impl={self.spec}: timm's Attention has no grouped kv heads: n_kv_heads={n_kv_heads} != "
                           f"n_heads={n_heads}; drop n_kv_heads")
        with seeded(seed):
            module = self.layers.Attention(d_model, num_heads=n_heads, qkv_bias=True, proj_bias=True,
                                           attn_drop=dropout)
            bound = 1 / math.sqrt(d_model)
            with torch.no_grad():  # biases drawn at random, so a bias bug cannot hide
                module.qkv.bias.uniform_(-bound, bound)
                module.proj.bias.uniform_(-bound, bound)
        module.fused_attn = self.fused
        return module.to(device=device, dtype=dtype).eval()

    def forward(self, module: nn.Module, x: torch.Tensor, padding_mask: torch.Tensor | None, *, causal: bool,
                cache: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = x.shape
        if padding_mask is None:
            return checked_output((module(x, is_causal=causal), None), "timm Attention")
        attend = torch.ones(T, T, dtype=torch.bool, device=x.device)
        if causal:
            attend = attend.tril()
        mask = attend[None, None] & padding_mask.to(device=x.device, dtype=torch.bool)[:, None, None, :]  # (B,1,T,T)
        return checked_output((module(x, attn_mask=mask), None), "timm Attention")

    def parameters(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return dict(module.named_parameters())

    def projections(self, params: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> Projections:
        w_q, w_k, w_v = params["qkv.weight"].chunk(3, dim=0)
        b_q, b_k, b_v = params["qkv.bias"].chunk(3, dim=0)
        return Projections(w_q, w_k, w_v, params["proj.weight"], n_heads, n_heads, b_q, b_k, b_v,
                           params["proj.bias"])

    def set_projections(self, module: nn.Module, p: Projections) -> None:
        zeros = torch.zeros_like(p.w_q[:, 0])
        copy_linear(module.qkv, torch.cat([p.w_q, p.w_k, p.w_v]),
                    torch.cat([b if b is not None else zeros for b in (p.b_q, p.b_k, p.b_v)]))
        copy_linear(module.proj, p.w_o, p.b_o)

    def hooks(self, module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        return module.qkv, module.proj
