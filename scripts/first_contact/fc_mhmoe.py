"""mh-moe's SparseMoE (mh_moe.main: NoisyTopkRouter + Expert(Linear(D, 4D), ReLU, Linear(4D, D), Dropout)),
written from tfmoe's docs alone. Its router adds Gaussian noise scaled by softplus(noise_linear(x)) in eval mode
too; the adapter switches the noise off (noise_linear weight 0, bias -100: softplus ~ 4e-44)."""

from __future__ import annotations

import contextlib
import io

import torch
from mh_moe.main import SparseMoE

from tfmoe.adapters.moe_base import MoEAdapter, MoESemantics
from tfmoe.components import moe_reference as ref


class Adapter(MoEAdapter):
    noise_off = True

    def build(self, sizes, seed):
        torch.manual_seed(seed)
        m = SparseMoE(sizes.d_model, sizes.n_experts, sizes.top_k)
        if self.noise_off:
            with torch.no_grad():
                m.router.noise_linear.weight.zero_()
                m.router.noise_linear.bias.fill_(-100.0)
        return m

    def forward(self, module, x):
        with contextlib.redirect_stdout(io.StringIO()):  # the library prints shapes
            return module(x)

    def semantics(self, sizes, seq):
        return MoESemantics("softmax", softmax_after_topk=True)

    def router_logits(self, module, x):
        return module.router.topkroute_linear(x.reshape(-1, x.shape[-1]))

    def reference_weights(self, module):
        r = module.router.topkroute_linear
        experts = []
        for e in module.experts:
            fc1, fc2 = e.net[0], e.net[2]
            experts.append(ref.MlpExpert(fc1.weight.detach().double(), fc2.weight.detach().double(), "relu",
                                         fc1.bias.detach().double(), fc2.bias.detach().double()))
        return ref.LayerWeights(r.weight.detach().double(), experts, router_bias=r.bias.detach().double())


class BugNoisyEval(Adapter):
    """The library as shipped: eval-mode routing noise (a real bug of the library for inference)."""

    noise_off = False


class BugExpertScaled(Adapter):
    """Bug planted in the library's Expert: its output scaled by 1.5."""

    def build(self, sizes, seed):
        m = super().build(sizes, seed)
        for e in m.experts:
            e.net[2].register_forward_hook(lambda _m, _i, out: out * 1.5)
        return m
