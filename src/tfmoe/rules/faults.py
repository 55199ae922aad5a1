"""Whose fault an exception raised during a check is: the user's code (that check's failure) or tfmoe's, a shipped
adapter's included (an error: the run crashes, exit 3, and the layer is never blamed).

The rule, applied by the batteries' check wrappers (:func:`tfmoe_fault`):

1. :class:`~tfmoe.contract.errors.AdapterError` is tfmoe's by definition (raised where an adapter knows the installed
   library is not what it was written for).
2. :class:`~tfmoe.contract.errors.ContractError` (the code under test returned something the protocol forbids) is the
   user's, unless a shipped adapter produced it (``library`` is set): then the adapter broke its own contract.
3. Otherwise the traceback decides. Walking from where the exception was raised outwards, frames inside torch
   and the standard library are passed over (they raise on behalf of their caller); the first other frame is
   the code at fault. Inside the tfmoe package: tfmoe's. Inside ``library``, the package a shipped adapter
   drives (e.g. transformers under ``impl=hf:``): the adapter drove it where it does not go, tfmoe's too.
   Anything else (the user's file, any other library the user's layer uses): the user's.

Kernel mode (``attn-check kernel=``) applies the same rule to the kernel's call
(:func:`tfmoe.experiments.attn_check.kernel_judging.kernel_fault`): a built-in kernel is tfmoe's code, so whatever
it raises is tfmoe's; a user's kernel answers for what it, torch or native code under it raises.

A raised check is recorded with observed=None and a detail that starts with :data:`RAISED`, then the exception's
type and its whole message (:func:`raised_detail`); :func:`is_raised` recognises such a row, so the diagnosis never
takes it for a measurement.
"""

from __future__ import annotations

import importlib.metadata
import sys
import sysconfig
import traceback
from pathlib import Path
from types import TracebackType

from tfmoe.contract.errors import AdapterError, ContractError

RAISED = "raised "
_TFMOE = Path(__file__).resolve().parents[1]
_STDLIB = tuple(Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib"))


def _package_dir(name: str) -> Path | None:
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    return Path(file).resolve().parent if file else None


def _under(path: Path, root: Path | None) -> bool:
    return root is not None and (path == root or root in path.parents)


def culprit_frame(exc: BaseException, library: str | None = None) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback outside torch and the standard library (None if none)."""
    torch_dir = _package_dir("torch")
    frames = traceback.extract_tb(exc.__traceback__) if isinstance(exc.__traceback__, TracebackType) else []
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        stdlib = any(_under(path, d) for d in _STDLIB) and not {"site-packages", "dist-packages"} & set(path.parts)
        if _under(path, torch_dir) or stdlib:
            continue
        return frame
    return None


def is_tfmoe_frame(frame: traceback.FrameSummary, library: str | None = None) -> bool:
    path = Path(frame.filename).resolve()
    lib_dir = _package_dir(library) if library and library != "torch" else None
    return _under(path, _TFMOE) or _under(path, lib_dir)


def library_version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def tfmoe_fault(exc: BaseException, who: str, library: str | None = None, supported: str = "") -> AdapterError | None:
    """The error to crash with when tfmoe (or the shipped adapter ``who`` driving ``library``, tested on
    ``supported``) is at fault for ``exc``; None when the user's code is (the check fails with the exception)."""
    if isinstance(exc, AdapterError):
        return exc
    if isinstance(exc, ContractError) and library is None:
        return None
    frame = culprit_frame(exc, library)
    if not isinstance(exc, ContractError) and (frame is None or not is_tfmoe_frame(frame, library)):
        return None
    where = "" if frame is None else f" at {Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    lib = "" if not library else f" on {library} {library_version(library)}" + (
        f" (supported: {library}{supported})" if supported else "")
    return AdapterError(f"{who} raised {type(exc).__name__}: {exc}{where}{lib} — an error in tfmoe or its shipped "
                        "adapter, not a failure of the layer under test; please report it")


def raised_detail(exc: BaseException) -> str:
    """A raised check's detail: the exception's type and its whole message, first."""
    message = " ".join(str(exc).split())
    return f"{RAISED}{type(exc).__name__}" + (f": {message}" if message else "")


def is_raised(observed: object, detail: object) -> bool:
    """Whether a check row records an exception rather than a measurement."""
    return observed is None and isinstance(detail, str) and detail.startswith(RAISED)
