"""The kernel battery's case matrix (in the spirit of FlashAttention's and PyTorch's SDPA tests) and one case's
inputs: q, k, v, the kernel's mask arguments and the masks the reference reads (never the kernel's own)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tfmoe.components.reference_attention import causal_visibility, key_padding_visibility

MASKS = ("none", "causal", "pad_bool", "pad_additive", "fully_masked", "fully_masked_additive", "bool_random",
         "bool_structured", "additive_random", "additive_structured", "per_head_bool", "per_head_additive")
# In the order the battery runs them: a family runs after the families its cases rest on (kernel_battery).
FAMILIES = ("scale", "gqa", "causal", "padding_bool", "padding_additive", "fully_masked", "mask_bool",
            "mask_additive", "per_head", "long_rows", "dropout", "weights", "backward")
# Families judged on every case of the others (a probe per case), recorded after the matrix: the weights read
# exactly through a one-hot v (kernel_weights), and dq, dk, dv.
PROBES = ("weights", "backward")
LONG_ROW_OFFSET = 4.0  # the long_rows case's v is randn + this: O ~ 4, so the rounding of a running output or
#                        denominator (relative, per key block) shows beside the plain output's one rounding
MASK_FAMILY = {"causal": "causal", "pad_bool": "padding_bool", "pad_additive": "padding_additive",
               "fully_masked": "fully_masked", "fully_masked_additive": "fully_masked",
               "bool_random": "mask_bool", "bool_structured": "mask_bool", "additive_random": "mask_additive",
               "additive_structured": "mask_additive", "per_head_bool": "per_head", "per_head_additive": "per_head"}
ADDITIVE = ("pad_additive", "fully_masked_additive", "additive_random", "additive_structured", "per_head_additive")
# What makes a row see no key, each with its own declared policy (kernel_checks.fully_masked_expect): a causal
# mask (is_causal, bottom-right with Tq > Tk), a boolean mask, an additive mask all -inf on the row.
ROW_KINDS = ("bool", "additive", "causal")


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
    dropout_p: float = 0.0  # the dropout family's p (0 elsewhere: the kernel gets no dropout_p)

    @property
    def row_kind(self) -> str:
        """What makes a row of this case see no key: causal | additive | bool (see ROW_KINDS)."""
        return "causal" if self.mask == "causal" else "additive" if self.mask in ADDITIVE else "bool"

    def label(self) -> str:
        sc = "" if self.scale is None else f", scale={self.scale:g}"
        dp = f", dropout_p={self.dropout_p:g}" if self.dropout_p else ""
        return f"(Tq={self.Tq}, Tk={self.Tk}, D={self.D}, Hkv={self.Hkv}, mask={self.mask}{sc}{dp})"

    def tags(self) -> dict[str, Any]:
        return {"family": self.family, "Tq": self.Tq, "Tk": self.Tk, "D": self.D, "Hkv": self.Hkv,
                "mask": self.mask, "explicit_scale": self.scale is not None}


def build_cases(shapes: list[list[int]], Hq: int, kv_heads: list[int], masks: list[str],
                scale: float, dropout_p: float = 0.0, dropout_shape: tuple[int, int, int] = (48, 32, 32),
                long_row: tuple[int, int, int] | None = None) -> list[Case]:
    """The matrix: per shape (Tq, Tk, D), ``scale`` (Hkv = Hq, no mask, the default and an explicit scale),
    ``gqa`` (each Hkv < Hq, no mask), and each other mask of ``masks`` once, its Hkv rotating through
    ``kv_heads`` from shape to shape (so every mask meets MHA, GQA and MQA across the matrix); then, when
    ``dropout_p`` > 0, one ``dropout`` case at ``dropout_shape`` (Hkv = Hq, no mask; Tk <= D: see
    kernel_judging.run_dropout_case); then, when ``long_row`` is given, one ``long_rows`` case (Tq, Tk, D) with
    thousands of keys per row (Hkv = Hq, no mask, v offset by LONG_ROW_OFFSET): an accumulation in the inputs'
    half precision, block after block, shows only there."""
    cases: list[Case] = []
    first = [m for m in masks if m in MASKS[:6] and m != "none"]  # the matrix's first six masks
    for n, (Tq, Tk, D) in enumerate(shapes):
        if "none" in masks:
            cases += [Case("scale", Tq, Tk, D, Hq, "none"), Case("scale", Tq, Tk, D, Hq, "none", scale)]
            cases += [Case("gqa", Tq, Tk, D, h, "none") for h in kv_heads if h != Hq]
        cases += [Case(MASK_FAMILY[m], Tq, Tk, D, kv_heads[(n + j) % len(kv_heads)], m) for j, m in enumerate(first)]
    # The full and per-head masks come after every shape's first cases: a case's inputs are drawn from
    # (seed, its index), so the cases the matrix had before keep the draws they had.
    later = [m for m in masks if m not in MASKS[:6]]
    for n, (Tq, Tk, D) in enumerate(shapes):
        cases += [Case(MASK_FAMILY[m], Tq, Tk, D, kv_heads[(n + j) % len(kv_heads)], m) for j, m in enumerate(later)]
    if dropout_p > 0:
        cases.append(Case("dropout", *dropout_shape, Hq, "none", dropout_p=dropout_p))
    if long_row is not None:
        cases.append(Case("long_rows", *long_row, Hq, "none"))
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


def random_visibility(B: int, H: int, Tq: int, Tk: int, g: torch.Generator) -> torch.Tensor:
    """(B,H,Tq,Tk) bool: each (query, key) pair seen with probability 0.6, every (batch row, head) different;
    the last query row of batch row 0 sees nothing (so every mask kind meets a row without a key)."""
    vis = torch.rand(B, H, Tq, Tk, generator=g) < 0.6
    vis[0, :, -1] = False
    return vis


def document_visibility(B: int, Tq: int, Tk: int) -> torch.Tensor:
    """(B,1,Tq,Tk) bool, structured: packed documents (block-diagonal), batch row b holding b + 2 documents of
    equal length on the query and the key axes; with Tk < documents, a document without keys sees nothing."""
    rows = []
    for b in range(B):
        n = b + 2
        doc_q = torch.arange(Tq) * n // Tq  # (Tq,)
        doc_k = torch.arange(Tk) * n // Tk  # (Tk,)
        rows.append(doc_q[:, None] == doc_k[None, :])
    return torch.stack(rows)[:, None]  # (B,1,Tq,Tk)


def alibi_bias(H: int, Tq: int, Tk: int, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(1,H|1,Tq,Tk) finite ALiBi-like bias -slope_h·|i + Tk - Tq - j| (queries at the last Tq positions) and
    the visibility of a window of 3 + h keys around each query's position (so each head sees other keys;
    ``per_head`` False: head 0's, for every head)."""
    n = H if per_head else 1
    dist = (torch.arange(Tq)[:, None] + Tk - Tq - torch.arange(Tk)[None, :]).abs().double()  # (Tq,Tk)
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(n)], dtype=torch.float64)
    width = torch.tensor([3 + h for h in range(n)])
    return -slopes.view(1, n, 1, 1) * dist, dist[None, None] < width.view(1, n, 1, 1)


def make_inputs(case: Case, B: int, Hq: int, align: str, seed: int, index: int, device: torch.device,
                dtype: torch.dtype) -> CaseInputs:
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    Tq, Tk, D, Hkv = case.Tq, case.Tk, case.D, case.Hkv

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    def additive(vis: torch.Tensor, finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference's visibility and finite bias, and the kernel's float mask (bias, -inf where hidden)."""
        vis, finite = vis.to(device), finite.to(device=device, dtype=dtype)
        return vis, finite, finite.masked_fill(~vis, float("-inf"))

    q, k, v, grad_out = draw(B, Hq, Tq, D), draw(B, Hkv, Tk, D), draw(B, Hkv, Tk, D), draw(B, Hq, Tq, D)
    if case.family == "long_rows":
        v = v + LONG_ROW_OFFSET
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
    elif case.mask == "bool_random":  # (B,1,Tq,Tk): every query row its own keys
        visible = random_visibility(B, 1, Tq, Tk, g).to(device)
        kwargs["attn_mask"] = visible.clone()
    elif case.mask == "bool_structured":
        visible = document_visibility(B, Tq, Tk).to(device)
        kwargs["attn_mask"] = visible.clone()
    elif case.mask == "additive_random":
        visible, bias, kwargs["attn_mask"] = additive(random_visibility(B, 1, Tq, Tk, g), draw(B, 1, Tq, Tk))
    elif case.mask == "additive_structured":
        finite, vis = alibi_bias(Hq, Tq, Tk, per_head=False)
        visible, bias, kwargs["attn_mask"] = additive(vis.expand(B, 1, Tq, Tk), finite.expand(B, 1, Tq, Tk))
    elif case.mask == "per_head_bool":  # (B,Hq,Tq,Tk): every head its own keys
        visible = random_visibility(B, Hq, Tq, Tk, g).to(device)
        kwargs["attn_mask"] = visible.clone()
    elif case.mask == "per_head_additive":  # per-head ALiBi slopes and windows
        finite, vis = alibi_bias(Hq, Tq, Tk, per_head=True)
        visible, bias, kwargs["attn_mask"] = additive(vis.expand(B, Hq, Tq, Tk), finite.expand(B, Hq, Tq, Tk))
    if case.scale is not None:
        kwargs["scale"] = case.scale
    if case.dropout_p:
        kwargs["dropout_p"] = case.dropout_p
    if Hkv != Hq:
        kwargs["enable_gqa"] = True
    seen = (torch.ones(B, Hq, Tq, dtype=torch.bool, device=device) if visible is None
            else visible.expand(B, Hq, Tq, Tk).any(dim=-1))
    grad_out = grad_out * seen[..., None]
    return CaseInputs(q, k, v, grad_out, kwargs, visible, bias, seen)



# What each family's property is, as a case can reveal it (kernel_battery.record_family's coverage)
REVEALS = {"scale": "the softmax scale (a row that sees two keys or more)",
           "gqa": "the kv head each query head reads (Hkv < Hq)",
           "causal": "the causal mask (a key hidden from a row)",
           "padding_bool": "the padding mask (a padded key)", "padding_additive": "the padding mask (a padded key)",
           "fully_masked": "rows that see no key", "mask_bool": "the mask (a key hidden from a row)",
           "mask_additive": "the mask (a key hidden from a row)", "per_head": "the per-head mask (a key hidden)",
           "long_rows": "an accumulation over thousands of keys", "dropout": "dropout (p > 0)",
           "weights": "the weights (a row that sees two keys or more)", "backward": "the gradients"}


def case_reveals(case: Case, inp: CaseInputs) -> bool:
    """Whether the case's inputs can show its family's property at all: a mask that hides no key (a causal mask
    over one key, a padding mask with no padding) or a softmax over one key (the scale, the weights) cannot. A
    family judged only on such cases is not judged (kernel_battery.record_family), never passed."""
    B, Hq, Tq, Tk = inp.q.shape[0], inp.q.shape[1], case.Tq, case.Tk
    if case.family in ("scale", "weights"):
        counts = (torch.full((B, Hq, Tq), Tk, device=inp.q.device) if inp.visible is None
                  else inp.visible.expand(B, Hq, Tq, Tk).sum(dim=-1))
        return bool((counts >= 2).any())
    if case.family == "fully_masked":
        return not bool(inp.seen.all())
    if case.mask != "none":
        return inp.visible is not None and not bool(inp.visible.all())
    return True
