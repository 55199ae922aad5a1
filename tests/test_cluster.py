"""Sweeps on a real single-node SLURM cluster (scripts/slurm-up.sh; run with `make test-cluster`): jobs go through
sbatch, a job past hydra.launcher.timeout_min is stopped by SLURM and keeps its records, a job killed with SIGKILL
is reported `lost`, and every sweep ends with a complete sweep.parquet. route-sim ep_size=2 with its ranks as SLURM
tasks: `srun -n 2` (one run, both ranks' rows), a submitit sweep with tasks_per_node=2 (a killed rank ends its job
`crashed`, naming it), and scancel while a rank hangs (`interrupted`, no worker left)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.harness.store import notebook

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
TFMOE = [sys.executable, "-m", "tfmoe.cli"]
SLURM = ["hydra/launcher=submitit_slurm"]


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster() -> None:
    if shutil.which("sbatch") is None:
        pytest.fail("no SLURM here: run `make test-cluster` (it starts the cluster with scripts/slurm-up.sh)")
    state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    if state.returncode != 0 or not state.stdout.strip().startswith(("idle", "mix", "alloc")):
        pytest.fail(f"the SLURM node is not up ({state.stdout.strip() or state.stderr.strip()}): make slurm-up")


def _tfmoe(args: list[str], cwd: Path, timeout: float = 480) -> subprocess.CompletedProcess:
    return subprocess.run([*TFMOE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "250"})


def _sweep_dir(cwd: Path, experiment: str) -> Path:
    (sweep,) = (cwd / "runs" / experiment).glob("multirun-*")
    return sweep


def _slurm_job_ids(sweep: Path) -> list[str]:
    return sorted({p.name.split("_")[0] for p in (sweep / ".submitit").iterdir() if p.name[0].isdigit()})


def _sacct_states(job_id: str, tasks: int) -> dict[str, str]:
    """SLURM's own record of each task of a job array ('<id>_<task>' -> state), read back from its accounting.

    slurmdbd fills its records asynchronously: for a moment after the array ends it can hold one record keyed by
    the bare array id ('21': COMPLETED) before each task's '<id>_<task>' row lands (F-134). So wait until every
    task has its own row in a final state, not merely until some row is final."""
    expected = {f"{job_id}_{task}" for task in range(tasks)}
    deadline = time.monotonic() + 120
    while True:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", job_id],
                             capture_output=True, text=True, timeout=30).stdout
        states = dict(line.split("|", 1) for line in out.split())
        settled = expected <= states.keys() and all(
            states[key].split()[0] not in ("PENDING", "RUNNING", "COMPLETING") for key in expected)
        if settled or time.monotonic() > deadline:
            return states
        time.sleep(1)


def test_slurm_sweep_runs_both_jobs_through_sbatch(tmp_path: Path) -> None:
    r = _tfmoe(["shift-labels", "-m", "seed=0,1", *SLURM], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    sweep = _sweep_dir(tmp_path, "shift-labels")
    df = pd.read_parquet(sweep / "sweep.parquet")
    assert set(df["seed"]) == {0, 1} and (df["status"] == "ok").all()
    for job in ("0", "1"):
        run = notebook.load_run(sweep / job).run
        assert run["status"] == "ok" and "submitit" in " ".join(run["argv"])  # ran by submitit's worker
    ids = _slurm_job_ids(sweep)
    assert len(ids) == 1  # one sbatch job array of two tasks
    assert _sacct_states(ids[0], tasks=2) == {f"{ids[0]}_0": "COMPLETED", f"{ids[0]}_1": "COMPLETED"}


def test_a_job_past_its_slurm_time_limit_keeps_its_records_as_interrupted(tmp_path: Path) -> None:
    """Job 0 ends in seconds; job 1 would run for hours: at timeout_min=1 SLURM sends SIGTERM (signal_delay_s=0
    keeps submitit's earlier SIGUSR2 warning out of the way), tfmoe records it as interrupted and the sweep says so."""
    r = _tfmoe(["route-sim", "-m", "steps=20,1000000", "strategies=[none]", *SLURM,
                "hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=0"], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 143, out
    assert "job 1 (steps=1000000 strategies=[none]): interrupted: terminated by SIGTERM" in out
    sweep = _sweep_dir(tmp_path, "route-sim")
    states = pd.read_parquet(sweep / "sweep.parquet").drop_duplicates("job").set_index("job")["status"]
    assert states.to_dict() == {"0": "ok", "1": "interrupted"}
    late = notebook.load_run(sweep / "1")
    assert late.run["exit_code"] == 143 and "SIGTERM" in late.run["error"]
    assert late.metrics["step"].max() > 20  # the steps done before the limit are on disk
    (job_id,) = _slurm_job_ids(sweep)
    assert _sacct_states(job_id, tasks=2) == {f"{job_id}_0": "COMPLETED", f"{job_id}_1": "TIMEOUT"}  # SLURM's own verdict


def test_a_job_killed_by_sigkill_is_lost_and_the_sweep_still_completes(tmp_path: Path) -> None:
    """SIGKILL to job 1's process (the OOM killer; SLURM after KillWait): submitit raises for the job,
    yet the sweep ends with a sweep.parquet that holds job 0's results and job 1 as `lost`, and exits 137."""
    proc = subprocess.Popen([*TFMOE, "route-sim", "-m", "steps=20,1000000", "strategies=[none]", *SLURM],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "250"})
    try:
        deadline = time.monotonic() + 300
        metrics = None
        while time.monotonic() < deadline and proc.poll() is None:
            found = list((tmp_path / "runs" / "route-sim").glob("multirun-*/1/metrics.parquet"))
            if found and _has_training_steps(found[0]):
                metrics = found[0]
                break
            time.sleep(0.5)
        assert metrics is not None, "job 1 never wrote training steps while running"
        sweep = metrics.parent.parent
        # the OOM killer's way: SIGKILL straight to the job's process, found from what run.parquet records
        # (`scancel --signal=KILL` would be a cancel: SLURM sends SIGTERM first)
        row = notebook.read_run_row(sweep / "1")
        assert row["status"] == "running" and notebook.process_alive(row["pid"], row["process_started_at"])
        os.kill(int(row["pid"]), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 137, out + err
    assert "job 1 (steps=1000000 strategies=[none]): lost" in out
    states = pd.read_parquet(sweep / "sweep.parquet").drop_duplicates("job").set_index("job")["status"]
    assert states.to_dict() == {"0": "ok", "1": "lost"}
    assert _has_training_steps(sweep / "1" / "metrics.parquet")  # its periodic writes survive the kill


def _has_training_steps(path: Path) -> bool:
    try:
        m = pd.read_parquet(path)
    except (OSError, ValueError):
        return False
    return "step" in m and m["step"].notna().any()


# ------------------------------------------------------------------ route-sim ep_size=W: the ranks are SLURM tasks
TESTS = Path(__file__).resolve().parent


def _ep_ranks(run: notebook.RunData) -> set[int]:
    """The ranks with rows in the run's metrics (every rank's forward time, per step)."""
    m = run.metrics
    return {int(r) for r in m.loc[m["name"] == "ep.forward_ms", "rank"]}


def test_srun_makes_each_task_one_rank_of_one_run(tmp_path: Path) -> None:
    """`srun -n 2 tfmoe route-sim ep_size=2` inside an sbatch allocation: task 0 writes the one run directory, with
    both ranks' rows; task 1 serves it and writes nothing; every check passes."""
    script = tmp_path / "ep.sh"
    script.write_text(f"#!/bin/bash\nsrun -n 2 {sys.executable} -m tfmoe.cli route-sim ep_size=2 steps=0\n"
                      "echo srun-exit=$?\n")
    r = subprocess.run(["sbatch", "-n", "2", "-W", "-o", str(tmp_path / "job.out"), f"--chdir={tmp_path}",
                        str(script)], capture_output=True, text=True, timeout=400,
                       env={**os.environ, "COLUMNS": "250"})
    out = (tmp_path / "job.out").read_text()
    assert r.returncode == 0 and "srun-exit=0" in out, r.stdout + r.stderr + out
    job_id = r.stdout.split()[-1]
    (run_dir,) = (tmp_path / "runs" / "route-sim").iterdir()  # one run for the two tasks
    run = notebook.load_run(run_dir)
    assert run.run["status"] == "ok" and run.checks["passed"].all() and len(run.checks) >= 8
    assert _ep_ranks(run) == {0, 1}
    assert f"the 2 tasks of SLURM job {job_id} step 0" in (run_dir / "summary.md").read_text()


def test_submitit_runs_each_sweep_job_as_two_tasks_and_a_killed_rank_ends_its_job_crashed(tmp_path: Path) -> None:
    """`-m ... hydra/launcher=submitit_slurm hydra.launcher.tasks_per_node=2`: each job is one srun step of two
    tasks forming the process group, one run directory per job. Job 1's rank 1 is SIGKILLed mid-run
    (buggy_ep:DiesOnRank1): its job ends `crashed` naming rank 1, in bounded time, and the sweep completes."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)  # buggy_ep importable
    env = {**os.environ, "COLUMNS": "250", "PYTHONPATH": path}
    started = time.monotonic()
    r = subprocess.run([*TFMOE, "route-sim", "-m", "ep_size=2", "steps=0", "ep_impl=null,buggy_ep:DiesOnRank1",
                        *SLURM, "hydra.launcher.tasks_per_node=2"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=480, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 3, out
    assert time.monotonic() - started < 300, "a killed rank must not hang its job"
    sweep = _sweep_dir(tmp_path, "route-sim")
    states = pd.read_parquet(sweep / "sweep.parquet").drop_duplicates("job").set_index("job")["status"]
    assert states.to_dict() == {"0": "ok", "1": "crashed"}
    assert sorted(p.name for p in sweep.iterdir() if not p.name.startswith((".", "multirun", "sweep"))) == ["0", "1"]
    ok = notebook.load_run(sweep / "0")
    assert ok.run["status"] == "ok" and ok.checks["passed"].all() and _ep_ranks(ok) == {0, 1}
    crashed = notebook.load_run(sweep / "1").run
    assert "worker rank 1 of 2 failed (killed by SIGKILL)" in crashed["error"], crashed["error"]
    (job_id,) = _slurm_job_ids(sweep)
    assert {f"{job_id}_{t}_{task}_result.pkl" for t in (0, 1) for task in (0, 1)} <= {
        p.name for p in (sweep / ".submitit").rglob("*_result.pkl")}  # both tasks of both jobs returned


def test_scancel_interrupts_every_rank_and_the_run_is_interrupted(tmp_path: Path) -> None:
    """scancel while rank 1 hangs (buggy_ep:Sleeps) and rank 0 waits in a collective: SLURM's SIGTERM reaches both
    tasks, task 0 records `interrupted` (exit 143), each task stops its worker, and no worker is left."""
    import psutil

    script = tmp_path / "ep.sh"
    script.write_text(f"#!/bin/bash\nsrun -n 2 {sys.executable} -m tfmoe.cli route-sim ep_size=2 steps=0 "
                      "ep_impl=buggy_ep:Sleeps\n")
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)  # buggy_ep importable
    job = subprocess.run(["sbatch", "--parsable", "-n", "2", "-o", str(tmp_path / "job.out"), f"--chdir={tmp_path}",
                          str(script)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": path}).stdout.strip()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not list((tmp_path / "runs" / "route-sim").glob("*/run.parquet")):
        time.sleep(0.5)  # task 0's run has started
    time.sleep(10)  # the workers are up: rank 0 waits for rank 1 in the first All-to-All
    subprocess.run(["scancel", job], check=True, timeout=30)
    while time.monotonic() < deadline and subprocess.run(["squeue", "-h", "-j", job], capture_output=True,
                                                         text=True).stdout.strip():
        time.sleep(0.5)
    (run_dir,) = (tmp_path / "runs" / "route-sim").iterdir()
    run = notebook.read_run_row(run_dir)
    assert run["status"] == "interrupted" and run["exit_code"] == 143, (tmp_path / "job.out").read_text()
    left = [p for p in psutil.process_iter(["cmdline"]) if "ep_slurm import main" in " ".join(p.info["cmdline"] or [])]
    assert left == []
