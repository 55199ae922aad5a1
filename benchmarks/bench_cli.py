"""Core benchmarks: `tfmoe --help` start-up time (target ≤ 0.3 s median) and the basic launcher's per-job
overhead beyond the job's own compute (target ≤ 0.1 s, issue 16). Prints figures and ratios to the targets, the
Hydra composition cost per job with and without tfmoe's sweep_speed (interleaved, in one process, so machine load
hits both alike), the cost of building every job's settings before a sweep starts, and sweep.parquet / the
progress bar at 1,000 jobs. The load average is printed: on a shared machine every wall time scales with it."""

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


# The jobs' torch runs on one thread: with torch's two OpenMP threads on two shared cores a job's own wall varied
# 0.09-0.7 s between runs minutes apart (one thread waits for the other, descheduled), drowning the bookkeeping.
ONE_THREAD = ["threads=1"]


def _sweep(work: Path, jobs: int) -> tuple[float, float, Path]:
    """(wall s, summed job wall s from run.parquet, sweep dir) of a basic-launcher sweep of shift-labels."""
    before = set((work / "runs" / "shift-labels").glob("multirun-*"))
    t0 = time.perf_counter()
    subprocess.run([TFMOE, "shift-labels", "-m", f"seed=range(0,{jobs})", *ONE_THREAD], cwd=work, check=True,
                   capture_output=True, env={**os.environ, "COLUMNS": "120"})
    total = time.perf_counter() - t0
    sweep = next(iter(set((work / "runs" / "shift-labels").glob("multirun-*")) - before))
    compute = sum(float(pd.read_parquet(sweep / str(j) / "run.parquet").iloc[0]["wall_s"]) for j in range(jobs))
    return total, compute, sweep


def sweep_overhead(jobs: int = 8, more: int = 24) -> tuple[float, float, float, float]:
    """(per-job overhead s of a ``jobs``-job sweep, sweep wall s, summed job wall s, marginal overhead s per job).

    The first: (sweep wall - a single run's start-up - the jobs' own wall) / jobs, so the sweep's fixed costs
    (composing the master config, building every job's settings first, sweep.parquet) are shared by ``jobs``. The
    marginal: ((wall - jobs' wall) of a ``more``-job sweep - the same of the ``jobs``-job one) / (more - jobs): what
    one more job costs, the figure a 1,000-job sweep pays per job."""
    work = Path(tempfile.mkdtemp())
    try:
        total, compute, sweep = _sweep(work, jobs)
        # one single run measures the fixed start-up cost (python, hydra, and importing torch and the experiment:
        # inside a single run's wall_s, before a sweep's first job in the sweep) paid once per sweep
        t1 = time.perf_counter()
        subprocess.run([TFMOE, "shift-labels", *ONE_THREAD], cwd=work, check=True, capture_output=True)
        single = time.perf_counter() - t1
        startup = single - float(pd.read_parquet(sweep / "0" / "run.parquet").iloc[0]["wall_s"])
        overhead = (total - startup - compute) / jobs
        big_total, big_compute, _ = _sweep(work, more)
        marginal = ((big_total - big_compute) - (total - compute)) / (more - jobs)
        return overhead, total, compute, marginal
    finally:
        shutil.rmtree(work)


def composition_per_job(jobs: int = 6, rounds: int = 3) -> tuple[float, float]:
    """(Hydra as is, with sweep_speed) seconds of config composition per job of a basic-launcher sweep: Hydra
    composes each job twice (the sweeper's validation, then the launcher), re-parsing every YAML file each time."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from tfmoe.harness.launching import runner
    from tfmoe.harness.launching.launch import config_dir
    from tfmoe.harness.launching.sweep_speed import faster_composition

    runner.register_resolvers()
    plain, fast = [], []
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        master = loader.load_configuration("shift_labels", [f"seed=range(0,{jobs})"], RunMode.MULTIRUN)
        batch = [[f"seed={i}"] for i in range(jobs)]
        for _ in range(rounds):
            for use_fast, out in ((False, plain), (True, fast)):
                undo = faster_composition(loader) if use_fast else (lambda: None)
                t0 = time.perf_counter()
                for job in batch:  # validate_batch_is_legal
                    loader.load_sweep_config(master, job)
                for job in batch:  # BasicLauncher.launch
                    loader.load_sweep_config(master, job)
                out.append((time.perf_counter() - t0) / jobs)
                undo()
    GlobalHydra.instance().clear()
    return statistics.median(plain), statistics.median(fast)


def sweep_file_at(jobs: int = 1000) -> tuple[float, float, int]:
    """(s to write sweep.parquet for ``jobs`` job directories copied from a real job, s for ``jobs`` progress-bar
    advances, rows in sweep.parquet)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from rich.console import Console
    from rich.progress import Progress

    from tfmoe.harness.store.sweeps import write_sweep_outputs

    work = Path(tempfile.mkdtemp())
    try:
        subprocess.run([TFMOE, "shift-labels", "-m", "seed=0"], cwd=work, check=True, capture_output=True)
        src_sweep = next((work / "runs" / "shift-labels").glob("multirun-*"))
        src, sweep = src_sweep / "0", work / "big" / src_sweep.name
        row = pq.read_table(src / "run.parquet")
        for i in range(jobs):
            dst = sweep / str(i)
            shutil.copytree(src, dst, copy_function=os.link, ignore=shutil.ignore_patterns("run.parquet"))
            rid = row.set_column(row.schema.get_field_index("run_id"), "run_id",
                                 pa.array([f"{src_sweep.name.removeprefix('multirun-')}-{i}"]))
            pq.write_table(rid, dst / "run.parquet")
        t0 = time.perf_counter()
        write_sweep_outputs(sweep, "shift-labels")
        took = time.perf_counter() - t0
        rows = len(pd.read_parquet(sweep / "sweep.parquet"))
        progress = Progress(console=Console(file=io.StringIO(), force_terminal=True, width=100))
        task = progress.add_task("jobs", total=jobs)
        progress.start()
        t1 = time.perf_counter()
        for _ in range(jobs):
            progress.advance(task)
        bar = time.perf_counter() - t1
        progress.stop()
        return took, bar, rows
    finally:
        shutil.rmtree(work)


def settings_validation_per_job(jobs: int = 1000) -> dict[str, float]:
    """CPU seconds per job to build every job's settings before a sweep starts (launch.validate_sweep_settings,
    issue 12 item 7) for a ``jobs``-job sweep: each job's config derived from one composed config, then the
    experiment's settings(cfg)."""
    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.harness.launching import runner
    from tfmoe.harness.launching.launch import validate_sweep_settings

    runner.register_resolvers()
    out = {}
    for name, sweep in (("shift-labels", [f"seed=range(0,{jobs})"]),
                        ("complexity", [f"T=range(16,{16 + jobs})", "D=64"])):
        EXPERIMENTS[name].load()  # imports are not the per-job cost
        t0 = time.process_time()
        validate_sweep_settings(EXPERIMENTS[name], sweep)
        out[name] = (time.process_time() - t0) / jobs
    return out


def _cpu() -> float:
    """CPU seconds of this process and of the child processes it waited for (git)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def marginal_overhead_cpu(small: int = 3, large: int = 9) -> dict[str, float]:
    """CPU seconds of bookkeeping per extra job of an in-process basic-launcher sweep of shift-labels, beyond the
    experiment's own run: (CPU of a ``large``-job sweep - CPU of a ``small``-job one - the extra jobs' own CPU) /
    (large - small). Process CPU time, not wall, so a loaded machine skews it less; fixed per-sweep costs cancel.
    'before' undoes this issue's changes (Hydra composes each job twice; run.parquet through pandas; .hydra saves
    through PyYAML's Python emitter). Child processes (git) count."""
    import contextlib
    import importlib
    import io

    import tfmoe.harness.launching.sweep_speed as sweep_speed
    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.harness.launching import launch
    from tfmoe.harness.store import notebook, rundir

    module = importlib.import_module("tfmoe.experiments.shift_labels")
    run, write_run = module.run, notebook.RunWriter.write_run
    faster, records = sweep_speed.faster_composition, sweep_speed.faster_job_records
    own = [0.0, 0.0]  # the experiment's own CPU, wall

    def timed(cfg, rec):  # the experiment's own CPU and wall time
        t0, w0 = time.process_time(), time.perf_counter()
        try:
            return run(cfg, rec)
        finally:
            own[0] += time.process_time() - t0
            own[1] += time.perf_counter() - w0

    def pandas_write_run(self, row):
        rundir.write_parquet(pd.DataFrame([row]), self.run_dir / rundir.RUN_FILE, schema=rundir.RUN_SCHEMA)

    work = Path(tempfile.mkdtemp())
    old_cwd = os.getcwd()
    os.chdir(work)
    module.run = timed
    out: dict[str, float] = {}
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            launch.run_experiment(EXPERIMENTS["shift-labels"], ["seed=0"], quiet=True)  # imports, caches
            for label in ("before", "after", "before", "after"):
                sweep_speed.faster_composition = faster if label == "after" else (lambda loader: (lambda: None))
                sweep_speed.faster_job_records = records if label == "after" else (lambda: (lambda: None))
                notebook.RunWriter.write_run = write_run if label == "after" else pandas_write_run
                cpu = {}
                for n in (small, large):
                    own[0] = own[1] = 0.0
                    t0, w0 = _cpu(), time.perf_counter()
                    launch.run_experiment(EXPERIMENTS["shift-labels"], [f"seed=range(0,{n})", *ONE_THREAD],
                                          multirun=True, quiet=True)
                    cpu[n] = (_cpu() - t0, own[0], time.perf_counter() - w0, own[1])
                per_job = ((cpu[large][0] - cpu[small][0]) - (cpu[large][1] - cpu[small][1])) / (large - small)
                wall = ((cpu[large][2] - cpu[small][2]) - (cpu[large][3] - cpu[small][3])) / (large - small)
                out[label] = min(out.get(label, float("inf")), per_job)
                out[f"{label} wall"] = min(out.get(f"{label} wall", float("inf")), wall)
    finally:
        module.run, notebook.RunWriter.write_run, sweep_speed.faster_composition = run, write_run, faster
        sweep_speed.faster_job_records = records
        os.chdir(old_cwd)
        shutil.rmtree(work)
    return out


if __name__ == "__main__":
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    m = marginal_overhead_cpu()
    print(f"bookkeeping CPU per extra sweep job (in-process, beyond the experiment's own CPU): before "
          f"{m['before']:.3f} s, after {m['after']:.3f} s  (target 0.100 s; ratio {m['after'] / 0.1:.2f}x of target)")
    print(f"the same on the wall clock (in-process, no process start-up to subtract): before {m['before wall']:.3f} s, "
          f"after {m['after wall']:.3f} s  (ratio {m['after wall'] / 0.1:.2f}x of target)")
    v = settings_validation_per_job()
    print("settings of every job built before a 1,000-job sweep starts: "
          + ", ".join(f"{name} {cpu * 1000:.1f} ms CPU/job" for name, cpu in v.items()))
    plain, fast = composition_per_job()
    print(f"Hydra config composition per sweep job: {plain:.3f} s as Hydra does it (2 composes), {fast:.3f} s with "
          f"sweep_speed (derived from one composed config, YAML parsed once): {plain / fast:.2f}x less")
    took, bar, rows = sweep_file_at()
    print(f"sweep.parquet for 1,000 jobs: {took:.2f} s ({rows} rows); 1,000 progress-bar advances: {bar:.3f} s")
    h = help_time()
    print(f"tfmoe --help median: {h:.3f} s  (target 0.300 s; ratio {h / 0.3:.2f}x of target)")
    ov, total, compute, marginal = sweep_overhead()
    print(f"basic launcher, 8 jobs: sweep wall {total:.2f} s, jobs' own wall (run.parquet wall_s) {compute:.2f} s")
    print(f"per-job overhead beyond the job's own run: {ov:.3f} s  (target 0.100 s; ratio {ov / 0.1:.2f}x of target)")
    print(f"marginal wall overhead per extra job (24-job minus 8-job sweep): {marginal:.3f} s  (ratio "
          f"{marginal / 0.1:.2f}x of target)")
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.1f}")
