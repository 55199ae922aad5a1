"""Every process tfmoe starts ends with it (tfmoe/contract/lifetime.py): the kernel's parent-death signal on every child,
the workers' watch on their owner, the ranks' beats that name a rank that stops answering, and a watchdog on the
launcher itself. The SIGKILL, SIGSTOP tests run real expert-parallel launches (torch.distributed.run, gloo)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tfmoe.contract import lifetime
from tfmoe.experiments.route_sim import ep_launch

MARK = "TFMOE_TEST_MARK"  # inherited by every descendant: how the tests find them after their parent is gone


def _marked(mark: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _gone_within(mark: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = _marked(mark)
        if not left:
            return []
        time.sleep(0.2)
    left = []
    for p in _marked(mark):
        try:
            left.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
            p.kill()  # never leave them to the next test
        except psutil.Error:
            pass
    return left


# ------------------------------------------------------------------------------------------ the ties themselves
PARENT = """
import subprocess, sys, time
from tfmoe.contract import lifetime
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=lifetime.tied_preexec(),
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_tied_child_in_its_own_session_dies_with_its_sigkilled_parent() -> None:
    mark = uuid.uuid4().hex
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, MARK: mark})
    child = int(parent.stdout.readline())
    assert psutil.pid_exists(child)
    parent.kill()
    parent.wait()
    assert _gone_within(mark, 10) == []


def test_a_worker_whose_owner_has_gone_ends_itself(tmp_path: Path) -> None:
    """The watch covers a worker started before its parent-death signal was set (or by a launcher that died)."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    token = lifetime.owner_token(owner.pid)
    assert lifetime.owner_alive(token)
    code = ("import time; from tfmoe.contract import lifetime; lifetime.watch_owner(); print('up', flush=True); "
            "time.sleep(120)")
    env = {**os.environ, lifetime.OWNER_ENV: token, lifetime.BEATS_ENV: str(tmp_path), "RANK": "1"}
    worker = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "up"
    (age, pid, started), = lifetime.beats_of(tmp_path).values()
    assert pid == worker.pid and lifetime.same_process(pid, started) and age < 5
    owner.kill()
    owner.wait()
    assert not lifetime.owner_alive(token)
    assert worker.wait(timeout=10) == -signal.SIGKILL
    assert not lifetime.same_process(pid, started)


def _beats(tmp_path: Path, ages: dict[int, float]) -> str:
    now = time.time()
    for rank, age in ages.items():
        f = lifetime.beat_file(tmp_path, rank)
        f.write_text(f"{os.getpid()} {lifetime.start_time(os.getpid())}\n")
        os.utime(f, (now - age, now - age))
    return str(tmp_path)


def test_after_a_failure_the_rank_that_went_quiet_is_named_not_the_one_that_timed_out(tmp_path: Path) -> None:
    said = ep_launch.silent_rank(_beats(tmp_path, {0: 1.0, 1: 12.0}), 10.0, 2, time.time() - 30)
    assert said is not None and said.startswith("expert-parallel worker rank 1 of 2: no word for 11 s"), said
    assert "rank 0 timed out waiting for it (ep_timeout_s=10)" in said


def test_a_rank_that_never_beat_is_named(tmp_path: Path) -> None:
    said = ep_launch.silent_rank(_beats(tmp_path, {0: 1.0}), 10.0, 2, time.time() - 30)
    assert said is not None and "rank 1 of 2" in said and "never started answering" in said, said


def test_ranks_that_ended_together_name_nobody(tmp_path: Path) -> None:
    """A rank's own error ends every rank within moments: the launcher's own summary names it."""
    assert ep_launch.silent_rank(_beats(tmp_path, {0: 1.0, 1: 1.5}), 10.0, 2, time.time() - 30) is None


# ------------------------------------------------------------------------------------------ real launches
LONG_EP = ["route-sim", "ep_size=2", "ep_steps=100000", "ep_timeout_s=10"]


def _workers(mark: str) -> dict[str, psutil.Process]:
    ranks = {}
    for p in _marked(mark):
        try:
            line = " ".join(p.cmdline())
            if "ep_worker" in line and "torch.distributed.run" not in line:
                ranks[p.environ().get("RANK")] = p
        except psutil.Error:
            continue
    return ranks


def _start(tmp_path: Path, mark: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tfmoe.cli", *LONG_EP, *args], cwd=tmp_path,
                            env={**os.environ, MARK: mark}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _until(what, proc: subprocess.Popen, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"tfmoe ended (exit {proc.returncode}) early: {proc.stderr.read()[-2000:]}")
        time.sleep(0.1)
    raise AssertionError("timed out")


MOMENTS = [pytest.param("launcher", marks=pytest.mark.slow), pytest.param("workers", marks=pytest.mark.slow),
           "steps"]


@pytest.mark.parametrize("moment", MOMENTS)
def test_sigkill_of_tfmoe_leaves_no_process_behind(tmp_path: Path, moment: str) -> None:
    """Before: the launcher and both workers (each in a session of its own) ran on at 50 % CPU each."""
    mark = uuid.uuid4().hex
    proc = _start(tmp_path, mark)
    try:
        if moment == "launcher":  # torch.distributed.run is starting its workers
            _until(lambda: [p for p in _marked(mark) if "torch.distributed.run" in " ".join(p.cmdline())], proc)
        else:
            _until(lambda: len(_workers(mark)) == 2, proc)
            if moment == "steps":  # inside the steps: both ranks in their collectives
                _until(lambda: all(p.cpu_times().user > 3 for p in _workers(mark).values()), proc)
        before = [p.pid for p in _marked(mark) if p.pid != proc.pid]
        assert before
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _gone_within(mark, 10) == []


def _stop_one(tmp_path: Path, which: str) -> tuple[subprocess.Popen, float, str]:
    mark = uuid.uuid4().hex
    proc = _start(tmp_path, mark)
    try:
        workers = _until(lambda: (w := _workers(mark)) and len(w) == 2 and all(
            p.cpu_times().user > 3 for p in w.values()) and w, proc)
        if which == "launcher":
            target = next(p for p in _marked(mark) if "torch.distributed.run" in " ".join(p.cmdline()))
        else:
            target = workers["1"]
        target.suspend()
        t0 = time.monotonic()
        _out, err = proc.communicate(timeout=120)
        return proc, time.monotonic() - t0, err
    finally:
        if proc.poll() is None:
            proc.kill()
        assert _gone_within(mark, 10) == []


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_the_healthy_one_is_not_blamed(tmp_path: Path) -> None:
    """Before: `crashed`, blaming rank 0 (whose collective timed out), with no word about the timeout."""
    import pandas as pd

    proc, waited, err = _stop_one(tmp_path, "rank")
    assert proc.returncode == 3, err
    assert waited < 10 + ep_launch.STOP_GRACE_S + 15
    (run,) = tmp_path.glob("runs/route-sim/*/run.parquet")
    error = pd.read_parquet(run).iloc[0]["error"]
    assert "rank 1 of 2: no word for 10 s (ep_timeout_s=10" in error and "rank 0" not in error, error


@pytest.mark.slow
def test_a_stopped_launcher_ends_the_run_within_the_timeout(tmp_path: Path) -> None:
    """Before: tfmoe waited on the stopped torch.distributed.run until the run's whole bound (minutes)."""
    import pandas as pd

    proc, waited, err = _stop_one(tmp_path, "launcher")
    assert proc.returncode == 3, err
    assert waited < 10 + ep_launch.STOP_GRACE_S + 15
    (run,) = tmp_path.glob("runs/route-sim/*/run.parquet")
    error = pd.read_parquet(run).iloc[0]["error"]
    assert "torch.distributed.run" in error and "stopped answering: stopped for 10 s" in error, error
