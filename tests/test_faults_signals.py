"""Stopping a sweep from outside, on real processes (issue 24, item 5): SIGTERM to a basic sweep prints every job's
outcome; SIGTERM to a joblib sweep leaves its running jobs `interrupted` (not `lost`); SIGKILL of a joblib sweep's
launcher leaves no worker running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from conftest import sigint_default

from tfmoe.harness.store import notebook

TFMOE = [sys.executable, "-m", "tfmoe.cli"]
LONG = ["route-sim", "-m", "steps=1000000", "strategies=[none]", "flush_every_s=0.3"]
JOBLIB = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]


def _start(cwd: Path, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([*TFMOE, *args], cwd=cwd, preexec_fn=sigint_default, env={**os.environ, "COLUMNS": "200"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _jobs_with_metrics(cwd: Path, n: int, proc: subprocess.Popen, timeout: float = 180.0) -> list[Path]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(p.parent for p in cwd.glob("runs/route-sim/multirun-*/*/metrics.parquet"))
        if len(found) >= n:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"the sweep ended (exit {proc.returncode}) early: {proc.stderr.read()}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {n} jobs' metrics")


def _statuses(sweep: Path) -> dict[str, str]:
    return pd.read_parquet(sweep / "sweep.parquet").drop_duplicates("job").set_index("job")["status"].to_dict()


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_sigterm_to_a_basic_sweep_prints_every_jobs_outcome(tmp_path: Path) -> None:
    proc = _start(tmp_path, [*LONG, "top_k=1,2"])
    try:
        (job,) = _jobs_with_metrics(tmp_path, 1, proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        _end(proc)
    assert proc.returncode == 143, err
    assert "job 0 (steps=1000000 strategies=[none] flush_every_s=0.3 top_k=1): interrupted" in out, out
    assert "job 1 (steps=1000000 strategies=[none] flush_every_s=0.3 top_k=2): not_started" in out, out
    assert _statuses(job.parent) == {"0": "interrupted", "1": "not_started"}


def _sweep_processes(launcher: int) -> list[psutil.Process]:
    return psutil.Process(launcher).children(recursive=True)


def _alive(procs: list[psutil.Process]) -> list[str]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return left


@pytest.mark.slow
def test_sigterm_to_a_joblib_sweep_leaves_its_jobs_interrupted(tmp_path: Path) -> None:
    """Today: joblib kills its workers on the launcher's interrupt, and the jobs are `lost`."""
    proc = _start(tmp_path, [*LONG, *JOBLIB, "top_k=1,2,3"])
    try:
        jobs = _jobs_with_metrics(tmp_path, 2, proc)
        workers = _sweep_processes(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        _end(proc)
    assert proc.returncode == 143, err
    for job in jobs:
        run = notebook.load_run(job)
        assert run.run["status"] == "interrupted" and "SIGTERM" in run.run["error"], (job, run.run["status"])
        assert not run.metrics.empty  # the records it had were flushed by the job itself
    assert _statuses(jobs[0].parent) == {"0": "interrupted", "1": "interrupted", "2": "not_started"}
    assert "job 0 (" in out and "job 2 (" in out and "not_started" in out, out
    time.sleep(2)
    assert not _alive(workers)


@pytest.mark.slow
def test_sigkill_of_a_joblib_launcher_leaves_no_worker_running(tmp_path: Path) -> None:
    """Today: loky's workers run on and finish their jobs; a worker and two resource trackers were alive 16 minutes
    later. Each worker now watches its launcher: its job records `interrupted` and the worker exits."""
    proc = _start(tmp_path, [*LONG, *JOBLIB, "top_k=1,2,3"])
    try:
        jobs = _jobs_with_metrics(tmp_path, 2, proc)
        sweep = _sweep_processes(proc.pid)
        assert sweep, "no worker processes found"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        time.sleep(10)
        left = _alive(sweep)
    finally:
        for p in _alive(sweep):  # never leave them to the next test
            os.kill(int(p.split()[0]), signal.SIGKILL)
        _end(proc)
    assert not left, left
    for job in jobs:
        assert notebook.read_run_row(job)["status"] == "interrupted", job


# ------------------------------------------------------------------ issue 29, item 3: a signal at every stage
# The runner touches a marker per stage ($TFMOE_TEST_STAGES) and holds at the stage named in $TFMOE_TEST_HOLD until a
# signal arrives, so each signal lands inside that stage (not at guessed seconds). The fake experiment keeps it quick.
FAKE_MAIN = """
import sys
sys.path.insert(0, {tests!r})
import fake_experiment
from tfmoe.contract import registry
registry.EXPERIMENTS["fake"] = registry.Experiment("fake", "fake", "fake", "a test experiment")
sys.modules["tfmoe.experiments.fake"] = fake_experiment
from tfmoe.cli import main
main()
"""


def _start_fake(tmp_path: Path, args: list[str], hold: str) -> tuple[subprocess.Popen, Path]:
    import shutil

    conf = tmp_path / "conf"
    conf.mkdir(exist_ok=True)
    shutil.copy(Path(__file__).parents[1] / "conf" / "base.yaml", conf / "base.yaml")
    (conf / "fake.yaml").write_text("defaults:\n  - base\n  - _self_\nexperiment: fake\nmode: ok\nsteps: 5\n")
    (tmp_path / "fake_main.py").write_text(FAKE_MAIN.format(tests=str(Path(__file__).parent)))
    marks = tmp_path / "stages"
    env = {**os.environ, "TFMOE_CONF": str(conf), "TFMOE_TEST_STAGES": str(marks), "TFMOE_TEST_HOLD": hold}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "fake_main.py"), "fake", *args], cwd=tmp_path, env=env,
                            preexec_fn=sigint_default,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, marks


def _at(marks: Path, stage: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (marks / stage).exists():
        if proc.poll() is not None:
            raise AssertionError(f"ended (exit {proc.returncode}) before stage {stage}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for stage {stage}")
        time.sleep(0.02)


SLOW = pytest.mark.slow  # a subprocess each (~5 s idle): the default suite keeps the reported case (plots, Ctrl-C)
STAGES = [pytest.param("start", signal.SIGTERM, marks=SLOW), pytest.param("records", signal.SIGINT, marks=SLOW),
          pytest.param("status", signal.SIGTERM, marks=SLOW), pytest.param("summary", signal.SIGINT, marks=SLOW),
          ("plots", signal.SIGINT), pytest.param("plots", signal.SIGTERM, marks=SLOW)]


@pytest.mark.parametrize(("stage", "signum"), STAGES)
def test_a_signal_at_any_stage_ends_the_run_interrupted(tmp_path: Path, stage: str, signum: int) -> None:
    """Ctrl-C or SIGTERM while the final write drew the plots left the run `running` (later `lost`), exit 130 and no
    word; now every stage ends `interrupted`, with a stderr line, run.parquet and summary.md saying so."""
    proc, marks = _start_fake(tmp_path, [], hold=stage)
    try:
        _at(marks, stage, proc)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert proc.returncode == (130 if signum == signal.SIGINT else 143), err
    assert "Traceback" not in err and ("interrupted" in err or "terminated" in err), err
    (run_dir,) = [p.parent for p in tmp_path.glob("runs/fake/*/run.parquet")]
    run = notebook.read_run_row(run_dir)
    assert run["status"] == "interrupted" and run["exit_code"] == proc.returncode, dict(run)
    assert "status: **interrupted**" in (run_dir / "summary.md").read_text()
    assert notebook.load_run(run_dir).run["status"] == "interrupted"  # every table readable


def test_a_second_ctrl_c_while_the_records_are_written_keeps_them(tmp_path: Path) -> None:
    proc, marks = _start_fake(tmp_path, [], hold="experiment,records")
    try:
        _at(marks, "experiment", proc)
        proc.send_signal(signal.SIGINT)
        _at(marks, "records", proc)
        proc.send_signal(signal.SIGINT)  # the second Ctrl-C, while the first one's records are written
        out, err = proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    (run_dir,) = [p.parent for p in tmp_path.glob("runs/fake/*/run.parquet")]
    run = notebook.read_run_row(run_dir)
    assert run["status"] == "interrupted" and "Ctrl-C" in run["error"], dict(run)
    assert (run_dir / "summary.md").exists() and (run_dir / "tensors.parquet").exists()


def test_ctrl_c_while_a_sweep_job_draws_its_plots_stops_the_sweep_interrupted(tmp_path: Path) -> None:
    proc, marks = _start_fake(tmp_path, ["-m", "seed=0,1"], hold="plots")
    try:
        _at(marks, "plots", proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    (sweep,) = tmp_path.glob("runs/fake/multirun-*")
    assert _statuses(sweep) == {"0": "interrupted", "1": "not_started"}
    assert "job 0 (seed=0): interrupted" in out, out
