"""A run's status, the process exit code each status stands for, and the "worst of" order of exit codes.

The one place that says what ``status`` in run.parquet / sweep.parquet / the catalog may hold and which exit code
goes with it (README, "Exit codes"). A member *is* its stored string (``Status.OK == "ok"``), so parquet keeps the
same strings. torch-free: the CLI's readers import it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from enum import Enum


class Status(str, Enum):
    """What a run's ``status`` holds, with the exit code it stands for (``Status.CRASHED.exit_code == 3``)."""

    exit_code: int
    final: bool

    OK = "ok", 0, True  # every check passed (and every expectation held)
    FAILED = "failed", 1, True  # a check failed
    ERROR = "error", 2, True  # bad input: the message names the problem and the fix
    CRASHED = "crashed", 3, True  # the experiment itself raised (a bug): traceback in the run's log
    UNEXPECTED = "unexpected", 4, True  # every check passed, but an expectation (the user's prediction) did not hold
    INTERRUPTED = "interrupted", 130, True  # Ctrl-C; a terminating signal records 128 + its number (143 for SIGTERM)
    LOST = "lost", 137, False  # recorded running, its process is gone (SIGKILL, OOM): derived by readers, never written
    RUNNING = "running", 3, False  # no exit code yet: a reader asking for one counts it as crashed
    NOT_STARTED = "not_started", 130, True  # a sweep job that never began (the sweep was stopped): as interrupted
    UNREADABLE = "unreadable", 3, False  # a catalog row for a run.parquet that cannot be read (re-read at each sync)

    def __new__(cls, value: str, exit_code: int, final: bool) -> Status:
        member = str.__new__(cls, value)
        member._value_ = value
        member.exit_code = exit_code
        member.final = final  # a run never leaves it: the catalog need not re-read the run
        return member

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @classmethod
    def parse(cls, text: str) -> Status:
        """The status stored as ``text``; ValueError naming the known ones for anything else (the CLI turns it
        into bad input, exit 2)."""
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"unknown run status {text!r}: pass one of {', '.join(s.value for s in cls)}") from None


def exit_code_for(text: str) -> int:
    """The exit code a recorded status stands for; a status this version does not know counts as crashed."""
    try:
        return Status(text).exit_code
    except ValueError:
        return Status.CRASHED.exit_code


def signal_exit_code(signum: int) -> int:
    """What a shell reports for a process ended by signal ``signum`` (143 for SIGTERM, 140 for SIGUSR2)."""
    return 128 + signum


# Worst first: Ctrl-C, SIGTERM, (another signal, 128+N), lost (SIGKILL), bad input, crashed, a failed check,
# an expectation missed, ok. A code that is neither (not one tfmoe gives) ranks first: it is never hidden.
WORST_FIRST = (Status.INTERRUPTED.exit_code, signal_exit_code(signal.SIGTERM), Status.LOST.exit_code, Status.ERROR.exit_code,
               Status.CRASHED.exit_code, Status.FAILED.exit_code, Status.UNEXPECTED.exit_code, Status.OK.exit_code)
_OTHER_SIGNAL_RANK = 1.5  # after SIGTERM (index 1), before lost (index 2)


def worst_exit_code(codes: Iterable[int]) -> int:
    """The exit code of several runs (a sweep, `tfmoe all`): the worst by :data:`WORST_FIRST`; 0 for none."""

    def rank(code: int) -> float:
        if code in WORST_FIRST:
            return WORST_FIRST.index(code)
        return _OTHER_SIGNAL_RANK if code > 128 else -1

    return min(codes, key=rank, default=Status.OK.exit_code)
