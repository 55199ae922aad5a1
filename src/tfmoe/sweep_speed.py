"""Hydra's per-job composition cost in a sweep, cut without changing what it composes.

Hydra's basic sweeper first composes every job's config to validate the batch, then its launcher composes each
again to run it, and every composition re-reads and re-parses the same YAML files (pure-Python YAML). For the
duration of one multirun, in the launching process only, :func:`faster_composition` wraps the sweep's own config
loader (instance attributes, undone at the end of the sweep): a job's validated config is handed to the launcher
instead of being composed a second time, and each config source returns a deep copy of what it parsed the first
time. The result is the same config Hydra would compose (tests/test_catalog.py compares them).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any


def faster_composition(loader: Any) -> Callable[[], None]:
    """Wrap ``loader`` (Hydra's ConfigLoaderImpl); returns the function that undoes it."""
    undo: list[Callable[[], None]] = []
    sources = getattr(getattr(loader, "repository", None), "sources", None) or []
    for source in sources:
        parse = source.load_config
        parsed: dict[str, Any] = {}

        def load_config(config_path: str, parse: Any = parse, parsed: dict[str, Any] = parsed) -> Any:
            if config_path not in parsed:
                parsed[config_path] = parse(config_path)
            return copy.deepcopy(parsed[config_path])  # Hydra edits what it loads (it pops `defaults`)

        source.load_config = load_config
        undo.append(lambda source=source: source.__dict__.pop("load_config", None))
    compose = loader.load_sweep_config
    validated: dict[tuple[str, ...], Any] = {}
    calls: dict[tuple[str, ...], int] = {}

    def load_sweep_config(master_config: Any, sweep_overrides: list[str]) -> Any:
        key = tuple(sweep_overrides)
        calls[key] = calls.get(key, 0) + 1
        if calls[key] % 2 == 0 and key in validated:  # the launcher's call after the sweeper's validation
            return validated.pop(key)
        cfg = compose(master_config=master_config, sweep_overrides=sweep_overrides)
        validated[key] = cfg  # the sweeper's validation only checks that it composes, and drops it
        return cfg

    loader.load_sweep_config = load_sweep_config
    undo.append(lambda: loader.__dict__.pop("load_sweep_config", None))

    def restore() -> None:
        for u in undo:
            u()

    return restore
