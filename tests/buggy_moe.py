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
