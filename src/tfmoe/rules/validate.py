"""Config validation shared by the experiments: each failure is one BadInput line naming the key, the value
and the fix (exit 2)."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import OmegaConf

from tfmoe.contract.errors import BadInput


def _get(cfg: Any, key: str) -> Any:
    return OmegaConf.select(cfg, key) if OmegaConf.is_config(cfg) else cfg.get(key)


def require_int(cfg: Any, key: str, minimum: int | None = 1, fix: str | None = None) -> int:
    """``cfg[key]`` as an int >= ``minimum`` (bools refused)."""
    value = _get(cfg, key)
    bound = "" if minimum is None else f", an integer >= {minimum}"
    example = f"pass e.g. {key}={minimum if minimum is not None else 0}{bound}"  # a value the key accepts
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{key}={value!r} is not an integer: {fix or example}")
    if minimum is not None and value < minimum:
        raise BadInput(f"{key}={value} is below {minimum}: {fix or example}")
    return value


def require_number(cfg: Any, key: str, minimum: float | None = None, positive: bool = False,
                   fix: str | None = None) -> float:
    """``cfg[key]`` as a finite float; ``positive`` demands > 0, ``minimum`` demands >= minimum."""
    value = _get(cfg, key)
    example = f"pass e.g. {key}={minimum if minimum is not None and minimum > 0 else (1.0 if positive else 0.0)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadInput(f"{key}={value!r} is not a finite number: {fix or example}")
    if positive and value <= 0:
        raise BadInput(f"{key}={value} must be > 0: {fix or example}")
    if minimum is not None and value < minimum:
        raise BadInput(f"{key}={value} is below {minimum}: {fix or example}")
    return float(value)
