"""Kernel SPECs: ``torch:sdpa`` (and one SDPA backend each), ``torch:flex``, ``tfmoe:chunked`` or a user's
``pkg.module:function``, resolved to a :class:`Kernel` with SDPA's signature and what it declares."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from tfmoe.components.reference_attention import CAUSAL_ALIGNS
from tfmoe.contract.errors import BadInput
from tfmoe.rules.user_code import load_object

SDPA_PARAMS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
            "math": "MATH"}
CUDA_ONLY = {"torch:sdpa-efficient", "torch:sdpa-cudnn", "torch:flex-compiled"}
# SDPA backends that take only fp16/bf16 on CUDA (FlashAttention-2, cuDNN's fused attention): on an H200 every
# fp32 case raised "backend cannot run this case" (F-211); on CPU, flash takes fp32
FP16_BF16_ONLY_ON_CUDA = ("flash", "cudnn")
FLEX_COMPILED_MIN_HEAD_DIM = 16  # torch's flex_attention lowering: "NYI: embedding dimension ... at least 16"
BUILTINS = ("torch:sdpa", *(f"torch:sdpa-{b}" for b in BACKENDS), "torch:flex", "torch:flex-compiled",
            "tfmoe:chunked")


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
        if compiled and min(q.shape[-1], v.shape[-1]) < FLEX_COMPILED_MIN_HEAD_DIM:
            raise NotImplementedError(f"compiled FlexAttention needs a head dim of at least "
                                      f"{FLEX_COMPILED_MIN_HEAD_DIM} (torch's lowering), got {q.shape[-1]}")
        B, Hq, Tq, _ = q.shape
        Tk = k.shape[2]
        offset = 0 if causal_align == "top_left" else Tk - Tq
        mask = None if attn_mask is None else attn_mask.expand(B, attn_mask.shape[-3], Tq, Tk)  # (B,1|Hq,Tq,Tk)
        per_head = mask is not None and mask.shape[1] > 1
        bool_mask = mask if mask is not None and mask.dtype == torch.bool else None
        bias = mask if mask is not None and bool_mask is None else None

        def mask_mod(b, h, q_idx, kv_idx):
            keep = (kv_idx <= q_idx + offset) if is_causal else (kv_idx >= 0)
            return keep & bool_mask[b, h if per_head else 0, q_idx, kv_idx] if bool_mask is not None else keep

        block_mask = None
        if is_causal or bool_mask is not None:
            block_mask = create_block_mask(mask_mod, B, Hq if per_head else None, Tq, Tk, device=q.device)
        score_mod = None if bias is None else (
            lambda s, b, h, q_idx, kv_idx: s + bias[b, h if per_head else 0, q_idx, kv_idx])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            try:
                return attend(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                              enable_gqa=enable_gqa)
            except Exception as exc:  # the compiler's "not yet implemented", wrapped (InductorError), is a refusal
                if not compiled or "NotImplementedError" not in str(exc):
                    raise
                raise NotImplementedError(f"compiled FlexAttention cannot run this case: "
                                          f"{str(exc).splitlines()[0][:300]}") from None

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


def load_kernel(spec: str, causal_align: str | None, device: torch.device) -> Kernel:
    """Resolve SPEC to a Kernel; BadInput (exit 2) for anything that cannot be judged."""
    if spec in CUDA_ONLY and device.type != "cuda":
        raise BadInput(f"kernel={spec} runs on CUDA only: pass --device cuda on a CUDA machine "
                       "(on CPU use torch:sdpa, torch:sdpa-math, torch:sdpa-flash or torch:flex)")
    if spec == "torch:sdpa":
        return Kernel(spec, F.scaled_dot_product_attention, None, "top_left")
    if spec.startswith("torch:sdpa-") and spec.removeprefix("torch:sdpa-") in BACKENDS:
        name = spec.removeprefix("torch:sdpa-")
        fn = _sdpa_backend(name)
        if device.type == "cuda" and name in FP16_BF16_ONLY_ON_CUDA:
            fn.tfmoe_lacks = ("fp32",)  # a declared lack: dtype=fp32 exits 2 before any check
        return Kernel(spec, fn, None, "top_left")
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
    fn = load_object(spec, "kernel", bad_form=f"kernel={spec!r} is not a known kernel or 'python.module:function': "
                     f"use one of {', '.join(BUILTINS)} or e.g. kernel=my_attn:attention")
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

