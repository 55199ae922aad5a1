"""First contact: mistral-inference's MoeLayer (the Mixtral block) through tfmoe's route-sim, from the docs only.

impl=fc_mistral:Adapter; the Bug* classes plant a bug inside mistral-inference's own MoeLayer.forward. Only
mistral_inference.moe is importable on a CPU machine (transformer_layers imports xformers), so the experts are the
SwiGLU FeedForward of mistral_inference.transformer_layers written out here (w2(silu(w1 x) * w3 x)).
MoeLayer takes tokens as (N, D): the top-k gate logits are softmaxed (softmax after top-k).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from mistral_inference import moe as mistral_moe

from tfmoe.adapters import seeded
from tfmoe.adapters.moe_base import MoEAdapter, MoESemantics
from tfmoe.components.moe_reference import GluExpert, LayerWeights


class FeedForward(nn.Module):  # mistral_inference.transformer_layers.FeedForward without LoRA
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Adapter(MoEAdapter):
    def build(self, sizes, seed):
        self.plant()
        with seeded(seed):
            experts = [FeedForward(sizes.d_model, sizes.d_hidden) for _ in range(sizes.n_experts)]
            gate = nn.Linear(sizes.d_model, sizes.n_experts, bias=False)
            m = mistral_moe.MoeLayer(experts, gate, mistral_moe.MoeArgs(sizes.n_experts, sizes.top_k))
        return m.eval()

    def plant(self) -> None:
        """Where a Bug* subclass changes mistral-inference's own code."""

    def forward(self, module, x):
        B, T, D = x.shape
        return module(x.reshape(B * T, D)).reshape(B, T, D)

    def semantics(self, sizes, seq):
        return MoESemantics(score_func="softmax", softmax_after_topk=True, normalize=False)

    def reference_weights(self, module):
        def f64(w):
            return w.detach().double().clone()

        experts = [GluExpert(f64(e.w1.weight), f64(e.w3.weight), f64(e.w2.weight), "silu") for e in module.experts]
        return LayerWeights(router=f64(module.gate.weight), experts=experts)


def _forward(softmax_dim: int, weight_slot: int | None):
    """mistral_inference.moe.MoeLayer.forward (1.6.0) with one change: the softmax axis or the weight read."""

    def forward(self, inputs):
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, self.args.num_experts_per_tok)
        weights = F.softmax(weights, dim=softmax_dim, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            slot = nth_expert if weight_slot is None else torch.full_like(nth_expert, weight_slot)
            results[batch_idx] += weights[batch_idx, slot, None] * expert(inputs[batch_idx])
        return results

    return forward


class BugSoftmaxTokens(Adapter):
    """The top-k gate logits are softmaxed over the tokens (dim 0) instead of over the k choices."""

    def plant(self) -> None:
        mistral_moe.MoeLayer.forward = _forward(softmax_dim=0, weight_slot=None)


class BugFirstWeightOnly(Adapter):
    """Every chosen expert is weighted by the top-1 weight (the k-th choice's own weight is dropped)."""

    def plant(self) -> None:
        mistral_moe.MoeLayer.forward = _forward(softmax_dim=1, weight_slot=0)
