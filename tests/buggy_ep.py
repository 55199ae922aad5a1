"""Planted expert-parallel bugs, each a subclass of the package's ExpertParallelMoE that replaces one part of it
(tests/test_route_ep.py runs them as ``ep_impl=buggy_ep:<Name>`` under route-sim's defaults, ep_size=2), and the
faults: a rank that dies mid-step, a rank that never returns."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from tfmoe.components.expert_parallel import ExpertParallelMoE
from tfmoe.components.moe import capacity_keep, expert_capacity


class RoundRobin(ExpertParallelMoE):
    """Tokens sent as if experts were placed round-robin (e % W) while each rank holds a block."""

    def owner(self, expert: torch.Tensor) -> torch.Tensor:
        return expert % self.world

    def local_index(self, expert: torch.Tensor) -> torch.Tensor:
        return expert // self.world


class EqualSplits(ExpertParallelMoE):
    """Every peer's chunk padded to the largest a rank can send (T*k rows) instead of the exchanged split sizes;
    the padding is dropped on arrival, so the outputs stay right."""

    def exchange(self, rows: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        pad = self._tokens * self.top_k
        chunks = torch.split(rows, send)
        padded = torch.cat([torch.cat([c, c.new_zeros(pad - c.shape[0], c.shape[1])]) for c in chunks])
        got = super().exchange(padded, [pad] * self.world, [pad] * self.world)  # (W*pad, D)
        return torch.cat([got[p * pad:p * pad + recv[p]] for p in range(self.world)])

    def forward(self, x: torch.Tensor):
        self._tokens = x.reshape(-1, x.shape[-1]).shape[0]
        return super().forward(x)


class NoWeights(ExpertParallelMoE):
    """Combine without the routing weights: out[token] += row."""

    def combine(self, flat, token, weight, back):
        return torch.zeros_like(flat).index_add(0, token, back)


class NoAutograd(ExpertParallelMoE):
    """The All-to-All without autograd: the rows cross as plain data, so no gradient crosses ranks."""

    def exchange(self, rows: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        out = rows.new_empty(sum(recv), rows.shape[1])
        dist.all_to_all_single(out, rows.detach().contiguous(), recv, send, group=self.group)
        return out


class GlobalCapacity(ExpertParallelMoE):
    """Capacity applied over all ranks' tokens (W*T, gathered) where the layer documents it per rank."""

    def keep_mask(self, topk_idx: torch.Tensor):
        gathered = [torch.empty_like(topk_idx) for _ in range(self.world)]
        dist.all_gather(gathered, topk_idx, group=self.group)
        everyone = torch.cat(gathered)  # (W*T,k), rank order
        cap = expert_capacity(everyone.shape[0], self.top_k, self.n_experts, self.capacity_factor)
        t = topk_idx.shape[0]
        return capacity_keep(everyone, self.n_experts, cap)[self.rank * t:(self.rank + 1) * t], cap


class UntimedStall(ExpertParallelMoE):
    """Rank 0 stalls 0.3 s in every forward outside the layer's compute and All-to-All timers (an unmeasured
    host sync, say): the step time is no longer explained by them."""

    def forward(self, x: torch.Tensor):
        if self.rank == 0:
            time.sleep(0.3)
        return super().forward(x)


class NoisyOwnRng(ExpertParallelMoE):
    """Noisy top-k with each rank drawing its noise from its own RNG (torch's global generator, seeded alike on every
    rank) instead of the noise of its tokens' global indices: rank 1's tokens get the noise rank 0's got, so the
    routing is no longer the one the single-process reference draws."""

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None = None):
        if noise is not None:
            noise = torch.randn(noise.shape, dtype=noise.dtype)
        return super().forward(x, noise=noise)


class DiesOnRank1(ExpertParallelMoE):
    """Rank 1 is SIGKILLed in its third forward (step 1, after the warm-up and step 0), before the dispatch."""

    calls = 0

    def forward(self, x: torch.Tensor):
        DiesOnRank1.calls += 1
        if self.rank == 1 and DiesOnRank1.calls == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


class Sleeps(ExpertParallelMoE):
    """Rank 1 sleeps for an hour in its first forward (the SIGTERM and collective-timeout faults)."""

    def forward(self, x: torch.Tensor):
        if self.rank == 1:
            time.sleep(3600)
        return super().forward(x)


class RaisesInForward(ExpertParallelMoE):
    """A user's layer whose forward raises on every rank: its checks fail, the exception leading the detail."""

    def forward(self, x: torch.Tensor):
        raise RuntimeError("planted: my dispatcher is not written yet")


class EveryExpert(ExpertParallelMoE):
    """Dense dispatch: every token is sent to every expert (the unchosen with weight 0), so the outputs stay right
    but each token costs E expert rows and E*(W-1)/W rows on the wire: the counterexample to the claim that expert
    compute per token stays flat while the All-to-All bytes per token follow k*(W-1)/W."""

    def choose(self, probs: torch.Tensor):
        weights, topk_idx = super().choose(probs)
        rest = torch.argsort(probs, dim=-1, descending=True, stable=True)[:, self.top_k:]  # (T,E-k)
        return torch.cat([weights, torch.zeros_like(rest, dtype=weights.dtype)], 1), torch.cat([topk_idx, rest], 1)


def _fairscale_gumbel():
    from tfmoe.adapters.moe_ep_libs import FairscaleMoE

    class FairscaleGumbel(FairscaleMoE):
        """fairscale's layer with its gate's Gumbel noise left on: the second expert is drawn, not the second
        most probable, so the layer no longer computes what its documented top-2 semantics say."""

        def forward(self, x: torch.Tensor):
            flat = x.reshape(-1, x.shape[-1])
            from tfmoe.components.expert_parallel import CollectiveLayout

            self.layout = CollectiveLayout(2, 2, 0, padded_rows_per_peer=self.local * (2 * flat.shape[0] //
                                                                                       self.n_experts))
            out = self.moe(flat[:, None, :])
            return out.reshape(x.shape), torch.softmax(self.router(flat).float(), dim=-1)

    return FairscaleGumbel


def _deepspeed_sampling():
    from tfmoe.adapters.moe_ep_libs import DeepspeedMoE

    class DeepspeedSampling(DeepspeedMoE):
        """deepspeed's layer with its gate's second-expert sampling left on (``top2_2nd_expert_sampling``, its
        default: Gumbel noise added to the logits before the second argmax): the second expert is drawn, not the
        second most probable."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.moe.deepspeed_moe.gate.top2_2nd_expert_sampling = True

    return DeepspeedSampling


def __getattr__(name: str):  # the library bugs only where their library imports
    if name == "FairscaleGumbel":
        return _fairscale_gumbel()
    if name == "DeepspeedSampling":
        return _deepspeed_sampling()
    raise AttributeError(name)


class OddExperts(ExpertParallelMoE):
    """Experts that are not the course's Sequential(Linear, GELU, Linear) (a bare Linear): outside the interface,
    every check fails naming the layout."""

    def __init__(self, d_model, hidden, n_experts, top_k, group=None, capacity_factor=None):
        super().__init__(d_model, hidden, n_experts, top_k, group=group, capacity_factor=capacity_factor)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(d_model, d_model) for _ in range(self.local_experts))
