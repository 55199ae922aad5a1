"""x-transformers' ``Attend`` (the attention core of its ``Attention``) behind SDPA's signature, for
``tfmoe attn-check kernel=xt_attend_kernel:attend`` (tests put tests/ on sys.path; needs x-transformers)."""

from __future__ import annotations

import torch
from x_transformers.attend import Attend


def attend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """A bool mask is Attend's ``mask`` (True = attend), a float mask its ``attn_bias``; its causal mask is
    bottom-right (declared below). SDPA's enable_gqa maps query head h to kv head h // (Hq/Hkv); Attend's own
    repeat maps it to h % Hkv, so the kv heads are expanded here, SDPA's way."""
    if enable_gqa and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    core = Attend(causal=is_causal, dropout=dropout_p, scale=scale)  # training mode: dropout applies
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        out, _ = core(q, k, v, mask=attn_mask.expand(q.shape[0], -1, q.shape[2], -1))
    else:
        out, _ = core(q, k, v, attn_bias=attn_mask)
    return out


attend.causal_align = "bottom_right"
