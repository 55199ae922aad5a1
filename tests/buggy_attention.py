"""Planted-bug attention modules for `tfmoe attn-check impl=buggy_attention:<Class>` (tests put tests/ on sys.path).

``PlainMHA`` is a correct textbook implementation written independently of tfmoe's; each bug class changes
exactly one of its steps, the way the bug shows up in real code. ``MHAWrapper`` is a correct module written
differently (over ``nn.MultiheadAttention``) that must pass the whole battery.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def _up(t: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32 for the softmax; fp32/fp64 unchanged."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class PlainMHA(nn.Module):
    """Textbook multi-head self-attention with the course's interface; each step is a method to override."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, dropout: float = 0.0):
        super().__init__()
        assert d_model % n_heads == 0
        self.d_model, self.n_heads, self.d_head, self.causal, self.p = d_model, n_heads, d_model // n_heads, causal, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        B, T, _ = t.shape
        return t.view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B,H,T,Dh)

    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d_head)

    def visible(self, T_q: int, T_k: int, padding_mask: torch.Tensor | None, offset: int) -> torch.Tensor:
        """(B|1, 1, T_q, T_k) True = the query may look at the key."""
        vis = torch.ones(1, 1, T_q, T_k, dtype=torch.bool)
        if self.causal:
            q_pos = torch.arange(T_q)[:, None] + offset
            vis = vis & (torch.arange(T_k)[None, :] <= q_pos)
        if padding_mask is not None:
            vis = vis & padding_mask.bool()[:, None, None, :]  # hide padded keys
        return vis

    def normalize(self, scores: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
        w = _up(scores).masked_fill(~vis, float("-inf")).softmax(dim=-1)
        return torch.where(vis.any(dim=-1, keepdim=True), w, torch.zeros_like(w))  # fully masked rows -> 0

    def drop(self, w: torch.Tensor) -> torch.Tensor:
        return F.dropout(w, self.p, self.training)

    def merge(self, ctx: torch.Tensor) -> torch.Tensor:
        B, H, T, Dh = ctx.shape
        return ctx.transpose(1, 2).reshape(B, T, H * Dh)

    def cache_offset(self, cache_len: int) -> int:
        return cache_len

    def returned_weights(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, D = x.shape
        q, k, v = (self.split(t) for t in self.qkv(x).split(D, dim=-1))
        offset = 0
        if cache is not None:  # a tfmoe KVCache: append the new keys/values
            offset = self.cache_offset(cache.length)
            k, v = cache.append(k, v)
        scores = (q @ k.transpose(-2, -1)) * self.scale()  # (B,H,T,Tk)
        w = self.normalize(scores, self.visible(T, k.shape[2], padding_mask, offset))
        ctx = self.drop(w).to(v.dtype) @ v  # (B,H,T,Dh)
        return self.out(self.merge(ctx)), self.returned_weights(w)


# ------------------------------------------------------------------------------- the five bugs
class WrongSoftmaxAxis(PlainMHA):
    """softmax over the queries (dim=-2) instead of the keys."""

    def normalize(self, scores, vis):
        w = _up(scores).masked_fill(~vis, float("-inf")).softmax(dim=-2)
        return torch.nan_to_num(w)


class ScaleByDModel(PlainMHA):
    """scores / sqrt(d_model) instead of / sqrt(d_head): identical when n_heads = 1."""

    def scale(self):
        return 1.0 / math.sqrt(self.d_model)


class CausalOffByOne(PlainMHA):
    """triu(diagonal=2) instead of 1: every query also sees the next token."""

    def visible(self, T_q, T_k, padding_mask, offset):
        vis = torch.ones(1, 1, T_q, T_k, dtype=torch.bool)
        if self.causal:
            vis = vis & ~torch.ones(T_q, T_k, dtype=torch.bool).triu(diagonal=2 + offset)
        if padding_mask is not None:
            vis = vis & padding_mask.bool()[:, None, None, :]
        return vis


class PaddingOnQueries(PlainMHA):
    """the padding mask hides padded *queries* (rows) instead of padded keys (columns)."""

    def visible(self, T_q, T_k, padding_mask, offset):
        vis = PlainMHA.visible(self, T_q, T_k, None, offset)
        if padding_mask is not None:
            vis = vis & padding_mask.bool()[:, None, :, None]
        return vis


class MissingTransposeMerge(PlainMHA):
    """(B,H,T,Dh) reshaped straight to (B,T,D): heads and positions get interleaved."""

    def merge(self, ctx):
        B, H, T, Dh = ctx.shape
        return ctx.reshape(B, T, H * Dh)


# ----------------------------------------------------------------------------- one bug per other check
class DowncastToFp32(PlainMHA):
    """softmax "in fp32" written as .float(): an fp64 module silently computes in fp32 (tfmoe's own
    MultiHeadSelfAttention had this bug until attn-check's gradcheck caught it)."""

    def normalize(self, scores, vis):
        return PlainMHA.normalize(self, scores.float(), vis)


class HeadAveragedWeights(PlainMHA):
    """returns weights averaged over heads (B,T,T), nn.MultiheadAttention's default average_attn_weights=True."""

    def returned_weights(self, w):
        return w.mean(dim=1)


class TimeMajorOutput(PlainMHA):
    """returns the output time-major (T,B,D), nn.MultiheadAttention's default batch_first=False layout."""

    def forward(self, x, padding_mask=None, cache=None):
        out, w = super().forward(x, padding_mask, cache)
        return out.transpose(0, 1), w


class _BadSoftmax(torch.autograd.Function):
    """A 'fused' softmax with a hand-written backward that forgets the -Σ g·y term."""

    @staticmethod
    def forward(ctx, scores):
        y = scores.softmax(dim=-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return y * g  # correct: y * (g - (g * y).sum(-1, keepdim=True))


class WrongSoftmaxBackward(PlainMHA):
    """correct forward, wrong custom backward: only the gradient checks can see it."""

    def normalize(self, scores, vis):
        w = _BadSoftmax.apply(_up(scores).masked_fill(~vis, float("-inf")))
        return torch.where(vis.any(dim=-1, keepdim=True), w, torch.zeros_like(w))


class CacheWithoutOffset(PlainMHA):
    """with a KV cache the causal mask forgets the cached length: a new token sees only the first key(s)."""

    def cache_offset(self, cache_len):
        return 0


class GlobalMaxSoftmax(PlainMHA):
    """'stable' softmax subtracting the max over the whole batch, not per row: other rows' scale leaks in."""

    def normalize(self, scores, vis):
        s = _up(scores).masked_fill(~vis, float("-inf"))
        e = torch.exp(s - s.max())  # global max
        w = e / e.sum(dim=-1, keepdim=True)
        return torch.where(vis.any(dim=-1, keepdim=True), w, torch.zeros_like(w))


class RepeatMaskBug(PlainMHA):
    """flattens (B,H) for bmm and tiles the key mask with repeat() (head-major) instead of repeat_interleave()
    (batch-major): each batch row gets another row's padding. Invisible at B=1."""

    def forward(self, x, padding_mask=None, cache=None):
        if cache is not None:  # the bug lives in the bmm path; decoding with a cache is the base class's
            return super().forward(x, padding_mask, cache)
        B, T, D = x.shape
        q, k, v = (self.split(t).reshape(B * self.n_heads, T, self.d_head) for t in self.qkv(x).split(D, dim=-1))
        scores = torch.bmm(q, k.transpose(1, 2)) * self.scale()  # (B·H,T,T)
        vis = torch.ones(B * self.n_heads, T, T, dtype=torch.bool)
        if self.causal:
            vis = vis & torch.ones(T, T, dtype=torch.bool).tril()
        if padding_mask is not None:
            vis = vis & padding_mask.bool()[:, None, :].repeat(self.n_heads, 1, 1)  # bug: repeat_interleave(H, 0)
        w = _up(scores).masked_fill(~vis, float("-inf")).softmax(dim=-1)
        w = torch.where(vis.any(dim=-1, keepdim=True), w, torch.zeros_like(w))
        ctx = torch.bmm(self.drop(w).to(v.dtype), v).view(B, self.n_heads, T, self.d_head)
        return self.out(self.merge(ctx)), w.view(B, self.n_heads, T, T)


class Bf16Internal(PlainMHA):
    """runs the attention core in bf16 whatever the input dtype ("for speed"): 8x fp16's rounding error."""

    def forward(self, x, padding_mask=None, cache=None):
        params = {n: p.to(torch.bfloat16) for n, p in self.named_parameters()}
        out, w = torch.func.functional_call(_PlainCore(self), {f"inner.{n}": p for n, p in params.items()},
                                            (x.to(torch.bfloat16), padding_mask, cache))
        return out.to(x.dtype), w


class _PlainCore(nn.Module):
    """PlainMHA's forward on another instance's parameters (Bf16Internal swaps in bf16 copies)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, padding_mask, cache):
        return PlainMHA.forward(self.inner, x, padding_mask, cache)


class DropoutAlwaysOn(PlainMHA):
    """F.dropout's `training` defaults to True: dropout also runs in eval mode."""

    def drop(self, w):
        return F.dropout(w, self.p)


class DropoutNoRescale(PlainMHA):
    """drops weights but never scales the kept ones by 1/(1-p): the expectation shrinks by (1-p)."""

    def drop(self, w):
        if not self.training or self.p == 0:
            return w
        return w * (torch.rand_like(w) >= self.p)


class DropoutKeepProb(PlainMHA):
    """treats p as TF1's keep_prob: drops a fraction 1-p."""

    def drop(self, w):
        return F.dropout(w, 1 - self.p, self.training) if self.p > 0 else w


class DropoutNumpyRNG(PlainMHA):
    """draws the mask from numpy's global RNG: torch.manual_seed cannot reproduce it."""

    def drop(self, w):
        if not self.training or self.p == 0:
            return w
        keep = torch.from_numpy(np.random.rand(*w.shape) >= self.p).to(w.device)
        return w * keep / (1 - self.p)


# ------------------------------------------------------------------------------ nn.MultiheadAttention
class NaiveMHAWrapper(nn.Module):
    """nn.MultiheadAttention with the boolean key_padding_mask: a query with no visible key gets NaN, and the
    NaN reaches the gradients of the other rows (softmax of all -inf)."""

    float_mask = False

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, dropout: float = 0.0):
        super().__init__()
        self.causal = causal
        self.mha = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, bias=False, batch_first=True)
        # the course's interface: qkv and out *are* the MultiheadAttention's projections (tied parameters)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        with torch.no_grad():
            self.qkv.weight.copy_(self.mha.in_proj_weight)
            self.out.weight.copy_(self.mha.out_proj.weight)
        self.mha.in_proj_weight = self.qkv.weight
        self.mha.out_proj.weight = self.out.weight

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None):
        B, T, _ = x.shape
        hidden = torch.zeros(B, T, T, dtype=torch.bool, device=x.device)  # True = not allowed
        if self.causal:
            hidden = hidden | torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        if padding_mask is not None:
            hidden = hidden | ~padding_mask.bool()[:, None, :]
        hidden = hidden.repeat_interleave(self.mha.num_heads, dim=0)  # (B·H,T,T), batch-major as MHA wants
        if self.float_mask:  # finite "minus infinity": a fully masked row becomes uniform instead of NaN
            attn_mask = torch.zeros(hidden.shape, dtype=x.dtype, device=x.device).masked_fill(
                hidden, torch.finfo(x.dtype).min)
        else:
            attn_mask = hidden
        out, w = self.mha(x, x, x, attn_mask=attn_mask, need_weights=True, average_attn_weights=False)
        return out, w


class MHAWrapper(NaiveMHAWrapper):
    """A correct module written differently: nn.MultiheadAttention with an additive float mask (finfo.min
    instead of -inf), the usual workaround that keeps fully masked rows finite. Must pass the battery."""

    float_mask = True


# ------------------------------------------------------------------------------- chunked-attention bugs
def chunked_no_rescale(q, k, v, *, causal=False, key_padding_mask=None, block_size=128):
    """online softmax that forgets to rescale the old sums when the running max grows."""
    B, H, Tq, Dh = q.shape
    Tk = k.shape[2]
    m = torch.full((B, H, Tq, 1), float("-inf"))
    denom = torch.zeros(B, H, Tq, 1)
    acc = torch.zeros(B, H, Tq, Dh)
    for start in range(0, Tk, block_size):
        end = min(start + block_size, Tk)
        s = q.float() @ k[:, :, start:end].float().transpose(-2, -1) / math.sqrt(Dh)
        vis = torch.ones(Tq, end - start, dtype=torch.bool)
        if causal:
            vis = torch.arange(start, end)[None, :] <= (torch.arange(Tq) + Tk - Tq)[:, None]
        vis = vis[None, None]
        if key_padding_mask is not None:
            vis = vis & key_padding_mask[:, None, None, start:end]
        s = s.masked_fill(~vis, float("-inf"))
        m = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m.masked_fill(m == float("-inf"), 0))
        denom = denom + p.sum(-1, keepdim=True)  # bug: should be denom * exp(m_old - m) + ...
        acc = acc + p @ v[:, :, start:end].float()
    return (acc / denom.clamp_min(1e-30)).to(q.dtype)


def chunked_materialized(q, k, v, *, causal=False, key_padding_mask=None, block_size=128):
    """'chunked' in name only: concatenates every block's scores into the full (T,T) matrix."""
    blocks = [q.float() @ k[:, :, s:s + block_size].float().transpose(-2, -1) for s in range(0, k.shape[2], block_size)]
    scores = torch.cat(blocks, dim=-1) / math.sqrt(q.shape[-1])
    Tq, Tk = q.shape[2], k.shape[2]
    vis = torch.ones(1, 1, Tq, Tk, dtype=torch.bool)
    if causal:
        vis = vis & (torch.arange(Tk)[None, :] <= (torch.arange(Tq) + Tk - Tq)[:, None])
    if key_padding_mask is not None:
        vis = vis & key_padding_mask[:, None, None, :]
    w = scores.masked_fill(~vis, float("-inf")).softmax(-1)
    w = torch.where(vis.any(-1, keepdim=True), w, torch.zeros_like(w))
    return (w @ v.float()).to(q.dtype)


NOT_A_MODULE = 42


class NoPaddingSupport(PlainMHA):
    """raises as soon as it is given a padding mask."""

    def forward(self, x, padding_mask=None, cache=None):
        if padding_mask is not None:
            raise NotImplementedError("padding is not supported")
        return super().forward(x, None, cache)


class NoPaddingArg(nn.Module):
    """forward(x) only: cannot take the padding mask."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = False):
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        return x, x


class NoQkvLayer(nn.Module):
    """The course's signatures, but separate q/k/v layers instead of the fused `qkv` the interface reads."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = False):
        super().__init__()
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, padding_mask=None):
        return self.out(self.q(x)), None


class IgnoresPaddingMask(PlainMHA):
    """the chapter's listing without its padding line: takes padding_mask and never applies it. With causal
    attention and right padding no real query sees a padded key, so only a probe whose real queries follow padded
    keys (left padding) can tell (the default run has one: left_padding_match)."""

    def visible(self, T_q: int, T_k: int, padding_mask: torch.Tensor | None, offset: int) -> torch.Tensor:
        return super().visible(T_q, T_k, None, offset)


class RaisesOnPadding(PlainMHA):
    """raises a plain error (not NotImplementedError) when given a padding mask: the user's error, its checks fail."""

    def forward(self, x, padding_mask=None, cache=None):
        if padding_mask is not None:
            raise ValueError("padding is broken here")
        return super().forward(x, None, cache)


class CausalOnlyNoPadding(PlainMHA):
    """a training library's causal-only attention: declares it has no padding mask (tfmoe.rules.capabilities)."""

    tfmoe_lacks = ("padding_mask",)

    def forward(self, x, padding_mask=None, cache=None):
        if padding_mask is not None:
            raise NotImplementedError("this attention is causal-only and takes no padding mask")
        return super().forward(x, None, cache)


class CausalOnlyIgnoringDeclaredPadding(CausalOnlyNoPadding):
    """declares it lacks padding, and also has a real bug (softmax scaled by sqrt(d_model)): still caught."""

    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d_model)


class NoGqaDeclared(PlainMHA):
    """a course-interface class that says it has no GQA (its class attribute, read by the capability model)."""

    tfmoe_lacks = ("gqa",)


class Bf16Declared(Bf16Internal):
    """computes its attention core in bf16 by design and declares it (compute_dtype): judged at bf16."""

    tfmoe_compute_dtype = "bf16"


class Bf16DeclaredWrongScale(Bf16Declared):
    """declared bf16, and a real bug on top (scores / sqrt(d_model)): caught at the declared precision too."""

    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d_model)
