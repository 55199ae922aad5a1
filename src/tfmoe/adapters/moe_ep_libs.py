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

``ep_impl=lib:deepspeed``: deepspeed 0.19.8's ``deepspeed.moe.layer.MoE`` (``TopKGate`` k=2 + ``MOELayer``, GShard
again), on gloo with ``DS_ACCELERATOR=cpu``, its expert group made by ``set_deepspeed_parallelism()``. Built with
its gate's noise off (``noisy_gate_policy=None``, ``top2_2nd_expert_sampling=False``: the second expert is then the
second most probable), ``use_rts=False`` (random token selection is top-1 only anyway) and ``min_capacity=0``:
  capacity_factor c  ``drop_tokens=True``: capacity C = ceil(float32(T/E) * float32(2c)) per expert from each rank's
                     T tokens (deepspeed computes it in float32), 1st choices in token order then 2nd choices, the
                     two weights renormalised over the kept ones; two All-to-Alls of E/W * C rows to every peer
                     (capacity-padded equal splits) in a forward, two in a backward
  capacity_factor null  ``drop_tokens=False`` (documented: "equivalent to infinite capacity"): nothing dropped,
                     every chunk padded to the largest expert load on any rank, which one extra all_reduce (MAX, an
                     int64 scalar) in each forward agrees on
deepspeed is not in the lock: ``scripts/test-ep-libs.sh`` installs it with --no-deps (plus hjson, the one import
the lock lacks) beside torch 2.13.0. Its communication backend would JIT-compile a shared-memory all-reduce op on
first use (ninja and a C++ compiler; the MoE layer never calls it): the adapter marks no compiled op compatible in
this process (``deepspeed.ops.__compatible_ops__ = {}``), so deepspeed falls back to gloo as it does off Linux.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tfmoe.components.expert_parallel import CollectiveLayout
from tfmoe.contract.errors import BadInput

FAIRSCALE_VERSION = "0.4.13"
DEEPSPEED_VERSION = "0.19.8"
LIBS = {"lib:fairscale": "FairscaleMoE", "lib:deepspeed": "DeepspeedMoE"}


def check_lib(spec: str, tokens_per_rank: int, n_experts: int, top_k: int, capacity_factor: float | None,
              dtype: str = "fp32") -> None:
    """BadInput (exit 2, before any worker starts) when a shipped adapter cannot run these settings or its library
    is missing. Both libraries' gates compute in float32 whatever the input (fairscale's softmax(dtype=float),
    deepspeed's input.float()): at dtype=fp64 fairscale raises on the mixed dtypes and deepspeed's combine weights
    carry float32 rounding, so both are refused at any dtype but fp32."""
    if spec not in LIBS:
        raise BadInput(f"ep_impl={spec!r} is not a shipped adapter: use one of {', '.join(LIBS)}")
    if dtype != "fp32":
        raise BadInput(f"ep_impl={spec}: the library's gate computes in float32 whatever the input, so dtype={dtype} "
                       f"would judge float32 routing against a {dtype} reference: pass dtype=fp32")
    if spec == "lib:deepspeed":
        check_deepspeed(top_k)
        return
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


# ------------------------------------------------------------------------------------------ deepspeed
def check_deepspeed(top_k: int) -> None:
    """BadInput unless deepspeed DEEPSPEED_VERSION imports here and top_k is 2 (the gate this adapter judges)."""
    from importlib import metadata

    try:
        version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        raise BadInput(f"ep_impl=lib:deepspeed needs deepspeed {DEEPSPEED_VERSION}, not installed here: pip install "
                       f"--no-deps deepspeed=={DEEPSPEED_VERSION} hjson (or run scripts/test-ep-libs.sh)") from None
    if version != DEEPSPEED_VERSION:
        raise BadInput(f"ep_impl=lib:deepspeed is tested on deepspeed {DEEPSPEED_VERSION}, found {version}: pip install "
                       f"--no-deps deepspeed=={DEEPSPEED_VERSION}")
    if top_k != 2:
        raise BadInput("ep_impl=lib:deepspeed: the adapter judges deepspeed's top-2 gate (top1gating and topkgating "
                       "have other capacity rules): pass top_k=2")


def deepspeed_capacity(tokens: int, n_experts: int, capacity_factor: float) -> int:
    """deepspeed 0.19.8's top-2 capacity, as its ``_capacity`` computes it: ceil of float32(T/E) * float32(2*c)
    (min_capacity 0)."""
    import numpy as np

    return math.ceil(float(np.float32(tokens / n_experts) * np.float32(capacity_factor * 2)))


def import_deepspeed() -> Any:
    """deepspeed on CPU and gloo: DS_ACCELERATOR=cpu (unless set), no compiled op (its comm backend would otherwise
    JIT-build a shared-memory all-reduce it never uses here), its comm layer on the process group already made."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    if "__compatible_ops__" not in vars(deepspeed.ops):  # before its first probe: nothing to JIT-compile
        deepspeed.ops.__compatible_ops__ = {}
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return deepspeed


def lib_version(spec: str) -> str:
    """'<library> <installed version>' of a shipped adapter (for the line a crash names)."""
    from importlib import metadata

    name = spec.removeprefix("lib:")
    try:
        return f"{name} {metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return f"{name} (not installed)"


class DeepspeedMoE(nn.Module):
    """deepspeed 0.19.8's MoE(d, expert, E, ep_size=W, k=2, ...) over all ranks (its own expert group, made by
    set_deepspeed_parallelism), experts as the course's (Linear, GELU, Linear); capacity_factor None = its dropless
    mode (module docstring)."""

    ep_semantics = {"renormalize_kept": True, "capacity_float32": True}

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int, group: Any = None,
                 capacity_factor: float | None = 1.0):
        super().__init__()
        import_deepspeed()
        from deepspeed.moe.layer import MoE

        world = dist.get_world_size(group)
        if world != dist.get_world_size():
            raise ValueError(f"deepspeed's MoE makes its expert group over all {dist.get_world_size()} ranks, "
                             f"not the {world} of the group passed")
        expert = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))
        drop = capacity_factor is not None
        factor = float(capacity_factor) if drop else 1.0
        self.moe = MoE(d_model, expert, num_experts=n_experts, ep_size=world, k=top_k, capacity_factor=factor,
                       eval_capacity_factor=factor, min_capacity=0, noisy_gate_policy=None, drop_tokens=drop,
                       use_rts=False, top2_2nd_expert_sampling=False)
        self.moe.set_deepspeed_parallelism()
        self.router = self.moe.deepspeed_moe.gate.wg  # (E,D), no bias
        self.experts = self.moe.deepspeed_moe.experts.deepspeed_experts
        self.n_experts, self.world, self.local = n_experts, world, n_experts // world
        self.capacity_factor = capacity_factor
        self.layout: CollectiveLayout | None = None if drop else CollectiveLayout(2, 2, 0, pad_to_max_load=True,
                                                                                   allreduce_calls=1)
        self.last = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])  # (T,D)
        if self.capacity_factor is not None:
            capacity = deepspeed_capacity(flat.shape[0], self.n_experts, float(self.capacity_factor))
            self.layout = CollectiveLayout(2, 2, 0, padded_rows_per_peer=self.local * capacity)
        out, _l_aux, _counts = self.moe(flat)
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        return out.reshape(x.shape), probs
