"""MoE layers in the mixing forms and layouts the layer battery must judge with no options (route-sim
``impl=mixing_moe:<Name>``), each correct, with real bugs planted in twins:

- ``InsideWeight``: the combine weight scales each expert's hidden activation before its last (bias-free)
  projection, down(w · gelu(x W1ᵀ + b1)), the expert called as ``expert(x, w)``; ``InsideWeightDeclared`` says so.
- ``LatentFolded`` / ``LatentProjected``: a latent MoE (x -> r, experts in r, the weighted mixture projected back
  after the experts), given to the reference folded into each expert, or as ``LayerWeights(pre=, post=)``.
- ``TupleExperts``: experts returning ``(out, bias)`` (their last bias apart, Megatron-style), summed by the layer.
- ``SeveralShared``: two ungated shared experts, ``LayerWeights(shared=[a, b])``.
- ``BlackBox``: experts in their own class (a SwiGLU), no ``tfmoe_expert_ffn``: run as black boxes.
- ``WithGroup``: the course's layer holding a torch.distributed ProcessGroup (it cannot be deep-copied).
- ``PlainListProbe`` (probe_targets returns a plain list) and ``WrongProbeType`` (a dict: bad input).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tfmoe.adapters.moe_base import MoEAdapter, MoESemantics
from tfmoe.components import moe_reference as ref


def top_k(logits: torch.Tensor, k: int, renormalise: bool = True):
    probs = logits.softmax(dim=-1)
    w, idx = probs.topk(k, dim=-1)  # (N,k)
    return probs, (w / w.sum(dim=-1, keepdim=True) if renormalise else w), idx


def mix(flat: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, experts, d_out: int | None = None, call=None):
    """sum over each token's k experts of call(expert, rows, weights (n,1)) into (N, d_out)."""
    out = flat.new_zeros(flat.shape[0], d_out or flat.shape[1])
    for e, expert in enumerate(experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            out.index_add_(0, tok, call(expert, flat[tok], w[tok, slot, None]))
    return out


# ------------------------------------------------------------ the weight applied inside the expert
class ScaledFFN(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # (n,D), (n,1) -> (n,D)
        return self.fc2(F.gelu(self.fc1(x)) * w)


class InsideWeight(nn.Module):
    renormalise = True

    def __init__(self, d_model, hidden, n_experts, top_k_):
        super().__init__()
        self.top_k = top_k_
        self.router = nn.Linear(d_model, n_experts)
        self.experts = nn.ModuleList(ScaledFFN(d_model, hidden) for _ in range(n_experts))

    def tfmoe_expert_ffn(self, i):
        e = self.experts[i]
        return ref.MlpExpert(e.fc1.weight.detach(), e.fc2.weight.detach(), "gelu", e.fc1.bias.detach())

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs, w, idx = top_k(self.router(flat), self.top_k, self.renormalise)
        return mix(flat, w, idx, self.experts, call=lambda ex, rows, we: ex(rows, we)).view(x.shape), probs


class InsideNotRenormalised(InsideWeight):
    renormalise = False


class InsideWeightDeclared(InsideWeight):
    tfmoe_mixing = "weight_inside_expert"


class InsideDeclaredNotRenormalised(InsideWeightDeclared):
    renormalise = False


# ------------------------------------------------------------ a latent MoE: projection after the mixture
class Latent(nn.Module):
    def __init__(self, d_model, hidden, n_experts, k, r=8, renormalise=True):
        super().__init__()
        self.top_k, self.renormalise = k, renormalise
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.down, self.up = nn.Linear(d_model, r, bias=False), nn.Linear(r, d_model, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(r, hidden), nn.SiLU(), nn.Linear(hidden, r))
                                     for _ in range(n_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, w, idx = top_k(self.router(flat), self.top_k, self.renormalise)
        z = self.down(flat)  # (N,r)
        return self.up(mix(z, w, idx, self.experts, call=lambda ex, rows, we: we * ex(rows))).view(x.shape)


def _w(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double()


class LatentFolded(MoEAdapter):
    """The projections folded into each expert (exact: both are bias-free), as a user writes it with no slot for
    them: the probe then reads each weight times the projection's gain, and the battery names the form."""

    renormalise = True

    def build(self, sizes, seed):
        torch.manual_seed(seed)
        return Latent(sizes.d_model, sizes.d_hidden, sizes.n_experts, sizes.top_k, renormalise=self.renormalise)

    def forward(self, module, x):
        return module(x)

    def semantics(self, sizes, seq):
        return MoESemantics("softmax", normalize=True)

    def router_logits(self, module, x):
        return module.router(x)

    def reference_weights(self, module):
        down, up = _w(module.down.weight), _w(module.up.weight)
        experts = [ref.MlpExpert(_w(e[0].weight) @ down, up @ _w(e[2].weight), "silu", _w(e[0].bias),
                                 up @ _w(e[2].bias)) for e in module.experts]
        return ref.LayerWeights(_w(module.router.weight), experts)


class LatentFoldedNotRenormalised(LatentFolded):
    renormalise = False


class LatentProjected(LatentFolded):
    """The same layer given as it is: experts in r, LayerWeights(pre=, post=): the weights are measured along
    the projection."""

    def reference_weights(self, module):
        experts = [ref.MlpExpert(_w(e[0].weight), _w(e[2].weight), "silu", _w(e[0].bias), _w(e[2].bias))
                   for e in module.experts]
        return ref.LayerWeights(_w(module.router.weight), experts, pre=_w(module.down.weight),
                                post=_w(module.up.weight))


class LatentProjectedNotRenormalised(LatentProjected):
    renormalise = False


# ------------------------------------------------------------ experts returning (out, bias); several shared
class BiasApart(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d, bias=False)
        self.bias = nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x))), self.bias


class TupleLayer(nn.Module):
    def __init__(self, d, h, n_experts, k, n_shared=0, drop_second_shared=False):
        super().__init__()
        self.top_k, self.drop = k, drop_second_shared
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(BiasApart(d, h) for _ in range(n_experts))
        self.shared = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))
                                    for _ in range(n_shared))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, w, idx = top_k(self.router(flat), self.top_k)

        def call(ex, rows, we):
            out, bias = ex(rows)
            return we * (out + bias)
        out = mix(flat, w, idx, self.experts, call=call)
        for i, s in enumerate(self.shared):
            if not (self.drop and i == 1):
                out = out + s(flat)
        return out.view(x.shape)


class TupleExperts(MoEAdapter):
    n_shared, drop = 0, False

    def build(self, sizes, seed):
        torch.manual_seed(seed)
        return TupleLayer(sizes.d_model, sizes.d_hidden, sizes.n_experts, sizes.top_k, self.n_shared, self.drop)

    def forward(self, module, x):
        return module(x)

    def semantics(self, sizes, seq):
        return MoESemantics("softmax", normalize=True, shared_experts=self.n_shared)

    def router_logits(self, module, x):
        return module.router(x)

    def reference_weights(self, module):
        experts = [ref.MlpExpert(_w(e.fc1.weight), _w(e.fc2.weight), "relu", _w(e.fc1.bias), _w(e.bias))
                   for e in module.experts]
        shared = [ref.MlpExpert(_w(s[0].weight), _w(s[2].weight), "gelu", _w(s[0].bias), _w(s[2].bias))
                  for s in module.shared]
        return ref.LayerWeights(_w(module.router.weight), experts, shared=shared or None)


class SeveralShared(TupleExperts):
    n_shared = 2


class SecondSharedDropped(SeveralShared):
    drop = True


class PlainListProbe(TupleExperts):
    def probe_targets(self, module):
        return list(module.experts)


class WrongProbeType(TupleExperts):
    def probe_targets(self, module):
        return {"experts": module.experts}


# ------------------------------------------------------------ experts the reference cannot rebuild
class SwiGLU(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.w_gate, self.w_up = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.w_down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class BlackBox(nn.Module):
    argmin = False

    def __init__(self, d_model, hidden, n_experts, k):
        super().__init__()
        self.top_k = k
        self.router = nn.Linear(d_model, n_experts)
        self.experts = nn.ModuleList(SwiGLU(d_model, hidden) for _ in range(n_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        _, w, idx = top_k(-logits if self.argmin else logits, self.top_k)
        out = mix(flat, w, idx, self.experts, call=lambda ex, rows, we: we * ex(rows))
        return out.view(x.shape), logits.softmax(dim=-1)


class BlackBoxArgmin(BlackBox):
    argmin = True


# ------------------------------------------------------------ a layer holding a ProcessGroup
class WithGroup(nn.Module):
    """The course's ToyMoE plus the process group its expert-parallel version all-reduces over (the test starts a
    gloo group of world size 1): copy.deepcopy of it raises 'cannot pickle ProcessGroup'."""

    def __init__(self, d_model, hidden, n_experts, k):
        super().__init__()
        self.top_k = k
        self.group = dist.new_group([0])
        self.router = nn.Linear(d_model, n_experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))
                                     for _ in range(n_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs, w, idx = top_k(self.router(flat), self.top_k)
        out = mix(flat, w, idx, self.experts, call=lambda ex, rows, we: we * ex(rows))
        dist.all_reduce(out, group=self.group)  # world size 1: the identity
        return out.view(x.shape), probs


# ------------------------------------------------------------ a capacity counted over the whole batch
class BatchCapacityLayer(nn.Module):
    """Top-1 with each expert keeping its first ``capacity`` tokens of the whole batch (token order); the others
    get nothing (GShard/X-MoE-style eval capacity over the batch)."""

    def __init__(self, d, h, n_experts, capacity):
        super().__init__()
        self.capacity = capacity
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))
                                     for _ in range(n_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(dim=-1)
        w, idx = probs.max(dim=-1)  # (N,)
        seen = torch.zeros(len(self.experts), dtype=torch.long)
        keep = torch.zeros_like(w, dtype=torch.bool)
        for t, e in enumerate(idx.tolist()):
            keep[t] = bool(seen[e] < self.capacity)
            seen[e] += 1
        w = w * keep
        return mix(flat, w[:, None], idx[:, None], self.experts, call=lambda ex, rows, we: we * ex(rows)).view(x.shape)


class BatchCapacity(TupleExperts):
    capacity = 3

    def build(self, sizes, seed):
        torch.manual_seed(seed)
        return BatchCapacityLayer(sizes.d_model, sizes.d_hidden, sizes.n_experts, self.capacity)

    def semantics(self, sizes, seq):
        return MoESemantics("softmax", normalize=False, capacity=self.capacity, capacity_group="batch")

    def reference_weights(self, module):
        experts = [ref.MlpExpert(_w(e[0].weight), _w(e[2].weight), "gelu", _w(e[0].bias), _w(e[2].bias))
                   for e in module.experts]
        return ref.LayerWeights(_w(module.router.weight), experts)


class LatentFoldedExpertBug(LatentFolded):
    """A bug inside the latent experts (their output scaled by 1.5 in the layer's code), projection undeclared."""

    def build(self, sizes, seed):
        m = super().build(sizes, seed)
        for e in m.experts:
            e[2].register_forward_hook(lambda _m, _i, out: out * 1.5)
        return m


class InsideRouterRead(MoEAdapter):
    """InsideWeight through an adapter that names no expert module (probe_targets returns []): the weights are
    then read off the router through the declared semantics."""

    mixing = "weight_inside_expert"

    def build(self, sizes, seed):
        torch.manual_seed(seed)
        return InsideWeight(sizes.d_model, sizes.d_hidden, sizes.n_experts, sizes.top_k)

    def forward(self, module, x):
        return module(x)[0]

    def semantics(self, sizes, seq):
        return MoESemantics("softmax", normalize=True)

    def probe_targets(self, module):
        return []

    def router_logits(self, module, x):
        return module.router(x)

    def reference_weights(self, module):
        return ref.LayerWeights(_w(module.router.weight), [module.tfmoe_expert_ffn(i).to(torch.float64)
                                                           for i in range(len(module.experts))],
                                router_bias=_w(module.router.bias))


class SharedMiscount(SeveralShared):
    def semantics(self, sizes, seq):
        return MoESemantics("softmax", normalize=True, shared_experts=1)


class BiasedScaledFFN(ScaledFFN):
    def __init__(self, d: int, h: int):
        super().__init__(d, h)
        self.fc2 = nn.Linear(h, d)  # a last bias: down(w · h) + b is not w · (down(h) + b)


class InsideWeightBiased(InsideWeight):
    def __init__(self, d_model, hidden, n_experts, top_k_):
        super().__init__(d_model, hidden, n_experts, top_k_)
        self.experts = nn.ModuleList(BiasedScaledFFN(d_model, hidden) for _ in range(n_experts))

    def tfmoe_expert_ffn(self, i):
        e = self.experts[i]
        return ref.MlpExpert(e.fc1.weight.detach(), e.fc2.weight.detach(), "gelu", e.fc1.bias.detach(),
                             e.fc2.bias.detach())


class InsideWeightBiasedDeclared(InsideWeightBiased):
    tfmoe_mixing = "weight_inside_expert"


class InsideNoHook(InsideWeightDeclared):
    """``InsideWeightDeclared`` without ``tfmoe_expert_ffn``: its experts are black boxes whose forward takes (x, w),
    so the reference cannot call them as expert(x)."""

    tfmoe_expert_ffn = None


# ------------------------------------------------------------ a shared expert in the course interface
class CourseShared(nn.Module):
    """The course's ToyMoE plus one ungated shared expert, given through ``tfmoe_shared_experts()``."""

    shared_scale = 1.0

    def __init__(self, d_model, hidden, n_experts, k):
        super().__init__()
        self.top_k = k
        self.router = nn.Linear(d_model, n_experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))
                                     for _ in range(n_experts))
        self.shared = SwiGLU(d_model, hidden)

    def tfmoe_shared_experts(self):
        s = self.shared
        return ref.GluExpert(s.w_gate.weight.detach(), s.w_up.weight.detach(), s.w_down.weight.detach(), "silu")

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs, w, idx = top_k(self.router(flat), self.top_k)
        out = mix(flat, w, idx, self.experts, call=lambda ex, rows, we: we * ex(rows))
        return (out + self.shared_scale * self.shared(flat)).view(x.shape), probs


class CourseSharedDoubled(CourseShared):
    shared_scale = 2.0


class CourseSharedUndeclared(CourseShared):
    tfmoe_shared_experts = None
