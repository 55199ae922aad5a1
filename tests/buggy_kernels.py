"""Attention kernels with SDPA's signature, for tfmoe attn-check kernel=...: one correct kernel written plainly,
and kernels that each plant one real bug in exactly one check family."""

from __future__ import annotations

import math

import torch

NOT_A_FUNCTION = 42


def _attend(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *, kv_head=None,
            causal_offset=None, use_bool=True, use_float=True, fill_empty=True):
    """A plain (B,Hq,Tq,D) attention, written without SDPA; the keyword switches plant the bugs."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if Hkv != Hq:
        if not enable_gqa:
            raise ValueError("Hkv != Hq needs enable_gqa=True")
        heads = kv_head(Hq, Hkv) if kv_head else torch.arange(Hq) // (Hq // Hkv)
        k, v = k[:, heads], v[:, heads]
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D) if scale is None else scale)  # (B,Hq,Tq,Tk)
    allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    if is_causal:
        offset = 0 if causal_offset is None else causal_offset(Tq, Tk)
        allowed = torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None] + offset
    allowed = allowed.expand(B, Hq, Tq, Tk)
    if attn_mask is not None and attn_mask.dtype == torch.bool and use_bool:
        allowed = allowed & attn_mask
    if attn_mask is not None and attn_mask.dtype != torch.bool and use_float:
        s = s + attn_mask
    s = s.masked_fill(~allowed, float("-inf"))
    if fill_empty:
        empty = torch.isinf(s).all(dim=-1, keepdim=True)
        w = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    else:
        w = torch.softmax(s, dim=-1)  # a row of -inf -> NaN
    return w @ v


def plain_kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct: softmax(q kᵀ·scale + mask) v, fully masked rows -> 0 (SDPA's policy)."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa)


def kernel_ignores_scale(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Bug (scale): takes `scale` and ignores it (always 1/sqrt(D))."""
    return _attend(q, k, v, attn_mask, is_causal, None, enable_gqa)


def kernel_bottom_right(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Bug (causal): bottom-right causal alignment while claiming SDPA's top-left is_causal."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, causal_offset=lambda Tq, Tk: Tk - Tq)


def kernel_gqa_modulo(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Bug (gqa): query head h reads kv head h % Hkv instead of h // (Hq / Hkv)."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, kv_head=lambda Hq, Hkv: torch.arange(Hq) % Hkv)


def kernel_ignores_bool_mask(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                             enable_gqa=False):
    """Bug (padding_bool): a boolean mask is silently ignored (padded keys get attention)."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, use_bool=False)


def kernel_ignores_float_mask(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False):
    """Bug (padding_additive): an additive float mask is silently ignored."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, use_float=False)


def kernel_nan_rows(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Bug (fully_masked, against the default expectation zeros): a row that sees no key comes out NaN."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, fill_empty=False)


def kernel_nan_to_num_rows(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                           enable_gqa=False):
    """Bug (backward): softmax over an all -inf row, then nan_to_num — the forward is 0 there, but the softmax's
    backward is NaN, and NaN reaches dk and dv (the first cwd kernel written for the tests did exactly this)."""
    return torch.nan_to_num(_attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, fill_empty=False), nan=0.0)


class _WrongGradAttention(torch.autograd.Function):
    """The right forward, a hand-written backward that forgets the softmax Jacobian's δ term."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, enable_gqa):
        out = _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa)
        ctx.save_for_backward(q, k, v)
        ctx.args = (attn_mask, is_causal, scale, enable_gqa)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = _attend(qq, kk, vv, *ctx.args)
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad_out)
        return 2.0 * dq, dk, dv, None, None, None, None  # dq doubled: the planted bug


def kernel_wrong_grad(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Bug (backward): the forward is right, dq comes out twice too large."""
    return _WrongGradAttention.apply(q, k, v, attn_mask, is_causal, scale, enable_gqa)


def kernel_no_gqa_no_scale(q, k, v, attn_mask=None, is_causal=False):
    """Correct, but its signature has neither `scale` nor `enable_gqa`: those cases are skipped."""
    return _attend(q, k, v, attn_mask, is_causal)


def kernel_forward_only(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct forward; refuses autograd with NotImplementedError (like FlexAttention on CPU)."""
    if torch.is_grad_enabled() and q.requires_grad:
        raise NotImplementedError("this kernel has no backward yet")
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa)


def kernel_crashes_on_masks(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
    """Raises an ordinary error on any mask: the cases fail (with the error), the battery does not crash."""
    if attn_mask is not None:
        raise ValueError("mask layout not understood")
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa)


def kernel_declares_bottom_right(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Correct bottom-right kernel that says so (FlashAttention >= 2.1's convention)."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, causal_offset=lambda Tq, Tk: Tk - Tq)


kernel_declares_bottom_right.causal_align = "bottom_right"


def kernel_takes_only_q(q):
    return q


def kernel_wrong_shape(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa).transpose(1, 2)
