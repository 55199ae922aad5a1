"""One rank of ``tfmoe route-sim ep_size=W``: run under torch's own launcher (``python -m torch.distributed.run
-m tfmoe.experiments.route_sim.ep_worker``), never imported by the recipe.

Every rank builds the layer(s) named in the spec (``TFMOE_EP_SPEC``, JSON), redraws every weight from the seed by
its *global* identity (the router by the seed, global expert e by (seed, e)), so W = 1, 2, 4 hold the same
weights; then, per step, its shard of the batch runs forward and backward while this rank measures:
  the wall time of the forward and of the backward (after a barrier), and
  the bytes this process wrote (``wchar`` of /proc/self/io: gloo's TCP writes) during each, apart from the
  dispatcher's own split sizes,
and keeps what the layer reports (``layer.last``: routing, capacity, rows per peer, expert load, its own compute
and All-to-All times). Rank 0 gathers every rank's records (a gloo ``gather_object``) and prints them on stdout as
one line ``TFMOE-EP-RESULT <base64 torch.save>``; the recipe's side (``route_sim/expert_parallel.py``) judges them.
Every collective has the spec's timeout: a dead peer ends this rank with an error, never a hang.
"""

from __future__ import annotations

if __name__ == "__main__":  # a worker: tied to tfmoe's lifetime before anything else (tfmoe.contract.lifetime)
    from tfmoe.contract import lifetime as _lifetime

    _lifetime.die_with_parent()
    _lifetime.watch_owner()

import base64
import copy
import datetime
import io
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

RESULT_MARK = "TFMOE-EP-RESULT "
SPEC_ENV = "TFMOE_EP_SPEC"
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def written_bytes() -> int | None:
    """Bytes this process has passed to write() so far (Linux /proc/self/io ``wchar``); None elsewhere."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def batch(seed: int, step: int, tokens: int, d_model: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch x (N,D) and the backward's cotangent g (N,D), the same on every rank and for every W
    (each rank takes its shard)."""
    gen = torch.Generator().manual_seed(seed * 7919 + 104729 * (step + 1))
    x = torch.randn(tokens, d_model, generator=gen, dtype=torch.float64)
    g = torch.randn(tokens, d_model, generator=gen, dtype=torch.float64)
    return x.to(dtype), g.to(dtype)


def routing_noise(seed: int, step: int, tokens: int, n_experts: int) -> torch.Tensor:
    """Noisy top-k's standard-normal noise (N,E) float64 for the step's whole batch: a function of the seed, the step
    and each token's global index only (every rank draws the same block and takes its own rows), so a token gets the
    same noise whatever W and whichever rank holds it, and the single-process reference draws it identically."""
    gen = torch.Generator().manual_seed(seed * 6421 + 15485863 * (step + 1) + 3)
    return torch.randn(tokens, n_experts, generator=gen, dtype=torch.float64)


NOISE_GATE_SEED = 999_983  # the noise gate's weights: redrawn from seed * 1000003 - this (never an expert's seed)


def redraw(module: torch.nn.Module, seed: int) -> None:
    """Every parameter uniform in +-1/sqrt(last dim), from its own generator (``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            bound = p.shape[-1] ** -0.5
            p.copy_((torch.rand(p.shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound)


def load_class(spec: str) -> Any:
    if spec == "own":
        from tfmoe.components.expert_parallel import ExpertParallelMoE

        return ExpertParallelMoE
    if spec.startswith("lib:"):
        from tfmoe.adapters import moe_ep_libs

        return getattr(moe_ep_libs, moe_ep_libs.LIBS[spec])
    from tfmoe.rules.user_code import load_object

    return load_object(spec, "ep_impl")


def header_bytes(world: int) -> float | None:
    """Bytes one All-to-All writes per peer message beyond its payload, measured with an empty exchange."""
    empty = torch.zeros(0, 1)
    before = written_bytes()
    dist.all_to_all_single(torch.zeros(0, 1), empty, [0] * world, [0] * world)
    after = written_bytes()
    if before is None or after is None or world == 1:
        return None
    return (after - before) / (world - 1)


def allreduce_bytes(world: int) -> float | None:
    """Bytes one all_reduce of an int64 scalar writes (MAX; the extra collective of a layer that pads to the largest
    load), measured."""
    before = written_bytes()
    dist.all_reduce(torch.zeros((), dtype=torch.int64), op=dist.ReduceOp.MAX)
    after = written_bytes()
    if before is None or after is None or world == 1:
        return None
    return float(after - before)


def run_layer(impl: str, capacity_factor: float | None, spec: dict[str, Any], rank: int, world: int,
              noisy: bool = False) -> dict[str, Any]:
    """One layer's steps on this rank. ``noisy``: built with ``noisy=True``, its ``noise_gate`` redrawn from the seed
    (not left at zero, so the noise's scale depends on the token), each forward passed ``noise=`` this rank's rows of
    :func:`routing_noise`."""
    dtype = DTYPES[spec["dtype"]]
    d, e, k, seed, n = spec["d_model"], spec["n_experts"], spec["top_k"], spec["seed"], spec["tokens"]
    local = e // world
    torch.manual_seed(seed)
    extra = {"noisy": True} if noisy else {}
    layer = load_class(impl)(d, spec["d_hidden"], e, k, group=dist.group.WORLD,
                             capacity_factor=capacity_factor, **extra)
    redraw(layer.router, seed * 1000003)
    if noisy:
        redraw(layer.noise_gate, seed * 1000003 - NOISE_GATE_SEED)
    for j, expert in enumerate(layer.experts):
        redraw(expert, seed * 1000003 + 1 + rank * local + j)
    layer.to(dtype)
    shard = slice(rank * n // world, (rank + 1) * n // world)
    steps: list[dict[str, Any]] = []
    grads: dict[str, Any] = {}
    for step in range(-1, spec["steps"]):  # step -1 warms up (one-time warnings would count as written bytes)
        x_all, g_all = batch(seed, max(step, 0), n, d, dtype)
        x = x_all[shard].clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        dist.barrier()
        w0, t0 = written_bytes(), time.perf_counter()
        if noisy:
            out, _probs = layer(x, noise=routing_noise(seed, max(step, 0), n, e)[shard].to(dtype))
        else:
            out, _probs = layer(x)
        w1, t1 = written_bytes(), time.perf_counter()
        (out * g_all[shard]).sum().backward()
        w2, t2 = written_bytes(), time.perf_counter()
        if step < 0:
            continue
        stats = getattr(layer, "last", None)
        row: dict[str, Any] = {
            "step": step, "forward_ms": (t1 - t0) * 1e3, "backward_ms": (t2 - t1) * 1e3,
            "wire_forward": None if w0 is None else w1 - w0, "wire_backward": None if w1 is None else w2 - w1,
            "x": x.detach(), "stats": None if stats is None else copy.copy(stats),
        }
        if step == 0:
            row["out"] = out.detach()
            grads = {"x": None if x.grad is None else x.grad.detach(),
                     "router": {name: (None if p.grad is None else p.grad.detach())
                                for name, p in layer.router.named_parameters()},
                     "noise_gate": None if not noisy else {name: (None if p.grad is None else p.grad.detach())
                                                           for name, p in layer.noise_gate.named_parameters()},
                     "experts": {rank * local + j: {name: (None if p.grad is None else p.grad.detach())
                                                    for name, p in ex.named_parameters()}
                                 for j, ex in enumerate(layer.experts)}}
        steps.append(row)
    layout = getattr(layer, "layout", None)
    return {
        "rank": rank, "steps": steps, "grads": grads, "header_bytes": header_bytes(world),
        "allreduce_bytes": allreduce_bytes(world) if getattr(layout, "allreduce_calls", 0) else None,
        "layout": None if layout is None else (layout.forward_calls, layout.backward_calls,
                                               layout.metadata_bytes_per_peer, layout.padded_rows_per_peer,
                                               getattr(layout, "pad_to_max_load", False),
                                               getattr(layout, "allreduce_calls", 0)),
        "semantics": dict(getattr(layer, "ep_semantics", {})),
        "router": layer.router.state_dict(),
        "noise_gate": layer.noise_gate.state_dict() if noisy else None, "router_template": copy.deepcopy(layer.router),
        "experts": {rank * local + j: ex.state_dict() for j, ex in enumerate(layer.experts)},
        "expert_template": copy.deepcopy(layer.experts[0]) if len(layer.experts) else None,
        "class": f"{type(layer).__module__}.{type(layer).__qualname__}",
    }


TRAINED_STRATEGIES = ("none", "aux_loss", "z_loss", "noisy_topk", "aux_free")


def train(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """The training simulation under expert parallelism (the package's layer, fp32): route_sim.training's
    ClusterTask, the router skewed so experts 0..k-1 win every token, Adam on MSE(x + out, y) over this rank's
    shard of each batch (loss / W, so the expert gradients the All-to-All brings back are the global batch's);
    the replicated router's gradient summed over ranks (all_reduce), the balancing loss computed on the rank's
    tokens, the aux-free bias moved by the global load (all_reduce); noisy top-k's noise gate (zero init, as the
    single-process router's) replicated like the router, its noise this rank's rows of :func:`routing_noise`
    (seed + 2, the step). Per step and rank: the loads routed (global),
    the rows this rank's experts computed, dropped assignments, task loss."""
    import torch.nn.functional as F

    from tfmoe.components import moe
    from tfmoe.components.expert_parallel import ExpertParallelMoE
    from tfmoe.experiments.route_sim.training import ClusterTask

    t = spec["train"]
    d, e, k, seed, n = spec["d_model"], spec["n_experts"], spec["top_k"], spec["seed"], t["tokens"]
    local, shard = e // world, slice(rank * n // world, (rank + 1) * n // world)
    task = ClusterTask.make(d, t["clusters"], seed + 3)
    out: dict[str, Any] = {}
    for strategy in t["strategies"]:
        torch.manual_seed(seed + 4)
        noisy = strategy == "noisy_topk"
        layer = ExpertParallelMoE(d, spec["d_hidden"], e, k, group=dist.group.WORLD,
                                  capacity_factor=t["capacity_factor"], noisy=noisy)
        redraw(layer.router, seed * 1000003)
        for j, expert in enumerate(layer.experts):
            redraw(expert, seed * 1000003 + 1 + rank * local + j)
        with torch.no_grad():
            layer.router.weight[:k] += t["init_skew"] * task.offset / task.offset.norm() ** 2
        opt = torch.optim.Adam(layer.parameters(), lr=t["lr"])
        gen = torch.Generator().manual_seed(seed + 1)  # the same batches on every rank, every strategy
        rows: dict[str, list] = {"load": [], "rank_rows": [], "dropped": [], "task_loss": [], "balance_loss": []}
        for step in range(t["steps"]):
            xb, yb = task.sample(n, gen)
            x, y = xb[shard], yb[shard]
            noise = routing_noise(seed + 2, step, n, e)[shard].float() if noisy else None
            mixture, probs = layer(x, noise=noise)
            task_loss = F.mse_loss(x + mixture, y)
            st = layer.last
            balance = moe.switch_aux_loss(probs, st.topk_idx, t["aux_loss_coef"])
            applied = {"aux_loss": balance,
                       "z_loss": moe.router_z_loss(layer.router(x), t["z_loss_coef"])}.get(strategy, 0.0)
            opt.zero_grad(set_to_none=True)
            ((task_loss + applied) / world).backward()
            dist.all_reduce(layer.router.weight.grad)  # the replicated router: data parallel
            if noisy:
                dist.all_reduce(layer.noise_gate.weight.grad)
            opt.step()
            load = torch.bincount(st.topk_idx.reshape(-1), minlength=e)  # (E,) this rank's tokens, routed
            dist.all_reduce(load)
            if strategy == "aux_free":
                moe.update_selection_bias(layer.selection_bias, load, t["bias_update_rate"])
            rows["load"].append(load.clone())
            rows["rank_rows"].append(int(st.received_load.sum()))
            rows["dropped"].append(int((~st.keep).sum()))
            rows["task_loss"].append(float(task_loss))
            rows["balance_loss"].append(float(balance))
        rows["router"] = layer.router.weight.detach().clone()  # (E,D), with the noise gate's below it: (2E,D)
        if noisy:
            rows["router"] = torch.cat([rows["router"], layer.noise_gate.weight.detach()])
        out[strategy] = rows
    return out


def run_rank(spec: dict[str, Any], rank: int, world: int) -> list[Any] | None:
    """This rank's part of the run, in an initialised process group: the spec's layers, the training simulation,
    then every rank's records gathered on rank 0 (returned there; None elsewhere)."""
    results: dict[str, Any] = {}
    for layer in spec["layers"]:  # {"label", "impl", "capacity_factor", "noisy"?}
        try:
            results[layer["label"]] = run_layer(layer["impl"], layer["capacity_factor"], spec, rank, world,
                                                bool(layer.get("noisy", False)))
        except Exception as exc:  # the user's layer raised: that layer's checks fail, naming it (tfmoe's: crash)
            if layer["impl"] == "own":
                raise
            if layer["impl"].startswith("lib:"):  # a shipped adapter's: a crash, naming library and version
                from tfmoe.adapters.moe_ep_libs import lib_version

                raise RuntimeError(f"shipped adapter {layer['impl']} ({lib_version(layer['impl'])}) raised "
                                   f"{type(exc).__name__}: {exc}") from exc
            results[layer["label"]] = {"rank": rank, "raised": f"{type(exc).__name__}: {exc}"}
    if spec.get("train"):
        results["__train__"] = train(spec, rank, world)
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(results, gathered if rank == 0 else None, dst=0)
    return gathered if rank == 0 else None


def emit(world: int, gathered: list[Any]) -> None:
    """Rank 0: the gathered records on stdout, one line ``TFMOE-EP-RESULT <base64 torch.save>``."""
    buf = io.BytesIO()
    torch.save({"world": world, "ranks": gathered}, buf)
    sys.stdout.write(RESULT_MARK + base64.b64encode(buf.getvalue()).decode() + "\n")
    sys.stdout.flush()


def main() -> int:
    spec = json.loads(os.environ[SPEC_ENV])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = run_rank(spec, rank, world)
    if gathered is not None:
        emit(world, gathered)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
