"""Layers written for the first-contact causes of issue 28 (experiments/zoo.md, C1 and C3-C6): each is correct (or
carries one planted bug where it says so) and was failed, crashed or passed wrongly before the fix."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.utils.checkpoint
from buggy_attention import PlainMHA
from buggy_kernels import plain_kernel
from capability_layers import BlockAttentionAdapter

from tfmoe.adapters import seeded
from tfmoe.components.references import fused_projections


def checkpointed_kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """C6: a correct kernel that checkpoints its work with reentrant torch.utils.checkpoint (as a chunked library
    does): torch.autograd.grad refuses it, .backward() does not."""
    def run(q, k, v):
        return plain_kernel(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return torch.utils.checkpoint.checkpoint(run, q, k, v, use_reentrant=True)


class NanRowsWrongScale(PlainMHA):
    """C1: NaN in rows that see no key (declared fully_masked_policy=nan) and a real bug (scores / sqrt(d_model)):
    the NaN rows read as a random eval-mode forward used to stop every check from judging, exit 0."""

    def normalize(self, scores, vis):
        return scores.float().masked_fill(~vis, float("-inf")).softmax(dim=-1).to(scores.dtype)  # NaN rows

    def scale(self):
        return 1.0 / math.sqrt(self.d_model)


class NanRows(NanRowsWrongScale):
    """C1's layer without the bug: NaN in rows that see no key, declared with fully_masked_policy=nan."""

    def scale(self):
        return 1.0 / math.sqrt(self.d_head)


class OutsideWeights(nn.Module):
    """C5: keeps its projections as plain tensors (as Keras variables are), not registered parameters."""

    def __init__(self, d_model: int, n_heads: int, causal: bool):
        super().__init__()
        self.h, self.causal = n_heads, causal
        self.w_qkv = (torch.randn(3 * d_model, d_model) / math.sqrt(d_model)).requires_grad_(True)
        self.w_out = (torch.randn(d_model, d_model) / math.sqrt(d_model)).requires_grad_(True)

    def to(self, *args, **kwargs):  # plain tensors do not follow nn.Module.to
        self.w_qkv = self.w_qkv.detach().to(*args, **kwargs).requires_grad_(True)
        self.w_out = self.w_out.detach().to(*args, **kwargs).requires_grad_(True)
        return self

    def forward(self, x, padding_mask=None):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in (x @ self.w_qkv.T).split(D, dim=-1))
        vis = torch.ones(T, T, dtype=torch.bool, device=x.device)
        vis = (vis.tril() if self.causal else vis)[None, None]
        if padding_mask is not None:
            vis = vis & padding_mask[:, None, None, :]
        w = ((q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5).masked_fill(~vis, torch.finfo(x.dtype).min).softmax(-1)
        return (w @ v).transpose(1, 2).reshape(B, T, D) @ self.w_out.T


class OutsideWeightsAdapter(BlockAttentionAdapter):
    """C5's adapter: parameters() names the tensors the forward reads (no module path functional_call could swap)."""

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        with seeded(seed):
            return OutsideWeights(d_model, n_heads, causal).to(device=device, dtype=dtype).eval()

    def forward(self, module, x, padding_mask, *, causal, cache=None):
        return module(x, padding_mask), None

    def parameters(self, module):
        return {"w_qkv": module.w_qkv, "w_out": module.w_out}

    def projections(self, params, n_heads, n_kv_heads):
        return fused_projections(params["w_qkv"], params["w_out"], n_heads)


class RefusingAdapter(BlockAttentionAdapter):
    """C3: a user adapter whose build raises an ordinary ValueError for a setting its layer cannot take."""

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        if n_heads != 1:
            raise ValueError(f"this layer has one head (got n_heads={n_heads})")
        return super().build(d_model, n_heads, n_kv_heads=n_kv_heads, causal=causal, dropout=dropout, seed=seed,
                             dtype=dtype, device=device)


class _Renamed(nn.Module):
    count = 0

    def __init__(self, block):
        super().__init__()
        _Renamed.count += 1
        setattr(self, f"block_{_Renamed.count}", block)  # a new name per instance, as Keras names its layers
        self.inner = block


class RenamingAdapter(BlockAttentionAdapter):
    """C4: every build names its weights anew (block_1.*, block_2.*): copying weights between builds cannot work."""

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        return _Renamed(super().build(d_model, n_heads, n_kv_heads=n_kv_heads, causal=causal, dropout=dropout,
                                      seed=seed, dtype=dtype, device=device))

    def forward(self, module, x, padding_mask, *, causal, cache=None):
        return module.inner.attention(x, padding_mask), None

    def parameters(self, module):
        return {"inner.qkv.weight": module.inner.qkv.weight, "inner.out.weight": module.inner.out.weight}

    def projections(self, params, n_heads, n_kv_heads):
        return fused_projections(params["inner.qkv.weight"], params["inner.out.weight"], n_heads)


class _Growing(_Renamed):
    def __init__(self, block):
        super().__init__(block)
        self.register_buffer("history", torch.zeros(_Renamed.count))  # a per-instance shape: no order can map it


class GrowingAdapter(RenamingAdapter):
    """C4, the case no copy can fix: a state whose shapes differ between builds fails the copying checks."""

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        return _Growing(BlockAttentionAdapter.build(self, d_model, n_heads, n_kv_heads=n_kv_heads, causal=causal,
                                                    dropout=dropout, seed=seed, dtype=dtype, device=device))
