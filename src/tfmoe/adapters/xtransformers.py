"""``impl=x-transformers:attention[-flash][-nope]``: x-transformers' ``Attention`` (``x_transformers.x_transformers``)
with grouped kv heads (``kv_heads``), rotary positions passed in (``rotary_pos_emb`` from its ``RotaryEmbedding``
over the whole head; ``-nope``: none), the key padding as ``mask=`` (B, T) True = real token, and ``causal=`` at
call time. ``-flash``: ``flash=True`` (its ``F.scaled_dot_product_attention`` path, no weights returned); else its
einsum path, whose post-softmax weights come back (``return_intermediates=True``).

What the reference is told (read from x-transformers 2.31's source, not assumed):

- RoPE pairs dims (2i, 2i+1) ("interleaved": ``rearrange('... (d r) -> ... d r', r=2)``), base 10000;
- GQA tiles the kv heads: ``repeat('b kvh n d -> b (r kvh) n d')``, so query head h reads kv head h % Hkv, not
  h // (H/Hkv). The reference's mapping is h // (H/Hkv); the adapter hands it the query heads (rows of W_q,
  columns of W_o, the returned weights) in the order that makes the two agree: reference head h' is the layer's
  head (h' % r)·Hkv + h' // r, r = H/Hkv. A layer whose mapping differs from its declared one still fails;
- the scale is ``dim_head ** -0.5``.

Built with ``project_out=True``: at heads=1 x-transformers otherwise drops ``to_out`` (an identity), which changes
the parameter set with the head count. Its ``mask=`` also zeroes the output of padded *query* rows (after
``to_out``); those rows are don't-care (see the ``padded_query_policy`` of attn-check)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from tfmoe.adapters.base import AttentionAdapter, checked_output, copy_linear, require_tested_release, seeded
from tfmoe.components.references import Projections, Rope
from tfmoe.contract.errors import BadInput

TESTED = "2.31.10"
SUPPORTED = f"=={TESTED}"
VARIANTS = {"attention": (False, True), "attention-nope": (False, False), "attention-flash": (True, True),
            "attention-flash-nope": (True, False)}  # spec -> (flash, RoPE)
ROPE_BASE = 10_000.0


def require_x_transformers() -> Any:
    return require_tested_release("x-transformers", "x-transformers", "x_transformers.x_transformers", TESTED,
                                  f"x-transformers {TESTED} (the `xtransformers` extra)", "xtransformers")


def query_order(n_heads: int, n_kv_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """(H,) the layer's query head for each reference head h' (tiled GQA -> the reference's blocked mapping)."""
    r = n_heads // n_kv_heads
    h = torch.arange(n_heads, device=device)
    return (h % r) * n_kv_heads + h // r


class XTransformersAttention(AttentionAdapter):
    library = "x_transformers"  # an exception inside it is the adapter's error, not the layer's (tfmoe.rules.faults)
    supported = "==2.31.10"
    takes_dropout = True

    def __init__(self, variant: str):
        if variant not in VARIANTS:
            raise BadInput(f"impl=x-transformers:{variant}: unknown x-transformers layer: use one of "
                           + ", ".join(f"x-transformers:{v}" for v in VARIANTS))
        self.spec = f"x-transformers:{variant}"
        self.flash, self.rope = VARIANTS[variant]
        self.returns_weights = not self.flash
        self.xt = require_x_transformers()

    @property
    def name(self) -> str:
        return f"x-transformers Attention ({'flash' if self.flash else 'einsum'}, {'RoPE' if self.rope else 'no RoPE'})"

    def build(self, d_model: int, n_heads: int, *, n_kv_heads: int, causal: bool, dropout: float,
              seed: int | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
        dh = d_model // n_heads
        if self.rope and dh <= 2:  # RotaryEmbedding computes base_rescale_factor ** (dim / (dim - 2))
            raise BadInput(f"impl={self.spec}: head dim {dh} (d_model {d_model} / {n_heads} heads): x-transformers' "
                           "RotaryEmbedding divides by dim_head - 2, so RoPE needs dim_head > 2; use fewer heads "
                           f"or impl=x-transformers:{'attention-flash-nope' if self.flash else 'attention-nope'}")
        with seeded(seed):
            module = self.xt.Attention(d_model, dim_head=dh, heads=n_heads, kv_heads=n_kv_heads, causal=causal,
                                       flash=self.flash, dropout=dropout, project_out=True)
        rotary = self.xt.RotaryEmbedding(dh, base=ROPE_BASE).to(device) if self.rope else None
        object.__setattr__(module, "_tfmoe_rotary", rotary)  # not a submodule: its buffer is no parameter
        return module.to(device=device, dtype=dtype).eval()

    def forward(self, module: nn.Module, x: torch.Tensor, padding_mask: torch.Tensor | None, *, causal: bool,
                cache: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        rotary = module._tfmoe_rotary
        pos = None if rotary is None else rotary.forward_from_seq_len(x.shape[1])  # (freqs (1,T,Dh), 1.)
        mask = None if padding_mask is None else padding_mask.to(device=x.device, dtype=torch.bool)
        out, inter = module(x, mask=mask, rotary_pos_emb=pos, causal=causal, return_intermediates=True)
        weights = inter.post_softmax_attn
        if weights is not None:  # the layer's head order -> the reference's
            weights = weights.index_select(1, query_order(module.heads, module.kv_heads, x.device))
        return checked_output((out, weights), "x-transformers Attention")

    def parameters(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return dict(module.named_parameters())

    def projections(self, params: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> Projections:
        w_q, w_o = params["to_q.weight"], params["to_out.weight"]
        dh = w_q.shape[0] // n_heads
        order = query_order(n_heads, n_kv_heads, w_q.device)
        w_q = w_q.reshape(n_heads, dh, -1).index_select(0, order).reshape(n_heads * dh, -1)  # (H·Dh, D)
        w_o = w_o.reshape(w_o.shape[0], n_heads, dh).index_select(1, order).reshape(w_o.shape[0], -1)  # (D, H·Dh)
        rope = Rope(ROPE_BASE, dh, pairing="interleaved") if self.rope else None
        return Projections(w_q, params["to_k.weight"], params["to_v.weight"], w_o, n_heads, n_kv_heads, rope=rope)

    def set_projections(self, module: nn.Module, p: Projections) -> None:
        H, dh = p.n_heads, p.d_head
        back = query_order(H, p.n_kv_heads, p.w_q.device).argsort()  # reference order -> the layer's
        w_q = p.w_q.reshape(H, dh, -1).index_select(0, back).reshape(H * dh, -1)
        w_o = p.w_o.reshape(p.w_o.shape[0], H, dh).index_select(1, back).reshape(p.w_o.shape[0], -1)
        for layer, w in ((module.to_q, w_q), (module.to_k, p.w_k), (module.to_v, p.w_v), (module.to_out, w_o)):
            copy_linear(layer, w, None)

    def hooks(self, module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        return None, module.to_out
