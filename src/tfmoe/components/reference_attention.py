"""Attention from first principles, for judging attention kernels (``tfmoe attn-check kernel=...``).

Two implementations that share nothing with the kernels they judge (no SDPA, no ``repeat_interleave``, no
tfmoe mask function):

- :func:`reference_attention` — the reference: everything in fp64, the visibility mask built by index
  arithmetic, each query head mapped to its key/value head by ``h // (Hq / Hkv)``, a softmax written out
  (max-subtract, exp, sum, divide).
- :func:`plain_attention` — FlashAttention's yardstick: a plain implementation in the *run's* dtype, written
  another way (query heads grouped per key/value head by a reshape, ``torch.softmax``). Its error against the
  reference says what the dtype alone costs.

Masks are explicit: ``visible`` (bool, broadcastable to (B, Hq, Tq, Tk), True = the query sees the key) and an
optional finite additive ``bias`` (broadcastable likewise). A query row that sees no key ("fully masked") has no
defined output: both functions return 0 there, and the battery judges the kernel's policy separately.
"""

from __future__ import annotations

import math

import torch

CAUSAL_ALIGNS = ("top_left", "bottom_right")


def causal_visibility(Tq: int, Tk: int, align: str, device: torch.device | str | None = None) -> torch.Tensor:
    """(Tq, Tk) bool. ``top_left`` (SDPA's ``is_causal``): query i sees keys j <= i. ``bottom_right``
    (FlashAttention >= 2.1, KV-cache decoding): the queries are the last Tq positions, so query i sees keys
    j <= i + Tk - Tq; with Tq > Tk the first Tq - Tk queries see nothing."""
    if align not in CAUSAL_ALIGNS:
        raise ValueError(f"causal alignment {align!r} is not one of {CAUSAL_ALIGNS}")
    return lower_triangle(Tq, Tk, 0 if align == "top_left" else Tk - Tq, device)


def lower_triangle(Tq: int, Tk: int, offset: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """(Tq, Tk) bool: query i (at absolute position offset + i) sees keys j <= i + offset."""
    i = torch.arange(Tq, device=device).view(Tq, 1)
    j = torch.arange(Tk, device=device).view(1, Tk)
    return j <= i + offset  # (Tq, Tk)


def key_padding_visibility(lengths: list[int], Tk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(B, 1, 1, Tk) bool: batch row b sees its first lengths[b] keys (right padding)."""
    j = torch.arange(Tk, device=device).view(1, Tk)
    n = torch.tensor(lengths, dtype=torch.long, device=device).view(-1, 1)
    return (j < n)[:, None, None, :]  # (B,1,1,Tk)


def kv_head_index(Hq: int, Hkv: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(Hq,) long: query head h reads key/value head h // (Hq / Hkv) (consecutive query heads share one)."""
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    return torch.arange(Hq, device=device) // (Hq // Hkv)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, scale: float | None = None,
                        return_weights: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scale + bias, over visible keys) v in fp64.

    q (B,Hq,Tq,D), k/v (B,Hkv,Tk,D) -> (B,Hq,Tq,D) float64 (and the weights (B,Hq,Tq,Tk) if asked);
    differentiable (fp64 reference gradients).
    """
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, Tq, D = q.shape
    Tk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    heads = kv_head_index(Hq, k.shape[1], q.device)
    k_h, v_h = k[:, heads], v[:, heads]  # (B,Hq,Tk,D): our own head mapping
    s = torch.einsum("bhqd,bhkd->bhqk", q, k_h) * scale  # (B,Hq,Tq,Tk)
    if bias is not None:
        s = s + bias.double()
    if visible is None:
        visible = torch.ones(1, 1, Tq, Tk, dtype=torch.bool, device=q.device)
    visible = visible.expand(B, Hq, Tq, Tk)
    s = torch.where(visible, s, torch.tensor(-math.inf, dtype=s.dtype, device=s.device))
    row_max = s.amax(dim=-1, keepdim=True)  # (B,Hq,Tq,1); -inf on fully masked rows
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(s - row_max)  # hidden keys: exp(-inf) = 0
    denom = e.sum(dim=-1, keepdim=True)  # (B,Hq,Tq,1); 0 on fully masked rows
    w = e / denom.clamp_min(torch.finfo(torch.float64).tiny)  # fully masked rows: 0
    out = torch.einsum("bhqk,bhkd->bhqd", w, v_h)  # (B,Hq,Tq,D)
    return (out, w) if return_weights else out


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """The textbook computation with every op in q's dtype (FlashAttention's "PyTorch implementation").

    q (B,Hq,Tq,D), k/v (B,Hkv,Tk,D) -> (B,Hq,Tq,D) in q's dtype; fully masked rows -> 0, with finite gradients.
    """
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qg = q.reshape(B, Hkv, G, Tq, D)  # query heads grouped under their key/value head
    scores = (qg @ k.unsqueeze(2).transpose(-2, -1)) * scale  # (B,Hkv,G,Tq,Tk)
    scores = scores.reshape(B, Hq, Tq, Tk)
    if bias is not None:
        scores = scores + bias.to(q.dtype)
    if visible is not None:
        vis = visible.expand(B, Hq, Tq, Tk)
        seen = vis.any(dim=-1, keepdim=True)  # (B,Hq,Tq,1)
        scores = scores.masked_fill(~vis, float("-inf")).masked_fill(~seen, 0.0)  # no all -inf row: no NaN grads
        weights = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
    else:
        weights = torch.softmax(scores, dim=-1)
    out = weights.reshape(B, Hkv, G, Tq, Tk) @ v.unsqueeze(2)  # (B,Hkv,G,Tq,D)
    return out.reshape(B, Hq, Tq, D)
