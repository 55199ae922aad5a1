"""A sweep's exit code never says success for work not done: a launcher setting that cannot start a job is bad
input (exit 2, one line, nothing written); a launcher that fails mid-sweep is one line and a non-zero exit (137 when
it lost a worker process: its job is `lost`, never 130 "Ctrl-C"); a second Ctrl-C at any moment still exits 130
with sweep.parquet written and the unstarted jobs `not_started`."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from test_faults_signals import _at, _end, _start_fake, _statuses

from tfmoe.harness.launching.launch import LauncherFailed

TFMOE = [sys.executable, "-m", "tfmoe.cli"]
LONG = ["route-sim", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "steps=1000000", "strategies=[none]",
        "flush_every_s=0.3", "top_k=1,2,3"]


def test_n_jobs_0_is_bad_input_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    """Before: a 31-line traceback, every job not_started, and exit 0."""
    res = subprocess.run([*TFMOE, "route-sim", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=0", "top_k=1,2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: hydra.launcher.n_jobs=0: joblib needs a non-zero number of worker processes (-1: one per CPU): "
        "pass hydra.launcher.n_jobs=2"]
    assert not (tmp_path / "runs").exists()


def test_a_launchers_error_is_one_line_and_says_whether_a_worker_was_lost() -> None:
    class TerminatedWorkerError(RuntimeError):
        pass

    lost = LauncherFailed(TerminatedWorkerError("A worker process was unexpectedly terminated. This could be\n"
                                                "caused by a segfault.\nThe exit codes of the workers are {SIGKILL(-9)}"))
    assert str(lost) == "TerminatedWorkerError: A worker process was unexpectedly terminated" and lost.exit_code == 137
    other = LauncherFailed(ValueError("bad\nsecond line"))
    assert str(other) == "ValueError: bad" and other.exit_code == 3


def _loky_workers(proc: subprocess.Popen) -> list[psutil.Process]:
    """The launcher's loky workers, once they run loky's worker program (not a child still being forked, nor the
    resource tracker)."""
    kids = []
    for child in psutil.Process(proc.pid).children():
        try:
            line = " ".join(child.cmdline())
            if "loky" in line and "resource_tracker" not in line:
                kids.append(child)
        except psutil.Error:
            continue
    return kids


@pytest.mark.parametrize("moment", ["before any job", pytest.param("mid-job", marks=pytest.mark.slow)])
def test_a_killed_loky_worker_ends_the_sweep_137_in_one_line(tmp_path: Path, moment: str) -> None:
    """Before: 0 with a 31-line traceback (killed before any job ran), 130 with a 37-line one (killed mid-job)."""
    proc = subprocess.Popen([*TFMOE, *LONG], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            workers = _loky_workers(proc)
            jobs = glob.glob(str(tmp_path / "runs/route-sim/multirun-*/*/metrics.parquet"))
            if workers and (moment == "before any job" or jobs):
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.02)
        if moment == "mid-job":
            run = pd.read_parquet(Path(jobs[0]).parent / "run.parquet").iloc[0]
            os.kill(int(run["pid"]), signal.SIGKILL)
        else:
            workers[0].kill()
        out, err = proc.communicate(timeout=120)
    finally:
        _end(proc)
    assert proc.returncode == 137, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the sweep's launcher failed (TerminatedWorkerError: "), err
    assert "did not run or did not finish" in lines[0]
    (sweep,) = tmp_path.glob("runs/route-sim/multirun-*")
    statuses = _statuses(sweep)
    assert len(statuses) == 3 and "ok" not in statuses.values(), statuses
    if moment == "mid-job":
        assert statuses["0"] == "lost" or statuses["1"] == "lost", statuses


@pytest.mark.parametrize("second", ["sweep_records", "experiment"])
def test_a_second_ctrl_c_still_exits_130_and_writes_the_sweep_table(tmp_path: Path, second: str) -> None:
    """The second Ctrl-C lands while the stopped sweep completes sweep.parquet, or right after the first (while
    Hydra unwinds): exit 130, sweep.parquet with the job that ran `interrupted` and the others `not_started`."""
    proc, marks = _start_fake(tmp_path, ["-m", "seed=0,1,2"], hold="experiment,sweep_records")
    try:
        _at(marks, "experiment", proc)
        proc.send_signal(signal.SIGINT)
        if second == "sweep_records":
            _at(marks, "sweep_records", proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    (sweep,) = tmp_path.glob("runs/fake/multirun-*")
    assert _statuses(sweep) == {"0": "interrupted", "1": "not_started", "2": "not_started"}
