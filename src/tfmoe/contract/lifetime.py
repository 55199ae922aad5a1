"""Every process tfmoe starts ends with it.

Three ties, each enough on its own where it applies (Linux; elsewhere the last two):

* :func:`die_with_parent` — ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills this process when the thread that
  started it ends, whatever ends it (SIGKILL included). :func:`tied_preexec` applies it to a child of ours before
  its program starts; a worker started by someone else's launcher (torch.distributed.run) applies it itself, first.
* :func:`watch_owner` — a daemon thread in the worker that checks, twice a second, that the tfmoe process that owns
  it (``$TFMOE_OWNER``: its pid and start time) still runs, and kills its own process otherwise. It covers the
  moment before the first tie is set and a launcher that died in between.
* the same thread touches ``$TFMOE_BEATS/rank-<RANK>`` (its pid inside): the owner reads the files' ages to see a
  rank that stops answering (a stopped or frozen process beats no more) and the pids to stop every worker.

Touching a file (``utime``) writes no bytes: the workers' written-byte counters measure only their own traffic.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

OWNER_ENV = "TFMOE_OWNER"  # "<pid>:<start time>" of the tfmoe process a worker serves
BEATS_ENV = "TFMOE_BEATS"  # a directory: rank-<RANK> per worker, touched every BEAT_S
BEAT_S = 0.5
PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # this process's own symbols: libc (no ldconfig run)
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _prctl()  # resolved once, in the parent: a forked child only calls it


def die_with_parent(parent: int | None = None, signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when its parent ends; if the parent (pid ``parent``) has
    already ended, exit now. False where the system has no such tie (not Linux)."""
    if _PRCTL is None:
        return False
    _PRCTL(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(128 + int(signum))
    return True


def tied_preexec() -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child dies with this process (PR_SET_PDEATHSIG)."""
    parent = os.getpid()

    def preexec() -> None:
        die_with_parent(parent)

    return preexec


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # fields 3.. (after the name)
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22): with the pid, its identity."""
    stat = _stat(pid)
    return None if stat is None else stat[19]


def owner_token(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid)}"


def owner_alive(token: str) -> bool:
    """Whether the process named by :func:`owner_token` still runs (a reused pid is another process)."""
    pid, _, started = token.partition(":")
    if started == "None":  # no /proc: the pid alone
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return start_time(int(pid)) == started


def beat_file(beats: str | Path, rank: int | str) -> Path:
    return Path(beats) / f"rank-{rank}"


def watch_owner(token: str | None = None, beats: str | None = None, rank: str | None = None) -> None:
    """In a worker: tie it to its owner (``$TFMOE_OWNER``) and beat (``$TFMOE_BEATS``, ``$RANK``); see the module's
    docstring. Nothing happens without those variables."""
    token = os.environ.get(OWNER_ENV) if token is None else token
    beats = os.environ.get(BEATS_ENV) if beats is None else beats
    rank = os.environ.get("RANK") if rank is None else rank
    beat = None
    if beats and rank is not None:
        beat = beat_file(beats, rank)
        with contextlib.suppress(OSError):
            beat.write_text(f"{os.getpid()} {start_time(os.getpid())}\n")
    if token is None and beat is None:
        return

    def loop() -> None:
        while True:
            if token is not None and not owner_alive(token):
                os.kill(os.getpid(), signal.SIGKILL)
            if beat is not None:
                with contextlib.suppress(OSError):
                    os.utime(beat)
            time.sleep(BEAT_S)

    threading.Thread(target=loop, name="tfmoe-owner-watch", daemon=True).start()


def beats_of(beats: str | Path) -> dict[int, tuple[float, int | None, str | None]]:
    """rank -> (seconds since its last beat, pid, start time) for every worker that registered under ``beats``."""
    now = time.time()
    out: dict[int, tuple[float, int | None, str | None]] = {}
    for f in Path(beats).glob("rank-*"):
        with contextlib.suppress(OSError, ValueError):
            age = now - f.stat().st_mtime
            parts = f.read_text().split()
            pid = int(parts[0]) if parts else None
            out[int(f.name.removeprefix("rank-"))] = (age, pid, parts[1] if len(parts) > 1 else None)
    return out


def same_process(pid: int | None, started: str | None) -> bool:
    """Whether ``pid`` is still the process that started at ``started`` and has not exited (a zombie has)."""
    stat = None if pid is None or started is None else _stat(pid)
    return stat is not None and stat[19] == started and stat[0] not in ("Z", "X")
