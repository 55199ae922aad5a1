"""How close do a block's matmuls get to this machine's matmul peak? (issue: FFN >= 70 % of peak at D >= 512)

Prints, per (T, D): the FFN's fc1 / fc2 (Linear with bias) and the whole FFN (with GELU) as a fraction of the
best N x N matmul FLOP/s measured just before, plus the explicit fp32 attention (QKᵀ, softmax, ·V) against
PyTorch's SDPA and decode-vs-prefill time per token. Best-of-``repeats`` timings (other processes only slow
a measurement down). Run: .venv/bin/python benchmarks/bench_complexity.py [--threads 1] [--repeats 7] [--clock cpu]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import psutil
import torch
import torch.nn.functional as F

from tfmoe.components import complexity_model as cm
from tfmoe.components.attention import KVCache, attention_weights
from tfmoe.components.block import TransformerBlock
from tfmoe.components.masks import causal_mask

CLOCK = time.perf_counter


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Best-of-``repeats`` ms on CLOCK (perf_counter, or process_time with --clock cpu)."""
    fn()
    walls = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        walls.append((CLOCK() - t0) * 1e3)
    return min(walls)


def peak_flops(n: int, repeats: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / (best_ms(lambda: a @ b, repeats) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: time.process_time (all threads' CPU time; immune to waiting for a shared core)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"load {psutil.getloadavg()[0]:.1f}")
    print(f"{'T':>5} {'D':>5} {'peak GF/s':>9} {'fc1':>5} {'fc2':>5} {'ffn':>5} {'attn explicit/sdpa':>19} "
          f"{'decode/prefill per token':>25}")
    for D in (256, 512, 1024):
        for T in (128, 512, 2048):
            shape = cm.BlockShape(1, T, D, args.H)
            block = TransformerBlock(D, args.H).eval()
            x = torch.randn(1, T, D)
            with torch.inference_mode():
                peak = peak_flops(1024, args.repeats)
                u = block.ffn.fc1(x)
                g = F.gelu(u)
                half = cm.forward_flops(shape)["ffn"] / 2
                fc1 = half / (best_ms(lambda: block.ffn.fc1(x), args.repeats) / 1e3) / peak  # noqa: B023
                fc2 = half / (best_ms(lambda: block.ffn.fc2(g), args.repeats) / 1e3) / peak  # noqa: B023
                ffn = 2 * half / (best_ms(lambda: block.ffn(x), args.repeats) / 1e3) / peak  # noqa: B023
                q = k = v = torch.randn(1, args.H, T, D // args.H)
                mask = causal_mask(T)[None, None]
                explicit = best_ms(lambda: attention_weights(q, k, mask) @ v, args.repeats)  # noqa: B023
                sdpa = best_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),  # noqa: B023
                               args.repeats)
                prefill = best_ms(lambda: block(x, cache=KVCache()), max(3, args.repeats // 2)) / T  # noqa: B023
                base = KVCache()
                block(x[:, :-1], cache=base)
                decode = best_ms(lambda: block(x[:, -1:], cache=KVCache(base.k, base.v)),  # noqa: B023
                                 args.repeats)
            assert all(math.isfinite(v) for v in (fc1, fc2, ffn, explicit, sdpa, prefill, decode))
            print(f"{T:>5} {D:>5} {peak / 1e9:>9.0f} {fc1:>5.0%} {fc2:>5.0%} {ffn:>5.0%} "
                  f"{explicit / sdpa:>19.2f} {decode / prefill:>25.1f}")


if __name__ == "__main__":
    main()
