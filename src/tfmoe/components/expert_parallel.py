"""Expert parallelism in plain PyTorch on torch.distributed: the course's ToyMoE split over a process group.

W ranks, E experts, L = E/W experts per rank, placed in blocks: rank p holds experts p*L .. p*L+L-1 (its
``experts[j]`` is global expert p*L + j). The router is replicated; each rank routes its own tokens.

One forward on each rank (T local tokens, D wide, top-k):
  probs   = softmax(x W_r^T)                      (T,E)
          noisy top-k (``noisy=True``, Shazeer et al. 2017): softmax(x W_r^T + eps * softplus(x W_noise^T)), eps
          the (T,E) standard-normal noise the caller passes (``forward(x, noise=eps)``): the noise is an input,
          drawn by the caller as a function of the seed, the step and each token's global index (ep_worker's
          ``routing_noise``), so a token's noise is the same whichever rank holds it, and a single-process
          reference reproduces it exactly; no rank's RNG state enters
  top-k   = the k largest probs, weights renormalised to sum 1 (as the course's ToyMoE)
  capacity, per rank: C = ceil(T*k/E * capacity_factor) assignments per expert *from this rank's tokens*;
          1st choices in token order, then 2nd choices, ... (tfmoe.components.moe.capacity_keep); an
          assignment past C is dropped (contributes 0); capacity_factor None = dropless
  dispatch: the kept assignments, sorted by (owner rank, local expert), one row of x each (no de-duplication
          of a token sent twice to one rank); 1. an All-to-All of the (W*L,) row counts, 2. an All-to-All of
          the rows with those uneven splits, autograd-capable, 3. each local expert on its rows, 4. the
          All-to-All back (the reverse splits), 5. out[token] += weight * row
So a forward is three All-to-Alls (counts, rows, rows back) and a backward two (the rows' gradients):
:data:`A2A_LAYOUT`, which the expert-parallel battery uses to count the bytes a correct layer must send.

:class:`ExpertParallelMoE` keeps the last forward's bookkeeping in ``last`` (:class:`DispatchStats`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import _functional_collectives as fc

from tfmoe.components.moe import capacity_keep, expert_capacity


@dataclass(frozen=True)
class CollectiveLayout:
    """How many All-to-Alls a forward and a backward run, and the metadata bytes each rank sends each peer in a
    forward (beyond the token rows): what a correct layer's wire traffic is, given its routing decisions."""

    forward_calls: int
    backward_calls: int
    metadata_bytes_per_peer: int  # forward only
    padded_rows_per_peer: int | None = None  # a capacity-padded layer: rows to every peer in each call, whatever
    # the routing (None: the rows the routing sends)
    pad_to_max_load: bool = False  # a dropless padded layer (deepspeed's drop_tokens=False): every chunk padded to
    # the largest expert load on any rank, L * max load rows to every peer in each call
    allreduce_calls: int = 0  # scalar all_reduces a forward runs beside its All-to-Alls (that max load's)


@dataclass
class DispatchStats:
    """One forward on one rank (W ranks, L local experts, E experts, T tokens, k)."""

    topk_idx: torch.Tensor  # (T,k) chosen experts, best first
    keep: torch.Tensor  # (T,k) bool, within this rank's capacity
    capacity: int | None
    send_rows: list[int]  # (W,) rows sent to each peer (the own rank's included)
    recv_rows: list[int]  # (W,) rows received from each peer
    received_load: torch.Tensor  # (L,) rows each local expert computed
    compute_ms: float  # routing, capacity, permutation, experts, combine
    a2a_ms: float  # the three All-to-Alls, waits included


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
               ) -> torch.Tensor:
    """x (sum(in_splits), D) -> (sum(out_splits), D); autograd-capable (the backward runs the reverse
    All-to-All)."""
    y = fc.all_to_all_single_autograd(x, out_splits, in_splits, group or dist.group.WORLD)
    return fc.wait_tensor(y)


class ExpertParallelMoE(nn.Module):
    """The course's ToyMoE interface plus a process group: ``Class(d_model, hidden, n_experts, top_k, group=...)``
    holding a replicated ``router`` and its rank's ``experts`` (E/W of them, blocked placement);
    ``forward(x_local) -> (out_local, probs_local)``. Capacity per rank (module docstring). ``noisy``: a replicated
    ``noise_gate`` (zero-initialised, as the single-process router's: noise std softplus(0) = 0.69) scales the noise
    passed as ``forward(x_local, noise=eps_local)``."""

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int,
                 group: dist.ProcessGroup | None = None, capacity_factor: float | None = None, noisy: bool = False):
        super().__init__()
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if n_experts % self.world:
            raise ValueError(f"n_experts={n_experts} is not divisible by the group's {self.world} ranks")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.local_experts = n_experts // self.world  # L
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))
            for _ in range(self.local_experts))
        self.noise_gate = nn.Linear(d_model, n_experts, bias=False) if noisy else None  # noisy top-k
        if self.noise_gate is not None:
            nn.init.zeros_(self.noise_gate.weight)
        self.register_buffer("selection_bias", torch.zeros(n_experts))  # aux-loss-free balancing: selection only
        self.layout = CollectiveLayout(3, 2, self.local_experts * 8)
        self.last: DispatchStats | None = None

    # ---- the parts a planted bug replaces (tests/buggy_ep.py)
    def choose(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """probs (T,E) -> (weights (T,k) renormalised to sum 1, experts (T,k) best first), as ToyMoE; experts are
        chosen on probs + ``selection_bias`` (zeros unless aux-loss-free balancing moves it), weighted by probs."""
        _, topk_idx = (probs.detach() + self.selection_bias).topk(self.top_k, dim=-1)
        weights = probs.gather(-1, topk_idx)
        return weights / weights.sum(dim=-1, keepdim=True), topk_idx

    def owner(self, expert: torch.Tensor) -> torch.Tensor:
        """(S,) global expert ids -> (S,) the rank holding each (blocked placement)."""
        return expert // self.local_experts

    def local_index(self, expert: torch.Tensor) -> torch.Tensor:
        return expert % self.local_experts

    def keep_mask(self, topk_idx: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """(T,k) -> ((T,k) bool kept, capacity): capacity per rank, from this rank's T tokens."""
        capacity = expert_capacity(topk_idx.shape[0], self.top_k, self.n_experts, self.capacity_factor)
        return capacity_keep(topk_idx, self.n_experts, capacity), capacity

    def exchange(self, rows: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        return all_to_all(rows, recv, send, self.group)

    def combine(self, flat: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, back: torch.Tensor
                ) -> torch.Tensor:
        """out[token] += weight * row: flat (T,D), token (S,), weight (S,), back (S,D) -> (T,D)."""
        return torch.zeros_like(flat).index_add(0, token, weight[:, None].to(back.dtype) * back)

    def logits(self, flat: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """flat (T,D), noise (T,E) standard normal or None -> router logits (T,E), noise * softplus(x W_noise^T)
        added when given (noisy top-k)."""
        logits = self.router(flat)
        if noise is None:
            return logits
        if self.noise_gate is None:
            raise ValueError("noise passed to a layer built without noisy=True")
        return logits + noise.reshape(logits.shape).to(logits.dtype) * F.softplus(self.noise_gate(flat))

    # ---- forward
    def forward(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        W, L = self.world, self.local_experts
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T,D)
        t0 = time.perf_counter()
        probs = torch.softmax(self.logits(flat, noise), dim=-1)  # (T,E)
        weights, topk_idx = self.choose(probs)  # (T,k)
        k = topk_idx.shape[1]
        keep, capacity = self.keep_mask(topk_idx)  # (T,k)
        kept = keep.reshape(-1).nonzero().squeeze(1)  # (S,) kept assignment ids
        expert = topk_idx.reshape(-1)[kept]  # (S,)
        slot = self.owner(expert) * L + self.local_index(expert)  # (S,) in 0 .. W*L-1
        order = torch.argsort(slot, stable=True)
        kept, slot = kept[order], slot[order]
        token = kept // k  # (S,)
        weight = weights.reshape(-1)[kept]  # (S,)
        counts = torch.bincount(slot, minlength=W * L)  # (W*L,) rows for each (rank, local expert)
        compute = time.perf_counter() - t0

        t0 = time.perf_counter()
        recv_counts = torch.empty_like(counts)  # (W*L,): [src, local expert]
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send = counts.view(W, L).sum(1).tolist()
        recv = recv_counts.view(W, L).sum(1).tolist()
        received = self.exchange(flat[token], recv, send)  # (R,D), ordered by source rank, then local expert
        a2a = time.perf_counter() - t0

        t0 = time.perf_counter()
        local = torch.arange(L).repeat(W).repeat_interleave(recv_counts)  # (R,) local expert of each row
        by_expert = torch.argsort(local, stable=True)
        load = recv_counts.view(W, L).sum(0)  # (L,)
        chunks = torch.split(received[by_expert], load.tolist())
        y = torch.cat([self.experts[j](c) for j, c in enumerate(chunks)])[torch.argsort(by_expert)]  # (R,D)
        compute += time.perf_counter() - t0

        t0 = time.perf_counter()
        back = self.exchange(y, send, recv)  # (S,D), in this rank's send order
        a2a += time.perf_counter() - t0

        t0 = time.perf_counter()
        out = self.combine(flat, token, weight, back)
        compute += time.perf_counter() - t0
        self.last = DispatchStats(topk_idx.detach(), keep, capacity, send, recv, load, compute * 1e3, a2a * 1e3)
        return out.view(shape), probs.view(*shape[:-1], self.n_experts)


__all__ = ["ExpertParallelMoE", "DispatchStats", "CollectiveLayout", "all_to_all"]
