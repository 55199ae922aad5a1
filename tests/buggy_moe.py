"""Planted-bug MoE layers in the course's ToyMoE interface, for `tfmoe route-sim impl=buggy_moe:<Class>`
(tests put tests/ on sys.path). Each is the course's ToyMoE listing with one real bug; ``Correct`` is the
listing itself, unchanged."""

from __future__ import annotations

import torch
from torch import nn


class Correct(nn.Module):
    def __init__(self, d_model=128, hidden=256, n_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList([
            nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))
            for _ in range(n_experts)
        ])

    def probs(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.router(flat), dim=-1)

    def combine_weights(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, indices = probs.topk(self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), indices

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = self.probs(flat)
        weights, indices = self.combine_weights(probs)
        out = torch.zeros_like(flat)
        for expert_id, expert in enumerate(self.experts):
            token_pos, slot = self.served(indices, expert_id)
            if token_pos.numel() == 0:
                continue
            out[token_pos] += weights[token_pos, slot, None] * expert(flat[token_pos])
        return out.view(shape), probs

    def served(self, indices: torch.Tensor, expert_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token positions, top-k slots) that ``expert_id`` serves."""
        return torch.where(indices == expert_id)


class SoftmaxOverTokens(Correct):
    """Router softmax over the token axis instead of the experts: each token's routing depends on the batch."""

    def probs(self, flat):
        return torch.softmax(self.router(flat), dim=0)


class NotRenormalised(Correct):
    """Top-k weights used as raw probabilities (the course renormalises them to sum 1)."""

    def combine_weights(self, probs):
        return probs.topk(self.top_k, dim=-1)


class UnstableSoftmax(Correct):
    """Softmax written as exp(z)/sum exp(z) without subtracting the max: overflows in fp16."""

    def probs(self, flat):
        z = self.router(flat).exp()
        return z / z.sum(dim=-1, keepdim=True)


class FirstComeCapacity(Correct):
    """Each expert serves at most its first 3 assignments in token order; later tokens lose that expert:
    a token's output depends on where it sits in the batch."""

    def served(self, indices, expert_id):
        token_pos, slot = torch.where(indices == expert_id)
        return token_pos[:3], slot[:3]


class ArgminRouting(Correct):
    """Top-k of the *smallest* probabilities (topk(largest=False)): routes every token to its worst experts."""

    def combine_weights(self, probs):
        weights, indices = probs.topk(self.top_k, dim=-1, largest=False)
        return weights / weights.sum(dim=-1, keepdim=True), indices


class NoRouter(nn.Module):
    """Lacks the interface: the gate is called `gate`, not `router`, and there is no `top_k`."""

    def __init__(self, d_model, hidden, n_experts, top_k):
        super().__init__()
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(n_experts))

    def forward(self, x):
        return x, torch.softmax(self.gate(x), dim=-1)


class ReturnsTensor(Correct):
    """Lacks the interface: forward returns the output alone, not (out, probs)."""

    def forward(self, x):
        return super().forward(x)[0]


# ----------------------------------------------------------- correct, but written differently
class DenseZeroGates(Correct):
    """Correct: runs every expert on every token and weights them by a dense (N,E) gate matrix that is exactly 0
    off the top-k (the way dense/einsum MoE code is written). Same function as ``Correct``."""

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = self.probs(flat)
        weights, indices = self.combine_weights(probs)
        gates = torch.zeros_like(probs).scatter(1, indices, weights)  # (N,E), 0 off the top-k
        outs = torch.stack([expert(flat) for expert in self.experts], dim=1)  # (N,E,D)
        return (gates[..., None] * outs).sum(dim=1).view(shape), probs


class StraightThrough(Correct):
    """Correct: dispatches x * ((1 + c) - c), st-moe-pytorch's straight-through trick (the value is 1 up to
    rounding, the gradient reaches the gates): the rows an expert sees differ from x in the last bits."""

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = self.probs(flat)
        weights, indices = self.combine_weights(probs)
        out = torch.zeros_like(flat)
        for expert_id, expert in enumerate(self.experts):
            token_pos, slot = self.served(indices, expert_id)
            if token_pos.numel() == 0:
                continue
            c = weights[token_pos, slot, None]
            out[token_pos] += c * expert(flat[token_pos] * ((1 + c) - c))
        return out.view(shape), probs


class FloatRouter(Correct):
    """A float32 router beside experts in the run's dtype: ``F.linear(x.float(), router.weight)`` raises when
    the layer is cast to fp16/bf16 (weight Half, input Float). Correct in fp32/fp64."""

    def probs(self, flat):
        logits = torch.nn.functional.linear(flat.float() if flat.dtype != torch.float64 else flat,
                                            self.router.weight)
        return torch.softmax(logits, dim=-1).to(flat.dtype)


class DenseArgmin(DenseZeroGates):
    """The dense layer with a real bug: its zero gates sit on the top-k, its weights on the *smallest* scores."""

    def combine_weights(self, probs):
        weights, indices = probs.topk(self.top_k, dim=-1, largest=False)
        return weights / weights.sum(dim=-1, keepdim=True), indices


# ------------------------------------------------- a bug inside an expert's own module (issue 28)
class ScaledFFN(nn.Sequential):
    """The course's expert layout whose own forward scales its output by 1.5 (a bug in the expert's code, not in
    its weights): the reference rebuilds the FFN from the weights, so it is caught."""

    def forward(self, x):
        return 1.5 * super().forward(x)


class ExpertOutputScaled(Correct):
    """Expert 0's own module multiplies its output by 1.5; router and combine are right."""

    def __init__(self, d_model=128, hidden=256, n_experts=4, top_k=2):
        super().__init__(d_model, hidden, n_experts, top_k)
        self.experts[0] = ScaledFFN(*self.experts[0])


class OwnExpertLayout(Correct):
    """Correct, experts in a layout of their own (a gated FFN module, not the course's nn.Sequential), read
    through the documented hook ``tfmoe_expert_ffn(i)``."""

    def __init__(self, d_model=128, hidden=256, n_experts=4, top_k=2):
        super().__init__(d_model, hidden, n_experts, top_k)
        self.experts = nn.ModuleList(GatedFFN(d_model, hidden) for _ in range(n_experts))

    def tfmoe_expert_ffn(self, i):
        from tfmoe.components.moe_reference import GluExpert

        ex = self.experts[i]
        return GluExpert(ex.gate.weight.detach(), ex.up.weight.detach(), ex.down.weight.detach(), "silu")


class GatedFFN(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class OwnExpertLayoutUndeclared(OwnExpertLayout):
    """Experts in a layout the reference cannot rebuild, and no ``tfmoe_expert_ffn``: run as black boxes."""

    tfmoe_expert_ffn = None


# ------------------------------------------- experts computing in a fixed lower precision (issue 28)
class Bf16Experts(Correct):
    """A grouped-experts layer that stores a bf16 copy of its expert weights and always computes its experts in
    bf16, whatever the input dtype (the router and the combine stay in the input's dtype). Undeclared, it fails
    output_vs_reference (capabilities rule 4), the detail naming bf16 with both numbers and the declaration;
    declared (Bf16ExpertsDeclared) it is correct."""

    def expert_params(self, expert):
        return {name: p.to(torch.bfloat16) for name, p in expert.named_parameters()}

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = self.probs(flat)
        weights, indices = self.combine_weights(probs)
        out = torch.zeros_like(flat)
        for expert_id, expert in enumerate(self.experts):
            token_pos, slot = self.served(indices, expert_id)
            if token_pos.numel() == 0:
                continue
            y = torch.func.functional_call(expert, self.expert_params(expert), (flat[token_pos].to(torch.bfloat16),))
            out[token_pos] += weights[token_pos, slot, None] * y.to(flat.dtype)
        return out.view(shape), probs


class Bf16ExpertsDeclared(Bf16Experts):
    """The same layer, declaring it (tfmoe.rules.capabilities)."""

    tfmoe_expert_dtype = "bf16"


class Bf16ExpertsNoBias(Bf16Experts):
    """The bf16 layer with a wrong expert weight: its bf16 copy of each expert drops the second Linear's bias."""

    def expert_params(self, expert):
        params = super().expert_params(expert)
        params["2.bias"] = torch.zeros_like(params["2.bias"])
        return params


class Bf16ExpertsNoBiasDeclared(Bf16ExpertsNoBias):
    tfmoe_expert_dtype = "bf16"


class Bf16ExpertOutputScaled(Bf16Experts):
    """The bf16 layer with expert 0's own module scaling its output by 1.5."""

    def __init__(self, d_model=128, hidden=256, n_experts=4, top_k=2):
        super().__init__(d_model, hidden, n_experts, top_k)
        self.experts[0] = ScaledFFN(*self.experts[0])


# ----------------------------------------------------- declared and undeclared capabilities (issue 28)
class NoHalfDeclared(FloatRouter):
    """FloatRouter, declaring that it lacks fp16 and bf16: those checks are n/a, an fp16 run is refused."""

    tfmoe_lacks = ("fp16", "bf16")


class NoHalfNotImplemented(Correct):
    """Raises NotImplementedError for half-precision inputs, undeclared: finite.fp16/.bf16 are n/a."""

    def forward(self, x):
        if x.dtype in (torch.float16, torch.bfloat16):
            raise NotImplementedError(f"this layer has no {x.dtype} kernel")
        return super().forward(x)


class NoFp64NotImplemented(Correct):
    """Raises NotImplementedError for float64 inputs, undeclared: in an fp64 run every check is n/a, none fails."""

    def forward(self, x):
        if x.dtype == torch.float64:
            raise NotImplementedError("no float64 path")
        return super().forward(x)


# The planted bugs above, each with the checks it must fail under route-sim's *default* config
# (`tfmoe route-sim impl=buggy_moe:<Class>`, no other option); tests/planted_moe.py generates a test from each.
PLANTED: dict[str, frozenset[str]] = {
    "SoftmaxOverTokens": frozenset({"probs_sum_to_one", "batch_independence", "output_vs_reference"}),
    "NotRenormalised": frozenset({"routing_weights", "topk_weights_sum", "output_vs_reference"}),
    "UnstableSoftmax": frozenset({"finite.fp16"}),
    "FirstComeCapacity": frozenset({"permutation_equivariance", "output_vs_reference", "loads_sum"}),
    "ArgminRouting": frozenset({"routing_selection", "output_vs_reference"}),
    "DenseArgmin": frozenset({"routing_selection", "output_vs_reference"}),
    "ExpertOutputScaled": frozenset({"output_vs_reference"}),
    "Bf16Experts": frozenset({"output_vs_reference"}),  # undeclared lower precision: fails, cause named
    "Bf16ExpertsNoBias": frozenset({"output_vs_reference"}),
    "Bf16ExpertsNoBiasDeclared": frozenset({"output_vs_reference"}),
    "Bf16ExpertOutputScaled": frozenset({"output_vs_reference"}),
}
# correct layers (every check passes or is n/a), and layers that are bad input (exit 2)
CORRECT = ("Correct", "DenseZeroGates", "StraightThrough", "OwnExpertLayout", "Bf16ExpertsDeclared",
           "NoHalfDeclared", "NoHalfNotImplemented", "NoFp64NotImplemented")
RAISES = ("FloatRouter",)  # correct in fp32/fp64, raises in half precision (finite.* fail with the exception)
BAD_INPUT = ("NoRouter", "ReturnsTensor", "OwnExpertLayoutUndeclared")
HELPERS = ("ScaledFFN", "GatedFFN")  # building blocks, not layers
