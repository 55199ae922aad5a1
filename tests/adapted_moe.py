"""A user's own MoE layout driven through the MoEAdapter protocol (`impl=adapted_moe:SoftmaxAfterTopKAdapter`):
a layer that takes the top-k of the router *logits* and a softmax over those k (Mixtral's HF code before 4.38 and
many papers write it so), with experts stored as one (E, D, H) tensor pair. Correct; a buggy twin forgets to
apply the softmax over the k (weights = raw logits)."""

from __future__ import annotations

import torch
import torch.nn as nn

from tfmoe.adapters.moe_base import MoEAdapter, MoESemantics
from tfmoe.adapters.moe_layers import LayerSizes, stacked_fill
from tfmoe.components import moe_reference as ref


class Experts(nn.Module):
    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, d_model, hidden) / d_model**0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, d_model) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (E,N,D) -> (E,N,D)
        return torch.relu(x @ self.w1) @ self.w2


class SoftmaxAfterTopK(nn.Module):
    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(n_experts, d_model, hidden)

    def gates(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N,D)
        top, idx = self.gate(flat).topk(self.top_k, dim=-1)  # (N,k)
        combine = torch.zeros(flat.shape[0], self.gate.out_features, dtype=flat.dtype).scatter(1, idx, self.gates(top))
        outs = self.experts(flat.expand(combine.shape[1], *flat.shape))  # (E,N,D): every expert on every token
        return torch.einsum("ne,end->nd", combine, outs).view(x.shape)


class RawLogitWeights(SoftmaxAfterTopK):
    def gates(self, logits):
        return logits


class SoftmaxAfterTopKAdapter(MoEAdapter):
    layer = SoftmaxAfterTopK

    def build(self, sizes: LayerSizes, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return self.layer(sizes.d_model, sizes.d_hidden, sizes.n_experts, sizes.top_k)

    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x)

    def semantics(self, sizes: LayerSizes, seq: int) -> MoESemantics:
        return MoESemantics("softmax", softmax_after_topk=True)

    def probe_targets(self, module):
        return [module.experts], stacked_fill

    def router_logits(self, module, x):
        return module.gate(x)

    def reference_weights(self, module: nn.Module) -> ref.LayerWeights:
        w1, w2 = module.experts.w1.detach().double(), module.experts.w2.detach().double()
        experts = [ref.MlpExpert(w1[e].T.clone(), w2[e].T.clone(), "relu") for e in range(w1.shape[0])]
        return ref.LayerWeights(module.gate.weight.detach().double().clone(), experts)


class RawLogitWeightsAdapter(SoftmaxAfterTopKAdapter):
    layer = RawLogitWeights


class NeedsArgumentsAdapter(SoftmaxAfterTopKAdapter):
    """Bad input: an adapter class must build with no arguments."""

    def __init__(self, path: str):
        self.path = path


class WrongShapeAdapter(SoftmaxAfterTopKAdapter):
    """Bad input: forward returns the flat (N, D) output, not (B, T, D)."""

    def forward(self, module, x):
        return module(x).reshape(-1, x.shape[-1])
