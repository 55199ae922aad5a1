"""Finite or failed: a run that trains, or reports a loss, gradient or norm, checks that what it reported stayed
finite, and names the first step and quantity that did not.

The check reads the run's own metrics rows (what it reports is what is judged), in the order they were recorded,
so "first" is the first in time: the first step, and within a step the first quantity recorded. A setting meant to
diverge (a stress test) says so with ``expect_divergence: true`` in its config: the check then passes only when
the run did diverge, so the stress test still proves what it claims. Pure Python: no torch import.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tfmoe.contract.errors import BadInput

EXPECT_DIVERGENCE_FIX = "pass expect_divergence=true (a stress test) or expect_divergence=false"


@dataclass(frozen=True)
class Finiteness:
    """What :func:`scan` found among the rows it was given."""

    total: int  # values scanned
    bad: int  # non-finite ones
    first: dict[str, Any] | None  # the first non-finite row (recording order)
    per_quantity: dict[str, tuple[int, int]]  # name -> (non-finite, total), for the names with a non-finite value

    @property
    def finite(self) -> bool:
        return self.bad == 0


def where(row: dict[str, Any]) -> str:
    """``task_loss = nan at step 1 (strategy=none)``: the value, its step and its tags."""
    tags = {k: v for k, v in row.items() if k not in ("name", "value", "step", "measured") and v is not None}
    at = f" at step {row['step']}" if row.get("step") is not None else ""
    tag_text = f" ({', '.join(f'{k}={v}' for k, v in tags.items())})" if tags else ""
    return f"{row['name']} = {row['value']}{at}{tag_text}"


def scan(rows: Iterable[dict[str, Any]]) -> Finiteness:
    """Count the non-finite values of ``rows`` (metrics rows) and keep the first."""
    total = bad = 0
    first = None
    counts: dict[str, list[int]] = {}
    for row in rows:
        total += 1
        c = counts.setdefault(row["name"], [0, 0])
        c[1] += 1
        if not math.isfinite(float(row["value"])):
            bad += 1
            c[0] += 1
            first = first or row
    return Finiteness(total, bad, first, {k: (b, n) for k, (b, n) in counts.items() if b})


def check_finite(rec: Any, name: str, quantities: Iterable[str], *, expect_divergence: bool = False,
                 what: str = "", **tags: Any) -> bool:
    """Record check ``name``: every metrics row the run recorded so far whose name is in ``quantities`` (and whose
    tags match ``tags``) is finite. Its detail names the first non-finite step and quantity, and how many of each
    quantity went non-finite. Under ``expect_divergence`` the check passes only when some value is non-finite."""
    names = set(quantities)
    rows = [r for r in rec.metrics_rows
            if r["name"] in names and all(r.get(k) == v for k, v in tags.items())]
    found = scan(rows)
    scope = f"{found.total} value(s) of {', '.join(sorted(names))}" + (f" ({what})" if what else "")
    if found.first is not None:
        counts = "; ".join(f"{q} {b} of {n}" for q, (b, n) in found.per_quantity.items())
        detail = f"diverged: first non-finite {where(found.first)}; non-finite: {counts}; of {scope}"
    else:
        detail = f"all {scope} finite"
    if expect_divergence:
        detail = ("expect_divergence=true (a stress test): " + detail
                  + ("" if found.bad else ": it was expected to diverge; set expect_divergence=false if it should "
                     "not"))
        return rec.check(name, found.bad > 0, float(found.bad), 1.0, detail)
    return rec.check(name, found.finite, float(found.bad), 0.0, detail)


def expect_divergence(cfg: Any) -> bool:
    """The config's ``expect_divergence`` (false when absent), refused unless a boolean."""
    value = cfg.get("expect_divergence", False)
    if not isinstance(value, bool):
        raise BadInput(f"expect_divergence={value!r} is not a boolean: {EXPECT_DIVERGENCE_FIX}")
    return value
