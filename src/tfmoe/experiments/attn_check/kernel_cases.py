"""The kernel battery's case matrix (in the spirit of FlashAttention's and PyTorch's SDPA tests) and one case's
inputs: q, k, v, the kernel's mask arguments and the masks the reference reads (never the kernel's own)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tfmoe.components.reference_attention import causal_visibility, key_padding_visibility

MASKS = ("none", "causal", "pad_bool", "pad_additive", "fully_masked", "fully_masked_additive")
FAMILIES = ("scale", "gqa", "causal", "padding_bool", "padding_additive", "fully_masked", "backward")
MASK_FAMILY = {"causal": "causal", "pad_bool": "padding_bool", "pad_additive": "padding_additive",
               "fully_masked": "fully_masked", "fully_masked_additive": "fully_masked"}
POLICIES = ("zeros", "nan", "uniform")


@dataclass(frozen=True)
class Case:
    """One cell of the matrix."""

    family: str
    Tq: int
    Tk: int
    D: int
    Hkv: int
    mask: str
    scale: float | None = None

    def label(self) -> str:
        sc = "" if self.scale is None else f", scale={self.scale:g}"
        return f"(Tq={self.Tq}, Tk={self.Tk}, D={self.D}, Hkv={self.Hkv}, mask={self.mask}{sc})"

    def tags(self) -> dict[str, Any]:
        return {"family": self.family, "Tq": self.Tq, "Tk": self.Tk, "D": self.D, "Hkv": self.Hkv,
                "mask": self.mask, "explicit_scale": self.scale is not None}


def build_cases(shapes: list[list[int]], Hq: int, kv_heads: list[int], masks: list[str],
                scale: float) -> list[Case]:
    """The matrix: per shape (Tq, Tk, D), ``scale`` (Hkv = Hq, no mask, the default and an explicit scale),
    ``gqa`` (each Hkv < Hq, no mask), and each other mask of ``masks`` once, its Hkv rotating through
    ``kv_heads`` from shape to shape (so every mask meets MHA, GQA and MQA across the matrix)."""
    cases: list[Case] = []
    for n, (Tq, Tk, D) in enumerate(shapes):
        if "none" in masks:
            cases += [Case("scale", Tq, Tk, D, Hq, "none"), Case("scale", Tq, Tk, D, Hq, "none", scale)]
            cases += [Case("gqa", Tq, Tk, D, h, "none") for h in kv_heads if h != Hq]
        cases += [Case(MASK_FAMILY[m], Tq, Tk, D, kv_heads[(n + j) % len(kv_heads)], m)
                  for j, m in enumerate(x for x in masks if x != "none")]
    return cases


@dataclass
class CaseInputs:
    """What the kernel gets, and the masks the reference reads (never the kernel's own mask tensor)."""

    q: torch.Tensor  # (B,Hq,Tq,D) run dtype
    k: torch.Tensor  # (B,Hkv,Tk,D)
    v: torch.Tensor
    grad_out: torch.Tensor  # (B,Hq,Tq,D), 0 on rows that see no key
    kwargs: dict[str, Any]  # SDPA keyword arguments for the kernel
    visible: torch.Tensor | None  # broadcastable (B|1,1,Tq,Tk) bool, for the reference
    bias: torch.Tensor | None  # finite additive bias, for the reference
    seen: torch.Tensor  # (B,Hq,Tq) rows that see at least one key


def pad_lengths(B: int, Tk: int, fully_masked: bool) -> list[int]:
    """Key lengths per batch row: Tk - 1 (one padded key), about 2/3 of Tk, ...; the last row 0 for the
    fully masked case (an empty sequence: every query of that row sees nothing)."""
    lengths = [max(1, Tk - 1) if b % 2 == 0 else max(1, (2 * Tk + 2) // 3) for b in range(B)]
    if fully_masked:
        lengths[-1] = 0
    return lengths


def make_inputs(case: Case, B: int, Hq: int, align: str, seed: int, index: int, device: torch.device,
                dtype: torch.dtype) -> CaseInputs:
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    Tq, Tk, D, Hkv = case.Tq, case.Tk, case.D, case.Hkv

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, k, v, grad_out = draw(B, Hq, Tq, D), draw(B, Hkv, Tk, D), draw(B, Hkv, Tk, D), draw(B, Hq, Tq, D)
    kwargs: dict[str, Any] = {}
    visible, bias = None, None
    if case.mask == "causal":
        kwargs["is_causal"] = True
        visible = causal_visibility(Tq, Tk, align, device)[None, None]
    elif case.mask in ("pad_bool", "fully_masked"):
        visible = key_padding_visibility(pad_lengths(B, Tk, case.mask == "fully_masked"), Tk, device)
        kwargs["attn_mask"] = visible.clone()
    elif case.mask == "pad_additive":
        visible = key_padding_visibility(pad_lengths(B, Tk, False), Tk, device)
        bias = draw(B, 1, Tq, Tk)  # a finite score bias (ALiBi-like) on every pair, -inf on padded keys
        kwargs["attn_mask"] = bias.masked_fill(~visible, float("-inf"))
    elif case.mask == "fully_masked_additive":  # 0 / -inf key padding, the last row all -inf
        visible = key_padding_visibility(pad_lengths(B, Tk, True), Tk, device)
        kwargs["attn_mask"] = torch.zeros(visible.shape, device=device, dtype=dtype).masked_fill(~visible, -math.inf)
    if case.scale is not None:
        kwargs["scale"] = case.scale
    if Hkv != Hq:
        kwargs["enable_gqa"] = True
    seen = (torch.ones(B, Hq, Tq, dtype=torch.bool, device=device) if visible is None
            else visible.any(dim=-1).expand(B, Hq, Tq))
    grad_out = grad_out * seen[..., None]
    return CaseInputs(q, k, v, grad_out, kwargs, visible, bias, seen)

