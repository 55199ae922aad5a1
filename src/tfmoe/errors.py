"""Exceptions that map onto the CLI's exit codes."""

from __future__ import annotations


class BadInput(Exception):
    """The user gave input we cannot use. The CLI prints the message as one line and exits 2.

    The message must name the problem and the fix, e.g.
    ``"top_k=9 is larger than n_experts=8: pass top_k between 1 and 8"``.
    """


EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNEXPECTED = 4  # every check passed, but an expectation (the user's prediction) did not hold
EXIT_INTERRUPTED = 130
EXIT_LOST = 137  # 128 + SIGKILL: what a shell reports for a killed process; readers derive `lost` (no one records it)
EXIT_TERMINATED = 143  # 128 + SIGTERM: what SLURM sends at a job's time limit, and `kill`'s default


class Terminated(BaseException):
    """Raised in the main thread when the process gets SIGTERM (or another terminating signal), like Ctrl-C
    raises KeyboardInterrupt: the run records what it has, its status becomes ``interrupted``, and the
    process exits 128 + the signal's number (143 for SIGTERM)."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"terminated by {self.signal_name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def raise_terminated(signum: int, frame: object = None) -> None:
    """A signal handler: turn the signal into :class:`Terminated` in the main thread."""
    raise Terminated(signum)
