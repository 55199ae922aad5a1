"""``impl=torchtune:mha`` / ``torchtune:mha-nope``: torchtune's ``MultiHeadAttention`` (``torchtune.modules``), as
its Llama builders assemble it: q/k/v/output ``nn.Linear`` without biases, grouped kv heads (``num_kv_heads``) and
``RotaryPositionalEmbeddings`` (``mha``; ``mha-nope``: no positional embedding).

What the reference is told (read from torchtune 0.6.1's source, not assumed):

- RoPE pairs dims (2i, 2i+1) ("interleaved": ``x.reshape(..., -1, 2)``), angle pos · base^(-2i/Dh), base 10000;
- query head h reads kv head h // (H/Hkv) (``k.unsqueeze(2).expand(b, Hkv, H/Hkv, ...).flatten(1, 2)``);
- the scale is SDPA's default 1/sqrt(Dh).

Masks: torchtune's self-attention is called ``module(x, x, mask=...)`` (y = x is the key/value input); its bool
``mask`` (B, Tq, Tk) is True = the query attends to the key and replaces the causal default when given. The adapter
passes no mask for a causal call without padding (torchtune's own ``is_causal`` path), else one mask holding the
causal triangle (when causal) and the key padding. The layer returns no weights; dropout is SDPA's ``dropout_p``
(``attn_dropout``) in training mode."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from tfmoe.adapters.base import AttentionAdapter, checked_output, copy_linear, require_tested_release, seeded
from tfmoe.components.references import Projections, Rope
from tfmoe.contract.errors import BadInput

SUPPORTED = "torchtune 0.6.1 with torchao 0.11.0 (the `torchtune` extra)"
VARIANTS = {"mha": True, "mha-nope": False}  # spec -> RoPE on
ROPE_BASE = 10_000.0


def require_torchtune() -> Any:
    return require_tested_release("torchtune", "torchtune", "torchtune.modules", "0.6.1", SUPPORTED, "torchtune")


class TorchtuneMHA(AttentionAdapter):
    library = "torchtune"  # an exception inside it is the adapter's error, not the layer's (tfmoe.rules.faults)
    supported = "==0.6.1"
    returns_weights = False
    takes_dropout = True

    def __init__(self, variant: str):
        if variant not in VARIANTS:
            raise BadInput(f"impl=torchtune:{variant}: unknown torchtune layer: use torchtune:mha (RoPE) or "
                           "torchtune:mha-nope")
        self.spec = f"torchtune:{variant}"
        self.rope = VARIANTS[variant]
        self.modules = require_torchtune()

    @property
    def name(self) -> str:
        return f"torchtune MultiHeadAttention ({'RoPE' if self.rope else 'no RoPE'})"

    def build(self, d_model: int, n_heads: int, *, n_kv_heads: int, causal: bool, dropout: float,
              seed: int | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
        dh = d_model // n_heads
        with seeded(seed):
            module = self.modules.MultiHeadAttention(
                embed_dim=d_model, num_heads=n_heads, num_kv_heads=n_kv_heads, head_dim=dh,
                q_proj=nn.Linear(d_model, n_heads * dh, bias=False),
                k_proj=nn.Linear(d_model, n_kv_heads * dh, bias=False),
                v_proj=nn.Linear(d_model, n_kv_heads * dh, bias=False),
                output_proj=nn.Linear(n_heads * dh, d_model, bias=False),
                pos_embeddings=self.modules.RotaryPositionalEmbeddings(dh, max_seq_len=4096, base=int(ROPE_BASE))
                if self.rope else None,
                max_seq_len=4096, is_causal=causal, attn_dropout=dropout)
        return module.to(device=device, dtype=dtype).eval()

    def forward(self, module: nn.Module, x: torch.Tensor, padding_mask: torch.Tensor | None, *, causal: bool,
                cache: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = x.shape
        mask = None  # torchtune: None = its causal default
        if padding_mask is not None or not causal:
            attend = torch.ones(T, T, dtype=torch.bool, device=x.device)
            if causal:
                attend = attend.tril()
            mask = attend.expand(B, T, T)  # (B,Tq,Tk) True = attend
            if padding_mask is not None:
                mask = mask & padding_mask.to(device=x.device, dtype=torch.bool)[:, None, :]
        return checked_output((module(x, x, mask=mask), None), "torchtune MultiHeadAttention")

    def parameters(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return dict(module.named_parameters())

    def projections(self, params: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> Projections:
        w_q = params["q_proj.weight"]
        rope = Rope(ROPE_BASE, w_q.shape[0] // n_heads, pairing="interleaved") if self.rope else None
        return Projections(w_q, params["k_proj.weight"], params["v_proj.weight"], params["output_proj.weight"],
                           n_heads, n_kv_heads, rope=rope)

    def set_projections(self, module: nn.Module, p: Projections) -> None:
        for name, w, b in (("q_proj", p.w_q, p.b_q), ("k_proj", p.w_k, p.b_k), ("v_proj", p.w_v, p.b_v),
                           ("output_proj", p.w_o, p.b_o)):
            copy_linear(getattr(module, name), w, b)

    def hooks(self, module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        return None, module.output_proj
