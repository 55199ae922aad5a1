"""Starting an expert-parallel run's workers and stopping them: torch.distributed.run on this machine, or rank 0's
worker alone under SLURM (``ep_slurm``). Below both ``expert_parallel`` (the battery) and ``ep_slurm``."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
from typing import Any

import torch

WORKER_MODULE = "tfmoe.experiments.route_sim.ep_worker"
STARTUP_S = 120.0  # the launcher's and W workers' start (import torch) on a loaded machine, beyond the timeouts
STOP_GRACE_S = 15.0  # after SIGTERM to the launcher, before SIGKILL to what is left


class RankFailed(RuntimeError):
    """A worker of an expert-parallel run died or raised: the message names the rank and how it ended."""


# ------------------------------------------------------------------------------------------ launching
def launch(spec: dict[str, Any], world: int, worker_cmd: list[str] | None = None,
           worker_env: dict[str, str] | None = None, explain: Any = None) -> dict[str, Any]:
    """Run the workers (torch.distributed.run, ``world`` processes) on ``spec``; rank 0's gathered records.
    RankFailed naming the rank when a worker fails; every process stopped (SIGTERM, then SIGKILL) when this one
    is interrupted or the run exceeds its bound. ``worker_cmd``, ``worker_env`` and ``explain`` (stderr, exit code,
    world -> one line) replace the launcher, its environment and its error summary: under SLURM, rank 0's worker
    alone (route_sim/ep_slurm.py)."""
    from tfmoe.experiments.route_sim.ep_worker import RESULT_MARK, SPEC_ENV

    cmd = worker_cmd or [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                         "--max-restarts=0", "--monitor-interval=0.2", "-m", WORKER_MODULE]
    name = "torch.distributed.run" if worker_cmd is None else "rank 0's worker"
    env = dict(os.environ) if worker_env is None else dict(worker_env)
    env[SPEC_ENV] = json.dumps(spec)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)  # the user's module, tfmoe
    bound = STARTUP_S + spec["timeout_s"] * (len(spec["layers"]) * (spec["steps"] + 2) + 2)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise RankFailed(f"the {world} expert-parallel workers did not finish within {bound:.0f} s "
                         "(stopped): a rank hangs outside a collective") from None
    except BaseException:  # Ctrl-C, SIGTERM (Terminated): every rank stops before the run records interrupted
        stop(proc)
        raise
    if proc.returncode != 0:
        logging.getLogger("tfmoe").error("%s exited %d; its stderr ends:\n%s", name, proc.returncode, err[-4000:])
        raise RankFailed((explain or failure_line)(err, proc.returncode, world))
    for line in out.splitlines():
        if line.startswith(RESULT_MARK):
            return torch.load(io.BytesIO(base64.b64decode(line[len(RESULT_MARK):])), weights_only=False)
    raise RankFailed(f"{name} exited 0 but rank 0 printed no result; stderr ends: {err[-300:]!r}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the launcher (it stops its workers), then SIGKILL to the launcher and its workers still alive."""
    import psutil

    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _gone, alive = psutil.wait_procs(family, timeout=STOP_GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.communicate()


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
