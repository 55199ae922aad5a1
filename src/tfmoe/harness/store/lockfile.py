"""The lock file (requirements.lock, written by `make lock`) and the versions a run recorded against it.

`make setup` installs exactly the locked versions; a run records the versions it ran with (run.parquet's
environment columns). ``version_drift`` names each recorded version that differs from the lock, so `tfmoe show`
can flag a run made in another environment.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tfmoe.contract.paths import CHECKOUT_ROOT

LOCK_FILE = "requirements.lock"
# run.parquet column -> the package (as the lock names it) whose version it records
RECORDED_PACKAGES = {"torch": "torch", "numpy": "numpy", "pandas": "pandas", "pyarrow": "pyarrow",
                     "hydra": "hydra-core"}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;#]+)")


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_path(root: Path = CHECKOUT_ROOT) -> Path | None:
    """The checkout's lock file, or None (an installed, non-editable tfmoe has none)."""
    path = root / LOCK_FILE
    return path if path.is_file() else None


def parse_lock(text: str) -> dict[str, str]:
    """{canonical package name: version} of every ``name==version`` pin (hash and comment lines skipped)."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        m = _PIN.match(line.strip())
        if m:
            pins[canonical(m.group(1))] = m.group(2)
    return pins


def read_lock(path: Path) -> dict[str, str]:
    return parse_lock(path.read_text(encoding="utf-8"))


def public(version: str) -> str:
    """The version without its local build label (2.13.0+cpu -> 2.13.0): a CUDA build of the locked torch is the
    locked version (docs/gpu.md)."""
    return version.split("+", 1)[0]


def version_drift(run: Mapping[str, Any], locked: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(package, the run's version, the locked version) for each recorded version that differs from the lock;
    a version the run did not record, or a package the lock does not pin, is not compared."""
    drift = []
    for column, package in RECORDED_PACKAGES.items():
        recorded, pinned = run.get(column), locked.get(canonical(package))
        if recorded is None or pinned is None or (isinstance(recorded, float) and recorded != recorded):
            continue
        if public(str(recorded)) != public(pinned):
            drift.append((package, str(recorded), pinned))
    return drift
