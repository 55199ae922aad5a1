"""MoE layers written in other common forms, from tfmoe's docs alone (course interface unless named an adapter):

- ``InsideWeight``: the combine weight scales the expert's hidden activation, inside the expert, before its last
  projection (bias-free): down(w · gelu(x W1ᵀ + b1)); the same function as w · expert(x).
- ``LatentAdapter``: a latent MoE: x projected down to r (bias-free), experts in r, the weighted mixture projected
  back up (bias-free) after the experts. Its reference_weights folds the two projections into each expert.
- ``BlackBox``: experts written as their own module class (a SwiGLU), no tfmoe_expert_ffn hook.
- ``WithGroup``: the course's layer holding a torch.distributed ProcessGroup (gloo, world size 1).
Each ``Bug*`` twin plants one real bug."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tfmoe.adapters.moe_base import MoEAdapter, MoESemantics
from tfmoe.components import moe_reference as ref


def _topk(logits: torch.Tensor, k: int, renormalise: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    probs = logits.softmax(dim=-1)
    w, idx = probs.topk(k, dim=-1)
    if renormalise:
        w = w / w.sum(dim=-1, keepdim=True)
    return probs, w, idx


class ScaledFFN(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # (n,D), (n,1)
        return self.fc2(F.gelu(self.fc1(x)) * w)


class InsideWeight(nn.Module):
    renormalise = True

    def __init__(self, d_model, hidden, n_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, n_experts)
        self.experts = nn.ModuleList(ScaledFFN(d_model, hidden) for _ in range(n_experts))

    def tfmoe_expert_ffn(self, i):
        e = self.experts[i]
        return ref.MlpExpert(e.fc1.weight.detach(), e.fc2.weight.detach(), "gelu", e.fc1.bias.detach())

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs, w, idx = _topk(self.router(flat), self.top_k, self.renormalise)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, expert(flat[tok], w[tok, slot, None]))
        return out.view(x.shape), probs


class BugInsideNotRenormalised(InsideWeight):
    renormalise = False


class Latent(nn.Module):
    def __init__(self, d_model, hidden, n_experts, top_k, r=8, renormalise=True):
        super().__init__()
        self.top_k, self.renormalise = top_k, renormalise
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.down, self.up = nn.Linear(d_model, r, bias=False), nn.Linear(r, d_model, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(r, hidden), nn.SiLU(), nn.Linear(hidden, r))
                                     for _ in range(n_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, w, idx = _topk(self.router(flat), self.top_k, self.renormalise)
        z = self.down(flat)
        mix = torch.zeros_like(z)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                mix.index_add_(0, tok, w[tok, slot, None] * expert(z[tok]))
        return self.up(mix).view(x.shape)


class LatentAdapter(MoEAdapter):
    renormalise = True

    def build(self, sizes, seed):
        torch.manual_seed(seed)
        return Latent(sizes.d_model, sizes.d_hidden, sizes.n_experts, sizes.top_k, renormalise=self.renormalise)

    def forward(self, module, x):
        return module(x)

    def semantics(self, sizes, seq):
        return MoESemantics("softmax", normalize=True)

    def router_logits(self, module, x):
        return module.router(x.reshape(-1, x.shape[-1]))

    def reference_weights(self, module):
        down, up = module.down.weight.detach().double(), module.up.weight.detach().double()
        experts = []
        for e in module.experts:
            w1, b1 = e[0].weight.detach().double(), e[0].bias.detach().double()
            w2, b2 = e[2].weight.detach().double(), e[2].bias.detach().double()
            experts.append(ref.MlpExpert(w1 @ down, up @ w2, "silu", b1, up @ b2))
        return ref.LayerWeights(module.router.weight.detach().double(), experts)


class BugLatentNotRenormalised(LatentAdapter):
    renormalise = False


class SwiGLU(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.w_gate, self.w_up, self.w_down = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class BlackBox(nn.Module):
    argmin = False

    def __init__(self, d_model, hidden, n_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, n_experts)
        self.experts = nn.ModuleList(SwiGLU(d_model, hidden) for _ in range(n_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        probs, w, idx = _topk(-logits if self.argmin else logits, self.top_k)
        probs = logits.softmax(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, w[tok, slot, None] * expert(flat[tok]))
        return out.view(x.shape), probs


class BugBlackBoxArgmin(BlackBox):
    argmin = True


def _group() -> dist.ProcessGroup:
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="fc-forms-"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return dist.new_group([0])


class WithGroup(nn.Module):
    """The course's ToyMoE, plus the process group its expert-parallel version would all-reduce over."""

    def __init__(self, d_model, hidden, n_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.group = _group()
        self.router = nn.Linear(d_model, n_experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))
                                     for _ in range(n_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs, w, idx = _topk(self.router(flat), self.top_k)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, w[tok, slot, None] * expert(flat[tok]))
        dist.all_reduce(out, group=self.group)  # world size 1: the identity
        return out.view(x.shape), probs


class InsideWeightDeclared(InsideWeight):
    tfmoe_mixing = "weight_inside_expert"


class BugInsideDeclaredNotRenormalised(InsideWeightDeclared):
    renormalise = False


class LatentProjected(LatentAdapter):
    """The latent MoE given to the reference as it is: experts in r, LayerWeights(pre=, post=)."""

    def reference_weights(self, module):
        experts = [ref.MlpExpert(e[0].weight.detach().double(), e[2].weight.detach().double(), "silu",
                                 e[0].bias.detach().double(), e[2].bias.detach().double()) for e in module.experts]
        return ref.LayerWeights(module.router.weight.detach().double(), experts,
                                pre=module.down.weight.detach().double(), post=module.up.weight.detach().double())


class BugLatentProjectedNotRenormalised(LatentProjected):
    renormalise = False
