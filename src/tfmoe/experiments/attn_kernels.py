"""tfmoe attn-check kernel=SPEC — judge an attention *kernel* with SDPA's signature on a FlashAttention-style
case matrix.

A kernel is ``fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)`` with
q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D); a boolean ``attn_mask`` means True = attend, a float one is added to the
scores. SPEC: ``torch:sdpa`` (and ``torch:sdpa-flash|-efficient|-cudnn|-math``, one SDPA backend each),
``torch:flex`` (FlexAttention, the case's mask as a mask_mod / score_mod; ``torch:flex-compiled`` on CUDA),
``tfmoe:chunked`` (the package's chunked exact attention) or ``pkg.module:function`` (the current directory is
importable, as with ``python -m``).

Each case (Tq, Tk, D, Hkv, mask) runs the kernel, an fp64 reference written from first principles and a plain
implementation in the run's dtype (:mod:`tfmoe.components.reference_attention`). FlashAttention's rule, forward
and backward: max|kernel - ref| <= factor · max|plain - ref| + 2 · the dtype's rounding at the reference's scale
(factor 2 for the output, ``kernel_checks.grad_factor`` — also 2, as in FlashAttention's tests — for dq/dk/dv).

Cases belong to one check family each (``kernel_<family>``); a family is judged only on cases whose
prerequisites passed (every masked case needs ``scale``; a case with Hkv < Hq needs ``gqa``; the fully masked
case needs ``padding_bool`` (its additive twin ``padding_additive``); a case's backward needs its own forward), so one bug fails one family and the other
families say they were not judged. A case the kernel cannot take (its signature lacks ``scale``/``enable_gqa``/
``attn_mask``/``is_causal``) is *skipped*; one it refuses with NotImplementedError (FlexAttention's backward on
CPU) is *not applicable* with the kernel's own reason — neither is a failure.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from tfmoe.components.reference_attention import (
    CAUSAL_ALIGNS,
    causal_visibility,
    key_padding_visibility,
    kv_head_index,
    plain_attention,
    reference_attention,
)
from tfmoe.errors import BadInput
from tfmoe.experiments.attn_check import classify_rows, max_abs_err, rounding_atol
from tfmoe.memory import available_memory_bytes
from tfmoe.recorder import Recorder
from tfmoe.validate import require_int, require_number

MASKS = ("none", "causal", "pad_bool", "pad_additive", "fully_masked", "fully_masked_additive")
FAMILIES = ("scale", "gqa", "causal", "padding_bool", "padding_additive", "fully_masked", "backward")
MASK_FAMILY = {"causal": "causal", "pad_bool": "padding_bool", "pad_additive": "padding_additive",
               "fully_masked": "fully_masked", "fully_masked_additive": "fully_masked"}
POLICIES = ("zeros", "nan", "uniform")
SDPA_PARAMS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
            "math": "MATH"}
CUDA_ONLY = {"torch:sdpa-efficient", "torch:sdpa-cudnn", "torch:flex-compiled"}
BUILTINS = ("torch:sdpa", *(f"torch:sdpa-{b}" for b in BACKENDS), "torch:flex", "torch:flex-compiled",
            "tfmoe:chunked")


# ============================================================================================ kernels
@dataclass
class Kernel:
    """The function under test, with SDPA's signature, and what it declares."""

    spec: str
    fn: Callable[..., torch.Tensor]
    params: frozenset[str] | None  # SDPA keyword arguments it accepts; None = all (signature not inspectable)
    causal_align: str | None  # its own is_causal convention; None = whatever causal_align says
    notes: list[str] = field(default_factory=list)


def _sdpa_backend(name: str) -> Callable[..., torch.Tensor]:
    """F.scaled_dot_product_attention restricted to one backend; a case the backend cannot run is
    NotImplementedError with SDPA's own reasons (its warnings)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, BACKENDS[name])

    def sdpa_one_backend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel(backend):
            warnings.simplefilter("always")
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                      is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
            except RuntimeError as exc:
                if "backend" not in str(exc) and "kernel" not in str(exc):
                    raise
                why = "; ".join(str(w.message).splitlines()[0] for w in caught) or str(exc).splitlines()[0]
                raise NotImplementedError(f"SDPA's {name} backend cannot run this case: {why}") from None

    sdpa_one_backend.__name__ = f"sdpa_{name}"
    return sdpa_one_backend


def _flex(compiled: bool, causal_align: str) -> Callable[..., torch.Tensor]:
    """FlexAttention behind SDPA's signature: a bool mask (and is_causal) become a mask_mod / BlockMask,
    a float mask a score_mod that adds it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend = torch.compile(flex_attention) if compiled else flex_attention

    def flex(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p:
            raise NotImplementedError("FlexAttention has no attention dropout")
        B, Hq, Tq, _ = q.shape
        Tk = k.shape[2]
        offset = 0 if causal_align == "top_left" else Tk - Tq
        bool_mask = attn_mask.expand(B, 1, Tq, Tk) if attn_mask is not None and attn_mask.dtype == torch.bool else None
        bias = attn_mask.expand(B, 1, Tq, Tk) if attn_mask is not None and bool_mask is None else None

        def mask_mod(b, h, q_idx, kv_idx):
            keep = (kv_idx <= q_idx + offset) if is_causal else (kv_idx >= 0)
            return keep & bool_mask[b, 0, q_idx, kv_idx] if bool_mask is not None else keep

        block_mask = None
        if is_causal or bool_mask is not None:
            block_mask = create_block_mask(mask_mod, B, None, Tq, Tk, device=q.device)
        score_mod = None if bias is None else (lambda s, b, h, q_idx, kv_idx: s + bias[b, 0, q_idx, kv_idx])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return attend(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)

    flex.__name__ = "flex_attention_compiled" if compiled else "flex_attention"
    return flex


def _chunked(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """tfmoe's chunked_attention behind SDPA's signature (no enable_gqa: it needs Hq = Hkv). It takes a key
    padding mask only, so a (Tq, Tk) or additive mask is NotImplementedError; its causal is bottom-right."""
    from tfmoe.components.chunked_attention import chunked_attention

    if dropout_p:
        raise NotImplementedError("tfmoe:chunked has no attention dropout")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("tfmoe:chunked is forward-only: its online softmax updates the running sums "
                                  "in place, which autograd cannot differentiate")
    kpm = None
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise NotImplementedError("tfmoe:chunked takes a boolean key padding mask, not an additive float mask")
        if attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[2] != 1:
            raise NotImplementedError("tfmoe:chunked takes a key padding mask (B, 1, 1, Tk), not a (Tq, Tk) mask")
        kpm = attn_mask[:, 0, 0, :].expand(q.shape[0], k.shape[2])
    return chunked_attention(q, k, v, causal=is_causal, key_padding_mask=kpm, scale=scale, block_size=64)


@contextlib.contextmanager
def cwd_importable() -> Iterator[None]:
    """The current directory on sys.path while importing the user's kernel, as ``python -m`` has it."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _user_kernel(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadInput(f"kernel={spec!r} is not a known kernel or 'python.module:function': use one of "
                       f"{', '.join(BUILTINS)} or e.g. kernel=my_attn:attention")
    try:
        with cwd_importable():
            obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import-time error of the user's module is bad input
        raise BadInput(f"kernel={spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}): check the "
                       "module name; the current directory and PYTHONPATH are searched") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BadInput(f"kernel={spec!r}: module {module_name!r} has no {attr!r}: check the name after ':'")
        obj = getattr(obj, part)
    return obj


def load_kernel(spec: str, causal_align: str | None, device: torch.device) -> Kernel:
    """Resolve SPEC to a Kernel; BadInput (exit 2) for anything that cannot be judged."""
    if not isinstance(spec, str) or not spec:
        raise BadInput(f"kernel={spec!r} must be a string: one of {', '.join(BUILTINS)} or 'python.module:function'")
    if spec in CUDA_ONLY and device.type != "cuda":
        raise BadInput(f"kernel={spec} runs on CUDA only: pass --device cuda on a CUDA machine "
                       "(on CPU use torch:sdpa, torch:sdpa-math, torch:sdpa-flash or torch:flex)")
    if spec == "torch:sdpa":
        return Kernel(spec, F.scaled_dot_product_attention, None, "top_left")
    if spec.startswith("torch:sdpa-") and spec.removeprefix("torch:sdpa-") in BACKENDS:
        return Kernel(spec, _sdpa_backend(spec.removeprefix("torch:sdpa-")), None, "top_left")
    if spec in ("torch:flex", "torch:flex-compiled"):
        align = causal_align or "top_left"
        kernel = Kernel(spec, _flex(spec.endswith("compiled"), align), None, None)
        if spec == "torch:flex":
            kernel.notes.append("torch:flex runs FlexAttention eagerly (unfused; it materialises the scores)")
        return kernel
    if spec == "tfmoe:chunked":
        return Kernel(spec, _chunked, frozenset(inspect.signature(_chunked).parameters) & set(SDPA_PARAMS),
                      "bottom_right")
    if spec.split(":", 1)[0] in ("torch", "tfmoe"):
        raise BadInput(f"kernel={spec!r} is not a built-in kernel: use one of {', '.join(BUILTINS)} "
                       "(or a full module path, e.g. torch.nn.functional:scaled_dot_product_attention)")
    fn = _user_kernel(spec)
    if inspect.isclass(fn) and issubclass(fn, nn.Module):
        raise BadInput(f"kernel={spec!r} is a torch.nn.Module class, not an attention function: judge modules "
                       "with impl=..., or point kernel at a function fn(q, k, v, attn_mask=None, ...)")
    if not callable(fn):
        raise BadInput(f"kernel={spec!r} is {type(fn).__name__} {fn!r}, not callable: point it at a function "
                       "fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: assume SDPA's, say so
        params, note = None, f"{spec}: signature not inspectable; assumed to be SDPA's full signature"
    else:
        try:
            sig.bind(torch.empty(0), torch.empty(0), torch.empty(0))
        except TypeError as exc:
            raise BadInput(f"kernel={spec!r}: signature {sig} cannot take (q, k, v) ({exc}): use "
                           "fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, "
                           "enable_gqa=False)") from None
        var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        params = None if var_kw else frozenset(sig.parameters) & set(SDPA_PARAMS)
        note = ""
    declared = getattr(fn, "causal_align", None)
    if declared is not None and declared not in CAUSAL_ALIGNS:
        raise BadInput(f"kernel={spec!r} declares causal_align={declared!r}: set the function's causal_align "
                       f"attribute to one of {list(CAUSAL_ALIGNS)}")
    kernel = Kernel(spec, fn, params, declared or (None if causal_align else "top_left"))
    if note:
        kernel.notes.append(note)
    return kernel


# ============================================================================================ settings
@dataclass
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


@dataclass
class KernelSettings:
    spec: str
    causal_align: str
    B: int
    Hq: int
    cases: list[Case]
    fully_masked_expect: tuple[str, ...]
    backward: bool
    grad_factor: float


def _int_list(value: Any, key: str) -> list[int]:
    value = OmegaConf.to_container(value) if OmegaConf.is_list(value) else value
    if not isinstance(value, list) or not value or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                                       for n in value):
        raise BadInput(f"{key}={value!r} must be a non-empty list of positive integers, e.g. {key}=[6,2,1]")
    return value


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


def kernel_settings(cfg: DictConfig) -> KernelSettings:
    """Validate the kernel-mode keys (BadInput names the key and the fix)."""
    align = cfg.get("causal_align")
    if align is not None and align not in CAUSAL_ALIGNS:
        raise BadInput(f"causal_align={align!r} is unknown: use causal_align=top_left (SDPA's is_causal) or "
                       "causal_align=bottom_right (FlashAttention >= 2.1, decoding)")
    B, Hq = require_int(cfg, "cases.batch", 1), require_int(cfg, "cases.q_heads", 1)
    kv_heads = _int_list(OmegaConf.select(cfg, "cases.kv_heads"), "cases.kv_heads")
    bad = [h for h in kv_heads if Hq % h]
    if bad:
        raise BadInput(f"cases.kv_heads {bad} do not divide cases.q_heads={Hq}: each key/value head serves "
                       f"Hq/Hkv query heads; pick among {[h for h in range(1, Hq + 1) if Hq % h == 0]}")
    raw = OmegaConf.select(cfg, "cases.shapes")
    raw = OmegaConf.to_container(raw) if OmegaConf.is_list(raw) else raw
    if (not isinstance(raw, list) or not raw or any(
            not isinstance(s, list) or len(s) != 3 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                                          for n in s) for s in raw)):
        raise BadInput(f"cases.shapes={raw!r} must be a list of [Tq, Tk, D] positive integers, "
                       "e.g. cases.shapes=[[17,17,64],[1,239,128]]")
    masks = OmegaConf.select(cfg, "cases.masks")
    masks = OmegaConf.to_container(masks) if OmegaConf.is_list(masks) else masks
    if not isinstance(masks, list) or not masks or any(m not in MASKS for m in masks):
        raise BadInput(f"cases.masks={masks!r} must be a non-empty list from {list(MASKS)}")
    scale = require_number(cfg, "cases.scale", positive=True)
    expect = OmegaConf.select(cfg, "kernel_checks.fully_masked_expect")
    expect = OmegaConf.to_container(expect) if OmegaConf.is_list(expect) else expect
    def policy_name(p: Any) -> Any:  # Hydra's grammar reads nan as a float
        return "nan" if isinstance(p, float) and math.isnan(p) else p

    expect = [policy_name(p) for p in expect] if isinstance(expect, list) else policy_name(expect)
    expect_t = POLICIES if expect == "any" else tuple(expect) if isinstance(expect, list) else (expect,)
    if not expect_t or any(p not in POLICIES for p in expect_t):
        raise BadInput(f"kernel_checks.fully_masked_expect={expect!r} is unknown: use zeros, nan, uniform, "
                       "a list of them, or any")
    backward = OmegaConf.select(cfg, "kernel_checks.backward")
    if not isinstance(backward, bool):
        raise BadInput(f"kernel_checks.backward={backward!r} is not true/false")
    factor = require_number(cfg, "kernel_checks.grad_factor", positive=True)
    return KernelSettings(cfg.kernel, align, B, Hq, build_cases(raw, Hq, kv_heads, masks, scale), expect_t,
                          backward, factor)


# ============================================================================================ one case
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


@dataclass
class Judged:
    """kernel vs the fp64 reference, next to the plain same-dtype implementation vs the same reference."""

    err: float
    plain_err: float
    atol: float
    factor: float

    @property
    def limit(self) -> float:
        return self.factor * self.plain_err + self.atol

    @property
    def passed(self) -> bool:
        return math.isfinite(self.err) and self.err <= self.limit

    def text(self, what: str) -> str:
        err = f"{self.err:.3g}" if math.isfinite(self.err) else "inf (NaN or inf values)"
        return (f"max|{what} - ref| {err} vs limit {self.limit:.3g} "
                f"({self.factor:g}×plain {self.plain_err:.3g} + rounding {self.atol:.3g})")


def cast_rounding(ref: torch.Tensor, dtype: torch.dtype, rows: torch.Tensor | None = None) -> float:
    """2·max|fl_dtype(ref) - ref|: what a perfect kernel loses by returning its result in ``dtype``.
    FlashAttention's 2·|(r + 0.3 - 0.3) - r| is that rounding at the scale of 0.3, which for |r| >> 1 (a dv that
    sums 1434 rows reaches ~90) is far below one ulp of r."""
    return 2.0 * max_abs_err(ref.detach().to(dtype), ref, rows)


def judge(out: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor, dtype: torch.dtype, factor: float,
          rows: torch.Tensor | None = None) -> Judged:
    """FlashAttention's rule on the selected rows (rows: bool over out's leading dims, or None = all); the
    rounding term is the larger of FlashAttention's and the reference's own rounding to ``dtype``."""
    atol = max(rounding_atol(ref, dtype, rows), cast_rounding(ref, dtype, rows))
    return Judged(max_abs_err(out, ref, rows), max_abs_err(plain, ref, rows), atol, factor)


@dataclass
class Outcome:
    """What one case (forward, or its backward) gave."""

    case: Case
    status: str  # pass | fail | n/a | skipped | blocked
    detail: str = ""
    ratio: float = 0.0  # err / limit of the worst comparison (inf for a crash or a wrong policy)
    policy: str = "none"  # the kernel's output on rows that see no key
    evidence: dict[str, torch.Tensor] = field(default_factory=dict)


def missing_params(kernel: Kernel, kwargs: dict[str, Any]) -> list[str]:
    return [] if kernel.params is None else [p for p in kwargs if p not in kernel.params]


def call_kernel(kernel: Kernel, inp: CaseInputs, q, k, v) -> torch.Tensor:
    out = kernel.fn(q, k, v, **inp.kwargs)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the kernel returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"the kernel returned shape {tuple(out.shape)}, expected (B, Hq, Tq, D) = {tuple(q.shape)}")
    if out.dtype != q.dtype:
        raise ValueError(f"the kernel returned {out.dtype} for {q.dtype} inputs (SDPA returns the inputs' dtype)")
    return out


def _raised(exc: Exception) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


def _ratio(j: Judged) -> float:
    return j.err / j.limit if j.limit > 0 else (0.0 if j.err == 0 else math.inf)


def accumulation_atols(inp: CaseInputs, ref_out: torch.Tensor, weights: torch.Tensor, scale: float,
                       dtype: torch.dtype) -> dict[str, float]:
    """Rounding floors for the gradients, where FlashAttention's "rounding at the reference's scale" is 0 or
    far below what any fp32-accumulating kernel can reach (eps_acc = fp32's eps, fp64's for fp64 runs;
    independent roundings add in quadrature; each floor is twice the estimate):

    - dq, dk carry dS = P∘(dP - δ), δ_i = dO_i·O_i, a difference that cancels exactly when a row's softmax is
      constant (Tk = 1: dq = dk = 0 exactly, so the plain implementation's error is 0 too). A kernel forming δ
      from dO·O (FlashAttention's way) rounds it: e_i ≈ eps_acc·Σ_d|dO_id·O_id|, reaching dq_i as
      scale·e_i·(Σ_j P_ij²)^½·max|k| and dk_j as scale·(Σ_i (P_ij·e_i)²)^½·max|q|.
    - dv_j = Σ_i P_ij·dO_i sums n = (Hq/Hkv)·Tq terms; a kernel that accumulates them one block after
      another (SDPA's CPU backward) rounds each partial sum: ≈ eps_acc·√n·(Σ_i P_ij²)^½·max|dO|."""
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    e = eps * (inp.grad_out.double().abs() * ref_out.detach().abs()).sum(dim=-1, keepdim=True)  # (B,Hq,Tq,1)
    w = weights.detach()
    B, Hq, Tq, Tk = w.shape
    Hkv = inp.k.shape[1]
    dq = scale * float((e * w.pow(2).sum(dim=-1, keepdim=True).sqrt()).max()) * float(inp.k.double().abs().max())
    dk = scale * float((w * e).pow(2).reshape(B, Hkv, -1, Tq, Tk).sum(dim=(2, 3)).max().sqrt()) \
        * float(inp.q.double().abs().max())
    p2 = w.pow(2).reshape(B, Hkv, -1, Tq, Tk).sum(dim=(2, 3))  # (B,Hkv,Tk): Σ over the group's queries
    dv = eps * math.sqrt(Hq // Hkv * Tq) * float(p2.max().sqrt()) * float(inp.grad_out.double().abs().max())
    return {"dq": 2.0 * dq, "dk": 2.0 * dk, "dv": 2.0 * dv}


def run_case(kernel: Kernel, case: Case, inp: CaseInputs, dtype: torch.dtype, expect: tuple[str, ...],
             backward: bool, grad_factor: float, rec: Recorder) -> tuple[Outcome, Outcome | None]:
    """One case: the forward (kernel vs reference on rows that see a key; the policy on rows that see none),
    then — if the forward passed and backward is on — dq (rows that see a key), dk, dv."""
    tensors = {"q": inp.q, "k": inp.k, "v": inp.v, **{k: v for k, v in inp.kwargs.items()
                                                      if isinstance(v, torch.Tensor)}}
    try:
        with torch.no_grad():
            out = call_kernel(kernel, inp, inp.q, inp.k, inp.v)
    except NotImplementedError as exc:
        return Outcome(case, "n/a", f"{case.label()}: {_raised(exc)}"), None
    except Exception as exc:  # the kernel crashed on this case: a failure, never a crash of the battery
        return Outcome(case, "fail", f"{case.label()}: the kernel raised {_raised(exc)}", math.inf,
                       evidence=tensors), None
    leaves = {name: [t.detach().to(cast).requires_grad_(backward) for t in (inp.q, inp.k, inp.v)]
              for name, cast in (("ref", torch.float64), ("plain", dtype))}
    with torch.set_grad_enabled(backward):
        ref, weights = reference_attention(*leaves["ref"], inp.visible, inp.bias, case.scale, return_weights=True)
        plain = plain_attention(*leaves["plain"], inp.visible, inp.bias, case.scale)
    j = judge(out, ref, plain, dtype, 2.0, inp.seen)
    rec.metric("err", j.err, tensor="out", plain_err=j.plain_err, limit=j.limit, **case.tags())
    policy = "none"
    if not bool(inp.seen.all()):
        heads = kv_head_index(out.shape[1], case.Hkv, out.device)
        mean_v = inp.v.double().mean(dim=2, keepdim=True)[:, heads].expand_as(ref)  # uniform weights' output
        kind = classify_rows(out[~inp.seen], mean_v[~inp.seen], dtype)
        policy = {"mean_of_v": "uniform"}.get(kind, kind)
    ratio = _ratio(j)
    problems = [] if j.passed else [j.text("out")]
    if case.family == "fully_masked" and policy not in expect:
        problems.append(f"rows that see no key give {policy}, expected {'|'.join(expect)} "
                        f"(kernel_checks.fully_masked_expect; set it to {policy} if that is your kernel's "
                        "documented policy)" if policy in POLICIES else
                        f"rows that see no key give {policy} (neither zeros, NaN nor the uniform average of v)")
        ratio = math.inf
    evidence = {**tensors, "out": out, "ref": ref.detach()}
    fwd = Outcome(case, "fail" if problems else "pass",
                  f"{case.label()}: " + ("; ".join(problems) if problems else j.text("out")), ratio, policy, evidence)
    if not backward or fwd.status != "pass":
        return fwd, None
    floors = accumulation_atols(inp, ref, weights, 1.0 / math.sqrt(case.D) if case.scale is None else case.scale,
                                dtype)
    return fwd, run_backward(kernel, case, inp, dtype, grad_factor, ref, plain, leaves, tensors, floors, rec)


def run_backward(kernel: Kernel, case: Case, inp: CaseInputs, dtype: torch.dtype, factor: float,
                 ref: torch.Tensor, plain: torch.Tensor, leaves: dict[str, list[torch.Tensor]],
                 tensors: dict[str, torch.Tensor], floors: dict[str, float], rec: Recorder) -> Outcome:
    """dq (rows that see a key), dk, dv of the kernel vs the fp64 reference's, next to the plain's."""
    evidence = {**tensors, "grad_out": inp.grad_out}
    try:
        mine = [t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
        got = torch.autograd.grad(call_kernel(kernel, inp, *mine), mine, inp.grad_out)
    except NotImplementedError as exc:
        return Outcome(case, "n/a", f"{case.label()}: backward: {_raised(exc)}")
    except Exception as exc:
        hint = " (a forward-only kernel: pass kernel_checks.backward=false)" if "grad" in str(exc) else ""
        return Outcome(case, "fail", f"{case.label()}: backward raised {_raised(exc)}{hint}", math.inf,
                       evidence=evidence)
    ref_g = torch.autograd.grad(ref, leaves["ref"], inp.grad_out.double())
    plain_g = torch.autograd.grad(plain, leaves["plain"], inp.grad_out)
    judged: dict[str, Judged] = {}
    for i, name in enumerate(("dq", "dk", "dv")):
        j = judge(got[i], ref_g[i], plain_g[i], dtype, factor, inp.seen if name == "dq" else None)
        judged[name] = Judged(j.err, j.plain_err, max(j.atol, floors[name]), factor)
        rec.metric("err", j.err, tensor=name, plain_err=j.plain_err, limit=judged[name].limit, **case.tags())
    worst_name, worst = max(judged.items(), key=lambda kv: _ratio(kv[1]))
    bad = [j.text(n) for n, j in judged.items() if not j.passed]
    for i, n in enumerate(("dq", "dk", "dv")):
        evidence[f"{n}_kernel"], evidence[f"{n}_ref"] = got[i], ref_g[i]
    detail = f"{case.label()}: " + ("; ".join(bad) if bad else worst.text(worst_name))
    return Outcome(case, "fail" if bad else "pass", detail, _ratio(worst), evidence=evidence)


# ============================================================================================ the battery
PREREQ_TEXT = {"scale": "kernel_scale (plain attention)", "gqa": "kernel_gqa (Hkv < Hq)",
               "padding_bool": "kernel_padding_bool (boolean masks)",
               "padding_additive": "kernel_padding_additive (float masks)"}


def prerequisites(case: Case, Hq: int) -> list[str]:
    """The families a case's verdict rests on: a failure there would fail this case for another reason."""
    needs = [] if case.family == "scale" else ["scale"]
    if case.Hkv != Hq and case.family != "gqa":
        needs.append("gqa")
    if case.family == "fully_masked":
        needs.append("padding_additive" if case.mask == "fully_masked_additive" else "padding_bool")
    return needs


def record_family(rec: Recorder, family: str, outcomes: list[Outcome], reason_blocked: str) -> str:
    """One check ``kernel_<family>`` over its cases (pass / fail), or a note when nothing was judged (n/a).
    Returns the family's verdict: pass | fail | n/a."""
    name = f"kernel_{family}"
    by = {s: [o for o in outcomes if o.status == s] for s in ("pass", "fail", "n/a", "skipped", "blocked")}
    counts = ", ".join(f"{len(v)} {s}" for s, v in by.items() if v)
    extras = []
    if by["skipped"]:
        extras.append(f"skipped: {by['skipped'][0].detail}")
    if by["n/a"]:
        extras.append(f"not applicable: {by['n/a'][0].detail}")
    if by["blocked"]:
        extras.append(f"not judged: {reason_blocked}")
        if by["pass"] or by["fail"]:
            rec.note(f"{name}: {len(by['blocked'])} cases not judged: {reason_blocked}")
    if not by["pass"] and not by["fail"]:
        rec.note(f"{name} n/a ({counts or 'no cases'}): " + "; ".join(extras))
        return "n/a"
    failed = sorted(by["fail"], key=lambda o: -o.ratio)
    if failed:
        worst = failed[0]
        others = [o.case.label() for o in failed[1:4]]
        more = f" +{len(failed) - 4} more" if len(failed) > 4 else ""
        detail = (f"{len(failed)} of {len(by['pass']) + len(failed)} cases failed ({counts}); worst "
                  f"{worst.detail}" + (f"; also {', '.join(others)}{more}" if others else ""))
    else:
        worst = max(by["pass"], key=lambda o: o.ratio)
        detail = f"all {len(by['pass'])} judged cases within FlashAttention's rule ({counts}); closest {worst.detail}"
    if extras:
        detail += " | " + " | ".join(extras)
    rec.check(name, not failed, float(len(failed)), 0.0, detail, evidence=failed[0].evidence if failed else None)
    return "fail" if failed else "pass"


def run_kernel_battery(cfg: DictConfig, rec: Recorder) -> None:
    """The kernel battery: every case of the matrix, one check per family, a conformance summary.

    On CPU with ``threads`` unset it runs on one intra-op thread: its tensors are at most a few MB, and on a
    shared 2-core machine OpenMP's hand-offs cost more than the maths (the default matrix took 215 s wall /
    55 s CPU on 2 threads vs 30 s / 7 s on 1 at load 15: benchmarks/bench_attn_kernels.py)."""
    from tfmoe.runner import torch_threads

    one = rec.device.type == "cpu" and cfg.get("threads") is None
    if one:
        rec.note("kernel mode on CPU: 1 intra-op thread (threads=null; pass threads=N to choose)")
    with torch_threads(1 if one else None):
        _run_battery(cfg, rec)


def _run_battery(cfg: DictConfig, rec: Recorder) -> None:
    device, dtype = rec.device, rec.dtype
    s = kernel_settings(cfg)
    kernel = load_kernel(s.spec, s.causal_align, device)
    if kernel.causal_align and s.causal_align and kernel.causal_align != s.causal_align:
        raise BadInput(f"causal_align={s.causal_align} contradicts {s.spec}, whose is_causal is "
                       f"{kernel.causal_align.replace('_', '-')} aligned: drop causal_align or pass "
                       f"causal_align={kernel.causal_align}")
    align = s.causal_align or kernel.causal_align or "top_left"
    need = max(8 * s.B * s.Hq * c.Tq * c.Tk * 6 for c in s.cases)  # fp64 scores, weights and their grads
    if need > available_memory_bytes(device):
        raise BadInput(f"the largest case needs about {need / 2**30:.1f} GiB for the fp64 reference: "
                       "use smaller cases.shapes")
    for n in kernel.notes:
        rec.note(n)
    rec.note(f"kernel mode: {s.spec}, causal_align={align}, B={s.B}, Hq={s.Hq}, {len(s.cases)} forward cases; "
             "reference = fp64 first-principles attention (tfmoe.components.reference_attention); "
             f"rule: err <= 2·plain + rounding (output), {s.grad_factor:g}·plain + rounding (dq, dk, dv)")
    if cfg.get("impl") is not None:
        rec.note("kernel mode ignores the module-mode keys (impl, B, T, d_model, ...)")

    verdict: dict[str, str] = {}
    outcomes: dict[str, list[Outcome]] = {f: [] for f in FAMILIES}
    policies: dict[str, set[str]] = {}
    t0 = time.perf_counter()
    backward_outcomes: dict[int, Outcome] = {}
    for family in FAMILIES[:-1]:
        idx = [i for i, c in enumerate(s.cases) if c.family == family]
        if not idx:
            continue
        with rec.stage("kernel_family", family=family):
            for i in idx:
                case = s.cases[i]
                blocked = [p for p in prerequisites(case, s.Hq) if verdict.get(p) == "fail"]
                inp = make_inputs(case, s.B, s.Hq, align, rec.seed, i, device, dtype)
                missing = missing_params(kernel, inp.kwargs)
                if blocked:
                    o = Outcome(case, "blocked", f"{case.label()}: needs {', '.join(blocked)}")
                elif missing:
                    o = Outcome(case, "skipped", f"{case.label()}: the kernel's signature has no "
                                f"{', '.join(missing)}")
                else:
                    o, bwd = run_case(kernel, case, inp, dtype, s.fully_masked_expect, s.backward, s.grad_factor, rec)
                    if o.policy != "none":
                        policies.setdefault(case.mask, set()).add(o.policy)
                    rec.metric("case_passed", float(o.status == "pass"), status=o.status, policy=o.policy,
                               **case.tags())
                    if bwd is not None:
                        backward_outcomes[i] = bwd
                if s.backward:
                    backward_outcomes.setdefault(i, Outcome(case, o.status, o.detail) if o.status in (
                        "n/a", "skipped") else Outcome(case, "blocked", f"{case.label()}: its forward did not pass"))
                outcomes[family].append(o)
        blocked_by = sorted({p for o in outcomes[family] if o.status == "blocked"
                             for p in prerequisites(o.case, s.Hq) if verdict.get(p) == "fail"})
        verdict[family] = record_family(rec, family, outcomes[family],
                                        "prerequisite " + ", ".join(PREREQ_TEXT[p] for p in blocked_by)
                                        + " failed: fix that first")
    if s.backward:
        outcomes["backward"] = [backward_outcomes[i] for i in sorted(backward_outcomes)]
        verdict["backward"] = record_family(rec, "backward", outcomes["backward"],
                                            "the backward of a case whose forward did not pass is not judged")
    else:
        rec.note("kernel_backward not run: kernel_checks.backward=false")
        verdict["backward"] = "n/a"
    wall = time.perf_counter() - t0
    rec.metric("matrix_wall_s", wall, measured=True)
    for mask, kinds in sorted(policies.items()):
        rec.note(f"rows that see no key ({mask} cases): the kernel gives {', '.join(sorted(kinds))}")
    if not any(v in ("pass", "fail") for v in verdict.values()):
        rec.check("kernel_ran", False, None, None, f"{s.spec} ran no case of the matrix (every family n/a): "
                  "see the notes for the kernel's reasons")
    _kernel_summary(rec, s, align, dtype, verdict, outcomes, policies, wall)


def _kernel_summary(rec: Recorder, s: KernelSettings, align: str, dtype: torch.dtype, verdict: dict[str, str],
                    outcomes: dict[str, list[Outcome]], policies: dict[str, set[str]], wall: float) -> None:
    table = Table(title=f"attn-check kernel={s.spec} ({str(dtype).removeprefix('torch.')}, causal_align={align})")
    for col in ("family", "verdict", "pass", "fail", "n/a", "skipped", "not judged"):
        table.add_column(col)
    lines = ["| family | verdict | pass | fail | n/a | skipped | not judged |", "|---|---|---|---|---|---|---|"]
    for family in FAMILIES:
        outs = outcomes[family]
        n = [sum(o.status == st for o in outs) for st in ("pass", "fail", "n/a", "skipped", "blocked")]
        v = verdict.get(family, "n/a")
        table.add_row(f"kernel_{family}", v, *map(str, n), style="red" if v == "fail" else None)
        lines.append(f"| kernel_{family} | {'**fail**' if v == 'fail' else v} | " + " | ".join(map(str, n)) + " |")
    rec.print(table)
    pol = "; ".join(f"{m}: {', '.join(sorted(k))}" for m, k in sorted(policies.items())) or "none observed"
    rec.print(f"rows that see no key: {pol}; matrix {wall:.1f} s")
    rec.summary(f"### attn-check kernel mode: `{s.spec}`, {str(dtype).removeprefix('torch.')}, causal_align={align}, "
                f"B={s.B}, Hq={s.Hq}, {len(s.cases)} cases\n\n" + "\n".join(lines)
                + f"\n\nRows that see no key: {pol}. Matrix wall time {wall:.1f} s.")
