"""Counterexamples to the chapter's claims (tests/test_claims.py plants each one and sees its check fail)."""

from __future__ import annotations

import torch
import torch.nn as nn
from buggy_attention import PlainMHA

from tfmoe.components.block import FeedForward
from tfmoe.components.moe import MoELayer, MoEOutput


class UniformAttention(PlainMHA):
    """Every visible key gets the same weight, whatever q·k says: attention that does not select by content."""

    def normalize(self, scores: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
        w = vis.to(scores.dtype).expand_as(scores)
        return w / w.sum(dim=-1, keepdim=True).clamp_min(1)


class SelfOnlyAttention(nn.Module):
    """Each token attends only to itself (weights = identity): a per-token map that never communicates."""

    def __init__(self, d_model: int):
        super().__init__()
        self.v = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        T = x.shape[1]
        return self.v(x), torch.eye(T).expand(x.shape[0], 1, T, T)


class DenseMoE(MoELayer):
    """Runs every expert on every token and zeroes the unchosen ones: the output of a top-k MoE, the cost of all E."""

    def forward(self, x: torch.Tensor, generator=None, dispatch=None) -> MoEOutput:
        routing = self.router(x, generator)
        gate = torch.zeros(x.shape[0], self.n_experts, dtype=x.dtype).scatter(
            1, routing.topk_idx, routing.topk_weight.to(x.dtype))  # (N,E)
        outs = torch.stack([e(x) for e in self.experts], dim=1)  # (N,E,D): every expert on every token
        mixture = (gate.unsqueeze(-1) * outs).sum(dim=1)
        keep = torch.ones_like(routing.topk_idx, dtype=torch.bool)
        return MoEOutput(x + mixture, mixture, routing, keep, torch.full((self.n_experts,), x.shape[0]), None)


class AlwaysOnExpert(MoELayer):
    """Runs each token's top-k experts plus one always-on (shared) expert: its FLOPs stay flat as E doubles,
    yet every token runs k + 1 experts."""

    def __init__(self, d_model: int, d_hidden: int, n_experts: int, top_k: int, **kwargs):
        super().__init__(d_model, d_hidden, n_experts, top_k, **kwargs)
        self.shared = FeedForward(d_model, d_hidden, "gelu", bias=False)

    def forward(self, x: torch.Tensor, generator=None, dispatch=None) -> MoEOutput:
        routed = super().forward(x, generator, dispatch)
        mixture = routed.mixture + self.shared(x)
        return MoEOutput(x + mixture if self.residual else mixture, mixture, routed.routing, routed.keep,
                         routed.processed, routed.capacity)


__all__ = ["UniformAttention", "SelfOnlyAttention", "DenseMoE", "AlwaysOnExpert", "FeedForward"]
