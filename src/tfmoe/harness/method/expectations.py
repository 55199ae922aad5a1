"""Expectations: the user's prediction, written down before the run and judged by it afterwards.

Config form (``conf/base.yaml`` key ``expect``, default ``{}``)::

    expect: {cv: "< 0.1"}                                   # METRIC: "OP VALUE"
    expect: {"cv[strategy=aux_free]": "~ 0.3 ± 0.1"}         # a tag selection (YAML key)
    expect: {balance: "max(cv[strategy=aux_free]) in [0, 0.6]"}  # any label: "METRIC OP VALUE"

OP is one of ``< <= > >= == !=``, ``~ VALUE ± TOL`` (``+-`` too) or ``in [A, B]``. METRIC is a metric name,
optionally with tag selections ``name[tag=value,...]``, optionally inside an aggregate ``max( )``, ``min( )``,
``mean( )``, ``first( )``, ``last( )``. A metric recorded per step is judged at its last step unless an
aggregate is named; when several rows remain (e.g. one per strategy) every one of them must hold and the
observed value is the one that misses most. Nothing here imports torch: validation runs before any run starts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tfmoe.contract.errors import BadInput
from tfmoe.harness.store.rundir import is_missing

AGGREGATES = ("max", "min", "mean", "first", "last")
COMPARISONS = ("<=", ">=", "==", "!=", "<", ">")  # two-character operators first
NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf"
_METRIC_RE = re.compile(r"^\s*(?:(?P<agg>[A-Za-z_]+)\(\s*(?P<inner>[^()]*?)\s*\)|(?P<bare>[^()\s][^()]*?))\s*$")
_NAME_RE = re.compile(r"^(?P<name>[A-Za-z_][\w.\-{}]*)(?:\[(?P<tags>[^\[\]]*)\])?$")
_OP_RE = re.compile(r"^\s*(?P<op><=|>=|==|!=|<|>|~|in\b)\s*(?P<rest>.*?)\s*$")
GRAMMAR = ('write "OP VALUE" with OP one of < <= > >= == !=, "~ VALUE ± TOL" or "in [A, B]", e.g. '
           "expect={cv: \"< 0.1\"} or --expect \"max(cv[strategy=aux_free]) < 0.5\"")


@dataclass(frozen=True)
class Expectation:
    """One parsed prediction."""

    label: str  # the config key
    metric: str  # metric name
    tags: tuple[tuple[str, str], ...]  # tag selections, in the order written
    aggregate: str | None  # max/min/mean/first/last, or None (last step, every remaining row)
    op: str  # < <= > >= == != ~ in
    low: float  # the value (the centre for ~, A for in)
    high: float | None  # TOL for ~, B for in

    @property
    def selector(self) -> str:
        sel = self.metric + (f"[{','.join(f'{k}={v}' for k, v in self.tags)}]" if self.tags else "")
        return f"{self.aggregate}({sel})" if self.aggregate else sel

    @property
    def expected(self) -> str:
        if self.op == "~":
            return f"~ {_num(self.low)} ± {_num(self.high)}"
        if self.op == "in":
            return f"in [{_num(self.low)}, {_num(self.high)}]"
        return f"{self.op} {_num(self.low)}"

    @property
    def text(self) -> str:
        return f"{self.selector} {self.expected}"

    def margin(self, v: float) -> float:
        """How far ``v`` is inside the expectation (>= 0 inside for the non-strict forms); NaN never holds."""
        if math.isnan(v):
            return -math.inf
        x, h = self.low, self.high
        return {"<": x - v, "<=": x - v, ">": v - x, ">=": v - x, "==": -abs(v - x), "!=": abs(v - x),
                "~": (h or 0.0) - abs(v - x), "in": min(v - x, (h or 0.0) - v)}[self.op]

    def holds(self, v: float) -> bool:
        if math.isnan(v):
            return False
        x, h = self.low, self.high
        return {"<": v < x, "<=": v <= x, ">": v > x, ">=": v >= x, "==": v == x, "!=": v != x,
                "~": abs(v - x) <= (h or 0.0), "in": x <= v <= (h or 0.0)}[self.op]


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.6g}"


def _float(text: str, what: str, label: str) -> float:
    text = text.strip()
    if not re.fullmatch(NUMBER, text):
        raise BadInput(f"expectation {label!r}: {what} {text!r} is not a number: {GRAMMAR}")
    return float(text)


def parse_condition(text: str, label: str) -> tuple[str, float, float | None]:
    """'< 0.1' | '~ 0.3 ± 0.05' | '~ 0.3 +- 0.05' | 'in [0, 1]' -> (op, low, high)."""
    m = _OP_RE.match(text)
    if not m:
        raise BadInput(f"expectation {label!r}: {text!r} has no operator: {GRAMMAR}")
    op, rest = m["op"], m["rest"]
    if op == "~":
        parts = re.split(r"±|\+-|\+/-", rest)
        if len(parts) != 2:
            raise BadInput(f"expectation {label!r}: {text!r} needs a tolerance: write \"~ VALUE ± TOL\" (or +-)")
        centre, tol = _float(parts[0], "value", label), _float(parts[1], "tolerance", label)
        if tol < 0:
            raise BadInput(f"expectation {label!r}: tolerance {tol:g} is negative: write a tolerance >= 0")
        return op, centre, tol
    if op == "in":
        m2 = re.fullmatch(r"\[\s*([^,\]]+?)\s*,\s*([^,\]]+?)\s*\]", rest)
        if not m2:
            raise BadInput(f"expectation {label!r}: {text!r}: write an interval as \"in [A, B]\"")
        a, b = _float(m2[1], "bound", label), _float(m2[2], "bound", label)
        if a > b:
            raise BadInput(f"expectation {label!r}: interval [{a:g}, {b:g}] is empty: write [low, high]")
        return op, a, b
    return op, _float(rest, "value", label), None


def parse_metric(text: str, label: str) -> tuple[str, tuple[tuple[str, str], ...], str | None]:
    """'max(cv[strategy=aux_free])' -> ('cv', (('strategy', 'aux_free'),), 'max')."""
    m = _METRIC_RE.match(text)
    if not m:
        raise BadInput(f"expectation {label!r}: {text!r} is not a metric: write NAME, NAME[tag=value] or "
                       f"AGG(NAME) with AGG one of {', '.join(AGGREGATES)}")
    agg, inner = (m["agg"], m["inner"]) if m["agg"] else (None, m["bare"])
    if agg is not None and agg not in AGGREGATES:
        raise BadInput(f"expectation {label!r}: unknown aggregate {agg!r}: use one of {', '.join(AGGREGATES)}")
    n = _NAME_RE.match(inner.strip())
    if not n:
        raise BadInput(f"expectation {label!r}: {inner.strip()!r} is not a metric name: write NAME or "
                       "NAME[tag=value,...]")
    tags: list[tuple[str, str]] = []
    for part in filter(None, (p.strip() for p in (n["tags"] or "").split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise BadInput(f"expectation {label!r}: tag selection {part!r} is not tag=value")
        tags.append((key.strip(), value.strip().strip("'\"")))
    return n["name"], tuple(tags), agg


def parse_one(label: str, text: Any) -> Expectation:
    """One config entry: ``label: "OP VALUE"`` (label is the metric) or ``label: "METRIC OP VALUE"``."""
    label = str(label)
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise BadInput(f"expectation {label!r}: {text!r} is not a string: {GRAMMAR}")
    text = str(text).strip()
    if not text:
        raise BadInput(f"expectation {label!r} is empty: {GRAMMAR}")
    if _OP_RE.match(text):
        metric_text, cond = label, text
    else:
        m = re.search(r"(<=|>=|==|!=|<|>|~|\bin\b)", _mask_brackets(text))
        if not m:
            raise BadInput(f"expectation {label!r}: {text!r} has no operator: {GRAMMAR}")
        metric_text, cond = text[:m.start()], text[m.start():]
    name, tags, agg = parse_metric(metric_text, label)
    op, low, high = parse_condition(cond, label)
    return Expectation(label, name, tags, agg, op, low, high)


def _mask_brackets(text: str) -> str:
    """The text with [..] tag selections blanked, so '=' inside them is not read as an operator."""
    out, depth = [], 0
    for ch in text:
        depth += ch == "["
        out.append(" " if depth else ch)
        depth -= ch == "]" and depth > 0
    return "".join(out)


def parse(expect: Any) -> list[Expectation]:
    """The ``expect`` config value (a mapping, or None/{}) -> expectations, refusing malformed ones."""
    if expect is None:
        return []
    if hasattr(expect, "items") and not isinstance(expect, Mapping):  # an OmegaConf DictConfig
        from omegaconf import OmegaConf

        expect = OmegaConf.to_container(expect, resolve=True)
    if not isinstance(expect, Mapping):
        raise BadInput(f"expect={expect!r} is not a mapping: write expect={{cv: \"< 0.1\"}} or --expect \"cv < 0.1\"")
    return [parse_one(k, v) for k, v in expect.items()]


def cli_override(texts: Iterable[str]) -> list[str]:
    """``--expect "cv < 0.1"`` (repeatable) -> Hydra overrides ``++expect.cli1='cv < 0.1'``, parsed first so a
    malformed one is refused before anything runs."""
    out = []
    for i, text in enumerate(texts, start=1):
        if _OP_RE.match(text):
            raise BadInput(f"--expect {text!r} names no metric: write --expect \"METRIC OP VALUE\", e.g. \"cv < 0.1\"")
        parse_one(f"--expect {text}", text)  # the whole expression must stand on its own
        quoted = text.replace("\\", "\\\\").replace("'", "\\'")
        out.append(f"++expect.cli{i}='{quoted}'")
    return out


# ------------------------------------------------------------------------------------------ validation
def validate(expectations: list[Expectation], declared: Mapping[str, Iterable[str] | None], experiment: str) -> None:
    """Refuse an expectation on a metric or tag ``experiment`` does not record (BadInput, listing what exists)."""
    for e in expectations:
        if e.metric not in declared:
            names = ", ".join(sorted(declared))
            raise BadInput(f"expectation {e.label!r}: {experiment} records no metric {e.metric!r}: "
                           f"it records {names}")
        if declared[e.metric] is None:  # a metric whose tags are built at run time: not validated
            continue
        tags = set(declared[e.metric]) | {"step"}
        for key, _ in e.tags:
            if key not in tags:
                known = ", ".join(sorted(tags))
                raise BadInput(f"expectation {e.label!r}: metric {e.metric!r} of {experiment} has no tag "
                               f"{key!r}: its tags are {known}")


def validate_tag_values(expectations: list[Expectation], known: Mapping[str, Iterable[Any]], experiment: str) -> None:
    """Refuse a tag selection whose value the run cannot record, where the experiment knows its tag's values from
    its settings (``known``: tag -> values, the module's optional ``tag_values(settings)``). A tag not in ``known``
    is only known once the run has recorded it: a wrong value there is named when the expectation is judged."""
    for e in expectations:
        for key, wanted in e.tags:
            if key not in known:
                continue
            values = [v for v in known[key]]
            if not any(_tag_matches(v, wanted) for v in values):
                listed = ", ".join(f"{key}={v}" for v in values) or f"no {key} at all"
                raise BadInput(f"expectation {e.label!r}: with these settings {experiment} records {e.metric} for "
                               f"{listed}; not {key}={wanted}: pick one of those, or change the settings")


# ------------------------------------------------------------------------------------------ judging
@dataclass
class Judgement:
    observed: float | None
    held: bool
    rows: int
    miss: float | None  # how far outside the expectation the observed value is (None when it held)
    detail: str  # how the value was taken (which aggregate, which rows) and which row it came from
    where: str = ""  # the row the observed value is: its tag values and step ('' for a mean over rows)


def _tag_matches(value: Any, wanted: str) -> bool:
    if is_missing(value):
        return False
    if str(value) == wanted:
        return True
    try:
        return float(value) == float(wanted)
    except (TypeError, ValueError):
        return False


def select_rows(e: Expectation, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics rows the expectation's name and tag selection pick, in recording order."""
    return [r for r in rows if r.get("name") == e.metric and all(_tag_matches(r.get(k), v) for k, v in e.tags)]


def _step(r: dict[str, Any]) -> int | None:
    import pandas as pd

    s = r.get("step")
    return None if s is None or (pd.api.types.is_scalar(s) and pd.isna(s)) else int(s)


def _present(v: Any) -> bool:
    import pandas as pd

    return v is not None and not (pd.api.types.is_scalar(v) and pd.isna(v)) and str(v) != ""


def row_label(r: dict[str, Any]) -> str:
    """'strategy=none, step 199': a metrics row's tag values and step (what names the row a value came from)."""
    tags = [f"{k}={_num(v) if isinstance(v, float) else v}" for k, v in r.items()
            if k not in ("name", "value", "step", "measured") and _present(v)]
    step = _step(r)
    return ", ".join(tags + ([f"step {step}"] if step is not None else []))


def _unknown_tag_values(e: Expectation, rows: list[dict[str, Any]]) -> str:
    """Which selected tag values the run never recorded for the metric, with the values it did record."""
    named = [r for r in rows if r.get("name") == e.metric]
    out = []
    for key, wanted in e.tags:
        seen = sorted({str(r.get(key)) for r in named if _present(r.get(key))})
        if not any(_tag_matches(v, wanted) for v in seen):
            listed = ", ".join(seen[:12]) + (" …" if len(seen) > 12 else "")
            out.append(f"{key}={wanted} is not a value it recorded ({key}: {listed or 'none'})")
    return "; ".join(out)


def recorded_names_like(metric: str, rows: list[dict[str, Any]]) -> list[str]:
    """The metric names a run did record that ``metric`` likely means, when it recorded none of ``metric``, sorted:
    those whose last dotted part is ``metric`` (``cv`` -> ``course.cv``, ``layer.cv``), else the closest spelling;
    [] when the run recorded ``metric`` itself or nothing like it."""
    import difflib

    names = sorted({str(r.get("name")) for r in rows if r.get("name") is not None})
    if metric in names:
        return []
    tail = [n for n in names if n.rsplit(".", 1)[-1] == metric or metric.rsplit(".", 1)[-1] == n]
    return tail or difflib.get_close_matches(metric, names, n=1, cutoff=0.8)


def judge(e: Expectation, rows: list[dict[str, Any]]) -> Judgement:
    picked = select_rows(e, rows)
    if not picked:
        like = recorded_names_like(e.metric, rows)  # [] when the run recorded the name (a tag picks nothing)
        unknown = "" if like else _unknown_tag_values(e, rows)
        meant = " or ".join([", ".join(like[:-1]), like[-1]] if len(like) > 1 else like)
        return Judgement(None, False, 0, None, f"the run recorded no rows of {e.selector}"
                         + (f": {unknown} (this tag's values are known only once the run has recorded them: check the spelling)"
                            if unknown else "")
                         + (f"; did you mean {meant}?" if like else ""))
    steps = [_step(r) for r in picked]
    ordered = [r for _, r in sorted(enumerate(picked), key=lambda ir: (steps[ir[0]] is None, steps[ir[0]] or 0, ir[0]))]
    values = [float(r["value"]) for r in ordered]
    if e.aggregate == "mean":
        candidates: list[tuple[float, dict[str, Any] | None]] = [(sum(values) / len(values), None)]
        how = f"the mean over {len(values)} row(s)"
    elif e.aggregate:
        pick = {"max": lambda: max(range(len(values)), key=lambda i: values[i]),
                "min": lambda: min(range(len(values)), key=lambda i: values[i]),
                "first": lambda: 0, "last": lambda: len(values) - 1}[e.aggregate]()
        candidates = [(values[pick], ordered[pick])]
        how = f"the {e.aggregate} over {len(values)} row(s)"
    else:
        known = [s for s in steps if s is not None]
        if known:
            last = max(known)
            candidates = [(float(r["value"]), r) for r, s in zip(picked, steps, strict=True) if s == last]
            how = f"the value at its last step ({last}), not an average over steps"
        else:
            candidates = [(v, r) for v, r in zip(values, ordered, strict=True)]
            how = f"{len(values)} row(s)" if len(values) > 1 else "1 row"
        if len(candidates) > 1:
            how += f"; all {len(candidates)} rows must hold, the one that misses most is shown"
    worst, row = min(candidates, key=lambda c: e.margin(c[0]))
    held = all(e.holds(v) for v, _ in candidates)
    miss = None if held else (math.inf if math.isnan(worst) else max(0.0, -e.margin(worst)))
    where = row_label(row) if row is not None else ""
    return Judgement(worst, held, len(picked), miss, how + (f"; observed at {where}" if where else ""), where)


def describe_miss(e: Expectation, j: Judgement) -> str:
    """'maxvio < 0.5 did not hold: observed 2.54688 at strategy=none, step 199 (the value at its last step (199),
    not an average over steps; ...) (misses by 2.05)'."""
    if j.observed is None:
        return f"{e.text} could not be judged: {j.detail}"
    by = "" if j.miss is None else (" (the value is NaN)" if math.isinf(j.miss) else f" (misses by {j.miss:.4g})")
    how = j.detail.split("; observed at ")[0]
    return f"{e.text} did not hold: observed {j.observed:.6g}{' at ' + j.where if j.where else ''} ({how}){by}"


def frame(expectations: list[Expectation], written_at: Any, judgements: list[Judgement] | None = None,
          judged_at: Any = None) -> Any:
    """expectations.parquet rows: the prediction (and, once judged, what the run observed)."""
    import pandas as pd

    rows = []
    for i, e in enumerate(expectations):
        j = judgements[i] if judgements is not None else None
        rows.append({"label": e.label, "metric": e.metric, "selector": e.selector, "aggregate": e.aggregate,
                     "expected": e.expected, "observed": None if j is None else j.observed,
                     "held": None if j is None else j.held, "miss": None if j is None else j.miss,
                     "rows": None if j is None else j.rows, "detail": "" if j is None else j.detail,
                     "written_at": written_at, "judged_at": judged_at if j is not None else None})
    return pd.DataFrame(rows, columns=["label", "metric", "selector", "aggregate", "expected", "observed", "held",
                                       "miss", "rows", "detail", "written_at", "judged_at"]).astype(
        {"observed": "float64", "miss": "float64"})
