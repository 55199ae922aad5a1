"""First contact: torchscale's MultiheadAttention through tfmoe's attn-check, from the docs only.

impl=fc_torchscale:MHA; the Bug* classes plant a bug inside torchscale's own code path. torchscale's conventions
(fairseq's): key_padding_mask True = *padded*; attn_mask an additive (Tq, Tk) float mask; biases on q, k, v and
out; the weights come back as (H, B, Tq, Tk), before dropout.
"""

from __future__ import annotations

import torch
from torchscale.architecture.config import EncoderConfig
from torchscale.component import multihead_attention as ts_mha

from tfmoe.adapters import AttentionAdapter, Projections, seeded


class MHA(AttentionAdapter):
    returns_weights = True
    takes_dropout = True
    supports_gqa = False

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        self.plant()
        with seeded(seed):
            m = ts_mha.MultiheadAttention(EncoderConfig(), d_model, n_heads, dropout=dropout, self_attention=True)
        return m.to(device=device, dtype=dtype).eval()

    def plant(self) -> None:
        """Where a Bug* subclass changes torchscale's own code."""

    def forward(self, module, x, padding_mask, *, causal, cache=None):
        T = x.shape[1]
        attn_mask = None
        if causal:  # as torchscale's Decoder builds it
            attn_mask = torch.triu(torch.full((T, T), float("-inf"), device=x.device, dtype=x.dtype), 1)
        kpm = None if padding_mask is None else ~padding_mask
        out, w = module(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask)
        return out, w.transpose(0, 1)  # (B,T,D), (B,H,Tq,Tk)

    def parameters(self, module):
        return dict(module.named_parameters())

    def projections(self, params, n_heads, n_kv_heads):
        return Projections(params["q_proj.weight"], params["k_proj.weight"], params["v_proj.weight"],
                           params["out_proj.weight"], n_heads, n_kv_heads,
                           b_q=params["q_proj.bias"], b_k=params["k_proj.bias"], b_v=params["v_proj.bias"],
                           b_o=params["out_proj.bias"])


class BugPaddingIgnored(MHA):
    """torchscale's forward drops the key_padding_mask it is given."""

    def plant(self) -> None:
        orig = ts_mha.MultiheadAttention.forward

        def forward(self, query, key, value, incremental_state=None, key_padding_mask=None, attn_mask=None,
                    rel_pos=None, is_first_step=False):
            return orig(self, query, key, value, incremental_state, None, attn_mask, rel_pos, is_first_step)

        ts_mha.MultiheadAttention.forward = forward


class BugScale(MHA):
    """torchscale's MultiheadAttention scales q by embed_dim**-0.5 instead of head_dim**-0.5."""

    def plant(self) -> None:
        orig = ts_mha.MultiheadAttention.__init__

        def __init__(self, args, embed_dim, num_heads, *a, **kw):
            orig(self, args, embed_dim, num_heads, *a, **kw)
            self.scaling = embed_dim ** -0.5

        ts_mha.MultiheadAttention.__init__ = __init__
