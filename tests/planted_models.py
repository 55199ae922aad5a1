"""Whole causal LMs for the model battery (decode / shift-labels / arch ``impl=``): correct ones written different
ways, and planted bugs, each a class built with no arguments, in Hugging Face's causal-LM calling convention
``forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False, labels=None)``.

Correct: ``AbsoluteTupleCache`` (learned absolute positions, a tuple-of-tuples cache), ``RotaryObjectCache`` (RoPE, a
cache object, the parameter named ``cache``), ``NoMaskLM`` (nanoGPT's ``forward(idx) -> logits``: no mask, no
cache, no loss), ``CapacityMoELM`` (a top-1 MoE feed-forward whose expert capacity drops tokens by what else is in
the batch: batch-dependent by design), ``Fp32Island`` (runs under autocast, raises when cast to half precision).

Planted (the experiment whose claim each breaks): ``PositionsIgnoreIds`` (arch), ``PaddingOnQueriesNotKeys``
(shift-labels), ``LossNotShifted`` (shift-labels), ``LossCountsPadding`` (shift-labels), ``NoCausalMaskWithCache``
(arch), ``CacheForgetsPastMask`` (decode), ``RopeOffByOneInStep`` (decode), ``CacheKeepsLastN`` (decode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, H, LAYERS, MAX_LEN = 64, 32, 4, 2, 256


@dataclass
class Output:
    logits: torch.Tensor
    past_key_values: Any = None
    loss: torch.Tensor | None = None


class LayerCache:
    """A cache object: per layer, keys and values (B, H, T_past, Dh)."""

    def __init__(self) -> None:
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def length(self) -> int:
        return self.k[0].shape[2] if self.k else 0


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, Dh) rotated by positions pos (B, T), rotate-half pairing."""
    dh = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, dh, 2, device=x.device, dtype=torch.float32) / dh))  # (Dh/2,)
    ang = pos.float()[:, None, :, None] * inv  # (B, 1, T, Dh/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Block(nn.Module):
    def __init__(self, positions: str, bug: str | None) -> None:
        super().__init__()
        self.lm = {"positions": positions, "bug": bug}  # the planted flags
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ffn = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def attend(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, past: tuple | None,
               causal: bool, step_rope_shift: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in self.qkv(x).split(D, -1))  # (B,H,T,Dh)
        if self.lm["positions"] == "rotary":
            p = pos + step_rope_shift
            q, k = rope(q, p), rope(k, p)
        P = 0
        if past is not None:
            P = past[0].shape[2]
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        kept = (k, v)
        Tk = k.shape[2]
        visible = torch.ones(T, Tk, dtype=torch.bool, device=x.device)
        if causal:
            visible = torch.arange(Tk, device=x.device)[None] <= torch.arange(P, P + T, device=x.device)[:, None]
        visible = visible[None, None].expand(B, 1, T, Tk)
        if mask is not None:
            m = mask.bool()
            if self.lm["bug"] == "cache_forgets_past_mask" and past is not None:
                m = torch.cat([torch.ones(B, P, dtype=torch.bool, device=x.device), m[:, -T:]], 1)
            if self.lm["bug"] == "padding_on_queries":
                visible = visible & m[:, -T:][:, None, :, None]  # hides padded *queries* (rows), not keys
            else:
                visible = visible & m[:, None, None, -Tk:]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(D // H)
        scores = scores.masked_fill(~visible, float("-inf"))
        w = torch.softmax(scores, -1).nan_to_num(0.0)  # a query that sees no key gets 0
        y = (w @ v).transpose(1, 2).reshape(B, T, D)
        return self.out(y), kept

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, past: tuple | None,
                causal: bool, shift: int) -> tuple[torch.Tensor, tuple]:
        a, kept = self.attend(self.ln1(x), pos, mask, past, causal, shift)
        x = x + a
        return x + self.ffn(self.ln2(x)), kept


class TinyLM(nn.Module):
    """A correct causal LM (no planted bug) with absolute positions and a tuple cache."""

    positions = "absolute"
    object_cache = False
    bug: str | None = None
    keep_last = 16  # cache_keeps_last_n: the keys a silently windowed cache keeps

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(MAX_LEN, D) if self.positions == "absolute" else None
        self.blocks = nn.ModuleList(self.make_block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def make_block(self) -> nn.Module:
        return Block(self.positions, self.bug)

    def _positions(self, ids: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                   past_len: int) -> torch.Tensor:
        B, T = ids.shape
        if self.bug == "positions_ignore_ids" or (position_ids is None and mask is None):
            return torch.arange(past_len, past_len + T, device=ids.device).expand(B, T)
        if position_ids is not None:
            return position_ids
        full = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return full[:, -T:]

    def _past(self, past: Any) -> list[tuple | None]:
        if past is None:
            return [None] * LAYERS
        if isinstance(past, LayerCache):
            return [(k, v) for k, v in zip(past.k, past.v, strict=True)] if past.k else [None] * LAYERS
        return list(past)

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
            past: Any, use_cache: bool, labels: torch.Tensor | None) -> Output:
        layers = self._past(past)
        P = 0 if layers[0] is None else layers[0][0].shape[2]
        pos = self._positions(input_ids, attention_mask, position_ids, P)
        x = self.tok(input_ids)
        if self.pos is not None:
            x = x + self.pos(pos)
        causal = not (self.bug == "no_causal_mask_with_cache" and (use_cache or past is not None))
        shift = 1 if self.bug == "rope_off_by_one_in_step" and past is not None and input_ids.shape[1] == 1 else 0
        kept = []
        for block, lp in zip(self.blocks, layers, strict=True):
            x, kv = block(x, pos, attention_mask, lp, causal, shift)
            if self.bug == "cache_keeps_last_n":
                kv = (kv[0][:, :, -self.keep_last:], kv[1][:, :, -self.keep_last:])
            kept.append(kv)
        logits = self.project(self.ln_f(x))  # (B, T, V)
        new_past: Any = None
        if use_cache:
            if self.object_cache:
                new_past = LayerCache()
                new_past.k, new_past.v = [k for k, _ in kept], [v for _, v in kept]
            else:
                new_past = tuple(kept)
        loss = None if labels is None else self.loss(logits, labels)
        return Output(logits, new_past, loss)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.bug == "loss_not_shifted":
            return F.cross_entropy(logits.transpose(1, 2).float(), labels, ignore_index=-100)
        per = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), labels[:, 1:], ignore_index=-100,
                              reduction="none")  # (B, T-1), 0 where ignored
        if self.bug == "loss_counts_padding":
            return per.mean()
        return per.sum() / (labels[:, 1:] != -100).sum()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None, use_cache: bool = False,
                labels: torch.Tensor | None = None) -> Output:
        return self.run(input_ids, attention_mask, position_ids, past_key_values, use_cache, labels)


class AbsoluteTupleCache(TinyLM):
    """Correct: learned absolute positions, a tuple-of-(k, v) cache."""


class RotaryObjectCache(TinyLM):
    """Correct: RoPE, a cache object, the past passed as ``cache`` (transformers 5.25's name)."""

    positions = "rotary"
    object_cache = True

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,  # type: ignore[override]
                position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool = False,
                labels: torch.Tensor | None = None) -> Output:
        return self.run(input_ids, attention_mask, position_ids, cache, use_cache, labels)


class NoMaskLM(TinyLM):
    """Correct, nanoGPT's layout: ``forward(idx) -> logits`` (no mask, no cache, no loss: detected lacks)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.run(idx, None, None, None, False, None).logits


class MoEFFN(nn.Module):
    """Top-1 MoE with an expert capacity: each expert serves at most ceil(capacity_factor * tokens / experts)
    tokens of the batch in token order; a dropped token's FFN output is 0 (the residual carries it)."""

    capacity_factor = 1.0

    def __init__(self, n_experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(D, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
                                     for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        flat = x.reshape(B * T, D)
        probs = torch.softmax(self.router(flat).float(), -1)
        w, e = probs.max(-1)
        cap = math.ceil(self.capacity_factor * B * T / len(self.experts))
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            idx = (e == i).nonzero().squeeze(-1)[:cap]
            if idx.numel():
                out[idx] = expert(flat[idx]) * w[idx, None].to(flat.dtype)
        return out.view(B, T, D)


class MoEBlock(Block):
    def __init__(self, positions: str, bug: str | None) -> None:
        super().__init__(positions, bug)
        self.ffn = MoEFFN()


class CapacityMoELM(TinyLM):
    """Correct, batch-dependent by design: a top-1 MoE feed-forward with capacity_factor=1.0."""

    def make_block(self) -> nn.Module:
        return MoEBlock(self.positions, self.bug)


class Fp32Island(TinyLM):
    """Correct, written for autocast: the head's input is upcast to fp32 (as some libraries keep norms in fp32), so
    the model cast to fp16/bf16 raises (a Half weight meets a Float input); under torch.autocast it runs."""

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h.float())


# ------------------------------------------------------------------------------------------- planted bugs
class PositionsIgnoreIds(TinyLM):
    """Absolute positions from arange(past, past + T), ignoring the supplied position ids and the mask: every
    left-padded row is shifted by its padding (unsloth's and nnsight's bug)."""

    bug = "positions_ignore_ids"


class PaddingOnQueriesNotKeys(TinyLM):
    """The padding mask hides padded queries (rows) instead of padded keys: real tokens attend to left padding."""

    bug = "padding_on_queries"


class LossNotShifted(TinyLM):
    """The loss compares logits[t] with labels[t] (not labels[t+1])."""

    bug = "loss_not_shifted"


class LossCountsPadding(TinyLM):
    """The loss averages over every position, ignored ones counted as 0 (reduction='none' then .mean())."""

    bug = "loss_counts_padding"


class NoCausalMaskWithCache(TinyLM):
    """No causal mask when a cache is requested or given (written for one-token steps): a prefill or a
    multi-token chunk sees its future."""

    bug = "no_causal_mask_with_cache"


class CacheForgetsPastMask(TinyLM):
    """In a cached step the padding mask covers only the new keys: the past's left padding becomes visible."""

    bug = "cache_forgets_past_mask"


class RopeOffByOneInStep(TinyLM):
    """RoPE: a single-token cached step rotates by position + 1."""

    positions = "rotary"
    bug = "rope_off_by_one_in_step"


class CacheKeepsLastN(TinyLM):
    """The cache silently keeps only the last 16 keys and values (a sliding window nobody asked for)."""

    bug = "cache_keeps_last_n"


CORRECT = ("AbsoluteTupleCache", "RotaryObjectCache", "NoMaskLM", "CapacityMoELM", "Fp32Island")
# planted bug -> the experiment where its claim lives (it must fail there under the defaults)
PLANTED = {"PositionsIgnoreIds": "arch", "NoCausalMaskWithCache": "arch", "PaddingOnQueriesNotKeys": "shift-labels",
           "LossNotShifted": "shift-labels", "LossCountsPadding": "shift-labels",
           "CacheForgetsPastMask": "decode", "RopeOffByOneInStep": "decode", "CacheKeepsLastN": "decode"}
