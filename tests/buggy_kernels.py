"""Attention kernels with SDPA's signature, for tfmoe attn-check kernel=...: one correct kernel written plainly,
and kernels that each plant one real bug in exactly one check family."""

from __future__ import annotations

import math

import torch

NOT_A_FUNCTION = 42


def _attend(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *, dropout_p=0.0, kv_head=None,
            causal_offset=None, use_bool=True, use_float=True, fill_empty=True, mask_view=None, use_dropout=True,
            rescale=True, uniform_causal_empty=False, rescale_by=None, hide_in_long_rows=False, normalise_last=False,
            approx_reciprocal=False):
    """A plain (B,Hq,Tq,D) attention, written without SDPA (dropout on the weights, torch's RNG, 1/(1-p));
    the keyword switches plant the bugs."""
    B, Hq, Tq, D = q.shape
    if attn_mask is not None and mask_view is not None:
        attn_mask = mask_view(attn_mask)
    Hkv, Tk = k.shape[1], k.shape[2]
    if Hkv != Hq:
        if not enable_gqa:
            raise ValueError("Hkv != Hq needs enable_gqa=True")
        heads = kv_head(Hq, Hkv) if kv_head else torch.arange(Hq, device=q.device) // (Hq // Hkv)
        if normalise_last:  # as the library's adapter: repeat_interleave, whose backward sums the group at once
            k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
        else:
            k, v = k[:, heads], v[:, heads]
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D) if scale is None else scale)  # (B,Hq,Tq,Tk)
    allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    if is_causal:
        offset = 0 if causal_offset is None else causal_offset(Tq, Tk)
        allowed = torch.arange(Tk, device=q.device)[None, :] <= torch.arange(Tq, device=q.device)[:, None] + offset
    allowed = allowed.expand(B, Hq, Tq, Tk)
    if attn_mask is not None and attn_mask.dtype == torch.bool and use_bool:
        allowed = allowed & attn_mask
    if attn_mask is not None and attn_mask.dtype != torch.bool and use_float:
        s = s + attn_mask
    s = s.masked_fill(~allowed, float("-inf"))
    if hide_in_long_rows:  # the bug: each row that sees >= 128 keys loses its lowest-scored visible key
        vis = ~torch.isinf(s)
        n = vis.sum(dim=-1, keepdim=True)
        lowest = torch.nn.functional.one_hot(s.masked_fill(~vis, float("inf")).argmin(dim=-1), s.shape[-1]).bool()
        s = s.masked_fill(lowest & (n >= 128), float("-inf"))
    if normalise_last:  # correct: exp(s - max) @ v, divided by Σ exp last; rows that see no key -> 0
        empty = torch.isinf(s).all(dim=-1, keepdim=True)
        s = s.masked_fill(empty, 0.0)
        e = torch.exp(s - s.amax(dim=-1, keepdim=True).detach())
        if approx_reciprocal:  # acc·(1/l) with 1/l one ulp high: PTX rcp.approx's bound, as a fused GPU kernel
            r = 1.0 / e.sum(dim=-1, keepdim=True)
            return ((e @ v) * torch.nextafter(r, torch.full_like(r, math.inf))).masked_fill(empty, 0.0)
        return ((e @ v) / e.sum(dim=-1, keepdim=True)).masked_fill(empty, 0.0)
    if fill_empty:
        empty = torch.isinf(s).all(dim=-1, keepdim=True)
        w = torch.softmax(s.masked_fill(empty, 0.0), dim=-1)
        if not (uniform_causal_empty and is_causal):  # the bug: a causal row that sees no key averages every v
            w = w.masked_fill(empty, 0.0)
    else:
        w = torch.softmax(s, dim=-1)  # a row of -inf -> NaN
    if dropout_p and use_dropout:
        keep = torch.rand(w.shape, device=w.device) >= dropout_p  # (B,Hq,Tq,Tk), torch's RNG
        w = w * keep / (1.0 - dropout_p) if rescale else w * keep
        if rescale_by is not None:
            w = w * rescale_by
    return w @ v


def plain_kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct: softmax(q kᵀ·scale + mask) v, fully masked rows -> 0 (SDPA's policy)."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)


def kernel_normalises_last(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct, written as chunked kernels are (memory-efficient-attention-pytorch 0.1.6): exp(s - max) @ v divided
    by Σ exp(s - max) last, through autograd in the run dtype. Its backward rounds dP = dO·vᵀ and δ = Σ_d dO·O
    (from products rounded to the dtype) each to the dtype: a row that sees one key gets dq = scale·(fl(dP) -
    fl(δ))·k, an ulp of δ, where the exact dq (and the plain softmax's) is 0 (F-206). Grouped kv heads are
    repeated as the library's adapter does (repeat_interleave: the backward sums each group at once)."""
    if dropout_p:
        raise NotImplementedError("kernel_normalises_last has no dropout")
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, normalise_last=True)


def kernel_approx_reciprocal(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct: normalises last with a reciprocal one ulp high, as a fused GPU kernel's rcp.approx may (F-211: SDPA's
    efficient backend on an H200 erred by an ulp of its output in fp32 where a row sees one key)."""
    if dropout_p:
        return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, normalise_last=True, approx_reciprocal=True)


def kernel_ignores_scale(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Bug (scale): takes `scale` and ignores it (always 1/sqrt(D))."""
    return _attend(q, k, v, attn_mask, is_causal, None, enable_gqa, dropout_p=dropout_p)


def kernel_bottom_right(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Bug (causal): bottom-right causal alignment while claiming SDPA's top-left is_causal."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p,
                   causal_offset=lambda Tq, Tk: Tk - Tq)


def kernel_gqa_modulo(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Bug (gqa): query head h reads kv head h % Hkv instead of h // (Hq / Hkv)."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p,
                   kv_head=lambda Hq, Hkv: torch.arange(Hq) % Hkv)


def kernel_ignores_bool_mask(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                             enable_gqa=False):
    """Bug (padding_bool): a boolean mask is silently ignored (padded keys get attention)."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p, use_bool=False)


def kernel_ignores_float_mask(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False):
    """Bug (padding_additive): an additive float mask is silently ignored."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p, use_float=False)


def kernel_nan_rows(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Bug (fully_masked, against the default expectation zeros): a row that sees no key comes out NaN."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p, fill_empty=False)


def kernel_nan_to_num_rows(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                           enable_gqa=False):
    """Bug (backward): softmax over an all -inf row, then nan_to_num — the forward is 0 there, but the softmax's
    backward is NaN, and NaN reaches dk and dv (the first cwd kernel written for the tests did exactly this)."""
    out = _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p, fill_empty=False)
    return torch.nan_to_num(out, nan=0.0)


class _WrongGradAttention(torch.autograd.Function):
    """The right forward, a hand-written backward that forgets the softmax Jacobian's δ term."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p):
        out = _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)
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
        return 2.0 * dq, dk, dv, None, None, None, None, None  # dq doubled: the planted bug


def kernel_wrong_grad(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Bug (backward): the forward is right, dq comes out twice too large."""
    return _WrongGradAttention.apply(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p)


def kernel_first_query_row_of_mask(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                   enable_gqa=False):
    """Bug (mask_bool): reads only the first query's row of a boolean mask, mask[..., :1, :], for every query:
    right for a (B,1,1,Tk) key padding mask (the old matrix's only boolean masks), wrong for a (B,1,Tq,Tk) one.
    (On a float mask the old matrix's (B,1,Tq,Tk) random bias of pad_additive already showed it.)"""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p,
                   mask_view=lambda m: m[..., :1, :] if m.dtype == torch.bool else m)


def kernel_first_head_of_mask(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False):
    """Bug (per_head): reads mask[:, :1], head 0's mask, for every head."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p,
                   mask_view=lambda m: m[:, :1])


def kernel_uniform_causal_empty(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                enable_gqa=False):
    """Bug (causal, against the default expectation zeros): bottom-right causal (declared), but a causal row
    that sees no key (Tq > Tk) averages every v, as x-transformers' Attend does."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p,
                   causal_offset=lambda Tq, Tk: Tk - Tq, uniform_causal_empty=True)


kernel_uniform_causal_empty.causal_align = "bottom_right"


def kernel_like_attend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct, with x-transformers' Attend's policies for rows that see no key: zeros for a boolean mask (its
    masked_fill with finfo.min, then zeroed), NaN for an all -inf additive mask (softmax of -inf), the uniform
    average of v for a causal row (bottom-right causal, Tq > Tk: its causal mask filled with finfo.min)."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p, fill_empty=False)
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p,
                   causal_offset=lambda Tq, Tk: Tk - Tq, uniform_causal_empty=True)


kernel_like_attend.causal_align = "bottom_right"


def kernel_ignores_dropout(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Bug (dropout): takes dropout_p and ignores it."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p, use_dropout=False)


def kernel_dropout_no_rescale(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False):
    """Bug (dropout): drops weights with probability p but forgets the 1/(1-p) rescale."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p, rescale=False)


def kernel_dropout_own_generator(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Bug (dropout): draws its mask from a generator of its own, seeded once: torch.manual_seed does not
    reach it (the same seed gives another mask on the next call)."""
    B, Hq, Tq, _ = q.shape
    out = _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    if not dropout_p:
        return out
    w_keep = torch.rand(B, Hq, Tq, k.shape[2], generator=_OWN) >= dropout_p
    w = _attend(q, k, torch.eye(k.shape[2], dtype=q.dtype).expand(B, k.shape[1], -1, -1), attn_mask, is_causal,
                scale, enable_gqa)  # the weights themselves (B,Hq,Tq,Tk)
    heads = torch.arange(Hq) // (Hq // k.shape[1])
    return (w * w_keep / (1.0 - dropout_p)) @ v[:, heads]


_OWN = torch.Generator().manual_seed(1234)


def kernel_dropout_rescale_off(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               enable_gqa=False):
    """Bug (dropout): kept weights rescaled by 1/(1-p)·(1 + 1e-5), a rescale that prints as 1.25 at 3 digits."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p,
                   rescale_by=1.0 + 1e-5 if dropout_p else None)


def kernel_no_gqa_no_scale(q, k, v, attn_mask=None, is_causal=False):
    """Correct, but its signature has neither `scale` nor `enable_gqa`: those cases are skipped."""
    return _attend(q, k, v, attn_mask, is_causal)


def kernel_forward_only(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct forward; refuses autograd with NotImplementedError (like FlexAttention on CPU)."""
    if torch.is_grad_enabled() and q.requires_grad:
        raise NotImplementedError("this kernel has no backward yet")
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)


def kernel_crashes_on_masks(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
    """Raises an ordinary error on any mask: the cases fail (with the error), the battery does not crash."""
    if attn_mask is not None:
        raise ValueError("mask layout not understood")
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)


def kernel_declares_bottom_right(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Correct bottom-right kernel that says so (FlashAttention >= 2.1's convention)."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p,
                   causal_offset=lambda Tq, Tk: Tk - Tq)


kernel_declares_bottom_right.causal_align = "bottom_right"


def kernel_takes_only_q(q):
    return q


def kernel_wrong_shape(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p).transpose(1, 2)


class _BackwardRaises(torch.autograd.Function):
    """The right forward; a backward that raises (the user's code, called by autograd's engine)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, enable_gqa):
        return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa)

    @staticmethod
    def backward(ctx, grad_out):
        raise RuntimeError("my backward is not written yet\n(see TODO)")


def kernel_backward_raises(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct forward (dropout included); its backward raises an ordinary error: only kernel_backward fails."""
    if dropout_p:
        return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)
    return _BackwardRaises.apply(q, k, v, attn_mask, is_causal, scale, enable_gqa)


native_matmul = torch.matmul  # a native function as the "kernel": what it raises is its own (no Python frame)


def kernel_hides_a_key_in_long_rows(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                    enable_gqa=False):
    """Bug (weights): a row that sees >= 128 keys loses its lowest-scored visible key (as a kernel would that takes
    the row's minimum for a padding sentinel). That weight is far below 1/128 of the row: in bf16 the output moves
    by less than the output rule's limit; in fp32 the output families see it."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p, hide_in_long_rows=True)


class _RedrawDropout(torch.autograd.Function):
    """A dropout forward right to the bit; a backward that draws a fresh mask instead of reusing the forward's."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p):
        ctx.save_for_backward(q, k, v)
        ctx.args = (attn_mask, is_causal, scale, enable_gqa, dropout_p)
        return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        attn_mask, is_causal, scale, enable_gqa, dropout_p = ctx.args
        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = _attend(qq, kk, vv, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)  # a new mask
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad_out)
        return dq, dk, dv, None, None, None, None, None


def kernel_dropout_redraws_in_backward(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                       enable_gqa=False):
    """Bug (backward, dropout cases only): the forward is plain_kernel's to the bit; the backward redraws the
    dropout mask, so dq, dk, dv belong to another mask."""
    return _RedrawDropout.apply(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p)


def kernel_fp16_online_softmax(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               enable_gqa=False):
    """Bug (long_rows in fp16; everywhere in fp32): an online softmax over blocks of 64 keys that keeps its
    running max, denominator and output in float16 (the scores and each block's products in fp32). In fp16 its
    error grows with the number of blocks: only rows of thousands of keys show it."""
    if dropout_p:
        return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if Hkv != Hq:
        heads = torch.arange(Hq, device=q.device) // (Hq // Hkv)
        k, v = k[:, heads], v[:, heads]
    s = (q.float() @ k.float().transpose(-2, -1)) * (1.0 / math.sqrt(D) if scale is None else scale)
    if is_causal:
        s = s.masked_fill(torch.arange(Tk, device=q.device)[None, :] > torch.arange(Tq, device=q.device)[:, None],
                         float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.float()
    acc = torch.float16
    m = torch.full((B, Hq, Tq, 1), float("-inf"), dtype=acc, device=q.device)
    denom = torch.zeros(B, Hq, Tq, 1, dtype=acc, device=q.device)
    o = torch.zeros(B, Hq, Tq, D, dtype=acc, device=q.device)
    for c in range(0, Tk, 64):
        sb = s[..., c:c + 64]
        m_new = torch.maximum(m, sb.amax(dim=-1, keepdim=True).to(acc))
        m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0).float()
        p = torch.exp(sb - m_safe)
        alpha = torch.exp(m.float() - m_safe)
        denom = (denom.float() * alpha + p.sum(dim=-1, keepdim=True)).to(acc)
        o = (o.float() * alpha + p @ v[:, :, c:c + 64].float()).to(acc)
        m = m_new
    seen = denom > 0
    return torch.where(seen, o.float() / denom.float().clamp_min(1e-30), 0.0).to(q.dtype)


def kernel_declares_no_gqa_no_dropout(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                      enable_gqa=False):
    """Correct for Hkv = Hq without dropout; declares the rest lacking (and would fail it: it ignores both)."""
    if k.shape[1] != q.shape[1]:
        raise ValueError("this kernel has no grouped kv heads")  # an ordinary error: a failure if it were called
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa)


kernel_declares_no_gqa_no_dropout.tfmoe_lacks = ("gqa", "dropout")


def kernel_declares_no_bf16(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct; declares it takes no bfloat16 inputs."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)


kernel_declares_no_bf16.tfmoe_lacks = ["bf16"]


class _GradsTooLarge(torch.autograd.Function):
    """Identity forward; dq, dk, dv come back multiplied by 1.0025 (in fp64, rounded to their dtype)."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        return tuple((g.double() * 1.0025).to(g.dtype) for g in (gq, gk, gv))


def kernel_grads_quarter_percent_large(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                       enable_gqa=False):
    """Bug (backward): a stale constant 1.0025 left in the backward (a loss scale, a rescale). In bf16 the
    rule-judged cases need ~0.3-0.9 % to see it (benchmarks/bench_kernel_sensitivity.py); the exact-gradient probe
    sees any error above half an ulp (~0.2 % in bf16)."""
    return _attend(*_GradsTooLarge.apply(q, k, v), attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)


def kernel_output_quarter_percent_large(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                        enable_gqa=False):
    """Bug (every forward family): the output 0.25 % too large, as if a dropout rescale 1/(1 - p), p = 0.0025, were
    left on in evaluation. In bf16 the rule-judged cases and the weights probe pass it (their limits are ~1 % of
    the output); each family's exact-output probe sees any error above half an ulp (~0.2 % in bf16)."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p) * 1.0025


# ------------------------------------------------------------ what a row that sees no key gives, one per kind
def _empty_rows_give(q, k, v, attn_mask, is_causal, scale, enable_gqa, kind):
    """plain_kernel, except that a row that sees no key gives ``kind``: zeros, nan, mean_of_v (every key weighted
    alike) or other (finite and unspecified: the first key's value)."""
    out = _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    Hq, Tq, Tk = q.shape[1], q.shape[2], k.shape[2]
    empty = torch.zeros(q.shape[0], Hq, Tq, dtype=torch.bool, device=q.device)
    if attn_mask is not None:
        vis = attn_mask if attn_mask.dtype == torch.bool else ~torch.isinf(attn_mask)
        empty = ~vis.expand(q.shape[0], Hq, Tq, Tk).any(dim=-1)
    vv = v.repeat_interleave(Hq // v.shape[1], dim=1)  # (B,Hq,Tk,D)
    fill = {"zeros": torch.zeros_like(out), "nan": torch.full_like(out, math.nan),
            "mean_of_v": vv.mean(dim=2, keepdim=True).expand_as(out),
            "other": vv[:, :, :1].expand_as(out)}[kind]
    return torch.where(empty[..., None], fill, out)


def kernel_empty_rows_mean_of_v(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                enable_gqa=False):
    """Correct under fully_masked_expect=uniform (or mean_of_v, finite, any): a row that sees no key averages v."""
    return _empty_rows_give(q, k, v, attn_mask, is_causal, scale, enable_gqa, "mean_of_v")


def kernel_empty_rows_finite(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct under fully_masked_expect=finite (or any): a row that sees no key gives finite, unspecified values
    (the first key's value)."""
    return _empty_rows_give(q, k, v, attn_mask, is_causal, scale, enable_gqa, "other")


EMPTY_ROW_KERNELS = {"zeros": "plain_kernel", "nan": "kernel_nan_rows", "mean_of_v": "kernel_empty_rows_mean_of_v",
                     "other": "kernel_empty_rows_finite"}


class _EmptyRowsModule(torch.nn.Module):
    """The course's interface (qkv, out Linear layers; forward(x, padding_mask) -> (out, weights)); a row that
    sees no key gets the weights of ``kind`` (zeros, nan, mean_of_v: uniform, other: all on the first key)."""

    kind = "zeros"

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, dropout: float = 0.0):
        super().__init__()
        self.h, self.causal = n_heads, causal
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = torch.nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, padding_mask=None):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))
        vis = torch.ones(1, 1, T, T, dtype=torch.bool, device=x.device)
        if self.causal:
            vis = vis & torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if padding_mask is not None:
            vis = vis & padding_mask.bool()[:, None, None, :]
        vis = vis.expand(B, self.h, T, T)
        empty = ~vis.any(dim=-1, keepdim=True)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.h)
        w = s.masked_fill(~vis, float("-inf")).masked_fill(empty, 0.0).softmax(dim=-1)
        fill = {"zeros": torch.zeros_like(w), "nan": torch.full_like(w, math.nan),
                "mean_of_v": torch.full_like(w, 1.0 / T),
                "other": torch.nn.functional.one_hot(torch.zeros_like(w[..., 0], dtype=torch.long), T).to(w.dtype)}
        w = torch.where(empty, fill[self.kind], w)
        return self.out((w @ v).transpose(1, 2).reshape(B, T, D)), w


class EmptyRowsZeros(_EmptyRowsModule):
    kind = "zeros"


class EmptyRowsNan(_EmptyRowsModule):
    kind = "nan"


class EmptyRowsMeanOfV(_EmptyRowsModule):
    kind = "mean_of_v"


class EmptyRowsFinite(_EmptyRowsModule):
    kind = "other"


EMPTY_ROW_MODULES = {"zeros": "EmptyRowsZeros", "nan": "EmptyRowsNan", "mean_of_v": "EmptyRowsMeanOfV",
                     "other": "EmptyRowsFinite"}


# ------------------------------------------------- a kernel without GQA whose queries and keys must be as long
def _square_only(q, k, attn_mask):
    if k.shape[1] != q.shape[1]:
        raise NotImplementedError("no grouped kv heads")
    if q.shape[2] != k.shape[2]:
        raise NotImplementedError("queries and keys must be equally long")


def kernel_square_only(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct where it runs: Hkv = Hq and Tq = Tk only (NotImplementedError otherwise, undeclared: detected)."""
    _square_only(q, k, attn_mask)
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)


def kernel_square_only_causal_sees_next(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                        enable_gqa=False):
    """Bug (causal): as kernel_square_only, but a causal query also sees the next key."""
    _square_only(q, k, attn_mask)
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p,
                   causal_offset=lambda Tq, Tk: 1)


def kernel_declares_square_only(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                enable_gqa=False):
    """Correct where it runs; declares what it lacks (tfmoe_lacks) instead of raising."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p)


kernel_declares_square_only.tfmoe_lacks = ("gqa", "unequal_lengths")


def kernel_declares_square_only_causal_sees_next(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                                 scale=None, enable_gqa=False):
    """Bug (causal): as kernel_declares_square_only, but a causal query also sees the next key."""
    return _attend(q, k, v, attn_mask, is_causal, scale, enable_gqa, dropout_p=dropout_p,
                   causal_offset=lambda Tq, Tk: 1)


kernel_declares_square_only_causal_sees_next.tfmoe_lacks = ("gqa", "unequal_lengths")


# ------------------------------------------- online softmax over key blocks, backward by autograd (fp32 floors)
def _online_softmax(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *, block=64,
                    base2=False, grad_scale=None):
    """Correct: a loop over blocks of ``block`` keys keeping a running max m, denominator l and output o, each
    block rescaling them by exp(m_old - m_new) (``base2``: exp2, log2(e) folded into the scale); the max stays in
    autograd's graph, as written in most pure-PyTorch kernels. Rows that see no key give 0. ``grad_scale`` plants
    a backward (1 + ε) times too large."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if Hkv != Hq:
        k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    unit = math.log2(math.e) if base2 else 1.0
    sc = (1.0 / math.sqrt(D) if scale is None else scale) * unit
    ex = torch.exp2 if base2 else torch.exp
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    m = torch.full((B, Hq, Tq, 1), float("-inf"), dtype=acc, device=q.device)
    denom = torch.zeros(B, Hq, Tq, 1, dtype=acc, device=q.device)
    o = torch.zeros(B, Hq, Tq, D, dtype=acc, device=q.device)
    for c in range(0, Tk, block):
        s = (qa @ ka[:, :, c:c + block].transpose(-2, -1)) * sc  # (B,Hq,Tq,b)
        if is_causal:
            hidden = torch.arange(c, min(c + block, Tk), device=q.device)[None, :] > \
                torch.arange(Tq, device=q.device)[:, None]
            s = s.masked_fill(hidden, float("-inf"))
        if attn_mask is not None:
            mb = attn_mask[..., c:c + block]
            s = s.masked_fill(~mb, float("-inf")) if mb.dtype == torch.bool else s + mb.to(acc) * unit
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)
        p = ex(s - m_safe)
        alpha = ex(m - m_safe)
        denom = denom * alpha + p.sum(dim=-1, keepdim=True)
        o = o * alpha + p @ va[:, :, c:c + block]
        m = m_new
    out = torch.where(denom > 0, o / denom.clamp_min(torch.finfo(acc).tiny), 0.0)
    if grad_scale is not None:
        out = _ScaleGrad.apply(out, grad_scale)
    return out.to(q.dtype)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def kernel_online_softmax(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct: blockwise online softmax (blocks of 64 keys, exp), backward by autograd through the running max."""
    if dropout_p:
        raise NotImplementedError("no dropout")
    return _online_softmax(q, k, v, attn_mask, is_causal, scale, enable_gqa)


def kernel_online_softmax_exp2(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               enable_gqa=False):
    """Correct: as kernel_online_softmax, blocks of 128 keys, exp2 with log2(e) folded into the scale."""
    if dropout_p:
        raise NotImplementedError("no dropout")
    return _online_softmax(q, k, v, attn_mask, is_causal, scale, enable_gqa, block=128, base2=True)


def kernel_online_softmax_grads_large(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                      enable_gqa=False):
    """Bug (backward): kernel_online_softmax whose dq, dk, dv are (1 + 2^-8) times too large."""
    if dropout_p:
        raise NotImplementedError("no dropout")
    return _online_softmax(q, k, v, attn_mask, is_causal, scale, enable_gqa, grad_scale=1.0 + 2.0 ** -8)


# ---------------------------------------- half precision: dk/dv summed in the run dtype one block after another
def kernel_half_groups_by_index(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                enable_gqa=False):
    """Correct: kernel_normalises_last with its kv heads expanded by indexing (k[:, heads]), whose backward adds
    the group's per-head dk, dv into one tensor of the run dtype, head after head (each partial sum rounded)."""
    B, Hq, Tq, D = q.shape
    Hkv = k.shape[1]
    if Hkv != Hq:
        heads = torch.arange(Hq, device=q.device) // (Hq // Hkv)
        k, v = k[:, heads], v[:, heads]
    return _attend(q, k, v, attn_mask, is_causal, scale, False, dropout_p=dropout_p, normalise_last=True)


def kernel_half_query_chunks(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                             chunk=4):
    """Correct: attention one chunk of ``chunk`` queries at a time through autograd in the run dtype (as
    memory-efficient kernels chunk their queries): every chunk reads all of k and v, so their backward adds each
    chunk's dk, dv contribution into tensors of the run dtype, chunk after chunk."""
    Tq = q.shape[2]
    outs = []
    for c in range(0, Tq, chunk):
        mask = attn_mask
        if attn_mask is not None and attn_mask.shape[-2] == Tq:
            mask = attn_mask[..., c:c + chunk, :]
        offset = c  # the chunk's queries sit at positions c.. of the sequence
        outs.append(_attend(q[:, :, c:c + chunk], k, v, mask, is_causal, scale, enable_gqa, dropout_p=dropout_p,
                            causal_offset=(lambda Tq_, Tk_, o=offset: o) if is_causal else None,
                            normalise_last=True))
    return torch.cat(outs, dim=2)


def kernel_half_query_chunks_grads_large(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                         enable_gqa=False):
    """Bug (backward): kernel_half_query_chunks with dq, dk, dv (1 + 2^-8) times too large."""
    return _ScaleGrad.apply(kernel_half_query_chunks(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa),
                            1.0 + 2.0 ** -8)
