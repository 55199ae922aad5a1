"""Expert-parallel overhead: the step time (forward + backward, slowest rank) of the package's ExpertParallelMoE at
W = 2 and 4 processes (torch.distributed.run, gloo, CPU) as a ratio to the same layer and the same global batch in
one process (W = 1, where the All-to-Alls are local copies), with the All-to-All's share of the forward.

The global batch is fixed (strong scaling): each of W ranks gets tokens/W. On this 2-core machine W = 4 runs two
processes per core, so its ratio includes oversubscription; on a machine with >= W free cores it would not. Prints
the median over steps of each launch; the launcher's start-up is not counted.

    PYTHONPATH=src python benchmarks/bench_ep.py [--tokens 4096] [--d-model 64] [--worlds 1,2,4]
"""

from __future__ import annotations

import argparse
import statistics

from tfmoe.experiments.route_sim.expert_parallel import launch


def step_times(world: int, args: argparse.Namespace) -> dict[str, float]:
    spec = {"d_model": args.d_model, "d_hidden": 2 * args.d_model, "n_experts": args.experts, "top_k": 2,
            "tokens": args.tokens, "seed": 0, "dtype": "fp32", "steps": args.steps, "timeout_s": 120.0,
            "layers": [{"label": "own", "impl": "own", "capacity_factor": None}]}
    ranks = [r["own"] for r in launch(spec, world)["ranks"]]
    steps = range(len(ranks[0]["steps"]))
    step = [max(r["steps"][i]["forward_ms"] + r["steps"][i]["backward_ms"] for r in ranks) for i in steps]
    fwd = [max(r["steps"][i]["forward_ms"] for r in ranks) for i in steps]
    a2a = [max(r["steps"][i]["stats"].a2a_ms for r in ranks) for i in steps]
    wire = [sum(r["steps"][i]["wire_forward"] + r["steps"][i]["wire_backward"] for r in ranks) for i in steps]
    return {"step_ms": statistics.median(step), "forward_ms": statistics.median(fwd),
            "a2a_ms": statistics.median(a2a), "wire_kb": statistics.median(wire) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worlds", default="1,2,4")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"expert parallelism, {args.tokens} tokens in all, d_model {args.d_model}, {args.experts} experts, top-2, "
          f"dropless, fp32, {args.steps} steps (median)")
    print(f"{'W':>3} {'step ms':>9} {'forward ms':>11} {'a2a ms':>8} {'a2a/fwd':>8} {'wire kB':>9} {'vs W=1':>7}")
    base = None
    for w in worlds:
        t = step_times(w, args)
        base = base or (t["step_ms"] if w == 1 else None)
        ratio = f"{t['step_ms'] / base:6.2f}x" if base else "   -"
        print(f"{w:>3} {t['step_ms']:9.2f} {t['forward_ms']:11.2f} {t['a2a_ms']:8.2f} "
              f"{t['a2a_ms'] / t['forward_ms']:8.2f} {t['wire_kb']:9.1f} {ratio:>7}")


if __name__ == "__main__":
    main()
