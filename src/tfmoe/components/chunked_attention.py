"""Exact attention over key blocks with an online softmax: FlashAttention's idea in plain PyTorch.

The scores are never materialised as a (T_q, T_k) matrix: for each block of keys we compute the block's
scores (T_q, block), fold them into a running maximum ``m``, a running denominator ``l`` and a running
numerator ``acc`` (rescaling the old sums by exp(m_old - m_new)), and divide once at the end. Same
mathematics as softmax(q kᵀ / sqrt(Dh)) v, memory O(T·block) instead of O(T²).

Policy for queries that see no key at all (every key masked): their output is 0, as in the course's
:class:`~tfmoe.components.attention.MultiHeadSelfAttention`.
"""

from __future__ import annotations

import math

import torch

from tfmoe.components.masks import combine_masks


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_padding_mask: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (B,H,T,Dh); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(f"key_padding_mask must be (B, T_k) = {(k.shape[0], k.shape[2])}, "
                         f"got {tuple(key_padding_mask.shape)}")


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      key_padding_mask: torch.Tensor | None = None, block_size: int = 128,
                      scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v computed block by block over the keys.

    q (B,H,Tq,Dh), k/v (B,H,Tk,Dh) -> (B,H,Tq,Dh) in q's dtype; sums are kept in fp32 (fp64 for fp64).
    ``causal``: query i sits at absolute position Tk - Tq + i (the queries are the last Tq tokens, as in
    KV-cache decoding) and sees keys j <= that position. ``key_padding_mask`` (B,Tk): True = real key.
    """
    _check_qkv(q, k, v, key_padding_mask)
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    B, H, Tq, Dh = q.shape
    Tk = k.shape[2]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    offset = Tk - Tq  # absolute position of query 0
    q_pos = torch.arange(Tq, device=q.device) + offset  # (Tq,)

    qf = q.to(acc_dtype)  # (B,H,Tq,Dh); no copy when q is already fp32/fp64
    m = torch.full((B, H, Tq, 1), float("-inf"), dtype=acc_dtype, device=q.device)  # running max
    denom = torch.zeros((B, H, Tq, 1), dtype=acc_dtype, device=q.device)  # running sum of exp
    acc = torch.zeros((B * H, Tq, Dh), dtype=acc_dtype, device=q.device)  # running sum of exp · v
    last_key = min(Tk, offset + Tq) if causal else Tk  # keys after the last query are never visible
    for start in range(0, last_key, block_size):
        end = min(start + block_size, Tk)
        kb = k[:, :, start:end].to(acc_dtype)  # (B,H,blk,Dh)
        vb = v[:, :, start:end].to(acc_dtype).reshape(B * H, end - start, Dh)  # (B·H,blk,Dh)
        s = (qf @ kb.transpose(-2, -1)).mul_(scale)  # (B,H,Tq,blk)
        visible = None
        if causal and end - 1 > offset:  # some key of this block lies in some query's future
            visible = torch.arange(start, end, device=q.device)[None, :] <= q_pos[:, None]  # (Tq,blk)
        if key_padding_mask is not None:
            kp = key_padding_mask[:, None, None, start:end].bool()  # (B,1,1,blk)
            visible = kp if visible is None else (visible & kp)
        if visible is not None:
            s.masked_fill_(~visible, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # (B,H,Tq,1)
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with nothing visible so far
        p = s.sub_(m_safe).exp_()  # (B,H,Tq,blk), in place: masked keys -> exp(-inf) = 0
        alpha = torch.exp(m - m_safe)  # rescales the old sums to the new maximum (0 while m = -inf)
        denom.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
        acc.mul_(alpha.view(B * H, Tq, 1)).baddbmm_(p.view(B * H, Tq, end - start), vb)  # acc += p·v in place
        m = m_new
    # a query that saw no key has acc = 0 and denom = 0: 0 / tiny = 0, the documented policy
    out = acc.div_(denom.view(B * H, Tq, 1).clamp_min(torch.finfo(acc_dtype).tiny)).view(B, H, Tq, Dh)
    return out.to(q.dtype)  # (B,H,Tq,Dh)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    key_padding_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """The textbook version, every op in q's dtype: materialises the (B,H,Tq,Tk) scores and weights.

    Same masking conventions and fully-masked-row policy (output 0) as :func:`chunked_attention`.
    """
    _check_qkv(q, k, v, key_padding_mask)
    Tq, Tk, Dh = q.shape[2], k.shape[2], q.shape[-1]
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B,H,Tq,Tk)
    mask = combine_masks(Tq, Tk, causal, key_padding_mask, device=q.device, offset=Tk - Tq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # (B,H,Tq,Tk); fully masked rows are NaN here
    if mask is not None:
        weights = torch.where(mask.any(dim=-1, keepdim=True), weights, torch.zeros_like(weights))
    return weights @ v  # (B,H,Tq,Dh)


def naive_attention_bytes(B: int, H: int, Tq: int, Tk: int, dtype: torch.dtype) -> int:
    """Estimated peak bytes of the naive path's (B,H,Tq,Tk) tensors: scores, mask fill and softmax output
    each hold one such matrix (the course module also keeps fp32 weights), so three of them at once."""
    itemsize = max(torch.empty((), dtype=dtype).element_size(), 4)  # softmax runs in fp32 at least
    return 3 * B * H * Tq * Tk * itemsize
