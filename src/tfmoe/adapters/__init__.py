"""Attention adapters: how attn-check drives layers written in other layouts (see ``base`` for the protocol).

``load_adapter(spec)``: ``torch:mha``, ``hf:<model_type>``, ``torchtune:mha``, ``x-transformers:attention``,
``timm:attention`` (and their variants, see ``LIBRARIES``), ``pkg.module:Class`` (a course-interface nn.Module, or
an :class:`~tfmoe.adapters.base.AttentionAdapter` subclass written for a user's own layout).

MoE layers for route-sim's layer battery: ``load_layer(impl, sizes)`` picks one of ``moe_layers`` (the package's
own, the course's ToyMoE interface) and ``moe_hf`` (transformers sparse blocks). Both loaders live here, above the
adapters they choose from, so no adapter imports another's loader."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch.nn as nn

from tfmoe.adapters.base import AttentionAdapter, ContractError, copy_linear, seeded
from tfmoe.components.references import Projections, Rope
from tfmoe.contract.errors import BadInput
from tfmoe.rules.user_code import built_adapter, load_object

if TYPE_CHECKING:
    from tfmoe.adapters.moe_layers import LayerSizes, LayerUnderTest

BUILTIN = ("torch:mha", "hf:<model_type>", "torchtune:mha[-nope]", "x-transformers:attention[-flash][-nope]",
           "timm:attention[-unfused]")
# third-party attention layers, each behind its own extra (pyproject.toml): scheme -> what impl= may name
LIBRARIES = {"torchtune": "mha, mha-nope", "x-transformers": "attention, attention-nope, attention-flash, "
             "attention-flash-nope", "timm": "attention, attention-unfused"}


def library_adapter(scheme: str, variant: str) -> AttentionAdapter:
    """``impl=torchtune:...``, ``impl=x-transformers:...``, ``impl=timm:...`` (each module imported only here)."""
    if scheme == "torchtune":
        from tfmoe.adapters.torchtune_mha import TorchtuneMHA

        return TorchtuneMHA(variant)
    if scheme == "x-transformers":
        from tfmoe.adapters.xtransformers import XTransformersAttention

        return XTransformersAttention(variant)
    from tfmoe.adapters.timm_attention import TimmAttention

    return TimmAttention(variant)


def load_adapter(spec: str, attn_implementation: str = "eager") -> AttentionAdapter:
    """The adapter ``impl=spec`` names (BadInput, one line, for anything else)."""
    scheme, sep, rest = spec.partition(":")
    if sep and scheme == "torch":
        if rest == "mha":
            from tfmoe.adapters.torch_mha import TorchMHA

            return TorchMHA()
        raise BadInput(f"impl={spec!r}: unknown SPEC torch:{rest}: the torch adapter is torch:mha "
                       "(nn.MultiheadAttention)")
    if sep and scheme == "hf":
        if not rest:
            raise BadInput(f"impl={spec!r}: name a model type after hf:, e.g. impl=hf:llama")
        from tfmoe.adapters.huggingface import HuggingFace

        return HuggingFace(rest, attn_implementation)
    if sep and scheme in LIBRARIES:
        return library_adapter(scheme, rest)
    obj = load_object(spec, "impl")
    if isinstance(obj, AttentionAdapter):
        return obj
    if inspect.isclass(obj) and issubclass(obj, AttentionAdapter):
        try:
            adapter = obj()
        except Exception as exc:
            raise BadInput(f"impl={spec!r}: adapter {obj.__qualname__}() raised {type(exc).__name__}: {exc}: "
                           "an adapter class must build with no arguments") from None
        adapter.spec = spec
        return adapter
    factory = callable(obj) and not inspect.isclass(obj) and not isinstance(obj, nn.Module)
    if not (inspect.isclass(obj) and issubclass(obj, nn.Module)) and not factory:
        raise BadInput(f"impl={spec!r} is {type(obj).__name__} {obj!r}, not a torch.nn.Module subclass, a factory "
                       "or an AttentionAdapter: point impl at your attention class (or torch:mha, hf:<model_type>)")
    from tfmoe.adapters.course import CourseInterface

    return CourseInterface(obj, spec)


def load_layer(impl: str | None, sizes: LayerSizes, seq: int = 12) -> LayerUnderTest:
    """The MoE layer ``impl=`` names: null = the package's own, hf:<type> = a transformers block, lib:<library> =
    a shipped :class:`~tfmoe.adapters.moe_base.MoEAdapter`, pkg.module:Adapter = a user's MoEAdapter (class or
    instance), else pkg.module:Class in the course's ToyMoE interface (BadInput, one line, for anything unusable).
    ``seq`` is the tokens per sequence (a declared capacity counts per sequence)."""
    from tfmoe.adapters.moe_base import AdaptedLayer
    from tfmoe.adapters.moe_layers import OwnLayer, ToyInterfaceLayer

    if impl is None:
        return OwnLayer(sizes)
    if impl.startswith("hf:"):
        from tfmoe.adapters.moe_hf import HFBlock

        return HFBlock(impl.removeprefix("hf:"), sizes)
    if impl.startswith("lib:"):
        from tfmoe.adapters.moe_libs import SHIPPED

        name = impl.removeprefix("lib:")
        if name not in SHIPPED:
            raise BadInput(f"impl={impl!r}: no shipped MoE adapter {name!r}: use one of "
                           f"{', '.join('lib:' + n for n in SHIPPED)}")
        return AdaptedLayer(SHIPPED[name](), sizes, seq)
    obj = load_object(impl, "impl", bad_form=f"impl={impl!r} is not 'pkg.module:Class' nor 'hf:<model type>': "
                      "write e.g. impl=my_moe:ToyMoE or impl=hf:mixtral")
    obj = built_adapter(obj, MoEAdapter, impl)
    if isinstance(obj, MoEAdapter):
        if obj.spec == "?":
            obj.spec = impl
        return AdaptedLayer(obj, sizes, seq)
    return ToyInterfaceLayer(impl, sizes)


__all__ = ["AttentionAdapter", "ContractError", "Projections", "Rope", "copy_linear", "seeded", "load_adapter", "load_layer", "BUILTIN",
           "MoEAdapter", "MoESemantics", "LayerSizes", "per_expert_fill", "stacked_fill", "LayerWeights", "MlpExpert",
           "GluExpert", "ChunkedGluExpert"]


# the MoE adapter protocol's public names (docs/checking-your-own-layers.md, "The MoE adapter protocol")
from tfmoe.adapters.moe_base import MoEAdapter, MoESemantics  # noqa: E402
from tfmoe.adapters.moe_layers import LayerSizes, per_expert_fill, stacked_fill  # noqa: E402
from tfmoe.components.moe_reference import ChunkedGluExpert, GluExpert, LayerWeights, MlpExpert  # noqa: E402
