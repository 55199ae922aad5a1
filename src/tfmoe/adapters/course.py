"""The course's interface as an adapter: ``Class(d_model, n_heads, causal[, dropout])`` with ``qkv`` =
Linear(D, 3D, bias=False) (rows q, k, v) and ``out`` = Linear(D, D, bias=False);
``forward(x, padding_mask=None[, cache=None]) -> (output (B,T,D), attn_weights (B,H,T,T))``, padding_mask (B,T)
True = real token. Causality is fixed at construction."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from tfmoe.adapters.base import AttentionAdapter, checked_output, copy_linear, seeded
from tfmoe.components.references import Projections, fused_projections
from tfmoe.contract.errors import BadInput


def _accepts(sig: inspect.Signature, name: str) -> bool:
    return name in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


class CourseInterface(AttentionAdapter):
    supports_gqa = False

    def __init__(self, cls: Callable[..., nn.Module], spec: str):
        if not inspect.isclass(cls):  # a factory(d_model, n_heads, causal=[, dropout=]) -> module (tfmoe.api.checking)
            self._init_factory(cls, spec)
            return
        init_sig = inspect.signature(cls.__init__)
        try:
            init_sig.bind(None, 8, 2, causal=True)
        except TypeError as exc:
            raise BadInput(f"impl={spec!r}: __init__{init_sig} cannot take (d_model, n_heads, causal=...) ({exc}): "
                           "use the course's constructor signature, or write an adapter (README: Check your own "
                           "attention)") from None
        fwd_sig = inspect.signature(cls.forward)
        try:
            fwd_sig.bind(None, torch.empty(0), padding_mask=None)
        except TypeError as exc:
            raise BadInput(f"impl={spec!r}: forward{fwd_sig} cannot take (x, padding_mask=...) ({exc}): "
                           "use forward(self, x, padding_mask=None) -> (output, attn_weights), or write an "
                           "adapter (README: Check your own attention)") from None
        self.cls, self.spec = cls, spec
        self.takes_dropout = _accepts(init_sig, "dropout")
        self.takes_cache = _accepts(fwd_sig, "cache")

    def _init_factory(self, factory: Callable[..., nn.Module], spec: str) -> None:
        """A factory's signature is read like __init__'s; its module's forward from one module it builds."""
        name = getattr(factory, "__qualname__", type(factory).__name__)
        init_sig = inspect.signature(factory)
        try:
            init_sig.bind(8, 2, causal=True)
        except TypeError as exc:
            raise BadInput(f"impl={spec!r} is a function {name}{init_sig}, not a torch.nn.Module subclass, and as a "
                           f"factory it cannot take (d_model, n_heads, causal=...) ({exc}): point impl at your "
                           "attention class, or a factory taking the course's constructor arguments") from None
        try:
            with seeded(0):
                probe = factory(8, 2, causal=True)
        except Exception as exc:
            raise BadInput(f"impl={spec!r}: factory {name}(8, 2, causal=True) raised {type(exc).__name__}: {exc}: "
                           "a factory must build the course's interface at any d_model, n_heads") from None
        if not isinstance(probe, nn.Module):
            raise BadInput(f"impl={spec!r}: factory {name}(8, 2, causal=True) returned {type(probe).__name__}, not "
                           "a torch.nn.Module")
        fwd_sig = inspect.signature(type(probe).forward)
        try:
            fwd_sig.bind(None, torch.empty(0), padding_mask=None)
        except TypeError as exc:
            raise BadInput(f"impl={spec!r}: forward{fwd_sig} cannot take (x, padding_mask=...) ({exc}): "
                           "use forward(self, x, padding_mask=None) -> (output, attn_weights)") from None
        self.cls, self.spec = factory, spec
        self.takes_dropout = _accepts(init_sig, "dropout")
        self.takes_cache = _accepts(fwd_sig, "cache")

    @property
    def name(self) -> str:
        return getattr(self.cls, "__name__", type(self.cls).__name__)

    def build(self, d_model: int, n_heads: int, *, n_kv_heads: int, causal: bool, dropout: float,
              seed: int | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if n_kv_heads != n_heads:
            raise BadInput(f"impl={self.spec}: the course interface has one fused qkv (no GQA): "
                           f"n_kv_heads={n_kv_heads} needs an adapter with separate k/v projections; drop n_kv_heads")
        kwargs: dict[str, Any] = {"causal": causal}
        if self.takes_dropout:
            kwargs["dropout"] = dropout
        try:
            with seeded(seed):
                module = self.cls(d_model, n_heads, **kwargs)
        except Exception as exc:
            raise BadInput(f"impl {getattr(self.cls, '__qualname__', self.name)}({d_model}, {n_heads}, {kwargs}) raised "
                           f"{type(exc).__name__}: {exc}: fix the class or the sizes") from None
        for name, shape in (("qkv", (3 * d_model, d_model)), ("out", (d_model, d_model))):
            weight = getattr(getattr(module, name, None), "weight", None)
            if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
                raise BadInput(f"impl {getattr(self.cls, '__qualname__', self.name)} needs `{name}` = Linear with weight {shape} "
                               f"(bias=False), found {getattr(weight, 'shape', None)}: the checks rebuild the "
                               "reference from it (or write an adapter: README, Check your own attention)")
        return module.to(device=device, dtype=dtype).eval()

    def forward(self, module: nn.Module, x: torch.Tensor, padding_mask: torch.Tensor | None, *, causal: bool,
                cache: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs = {} if cache is None else {"cache": cache}
        return checked_output(module(x, padding_mask=padding_mask, **kwargs), "forward")

    def parameters(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {"qkv.weight": module.qkv.weight, "out.weight": module.out.weight}

    def projections(self, params: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> Projections:
        return fused_projections(params["qkv.weight"], params["out.weight"], n_heads)

    def set_projections(self, module: nn.Module, p: Projections) -> None:
        copy_linear(module.qkv, torch.cat([p.w_q, p.w_k, p.w_v]), None)
        copy_linear(module.out, p.w_o, None)

    def hooks(self, module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        return module.qkv, module.out
