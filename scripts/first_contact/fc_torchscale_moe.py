"""torchscale's X-MoE layer (torchscale.component.xmoe: MOELayer + Top1Gate / Top2Gate, FeedForwardNetwork experts),
written from tfmoe's docs alone. MOELayer asks torch.distributed for its expert groups: the adapter starts a gloo
group of world size 1 (the layer then holds ProcessGroup objects)."""

from __future__ import annotations

import math
import os
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torchscale.component.feedforward_network import FeedForwardNetwork
from torchscale.component.xmoe import routing
from torchscale.component.xmoe.moe_layer import MOELayer
from torchscale.component.xmoe.routing import Top1Gate, Top2Gate

from tfmoe.adapters.moe_base import MoEAdapter, MoESemantics
from tfmoe.components import moe_reference as ref


def ensure_group() -> None:
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="fc-xmoe-"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


class Top1(MoEAdapter):
    top_k_gate = 1

    def gate(self, sizes):
        return Top1Gate(sizes.d_model, sizes.n_experts)

    def build(self, sizes, seed):
        ensure_group()
        torch.manual_seed(seed)
        experts = torch.nn.ModuleList(FeedForwardNetwork(sizes.d_model, sizes.d_hidden, "gelu", 0.0, 0.0, 1e-5)
                                      for _ in range(sizes.n_experts))
        args = SimpleNamespace(moe_expert_count=sizes.n_experts)
        return MOELayer(self.gate(sizes), experts, args)

    def forward(self, module, x):
        # the gates log a histogram of int64 expert ids: torch.histc has no int64 kernel on CPU (CUDA only)
        histc = torch.histc
        torch.histc = lambda t, *a, **k: histc(t.float() if not t.is_floating_point() else t, *a, **k)
        try:
            return module(x)[0]
        finally:
            torch.histc = histc

    def semantics(self, sizes, seq):
        # eval: capacity = ceil(0.25 * tokens) over the whole batch, top-1 keeps the raw softmax probability
        return MoESemantics("softmax", normalize=False, capacity=math.ceil(0.25 * 2 * seq), capacity_group="batch")

    def router_logits(self, module, x):
        return module.gate.wg(x.reshape(-1, x.shape[-1]))

    def reference_weights(self, module):
        experts = [ref.MlpExpert(e.fc1.weight.detach().double(), e.fc2.weight.detach().double(), "gelu",
                                 e.fc1.bias.detach().double(), e.fc2.bias.detach().double()) for e in module.experts]
        return ref.LayerWeights(module.gate.wg.weight.detach().double(), experts)


class Top2(Top1):
    """Top-2, second expert always kept ("all"); eval capacity = all tokens, so nothing is dropped."""

    def gate(self, sizes):
        return Top2Gate(sizes.d_model, sizes.n_experts, second_expert_policy="all",
                        moe_eval_capacity_token_fraction=1.0)

    def semantics(self, sizes, seq):
        return MoESemantics("softmax", normalize=True)


class BugTop1Argmin(Top1):
    """Bug planted in the library's gate: it routes on the negated logits (each token's least likely expert)."""

    def gate(self, sizes):
        g = Top1Gate(sizes.d_model, sizes.n_experts)
        g.forward = lambda input, mask=None: routing.top1gating(-g.wg(input), mask, eval_mode=not g.training)
        return g


class BugTop2FirstOnly(Top2):
    """Bug planted in the library's gate: the second expert's weight is dropped from the combine."""

    def gate(self, sizes):
        g = super().gate(sizes)
        fwd = g.forward

        def first_only(input, mask=None):
            l_aux, combine, dispatch, meta = fwd(input, mask)
            first = torch.zeros_like(combine)
            flat = combine.flatten(1)
            top = flat.argmax(dim=1)
            first.view(flat.shape).scatter_(1, top[:, None], flat.gather(1, top[:, None]))
            return l_aux, first, dispatch, meta
        g.forward = first_only
        return g
