"""attn-check kernel mode: time of the default case matrix (issue 13's target: torch:sdpa, fp32, <= 60 s here).

    .venv/bin/python benchmarks/bench_attn_kernels.py                      # torch:sdpa, fp32, the default matrix
    .venv/bin/python benchmarks/bench_attn_kernels.py --kernel torch:flex --dtype bf16

Runs the battery in-process exactly as `tfmoe attn-check kernel=...` composes it (no run directory; kernel mode uses
one intra-op thread on CPU unless threads=N is passed, e.g. `... threads=2` to compare) and prints the
wall time, this process's CPU time (less sensitive to other jobs on a shared machine), the per-family times and the
ratio to the 60 s target. Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import time

import torch

from tfmoe.api.testing import run_recorded

TARGET_S = 60.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="torch:sdpa")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides, e.g. kernel_checks.backward=false")
    args = ap.parse_args()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    rec = run_recorded("attn-check", [f"kernel={args.kernel}", f"dtype={args.dtype}", f"device={args.device}",
                                      *args.overrides])
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    n_cases = sum(r["name"] == "case_passed" for r in rec.metrics_rows)
    verdicts = ", ".join(f"{c.check}={'pass' if c.passed else 'FAIL'}" for c in rec.checks_rows)
    threads = next((n for n in rec.notes if "intra-op thread" in n), "")
    print(f"torch {torch.__version__}, {args.device}, kernel={args.kernel}, {args.dtype}, {n_cases} forward cases; "
          f"{threads}")
    for row in rec.timings_rows:
        print(f"  {row.get('family', row['stage']):>18}: {row['wall_ms'] / 1e3:7.2f} s")
    print(f"matrix wall {wall:.1f} s (target {TARGET_S:.0f} s, ratio {wall / TARGET_S:.2f}); "
          f"process CPU {cpu:.1f} s")
    print(verdicts)


if __name__ == "__main__":
    main()
