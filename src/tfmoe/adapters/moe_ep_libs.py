"""Shipped adapters of public expert-parallel MoE layers, in the interface ``route-sim ep_size=W`` judges (the
course's ToyMoE plus a process group): ``Class(d_model, hidden, n_experts, top_k, group=..., capacity_factor=...)``
with a replicated ``router`` (an nn.Linear, weight (E,D)), this rank's ``experts`` (E/W, blocked: rank p holds
p*E/W ..), ``forward(x_local (T,D)) -> (out_local (T,D), probs_local (T,E))``, and optionally:

  ``layout``        a :class:`~tfmoe.components.expert_parallel.CollectiveLayout`: the All-to-Alls of a forward and
                    a backward, their metadata and, for a capacity-padded layer, the rows it sends each peer whatever
                    the routing (``padded_rows_per_peer``)
  ``ep_semantics``  what the layer's routing does that the package's layer does not (``renormalize_kept``: the
                    combine weights renormalised over the assignments kept after capacity)
  ``last``          a :class:`~tfmoe.components.expert_parallel.DispatchStats` (loads, drops, times), else those
                    checks are n/a

``ep_impl=lib:fairscale``: fairscale 0.4.13's ``MOELayer`` with ``Top2Gate`` (GShard): top-2, capacity 2T/E per
expert from each rank's T tokens (1st choices in token order, then 2nd choices), the two weights renormalised over
the kept ones, All-to-Alls of capacity-padded equal splits (E/W * C rows to every peer). Its gate draws Gumbel noise
for the second choice; the adapter zeroes it (the second expert is then the second most probable), so the layer is
deterministic and the float64 reference can follow it. fairscale is not in the lock: ``scripts/test-ep-libs.sh``
builds a venv with it (pip install fairscale==0.4.13 --no-build-isolation beside torch 2.13.0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tfmoe.components.expert_parallel import CollectiveLayout
from tfmoe.errors import BadInput

FAIRSCALE_VERSION = "0.4.13"
LIBS = {"lib:fairscale": "FairscaleMoE"}


def check_lib(spec: str, tokens_per_rank: int, n_experts: int, top_k: int, capacity_factor: float | None) -> None:
    """BadInput (exit 2, before any worker starts) when a shipped adapter cannot run these settings or its library
    is missing."""
    if spec not in LIBS:
        raise BadInput(f"ep_impl={spec!r} is not a shipped adapter: use one of {', '.join(LIBS)}")
    try:
        import fairscale
        from fairscale.nn.moe import MOELayer  # noqa: F401
    except ImportError:
        raise BadInput(f"ep_impl={spec} needs fairscale {FAIRSCALE_VERSION}, not installed here: pip install "
                       f"--no-build-isolation fairscale=={FAIRSCALE_VERSION} (or run scripts/test-ep-libs.sh)") from None
    if fairscale.__version__ != FAIRSCALE_VERSION:
        raise BadInput(f"ep_impl={spec} is tested on fairscale {FAIRSCALE_VERSION}, found {fairscale.__version__}: "
                       f"pip install --no-build-isolation fairscale=={FAIRSCALE_VERSION}")
    if top_k != 2:
        raise BadInput(f"ep_impl={spec}: fairscale's Top2Gate routes to exactly 2 experts: pass top_k=2")
    if capacity_factor != 1.0:
        raise BadInput(f"ep_impl={spec}: fairscale's Top2Gate has a fixed capacity 2T/E (capacity_factor 1.0 at "
                       f"top-2): pass capacity_factor=1.0")
    if tokens_per_rank % n_experts:
        raise BadInput(f"ep_impl={spec}: fairscale's Top2Gate needs each rank's tokens ({tokens_per_rank}) to be a "
                       f"multiple of n_experts={n_experts}: pass tokens = ep_size x a multiple of {n_experts}")


@contextlib.contextmanager
def no_gumbel() -> Iterator[None]:
    """fairscale's top2gating draws its second choice with Gumbel noise: zeros while the block runs."""
    from fairscale.nn.moe import top2gate

    original = top2gate.gumbel_rsample
    top2gate.gumbel_rsample = lambda shape, device: torch.zeros(shape, device=device)
    try:
        yield
    finally:
        top2gate.gumbel_rsample = original


class FairscaleMoE(nn.Module):
    """fairscale 0.4.13's MOELayer(Top2Gate(d, E), ModuleList of this rank's E/W experts, group), experts as the
    course's (Linear, GELU, Linear)."""

    ep_semantics = {"renormalize_kept": True}

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int, group: Any = None,
                 capacity_factor: float | None = 1.0):
        super().__init__()
        from fairscale.nn.moe import MOELayer, Top2Gate

        world = dist.get_world_size(group)
        local = n_experts // world
        experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))
                                for _ in range(local))
        self.moe = MOELayer(Top2Gate(d_model, n_experts), experts, group)
        self.router = self.moe.gate.wg  # (E,D), no bias
        self.experts = self.moe.experts
        self.n_experts, self.world, self.local = n_experts, world, local
        self.layout: CollectiveLayout | None = None  # known once the batch size is (capacity 2T/E)
        self.last = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])  # (T,D)
        capacity = 2 * flat.shape[0] // self.n_experts
        self.layout = CollectiveLayout(2, 2, 0, padded_rows_per_peer=self.local * capacity)
        with no_gumbel():
            out = self.moe(flat[:, None, :])  # (T,1,D): fairscale wants (s, t, m) with s a multiple of E/W
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        return out.reshape(x.shape), probs
