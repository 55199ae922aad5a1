"""The MoE adapter protocol: how route-sim's layer battery drives a sparse MoE layer written in any layout
(``impl=pkg.module:MyAdapter``, or a shipped ``impl=lib:<library>``).

An adapter tells the battery, about one MoE implementation (nothing about how to route: the float64 reference
of :mod:`tfmoe.components.moe_reference` does that from the declared semantics):

1. ``build(sizes, seed)``: a fresh layer (random weights drawn after ``torch.manual_seed(seed)``), eval mode.
2. ``forward(module, x)``: x (B, T, D) through the layer's own code -> out (B, T, D).
3. ``router_probs(module, x)``: the layer's full router distribution (N, E) where it exposes one (else None);
   ``router_logits(module, x)`` likewise.
4. the combine weights (N, E) it applies: by default *measured* (:func:`~tfmoe.adapters.moe_layers.
   probe_combine_weights`) on the modules ``probe_targets(module)`` names (a list, one per expert; or (modules,
   filler), e.g. one module computing every expert with experts on dim 0; or [] when no module returns one
   expert's output: the weights are then read off the router through the semantics). Where the layer applies
   them elsewhere (``mixing``: ``weight_inside_expert``, ``post_mixture_projection``) they are measured there, or
   the undeclared form is detected and named by the battery. The **selection** is always derived from them: a
   token's experts are those with a nonzero weight (beyond the measurement's rounding), never which rows reached an
   expert, so a dense layer, a straight-through dispatch or padded capacity buffers read the same as a sparse
   gather.
5. ``semantics(sizes, seq)``: the declared :class:`MoESemantics` (softmax before or after top-k, renormalised
   or not, capacity or dropless, shared experts, score function), read from the library's docs and source.
6. ``reference_weights(module)``: the layer's weights in float64 as a :class:`~tfmoe.components.moe_reference.
   LayerWeights` (router (E, D), experts, shared expert), so the reference never calls the layer.

Optional declarations (read by :func:`tfmoe.rules.capabilities.declared`, with the config's ``lacks`` and
``layer.router_dtype`` / ``layer.expert_dtype``): ``lacks`` (features the layer lacks: ``fp16``, ``bf16`` make their
``finite.<dtype>`` check n/a and a run in that dtype exit 2), ``half_precision_unsupported`` (why fp16/bf16 copies
cannot run: lacking both, with that reason), ``router_dtype`` (the precision the layer computes its combine weights
in, None = the run's dtype), ``expert_dtype`` (the precision its experts compute in: the output is judged against
the plain mixture with experts in that dtype; undeclared, a lower precision is detected and named), and
``mixing``, and ``notes(module)``. ``reference_weights`` rebuilds every expert from its weights (``MlpExpert``,
``GluExpert``, ``ChunkedGluExpert``): the reference never runs the layer's expert modules, except one given as its
``nn.Module``, run as a black box (then ``layer.expert_internals`` is not judged). docs/checking-your-own-layers.md,
"The MoE adapter protocol", has every shape and return type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn as nn

from tfmoe.adapters.moe_layers import (
    Captured,
    Filler,
    LayerSizes,
    LayerUnderTest,
    call_layer,
    per_expert_fill,
    probe_combine_weights,
    probe_plan,
    reference_expert,
)
from tfmoe.components import moe_reference as ref
from tfmoe.contract.errors import BadInput


@dataclass(frozen=True)
class MoESemantics:
    """What a design declares its router and combine do (never measured from the layer)."""

    score_func: str = "softmax"  # softmax | sigmoid
    softmax_after_topk: bool = False  # top-k of the logits, then a softmax over the k (= renormalised top-k)
    normalize: bool = True  # the k weights renormalised to sum 1 (softmax before top-k)
    norm_eps: float = 0.0  # renormalisation divides by (sum + norm_eps)
    scaling: float = 1.0  # weights multiplied after normalisation (routed_scaling_factor)
    capacity: int | None = None  # assignments per expert per capacity group; None = dropless
    capacity_group: str = "sequence"  # the tokens a capacity counts over: "sequence" | "batch"
    shared_experts: int = 0  # ungated shared experts added to every token (their weights in reference_weights)
    residual: bool = False  # out = x + mixture

    def routing(self, top_k: int, seq: int) -> ref.RoutingSemantics:
        """These semantics in the reference's terms."""
        if self.score_func not in ("softmax", "sigmoid"):
            raise BadInput(f"MoESemantics.score_func={self.score_func!r}: the reference knows softmax and sigmoid")
        if self.softmax_after_topk and self.score_func != "softmax":
            raise BadInput("MoESemantics.softmax_after_topk needs score_func='softmax'")
        if self.capacity_group not in ("sequence", "batch"):
            raise BadInput(f"MoESemantics.capacity_group={self.capacity_group!r}: use 'sequence' or 'batch'")
        # a softmax over the k chosen logits is the renormalised top-k of the softmax over all experts
        normalize = True if self.softmax_after_topk else self.normalize
        return ref.RoutingSemantics(self.score_func, top_k, normalize, self.scaling, residual=self.residual,
                                    norm_eps=self.norm_eps, capacity=self.capacity,
                                    capacity_group=seq if self.capacity_group == "sequence" else None)


class MoEAdapter(ABC):
    """Base class of every MoE adapter (the shipped ones and a user's)."""

    spec: str = "?"
    half_precision_unsupported: str = ""
    lacks: tuple[str, ...] = ()
    router_dtype: torch.dtype | str | None = None
    expert_dtype: torch.dtype | str | None = None
    mixing: str | None = None  # None = the weight multiplies each expert's output; or a MIXING form

    @abstractmethod
    def build(self, sizes: LayerSizes, seed: int) -> nn.Module: ...

    @abstractmethod
    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def semantics(self, sizes: LayerSizes, seq: int) -> MoESemantics: ...

    @abstractmethod
    def reference_weights(self, module: nn.Module) -> ref.LayerWeights: ...

    def probe_targets(self, module: nn.Module) -> list[nn.Module] | tuple[list[nn.Module], Filler]:
        """The modules whose outputs are the experts' outputs: a list, one per expert in expert order; or
        ``(modules, filler)`` (one module for all, experts on dim 0: ``stacked_fill``); or ``[]`` when no module
        returns one expert's output (the weights are then read off ``router_logits`` / ``router_probs`` through the
        declared semantics). Default: ``module.experts``."""
        experts = getattr(module, "experts", None)
        if not isinstance(experts, (nn.ModuleList, list, tuple)):
            raise BadInput(f"impl={self.spec}: the adapter names no expert modules: override probe_targets(module)")
        return list(experts), per_expert_fill

    def router_probs(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return None

    def router_logits(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return None

    def notes(self, module: nn.Module | None = None) -> list[str]:
        return []


class AdaptedLayer(LayerUnderTest):
    """A :class:`MoEAdapter` as the battery's layer under test."""

    logits_in_fp32 = False
    router_precision = None  # the run's dtype unless the adapter declares router_dtype (read by the battery)

    def __init__(self, adapter: MoEAdapter, sizes: LayerSizes, seq: int):
        self.adapter, self.sizes, self.label = adapter, sizes, adapter.spec
        self.declared = adapter.semantics(sizes, seq)
        self.semantics = self.declared.routing(sizes.top_k, seq)
        # the declared router precision is applied by the battery (tfmoe.rules.capabilities), as any declaration
        self.half_precision_unsupported = adapter.half_precision_unsupported
        self.exposes_probs = type(adapter).router_probs is not MoEAdapter.router_probs

    @property
    def declaring(self) -> tuple[object, ...]:
        return (self.adapter,)

    def build(self, seed: int) -> nn.Module:
        return self.adapter.build(self.sizes, seed).eval()

    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = call_layer(self.adapter.forward, module, x)
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            raise BadInput(f"impl={self.label}: the adapter's forward returned "
                           f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__} for x "
                           f"{tuple(x.shape)}: it must return the layer's output shaped like x")
        return out

    def _router_output(self, name: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        n, e = x.numel() // x.shape[-1], self.sizes.n_experts
        t = call_layer(getattr(self.adapter, name), module, x)
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or t.numel() != n * e:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise BadInput(f"impl={self.label}: the adapter's {name}(module, x) returned {got} for x {tuple(x.shape)}: "
                           f"return a tensor of (tokens, n_experts) = ({n}, {e}) (any leading shape), or None")
        return t.reshape(n, e)

    def run(self, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Captured]:
        out = self.forward(module, x)
        e = self.sizes.n_experts
        targets, fill = probe_plan(self.adapter.probe_targets(module), self.label)
        probs = self._router_output("router_probs", module, x)
        logits = self._router_output("router_logits", module, x)
        if targets and self.probe_experts:
            weights, zero_tol, rows = probe_combine_weights(lambda t: self.forward(module, t), x, targets, e, fill,
                                                            self.probe_direction)
        else:  # read off the router by the battery, through the declared semantics
            if probs is None and logits is None:
                why = ("probe_targets(module) returned no module" if not targets else
                       "the layer declares its weights applied inside the experts (mixing = weight_inside_expert)")
                raise BadInput(f"impl={self.label}: {why}, so the combine weights are read off the router, but the "
                               "adapter gives neither router_logits(module, x) nor router_probs(module, x): "
                               "implement one (a tensor (tokens, n_experts))")
            weights, zero_tol, rows = None, 0.0, None
        return out, Captured(weights, probs, logits, rows, zero_tol)

    def expert_modules(self, module: nn.Module) -> list[nn.Module] | None:
        targets, fill = probe_plan(self.adapter.probe_targets(module), self.label)
        return targets if targets and fill is per_expert_fill and len(targets) == self.sizes.n_experts else None

    def reference_weights(self, module: nn.Module) -> ref.LayerWeights:
        w = self.adapter.reference_weights(module)
        if not isinstance(w, ref.LayerWeights):
            raise BadInput(f"impl={self.label}: reference_weights(module) returned {type(w).__name__}: return a "
                           "tfmoe.components.moe_reference.LayerWeights")
        w.experts = [reference_expert(ex, f"experts[{i}]", self.label) for i, ex in enumerate(w.experts)]
        if w.shared is not None:
            w.shared = [reference_expert(ex, f"shared[{i}]", self.label) for i, ex in enumerate(w.shared_list)]
        declared, given = self.declared.shared_experts, len(w.shared_list)
        if declared != given:
            raise BadInput(f"impl={self.label}: semantics declare shared_experts={declared} but reference_weights gives "
                           f"{given} shared expert(s): give LayerWeights(shared=[...]) one per shared expert, or "
                           f"declare MoESemantics(shared_experts={given})")
        return w

    def alternatives(self) -> dict[str, ref.RoutingSemantics]:
        sem = self.semantics
        alts = {"renormalised" if not sem.normalize else "not renormalised": sem.variant(normalize=not sem.normalize)}
        if sem.capacity is not None:
            alts["dropless (capacity ignored)"] = sem.variant(capacity=None)
        return alts

    def notes(self) -> list[str]:
        return [f"{self.label}: declared semantics {self.declared}", *self.adapter.notes()]
