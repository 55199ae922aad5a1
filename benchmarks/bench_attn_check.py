"""Chunked exact attention vs the naive path vs PyTorch SDPA: time and peak memory (issue 7's targets).

    .venv/bin/python benchmarks/bench_attn_check.py            # T = 512, 2048, 8192 (+ 32768 chunked-only)
    .venv/bin/python benchmarks/bench_attn_check.py --no-32k --causal

B=1, H=8, Dh=64, fp32 on CPU. Peak memory: torch.profiler(profile_memory=True) on CPU (every allocation and free
of PyTorch's CPU allocator, summed in time order), torch.cuda.max_memory_allocated on CUDA. Targets:
chunked peak <= 10 % of naive at T=8192 and rel err vs SDPA <= 1e-5; T=32768 completes where the naive path
(estimated) does not fit in 24 GB. Prints ratios; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tfmoe.components.chunked_attention import chunked_attention, naive_attention, naive_attention_bytes
from tfmoe.contract.recorder import measure
from tfmoe.rules.memory import peak_memory_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-head", type=int, default=64)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-32k", action="store_true", help="skip the chunked-only T=32768 run")
    ap.add_argument("--large-T", type=int, default=32768, help="the chunked-only size (naive does not fit)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    H, Dh = args.heads, args.d_head
    print(f"torch {torch.__version__}, {device}, threads={torch.get_num_threads()}, B=1, H={H}, Dh={Dh}, "
          f"fp32, block={args.block}, causal={args.causal}")
    print(f"{'T':>6} {'naive ms':>10} {'chunked ms':>11} {'sdpa ms':>9} {'naive/sdpa':>11} {'chunked/sdpa':>13} "
          f"{'naive MiB':>10} {'chunked MiB':>12} {'sdpa MiB':>9} {'chunked/naive mem':>18} {'rel err':>9}")
    for T in args.T + ([] if args.no_32k else [args.large_T]):
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(1, H, T, Dh, generator=g).to(device) for _ in range(3))
        variants = {
            "chunked": lambda q=q, k=k, v=v: chunked_attention(q, k, v, causal=args.causal, block_size=args.block),
            "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=args.causal),
            "naive": lambda q=q, k=k, v=v: naive_attention(q, k, v, causal=args.causal),
        }
        naive_est = naive_attention_bytes(1, H, T, T, torch.float32)
        run_naive = naive_est < 12 * 2**30  # T=32768 would need ~96 GiB: the point of the chunked path
        if not run_naive:
            del variants["naive"]
        with torch.no_grad():
            if T <= 8192:
                out_c, out_s = variants["chunked"](), variants["sdpa"]()
                peak = {name: peak_memory_bytes(fn, device) for name, fn in variants.items()}
                secs = {name: measure(fn, device, repeats=args.repeats, warmup=1)[0] / 1e3 for name, fn in variants.items()}
            else:  # one call each: time the profiled call itself and keep its output
                peak, secs, outs = {}, {}, {}
                for name, fn in variants.items():
                    t0 = time.perf_counter()
                    peak[name] = peak_memory_bytes(lambda fn=fn, name=name, outs=outs: outs.__setitem__(name, fn()), device)
                    secs[name] = time.perf_counter() - t0
                out_c, out_s = outs["chunked"], outs["sdpa"]
            rel = float((out_c - out_s).abs().max() / out_s.abs().max())
            del out_c, out_s
        naive_ms = f"{secs['naive'] * 1e3:10.1f}" if run_naive else f"{'(no run)':>10}"
        naive_mib = peak.get("naive", naive_est) / 2**20
        naive_ratio = f"{secs['naive'] / secs['sdpa']:11.2f}" if run_naive else f"{'-':>11}"
        print(f"{T:>6} {naive_ms} {secs['chunked'] * 1e3:11.1f} {secs['sdpa'] * 1e3:9.1f} {naive_ratio} "
              f"{secs['chunked'] / secs['sdpa']:13.2f} {naive_mib:10.1f}{'' if run_naive else '*'} "
              f"{peak['chunked'] / 2**20:11.1f} {peak['sdpa'] / 2**20:9.1f} "
              f"{peak['chunked'] / peak.get('naive', naive_est):18.4f} {rel:9.2e}", flush=True)
    print("* naive not run: its estimated peak 3·B·H·T²·4 bytes is shown (does not fit a 24 GB machine)")


if __name__ == "__main__":
    main()
