"""Shipped MoE adapters for two public PyTorch libraries (``impl=lib:st_moe_pytorch``, ``impl=lib:mixture_of_experts``;
the optional extra ``moe-libs``). Their semantics are read from the libraries' source, versions below:

- st-moe-pytorch 0.1.8 ``MoE`` (``TopNGating``): softmax over all experts (in the tokens' dtype), top-n (n >= 2),
  the n gates renormalised to sum 1 (denominator clamped at 1e-9); expert 2..n routed iff
  uniform < gate/threshold, so ``threshold_eval=0`` (clamped to 1e-9) routes every one and the layer is
  deterministic (the battery builds it so; a positive threshold is a random eval forward, refused). Capacity per
  sequence: ``max(min(n, int(n * capacity_factor / E)), 4)``; 1st choices in sequence order, then 2nd, ...; an
  assignment past capacity gets gate 0, the others are not renormalised. Dispatch by einsum with the dispatch
  tensor, straight-through ``1 + c - c.detach()`` by default (``layer.straight_through``). No residual. Each
  ``Expert`` is rebuilt from its weights: Linear(D, 2H), GEGLU (value, gate = the two halves; gelu(gate) * value *
  ``mult_bias``), Linear(H, D), biases on both.
- mixture-of-experts 0.2.3 ``MoE`` (``Top2Gating``, tensor2tensor's): softmax, top-2, gates divided by
  (g1 + g2 + 1e-9); ``second_policy_eval='all'`` keeps every 2nd choice (the battery builds it so: 'random' is
  random, 'threshold' and 'none' are not modelled); the same capacity rule and order; experts ``w1`` (E, D, H),
  ``w2`` (E, H, D) computed in one einsum; ReLU. No residual.

Both build their combine tensor from ``one_hot(...).float()``, so in fp16/bf16 their einsums raise on mixed dtypes:
the half-precision checks are n/a with that exception, and a half-precision run is refused (exit 2).
"""

from __future__ import annotations

import importlib
from importlib import metadata

import torch
import torch.nn as nn

from tfmoe.adapters.base import seeded
from tfmoe.adapters.moe_base import MoEAdapter, MoESemantics
from tfmoe.adapters.moe_layers import Filler, LayerSizes, stacked_fill
from tfmoe.components import moe_reference as ref
from tfmoe.contract.errors import BadInput

EXTRA = "pip install -e '.[moe-libs]'"
MIN_EXPERT_CAPACITY = 4  # both libraries' constant of that name
DEFAULT_CAPACITY_FACTOR = 2.0  # both libraries' capacity_factor_eval default
NORM_EPS = 1e-9  # Top2Gating's eps, added to its gates' denominator
HALF = ("builds its combine tensor in fp32 (one_hot(...).float()) and einsums it with the tokens, which raises "
        "for fp16/bf16 tokens")


def _library(dist: str, module: str, tested: str) -> object:
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        raise BadInput(f"impl=lib:{module} needs {dist}=={tested}: {EXTRA}") from None
    if version != tested:
        raise BadInput(f"impl=lib:{module}: {dist} {version} is installed; the adapter is tested on {dist}=={tested} "
                       f"only: pip install {dist}=={tested}")
    return importlib.import_module(module)


def capacity(seq: int, capacity_factor: float, n_experts: int) -> int:
    """Both libraries' rule, per sequence (read from their source)."""
    return max(min(seq, int((seq * capacity_factor) / n_experts)), MIN_EXPERT_CAPACITY)


class StMoE(MoEAdapter):
    """st-moe-pytorch 0.1.8's ``MoE``."""

    spec = "lib:st_moe_pytorch"
    half_precision_unsupported = f"st-moe-pytorch 0.1.8 {HALF}"

    def __init__(self) -> None:
        self.lib = _library("st-moe-pytorch", "st_moe_pytorch", "0.1.8")

    def build(self, sizes: LayerSizes, seed: int) -> nn.Module:
        if sizes.top_k < 2:
            raise BadInput(f"impl={self.spec}: top_k={sizes.top_k}: st-moe-pytorch's TopNGating asserts top_n >= 2: "
                           "pass top_k >= 2")
        with seeded(seed):
            return self.lib.MoE(sizes.d_model, num_experts=sizes.n_experts,
                                expert_hidden_mult=1.5 * sizes.d_hidden / sizes.d_model,  # Expert: int(d*mult*2/3)
                                gating_top_n=sizes.top_k, threshold_eval=0.0,
                                capacity_factor_eval=sizes.capacity_factor or DEFAULT_CAPACITY_FACTOR,
                                straight_through_dispatch_tensor=sizes.straight_through).eval()

    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x).outputs

    def semantics(self, sizes: LayerSizes, seq: int) -> MoESemantics:
        cf = sizes.capacity_factor or DEFAULT_CAPACITY_FACTOR
        return MoESemantics("softmax", normalize=True, capacity=capacity(seq, cf, sizes.n_experts))

    def router_logits(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return module.gate.to_gates(x)

    def probe_targets(self, module: nn.Module) -> tuple[list[nn.Module], Filler]:
        return super().probe_targets(module.experts)

    def reference_weights(self, module: nn.Module) -> ref.LayerWeights:
        return ref.LayerWeights(module.gate.to_gates.weight.detach().double().clone(),
                                [self.expert_weights(ex) for ex in module.experts.experts])

    def expert_weights(self, expert: nn.Module) -> ref.Expert:
        """st-moe-pytorch 0.1.8's ``Expert`` rebuilt from its weights (never run): ``net`` = [Linear(D, 2H),
        GEGLU (value, gate = chunk(2); gelu(gate) * value * mult_bias), Linear(H, D)] (an RMSNorm first with
        prenorm=True, which the adapter does not build)."""
        parts = list(expert.net)
        if len(parts) != 3 or type(parts[1]).__name__ != "GEGLU":
            raise BadInput(f"impl={self.spec}: an Expert with prenorm=True or without GEGLU is not the layout this "
                           "adapter reads (the MoE it builds has neither)")
        w_in, geglu, w_down = parts
        mult = geglu.mult_bias
        mult = mult.detach().double().clone() if isinstance(mult, torch.Tensor) else None

        def d(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().double().clone()

        return ref.ChunkedGluExpert(d(w_in.weight), d(w_down.weight), "gelu", d(w_in.bias), mult, d(w_down.bias))

    def notes(self, module: nn.Module | None = None) -> list[str]:
        return [f"{self.spec}: st-moe-pytorch {metadata.version('st-moe-pytorch')} MoE, threshold_eval=0 (every "
                "top-n expert routed; deterministic)"]


class MixtureOfExperts(MoEAdapter):
    """mixture-of-experts 0.2.3's ``MoE``."""

    spec = "lib:mixture_of_experts"
    half_precision_unsupported = f"mixture-of-experts 0.2.3 {HALF}"

    def __init__(self) -> None:
        self.lib = _library("mixture-of-experts", "mixture_of_experts", "0.2.3")

    def build(self, sizes: LayerSizes, seed: int) -> nn.Module:
        if sizes.top_k != 2:
            raise BadInput(f"impl={self.spec}: top_k={sizes.top_k}: mixture-of-experts' Top2Gating routes to 2 experts "
                           "(its 'none' policy weights one expert by g1/(g1+g2), not modelled): pass top_k=2")
        with seeded(seed):
            return self.lib.MoE(sizes.d_model, num_experts=sizes.n_experts, hidden_dim=sizes.d_hidden,
                                activation=nn.ReLU, second_policy_eval="all",
                                capacity_factor_eval=sizes.capacity_factor or DEFAULT_CAPACITY_FACTOR).eval()

    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x)[0]

    def semantics(self, sizes: LayerSizes, seq: int) -> MoESemantics:
        cf = sizes.capacity_factor or DEFAULT_CAPACITY_FACTOR
        return MoESemantics("softmax", normalize=True, norm_eps=NORM_EPS,
                            capacity=capacity(seq, cf, sizes.n_experts))

    def router_logits(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return x @ module.gate.w_gating

    def probe_targets(self, module: nn.Module) -> tuple[list[nn.Module], Filler]:
        return [module.experts], stacked_fill

    def reference_weights(self, module: nn.Module) -> ref.LayerWeights:
        w1, w2 = module.experts.w1.detach().double(), module.experts.w2.detach().double()  # (E,D,H), (E,H,D)
        experts: list[ref.Expert] = [ref.MlpExpert(w1[e].T.clone(), w2[e].T.clone(), "relu") for e in range(w1.shape[0])]
        return ref.LayerWeights(module.gate.w_gating.detach().double().T.clone(), experts)

    def notes(self, module: nn.Module | None = None) -> list[str]:
        return [f"{self.spec}: mixture-of-experts {metadata.version('mixture-of-experts')} MoE, second_policy_eval="
                "'all' (every 2nd choice kept; deterministic)"]


SHIPPED: dict[str, type[MoEAdapter]] = {"st_moe_pytorch": StMoE, "mixture_of_experts": MixtureOfExperts}
