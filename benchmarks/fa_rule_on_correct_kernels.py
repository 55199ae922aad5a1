"""FlashAttention's test rule applied to correct kernels: on which cases of the sensitivity matrix is it a valid bar?

bench_kernel_sensitivity.py measures tfmoe's sensitivity beside FlashAttention's rule (err <= 2·err(plain) +
2·max|(r + 0.3 - 0.3) - r|, written independently there). A rule is only a fair bar where it fails no correct
kernel. This script applies that same rule (imported from the benchmark, unchanged) to three correct kernels on
the benchmark's own matrix, seeds 0..S-1, and prints every (kernel, dtype, seed, tensor, case) it fails:

- ``sdpa``: torch's scaled_dot_product_attention (CPU: its flash kernel, fast exp, P recomputed from the
  logsumexp in the backward);
- ``plain_index``: the textbook computation in the run dtype, GQA by indexing ``k[:, heads]`` (autograd's index
  backward sums the group's per-head dk, dv one head after another, each rounded to the dtype);
- ``plain_grouped``: the textbook computation in the run dtype, GQA by grouping query heads under their kv head
  (one matmul per kv head, the group summed inside it).

    nice -n 10 .venv/bin/python benchmarks/fa_rule_on_correct_kernels.py --dtypes fp32 --seeds 12
    nice -n 10 .venv/bin/python benchmarks/fa_rule_on_correct_kernels.py --dtypes bf16 fp16 --seeds 3

Prints one line per false alarm, then per (dtype, kernel, tensor) how many of the matrix's cases it failed at some
seed. Exits 0 (a measurement, not a gate). Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernel_sensitivity as bench  # noqa: E402  (the rule and the matrix, exactly as benchmarked)

from tfmoe.api.testing import compose  # noqa: E402
from tfmoe.contract.registry import EXPERIMENTS  # noqa: E402
from tfmoe.experiments.attn_check.kernel_cases import make_inputs  # noqa: E402


def _masked_softmax(s: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    if visible is None:
        return torch.softmax(s, dim=-1)
    vis = visible.expand_as(s)
    empty = ~vis.any(dim=-1, keepdim=True)
    s = s.masked_fill(~vis, float("-inf")).masked_fill(empty, 0.0)
    return torch.softmax(s, dim=-1).masked_fill(empty, 0.0)


def plain_index(q, k, v, visible, bias, scale, dtype):
    """GQA by indexing: k[:, heads] (B,Hq,Tk,D)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    heads = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
    k, v = k[:, heads], v[:, heads]
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B,Hq,Tq,Tk)
    s = s + bias.to(dtype) if bias is not None else s
    return _masked_softmax(s, visible) @ v


def plain_grouped(q, k, v, visible, bias, scale, dtype):
    """GQA by grouping query heads: (B,Hkv,r·Tq,D) against each kv head."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    s = (q.reshape(B, Hkv, -1, D) @ k.transpose(-2, -1)) * (D ** -0.5 if scale is None else scale)
    s = s.reshape(B, Hq, Tq, Tk)
    s = s + bias.to(dtype) if bias is not None else s
    w = _masked_softmax(s, visible)
    return (w.reshape(B, Hkv, -1, Tk) @ v).reshape(B, Hq, Tq, D)


KERNELS: dict[str, Callable | None] = {"sdpa": None, "plain_index": plain_index, "plain_grouped": plain_grouped}


def outputs_and_grads(fn: Callable | None, case, inp, dtype: torch.dtype) -> list[torch.Tensor]:
    """(out, dq, dk, dv) of one kernel (None: SDPA with the case's own kwargs)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
    o = bench.sdpa(*leaves, **inp.kwargs) if fn is None else fn(*leaves, inp.visible, inp.bias, case.scale, dtype)
    return [o.detach(), *torch.autograd.grad(o, leaves, inp.grad_out.to(o.dtype))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="*", default=list(bench.DTYPES))
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    s = EXPERIMENTS["attn-check"].load().settings(compose("attn-check", ["kernel=torch:sdpa", *bench.MATRIX])).battery
    cases = [(i, c) for i, c in enumerate(s.cases) if c.family != "dropout"]
    print(f"torch {torch.__version__}, cpu, seeds 0-{args.seeds - 1}, {len(cases)} cases, {' '.join(bench.MATRIX)}")
    failed: dict[tuple[str, str, str], set[str]] = collections.defaultdict(set)
    for name in args.dtypes:
        dtype = bench.DTYPES[name]
        for seed in range(args.seeds):
            for i, case in cases:
                inp = make_inputs(case, s.B, s.Hq, "top_left", seed, i, torch.device("cpu"), dtype)
                ref = [t.double() for t in outputs_and_grads(
                    lambda q, k, v, vis, b, sc, _: bench.fa_attention(q, k, v, vis, b, sc, torch.float64),
                    case, inp, torch.float64)]
                plain = outputs_and_grads(bench.fa_attention, case, inp, dtype)
                for kernel, fn in KERNELS.items():
                    got = outputs_and_grads(fn, case, inp, dtype)
                    for j, tensor in enumerate(("out", "dq", "dk", "dv")):
                        if not bench.fa_passes(got[j], ref[j], plain[j], inp.seen if j < 2 else None):
                            failed[(name, kernel, tensor)].add(case.label())
                            print(f"FlashAttention's rule fails {kernel} {name} seed {seed} {tensor} at "
                                  f"{case.label()}", flush=True)
    print(f"\ncases failed at some seed (of {len(cases)}), per dtype, kernel, tensor; {time.perf_counter() - t0:.0f} s")
    for name in args.dtypes:
        for kernel in KERNELS:
            counts = {t: len(failed.get((name, kernel, t), ())) for t in ("out", "dq", "dk", "dv")}
            every = set().union(*(failed.get((name, kernel, t), set()) for t in counts))
            print(f"  {name:5} {kernel:14} " + " ".join(f"{t} {n:2d}" for t, n in counts.items())
                  + f"  any {len(every):2d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
