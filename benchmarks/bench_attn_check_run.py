"""attn-check module mode: time of the default battery run (`tfmoe attn-check` as `make run` composes it).

    .venv/bin/python benchmarks/bench_attn_check_run.py                 # default config, 3 repeats
    .venv/bin/python benchmarks/bench_attn_check_run.py --repeats 5 dtype=bf16

Runs the battery in-process (no run directory) and prints, per repeat and as the median, the wall time and this
process's CPU time (less sensitive to other jobs on a shared machine), the load average, and the number of checks
and how many passed, so a refactor can be compared before/after. Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tfmoe.api.testing import run_recorded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. dtype=bf16 checks=[masks,sdpa]")
    args = ap.parse_args()
    run_recorded("attn-check", [*args.overrides, "checks=[masks]"])  # warm-up: imports, first-call costs
    walls, cpus = [], []
    for i in range(args.repeats):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        rec = run_recorded("attn-check", list(args.overrides))
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.process_time() - cpu0)
        passed = sum(c.passed for c in rec.checks_rows)
        print(f"  run {i + 1}: wall {walls[-1]:.2f} s, CPU {cpus[-1]:.2f} s, {len(rec.checks_rows)} checks, "
              f"{passed} passed, load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, overrides={args.overrides}: median wall "
          f"{statistics.median(walls):.2f} s, median CPU {statistics.median(cpus):.2f} s over {args.repeats} runs")


if __name__ == "__main__":
    main()
