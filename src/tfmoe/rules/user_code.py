"""Loading the user's own code: ``impl=`` / ``kernel=`` / ``chunked.impl=`` name an object as
``python.module:Name``.

The current directory is importable while the module is imported, as with ``python -m``: a ``my_attn.py``
beside the user needs no PYTHONPATH. Every failure is ``BadInput`` (exit 2) with one line naming the fix; the
caller decides whether the object is of the right kind.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from tfmoe.contract.errors import BadInput


@contextlib.contextmanager
def cwd_importable() -> Iterator[None]:
    """The current directory on sys.path while importing the user's code, as ``python -m`` has it."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def built_adapter(obj: Any, base: type, spec: str) -> Any:
    """``obj`` itself, or an instance when it is a subclass of ``base`` (an adapter class builds with no arguments;
    its raise is the user's bad input, one line)."""
    import inspect

    if not (inspect.isclass(obj) and issubclass(obj, base)):
        return obj
    try:
        return obj()
    except Exception as exc:
        raise BadInput(f"impl={spec!r}: adapter {obj.__qualname__}() raised {type(exc).__name__}: {exc}: "
                       "an adapter class must build with no arguments") from None


def load_object(spec: str, key: str, bad_form: str | None = None) -> Any:
    """'python.module:Name' (Name may be dotted) -> the object; nothing is instantiated.

    ``key`` is the config key that named it (for the messages); ``bad_form`` the one-line message when ``spec``
    is not of the form 'module:Name' (default: the form and an example)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadInput(bad_form or f"{key}={spec!r} is not 'python.module:Name': write e.g. "
                                   f"{key}=mypackage.attn:MyAttention")
    try:
        with cwd_importable():
            module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time error of the user's module is bad input
        raise BadInput(f"{key}={spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}): "
                       "check the module path (the current directory and PYTHONPATH are searched)") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BadInput(f"{key}={spec!r}: module {module_name!r} has no {attr!r}: check the name after ':'")
        obj = getattr(obj, part)
    return obj
