"""First contact: memory-efficient-attention-pytorch's chunked kernel through tfmoe's kernel battery, docs only.

kernel=fc_mea:kernel wraps memory_efficient_attention(q, k, v, mask, causal, attn_bias, q_bucket_size,
k_bucket_size) into SDPA's signature: the scale is folded into q (the library always uses D**-0.5), grouped kv heads
are repeated (h // group), a bool mask becomes an additive bias with the library's own mask value (-finfo.max) and
an additive mask is clamped to it, so a query that sees no key averages v (uniform) in every kind of mask.
Buckets of 32 queries x 64 keys, so the chunked online softmax is what is judged. The library's dropout is not
attention dropout (the dropped weights leave the normaliser too), so dropout_p > 0 raises NotImplementedError.
kernel_bug_causal / kernel_bug_rescale plant a bug inside the library's summarize_qkv_chunk.
"""

from __future__ import annotations

import importlib
import math

import torch

# the package re-exports the function under the module's name: take the module itself
mea_mod = importlib.import_module("memory_efficient_attention_pytorch.memory_efficient_attention")

_ORIGINAL = mea_mod.summarize_qkv_chunk


def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p > 0:
        raise NotImplementedError("memory_efficient_attention's dropout renormalises over the kept weights")
    if scale is not None:
        q = q * (scale * math.sqrt(q.shape[-1]))
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    bias = None
    if attn_mask is not None:
        lowest = -torch.finfo(q.dtype).max
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, lowest)
        else:
            bias = attn_mask.to(q.dtype).clamp(min=lowest)
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return mea_mod.memory_efficient_attention(q, k, v, causal=is_causal, attn_bias=bias, q_bucket_size=32,
                                              k_bucket_size=64)


def _plant(summarize) -> None:
    mea_mod.summarize_qkv_chunk = summarize
    mea_mod.checkpointed_summarize_qkv_chunk = mea_mod.partial(mea_mod.checkpoint, summarize)


def _causal_off_by_one(q, k, v, mask, attn_bias_chunk, causal, qk_start_indices, dropout):
    """The library's chunk summary with the causal diagonal shifted: each query also sees the next key."""
    if not causal:
        return _ORIGINAL(q, k, v, mask, attn_bias_chunk, causal, qk_start_indices, dropout)
    q_start, k_start = qk_start_indices
    weight = torch.einsum("b h i d, b h j d -> b h i j", q, k)
    if attn_bias_chunk is not None:
        weight = weight + attn_bias_chunk
    mask_value = -torch.finfo(weight.dtype).max
    causal_mask = torch.ones((q.shape[-2], k.shape[-2]), dtype=torch.bool, device=q.device).triu(q_start - k_start + 2)
    weight = weight.masked_fill(causal_mask, mask_value)
    weight_max = weight.amax(dim=-1, keepdim=True).detach()
    exp_weight = (weight - weight_max).exp()
    return exp_weight.sum(dim=-1), torch.einsum("b h i j, b h j d -> b h i d", exp_weight, v), weight_max[..., 0]


def _no_running_max(q, k, v, mask, attn_bias_chunk, causal, qk_start_indices, dropout):
    """The chunk summary reports a running max of 0, so chunks are combined without rescaling to a common max."""
    s, wv, m = _ORIGINAL(q, k, v, mask, attn_bias_chunk, causal, qk_start_indices, dropout)
    return s, wv, torch.zeros_like(m)


def kernel_bug_causal(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    _plant(_causal_off_by_one)
    return kernel(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def kernel_bug_rescale(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    _plant(_no_running_max)
    return kernel(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
