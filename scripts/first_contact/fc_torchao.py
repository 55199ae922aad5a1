"""torchao's MoE block (torchao.prototype.moe_quant.MOEFeedForwardAOQuantizable), written from tfmoe's docs alone.

The block: router nn.Linear(D, E) -> softmax -> top-k -> renormalised over the k; the experts live in one
ConditionalFeedForwardAOQuantizable (w1, w3 (E, H, D), w2 (E, D, H)): silu(x w1[e]ᵀ) · x w3[e]ᵀ -> w2[e]ᵀ, and that
module also weights and sums the experts' outputs (no module returns one expert's output)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchao.prototype.moe_quant.quantizable_moe_modules import (
    ConditionalFeedForwardAOQuantizable,
    MOEFeedForwardAOQuantizable,
)

from tfmoe.adapters.moe_base import MoEAdapter, MoESemantics
from tfmoe.adapters.moe_layers import stacked_fill
from tfmoe.components import moe_reference as ref


class SharedMLP(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Adapter(MoEAdapter):
    """As first written: the experts' module named with stacked_fill, the nearest the docs then offered."""

    shared = False

    def build(self, sizes, seed):
        torch.manual_seed(seed)
        shared = SharedMLP(sizes.d_model, sizes.d_hidden) if self.shared else None
        return MOEFeedForwardAOQuantizable(sizes.d_model, sizes.d_hidden, sizes.n_experts, sizes.top_k,
                                           shared_expert=shared, empty_init=False)

    def forward(self, module, x):
        return module(x)

    def semantics(self, sizes, seq):
        return MoESemantics("softmax", normalize=True, shared_experts=int(self.shared))

    def probe_targets(self, module):  # one module computes every expert ("experts on dim 0" is the nearest the docs have)
        return [module.experts], stacked_fill

    def router_logits(self, module, x):
        return module.router(x.reshape(-1, x.shape[-1]))

    def reference_weights(self, module):
        ex = module.experts
        experts = [ref.GluExpert(ex.w1[e].detach().double(), ex.w3[e].detach().double(), ex.w2[e].detach().double(),
                                 "silu") for e in range(ex.num_experts)]
        shared = None
        if module.shared_expert is not None:
            s = module.shared_expert
            shared = ref.GluExpert(s.gate.weight.detach().double(), s.up.weight.detach().double(),
                                   s.down.weight.detach().double(), "silu")
        return ref.LayerWeights(module.router.weight.detach().double(), experts, shared=shared)


class Shared(Adapter):
    shared = True


class RouterRead(Adapter):
    """As the docs now say: no module returns one expert's output, so probe_targets returns [] and the combine
    weights are read off router_logits through the declared semantics."""

    def probe_targets(self, module):
        return []


class SharedRouterRead(RouterRead):
    shared = True


class NotRenormalised(MOEFeedForwardAOQuantizable):
    """Bug planted in the library's forward: the top-k scores are not renormalised."""

    def forward(self, x):
        b = x.shape[0]
        x = x.view(-1, self.hidden_dim)
        scores, idx = torch.topk(F.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        out = self.experts(x, idx, scores, self.top_k)
        return out.reshape(b, -1, self.hidden_dim)


class BugNotRenormalised(RouterRead):
    def build(self, sizes, seed):
        torch.manual_seed(seed)
        return NotRenormalised(sizes.d_model, sizes.d_hidden, sizes.n_experts, sizes.top_k, empty_init=False)


class GeluExperts(ConditionalFeedForwardAOQuantizable):
    """The library's experts with gelu where the design says silu (its act_fn argument is not read: silu is
    written into its forward, so the bug is planted in the forward itself)."""

    def forward(self, x, expert_indices, expert_weights, top_k):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = (expert_indices == e).nonzero(as_tuple=True)
            if tok.numel():
                y = F.linear(F.gelu(F.linear(x[tok], self.w1[e])) * F.linear(x[tok], self.w3[e]), self.w2[e])
                out.index_add_(0, tok, expert_weights[tok, slot, None] * y)
        return out


class BugGeluExperts(RouterRead):
    """Bug planted in the experts' forward: gelu where the design (and the reference) says silu."""

    def build(self, sizes, seed):
        m = super().build(sizes, seed)
        m.experts.__class__ = GeluExperts
        return m
