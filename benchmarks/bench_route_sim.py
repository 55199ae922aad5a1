"""MoE layer forward, loop vs sorted dispatch, against dense floors doing the same active FLOPs.

Default (issue 4): E=64, top-2, 16k tokens, d=256, hidden 512, CPU fp32, dropless.
Active FLOPs of the layer's experts: 4 * N * k * d * h (two matmuls per routed row).
Floors:
  matmul     one GEMM (N*k, d) @ (d, 2h): the same FLOPs in a single call (the issue's floor)
  dense_ffn  one GELU FFN d -> h -> d on N*k rows: the same FLOPs and the same activation
  chunked    the dense FFN on E contiguous chunks of N*k/E rows (what the experts do, minus routing)
"layer" is the whole MoELayer forward: router + top-k + capacity + dispatch + the residual add x + mixture;
"dispatch" is the expert part alone. Prints median times and the ratios layer / floor.

    .venv/bin/python benchmarks/bench_route_sim.py [--tokens 16384 --experts 64 ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tfmoe.components import moe
from tfmoe.components.block import FeedForward


def interleaved_medians(fns: dict, device: torch.device, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median ms per candidate, timed round-robin (one call of each per round) so that every candidate
    sees the same background load on a shared machine."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--capacity-factor", type=float, default=None, help="default: dropless")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    n, e, k, d, h = args.tokens, args.experts, args.top_k, args.d, args.hidden

    torch.manual_seed(0)
    layer = moe.MoELayer(d, h, e, k, args.capacity_factor).to(device, dtype).eval()
    x = torch.randn(n, d, device=device, dtype=dtype)
    rows = torch.randn(n * k, d, device=device, dtype=dtype)
    dense = FeedForward(d, h, "gelu", bias=False).to(device, dtype)
    w_cat = torch.randn(d, 2 * h, device=device, dtype=dtype)
    chunk = (n * k) // e

    with torch.no_grad():
        routing = layer.router(x)
        keep = moe.capacity_keep(routing.topk_idx, e, moe.expert_capacity(n, k, e, args.capacity_factor))
        weight = routing.topk_weight.to(dtype)
        a = layer(x, dispatch="loop").out
        b = layer(x, dispatch="sorted").out
        agree = float((a.double() - b.double()).abs().max())
        load = moe.expert_load(routing.topk_idx, e)
        t = interleaved_medians({
            "matmul floor": lambda: rows @ w_cat,
            "dense_ffn floor": lambda: dense(rows),
            "chunked floor": lambda: [dense(rows[i * chunk:(i + 1) * chunk]) for i in range(e)],
            "router+capacity": lambda: moe.capacity_keep(layer.router(x).topk_idx, e, None),
            "loop dispatch": lambda: moe.dispatch_loop(x, routing.topk_idx, weight, keep, layer.experts),
            "sorted dispatch": lambda: moe.dispatch_sorted(x, routing.topk_idx, weight, keep, layer.experts),
            "layer (loop)": lambda: layer(x, dispatch="loop"),
            "layer (sorted)": lambda: layer(x, dispatch="sorted"),
        }, device, args.repeats)
    flops = 4 * n * k * d * h
    print(f"MoE forward: tokens={n} E={e} top-{k} d={d} hidden={h} {args.dtype} on {device} "
          f"(threads={torch.get_num_threads()}), capacity_factor={args.capacity_factor}")
    print(f"active FLOPs {flops / 1e9:.2f} G; loads min/mean/max {int(load.min())}/{n * k / e:g}/{int(load.max())}; "
          f"max |loop - sorted| = {agree:g}")
    for name, ms in t.items():
        print(f"  {name:16s} {ms:9.2f} ms  {flops / ms / 1e6:8.1f} GFLOP/s-equivalent")
    for layer_name in ("layer (sorted)", "layer (loop)", "sorted dispatch", "loop dispatch"):
        ratios = "  ".join(f"/{f.split()[0]} {t[layer_name] / t[f]:.2f}x"
                           for f in ("matmul floor", "dense_ffn floor", "chunked floor"))
        print(f"ratio {layer_name:16s} {ratios}")
    goal = t["layer (sorted)"] / t["matmul floor"]
    print(f"goal: sorted layer <= 1.3x the one-matmul floor: {goal:.2f}x -> {'met' if goal <= 1.3 else 'NOT met'}")


if __name__ == "__main__":
    main()
