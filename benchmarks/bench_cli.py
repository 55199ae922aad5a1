"""Core benchmarks: `tfmoe --help` start-up time (target ≤ 0.3 s median) and the basic launcher's per-job
overhead beyond the job's own compute (target ≤ 0.2 s). Prints figures and ratios to the targets."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

TFMOE = str(Path(sys.executable).with_name("tfmoe"))


def help_time(repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([TFMOE, "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sweep_overhead(jobs: int = 8) -> tuple[float, float, float]:
    """(per-job overhead s, sweep wall s, summed job wall s) for a basic-launcher sweep of shift-labels."""
    work = Path(tempfile.mkdtemp())
    try:
        seeds = ",".join(str(i) for i in range(jobs))
        t0 = time.perf_counter()
        subprocess.run([TFMOE, "shift-labels", "-m", f"seed={seeds}"], cwd=work, check=True, capture_output=True,
                       env={**os.environ, "COLUMNS": "120"})
        total = time.perf_counter() - t0
        # one single run measures the fixed start-up cost (python, torch, hydra) paid once per sweep
        t1 = time.perf_counter()
        subprocess.run([TFMOE, "shift-labels"], cwd=work, check=True, capture_output=True)
        single = time.perf_counter() - t1
        sweep = next((work / "runs" / "shift-labels").glob("multirun-*"))
        compute = []
        for job in range(jobs):
            run = pd.read_parquet(sweep / str(job) / "run.parquet").iloc[0]
            compute.append(float(run["wall_s"]))
        startup = single - compute[0]
        overhead = (total - startup - sum(compute)) / jobs
        return overhead, total, sum(compute)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    h = help_time()
    print(f"tfmoe --help median: {h:.3f} s  (target 0.300 s; ratio {h / 0.3:.2f}x of target)")
    ov, total, compute = sweep_overhead()
    print(f"basic launcher, 8 jobs: sweep wall {total:.2f} s, jobs' own wall (run.parquet wall_s) {compute:.2f} s")
    print(f"per-job overhead beyond the job's own run: {ov:.3f} s  (target 0.200 s; ratio {ov / 0.2:.2f}x of target)")
