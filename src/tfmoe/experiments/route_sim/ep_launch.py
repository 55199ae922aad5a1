"""Starting an expert-parallel run's workers and stopping them: torch.distributed.run on this machine, or rank 0's
worker alone under SLURM (``ep_slurm``). Below both ``expert_parallel`` (the battery) and ``ep_slurm``."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

WORKER_MODULE = "tfmoe.experiments.route_sim.ep_worker"
STARTUP_S = 120.0  # the launcher's and W workers' start (import torch) on a loaded machine, beyond the timeouts
STOP_GRACE_S = 15.0  # after SIGTERM to the launcher, before SIGKILL to what is left


class RankFailed(RuntimeError):
    """A worker of an expert-parallel run died or raised: the message names the rank and how it ended."""


# ------------------------------------------------------------------------------------------ launching
POLL_S = 0.5  # how often the launcher and the ranks' beats are looked at


def launch(spec: dict[str, Any], world: int, worker_cmd: list[str] | None = None,
           worker_env: dict[str, str] | None = None, explain: Any = None) -> dict[str, Any]:
    """Run the workers (torch.distributed.run, ``world`` processes) on ``spec``; rank 0's gathered records.
    RankFailed naming the rank when a worker fails or stops answering (no beat for ``spec["timeout_s"]``), or when
    the launcher itself stops answering; every process stopped (SIGTERM, then SIGKILL) when this one is interrupted
    or the run exceeds its bound, and every process dies with this one (tfmoe.contract.lifetime). ``worker_cmd``,
    ``worker_env`` and ``explain`` (stderr, exit code, world -> one line) replace the launcher, its environment and
    its error summary: under SLURM, rank 0's worker alone (route_sim/ep_slurm.py)."""
    from tfmoe.contract import lifetime
    from tfmoe.experiments.route_sim.ep_worker import RESULT_MARK, SPEC_ENV

    cmd = worker_cmd or [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                         "--max-restarts=0", "--monitor-interval=0.2", "-m", WORKER_MODULE]
    name = "torch.distributed.run" if worker_cmd is None else "rank 0's worker"
    env = dict(os.environ) if worker_env is None else dict(worker_env)
    env[SPEC_ENV] = json.dumps(spec)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)  # the user's module, tfmoe
    beats = tempfile.mkdtemp(prefix="tfmoe-ep-beats-")
    env[lifetime.BEATS_ENV], env[lifetime.OWNER_ENV] = beats, lifetime.owner_token()
    bound = STARTUP_S + spec["timeout_s"] * (len(spec["layers"]) * (spec["steps"] + 2) + 2)
    launched = time.time()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                                start_new_session=True, preexec_fn=lifetime.tied_preexec())
        local = range(world) if worker_cmd is None else range(1)  # under SLURM: rank 0's worker alone
        try:
            out, err = watch(proc, name, world, float(spec["timeout_s"]), bound, beats, local)
        except BaseException:  # Ctrl-C, SIGTERM (Terminated), a watchdog: every rank stops first
            stop(proc, beats)
            raise
        finally:
            stop_workers(beats)  # a worker the launcher left behind (it died before it could stop them)
        if proc.returncode != 0:
            logging.getLogger("tfmoe").error("%s exited %d; its stderr ends:\n%s", name, proc.returncode, err[-4000:])
            silent = silent_rank(beats, float(spec["timeout_s"]), world, launched, local)
            raise RankFailed(silent or (explain or failure_line)(err, proc.returncode, world))
    finally:
        shutil.rmtree(beats, ignore_errors=True)
    for line in out.splitlines():
        if line.startswith(RESULT_MARK):
            return torch.load(io.BytesIO(base64.b64decode(line[len(RESULT_MARK):])), weights_only=False)
    raise RankFailed(f"{name} exited 0 but rank 0 printed no result; stderr ends: {err[-300:]!r}")


def watch(proc: subprocess.Popen, name: str, world: int, timeout_s: float, bound: float,
          beats: str, local: range) -> tuple[str, str]:
    """The launcher's (stdout, stderr) once it ends. RankFailed, while it runs, when a rank has not beaten for
    ``timeout_s`` (stopped, frozen) or has not begun to ``timeout_s`` after the first of ``local`` ranks did, when
    the launcher has been stopped for ``timeout_s``, or past ``bound``."""
    import psutil

    from tfmoe.contract import lifetime

    start, stopped_since, first_beat = time.monotonic(), None, None
    while True:
        try:
            return proc.communicate(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - start > bound:
            raise RankFailed(f"the {world} expert-parallel workers did not finish within {bound:.0f} s "
                             "(stopped): a rank hangs outside a collective")
        try:
            state = psutil.Process(proc.pid).status()
        except psutil.Error:
            state = None
        if state in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            stopped_since = now if stopped_since is None else stopped_since
            if now - stopped_since >= timeout_s:
                raise RankFailed(f"{name} (pid {proc.pid}) stopped answering: {state} for {now - stopped_since:.0f} "
                                 f"s (ep_timeout_s={timeout_s:g}); it and its workers were stopped")
        else:
            stopped_since = None
        seen = lifetime.beats_of(beats)
        for rank, (age, pid, started) in sorted(seen.items()):
            if age >= timeout_s and lifetime.same_process(pid, started):
                raise RankFailed(f"expert-parallel worker rank {rank} of {world}: no word for {age:.0f} s "
                                 f"(ep_timeout_s={timeout_s:g}; stopped or frozen); every rank was stopped")
        first_beat = now if seen and first_beat is None else first_beat
        missing = [r for r in local if r not in seen]
        if first_beat is not None and missing and now - first_beat >= timeout_s:
            raise RankFailed(f"expert-parallel worker rank {missing[0]} of {world}: no word for {now - first_beat:.0f} "
                             f"s after rank {min(seen)} began (ep_timeout_s={timeout_s:g}; it never started "
                             "answering: stopped or frozen); every rank was stopped")


def silent_rank(beats: str, timeout_s: float, world: int, started: float, local: range | None = None) -> str | None:
    """After the launcher failed: a rank whose beats stopped well before the others' (stopped or frozen while its
    peers waited for it in a collective), or that never beat at all (wall clock ``started``: the launch), named as
    the cause instead of the peer that timed out. Only the ranks started here (``local``) are judged."""
    from tfmoe.contract import lifetime

    seen = {rank: age for rank, (age, _pid, _started) in lifetime.beats_of(beats).items()}
    if not seen:
        return None
    never = time.time() - started
    ages = {r: seen.get(r, never) for r in (range(world) if local is None else local)}
    if len(ages) < 2:
        return None
    freshest = min(ages.values())
    quiet = {r: age for r, age in ages.items() if age - freshest >= max(timeout_s / 2, 2.0)}
    if not quiet:
        return None
    rank = max(quiet, key=quiet.get)
    others = ", ".join(f"rank {r}" for r in sorted(ages) if r not in quiet)
    return (f"expert-parallel worker rank {rank} of {world}: no word for {quiet[rank] - freshest:.0f} s before the "
            f"run failed ({'stopped or frozen' if rank in seen else 'it never started answering'}); {others} timed "
            f"out waiting for it (ep_timeout_s={timeout_s:g})")


def stop(proc: subprocess.Popen, beats: str | None = None) -> None:
    """SIGTERM (and SIGCONT, should one be stopped) to the launcher and every worker, then SIGKILL to what is left
    after STOP_GRACE_S."""
    import psutil

    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    family += [p for p in registered_workers(beats) if p.pid not in {q.pid for q in family}]
    for p in family:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)
    _gone, alive = psutil.wait_procs(family, timeout=STOP_GRACE_S)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    proc.communicate()


def registered_workers(beats: str | None) -> list[Any]:
    """The worker processes that registered their beat under ``beats`` and still run."""
    import psutil

    from tfmoe.contract import lifetime

    found = []
    for _rank, (_age, pid, started) in (lifetime.beats_of(beats).items() if beats else []):
        if lifetime.same_process(pid, started):
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(pid))
    return found


def stop_workers(beats: str) -> None:
    """SIGKILL every registered worker still running (the launcher has ended: nothing else will stop them)."""
    import psutil

    left = registered_workers(beats)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=5)


def failure_line(stderr: str, code: int, world: int) -> str:
    """One line from torch.distributed.run's error summary: the first failed rank, its exit code or signal, and
    the last line of its traceback (a peer closing a connection is what the other ranks see)."""
    rank = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", stderr, re.S)
    exitcode = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", stderr, re.S)
    what = ""
    if exitcode:
        n = int(exitcode.group(1))
        what = how_ended(n)
    errors = [ln.strip() for ln in stderr.splitlines() if re.match(r"\s*\w+(Error|Exception)\b.*:", ln)]
    last = f"; last error: {errors[-1][:240]}" if errors else ""
    who = f"rank {rank.group(1)} of {world}" if rank else f"a rank of {world} (torch.distributed.run exit {code})"
    return f"expert-parallel worker {who} failed ({what or 'no exit code'}){last}"


def how_ended(code: int) -> str:
    """A process's return code in words: 'killed by SIGKILL' (negative: the signal), else 'exit N'."""
    if code < 0:
        return f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"signal {-code}"
    return f"exit {code}"
