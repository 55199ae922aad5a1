"""Exceptions that map onto the CLI's exit codes (the codes themselves: tfmoe.contract.status)."""

from __future__ import annotations

from tfmoe.contract.status import signal_exit_code


class BadInput(Exception):
    """The user gave input we cannot use. The CLI prints the message as one line and exits 2.

    The message must name the problem and the fix, e.g.
    ``"top_k=9 is larger than n_experts=8: pass top_k between 1 and 8"``.
    """


class AdapterError(RuntimeError):
    """tfmoe or one of its shipped adapters is at fault (an incompatible library release, a contract the adapter
    itself breaks), never the layer under test: the run crashes (status ``crashed``, exit 3) with a message naming
    the library, its version and the supported range."""


class ContractError(RuntimeError):
    """The code under test returned something the adapter protocol (or the kernel signature) does not allow: that
    check's failure when the code is the user's, tfmoe's fault (:class:`AdapterError`) when a shipped adapter
    drives a library."""


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
        return signal_exit_code(self.signum)


def raise_terminated(signum: int, frame: object = None) -> None:
    """A signal handler: turn the signal into :class:`Terminated` in the main thread."""
    raise Terminated(signum)


# What the file system, not tfmoe, refuses: a full disk or quota, a read-only mount, a failing device
DISK_ERRNOS = {28, 122, 30, 5}  # ENOSPC, EDQUOT, EROFS, EIO


def disk_problem(exc: BaseException, path: object = None) -> str | None:
    """One line naming the cause, the path and the fix when ``exc`` (or what caused it) is a full disk, a quota, a
    read-only file system or a failing device (EIO); None for any other error."""
    import errno
    import os

    seen: BaseException | None = exc
    visited: set[int] = set()  # a chain can loop back (an exception re-raised while handling itself)
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        code = getattr(seen, "errno", None)
        if code is None and "No space left on device" in str(seen):
            code = errno.ENOSPC
        if code is None and "database or disk is full" in str(seen):
            code = errno.ENOSPC
        if code is None and ("disk I/O error" in str(seen) or "Input/output error" in str(seen)):  # SQLite, Arrow
            code = errno.EIO
        if code in DISK_ERRNOS:
            where = getattr(seen, "filename", None) or path
            fix = {errno.EROFS: "pass run_root=DIR that you can write",
                   errno.EIO: "check the device (dmesg), or pass run_root=DIR on another disk"}.get(
                code, "free space there, or pass run_root=DIR on another disk")
            return f"cannot write {where}: {os.strerror(code)} (errno {errno.errorcode[code]}): {fix}"
        seen = seen.__cause__ or seen.__context__
    return None
