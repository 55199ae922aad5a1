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
