"""The transformers releases the ``hf:`` adapters are tested on, declared once, and the calls that differ between
them (feature-detected from the installed function's signature, never from the version number).

``SUPPORTED`` is the range pyproject's ``hf`` extra declares: the floor is the oldest 5.x release CI tests the
adapters on (``scripts/test-hf-floor.sh``), the ceiling the next major. Outside it ``impl=hf:...`` exits 2 before
any check runs, naming the range. When an adapter breaks inside the range anyway, that is tfmoe's fault, not the
layer's: :func:`adapter_error` says so with the library, its version and the range (the run crashes, exit 3).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from tfmoe.contract.errors import AdapterError, BadInput

# 5.13.0: the oldest release where every hf adapter passes its tests (the attention adapter's pass from 5.0.0;
# route-sim's MoE blocks fail on 5.12.1: their routers' outputs and attributes differ).
FLOOR, CEILING = "5.13.0", "6"
SUPPORTED = f">={FLOOR},<{CEILING}"  # keep in step with pyproject.toml's `hf` extra
HF_EXTRA = f"pip install -e '.[hf]' (transformers{SUPPORTED})"


def installed_version() -> str:
    """The installed transformers' version string (raises ImportError when it is not installed)."""
    import transformers

    return str(transformers.__version__)


def in_range(version: str) -> bool:
    from packaging.version import Version

    return Version(FLOOR) <= Version(version) < Version(CEILING)  # 5.0.0rc1 is below the floor


def require_transformers() -> Any:
    """The transformers module, or BadInput (exit 2) naming the extra / the supported range."""
    try:
        version = installed_version()
    except ImportError:
        raise BadInput(f"impl=hf:... needs the optional extra `hf`: {HF_EXTRA}") from None
    if not in_range(version):
        raise BadInput(f"impl=hf:... supports transformers{SUPPORTED} (the releases its adapters are tested on), "
                       f"found {version}: {HF_EXTRA}")
    import transformers

    return transformers


def adapter_error(what: str, exc: BaseException | None = None) -> AdapterError:
    """tfmoe's hf adapter could not drive the installed transformers: library, version, supported range."""
    try:
        version = installed_version()
    except ImportError:
        version = "not installed"
    cause = f": {type(exc).__name__}: {exc}" if exc is not None else ""
    return AdapterError(f"tfmoe's hf adapter failed on transformers {version} (supported {SUPPORTED}): {what}"
                        f"{cause} — a tfmoe bug, not your layer's; please report it")


def call_compatible(fn: Callable[..., Any], **candidates: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature takes. A candidate may be given under several names
    as ``"name_a|name_b"``: the first name ``fn`` accepts is used (transformers renamed ``input_embeds`` to
    ``inputs_embeds`` and ``past_key_values`` to ``cache`` within 5.x). A required parameter none of the
    candidates fills is an :class:`AdapterError`."""
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {}
    for names, value in candidates.items():
        for name in names.split("|"):
            if name in params:
                kwargs[name] = value
                break
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in kwargs
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise adapter_error(f"{fn.__module__}.{fn.__qualname__} needs {missing}, which the adapter does not know")
    return fn(**kwargs)
