"""The CLI fuzzed from its own schema (issue 29, item 7): hypothesis draws overrides for every registered experiment's
config keys (the registry + conf/*.yaml as composed): wrong types, bounds, zero, negative, huge, NaN/inf, unicode,
unknown keys with and without `+`, list and mapping forms. Each case must end in exit 0, 1, 2 or 4 with no
traceback; exit 2 is one line and writes nothing; exit 0, 1 and 4 leave a complete, readable run.

Every case is first validated (TFMOE_VALIDATE_ONLY: the whole refusal path, in-process, no run); a few that pass
validation with small values are then run for real on experiments that are quick at their defaults. Budget: the
default suite draws FUZZ_EXAMPLES cases (a fixed, derandomized sequence); the long run draws more, at random:

    TFMOE_FUZZ_EXAMPLES=2000 TFMOE_FUZZ_RUNS=40 pytest tests/test_cli_fuzz.py -m fuzz --timeout=0 -s -p no:cacheprovider

(the counts of cases, refusals, real runs and exit codes are printed at the end, with -s).
"""

from __future__ import annotations

import collections
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tfmoe.api.testing import compose, run_cli  # noqa: E402
from tfmoe.contract.registry import EXPERIMENTS  # noqa: E402

LONG = "TFMOE_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("TFMOE_FUZZ_EXAMPLES", "40"))
REAL_RUNS = int(os.environ.get("TFMOE_FUZZ_RUNS", "2"))
# Experiments quick enough at their defaults (plus these overrides) to run for real inside the budget.
QUICK = {"shift-labels": [], "route-sim": ["steps=2", "tokens=64", "train_tokens=64", "strategies=[none]"]}
SKIP_KEYS = {"experiment", "run_root", "expect"}  # run_root: a drawn path would write outside the test's directory
COUNTS: collections.Counter = collections.Counter()


def _leaves(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out += _leaves(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def _schema() -> dict[str, list[tuple[str, Any]]]:
    from omegaconf import OmegaConf

    return {name: [(k, v) for k, v in _leaves(OmegaConf.to_container(compose(name), resolve=False))
                   if not k.startswith("hydra") and k not in SKIP_KEYS] for name in EXPERIMENTS}


SCHEMA = _schema()


def _text(v: Any) -> str:
    """A Python value as Hydra's override grammar writes it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, list):
        return "[" + ",".join(_text(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_text(x)}" for k, x in v.items()) + "}"
    return str(v)


def _values_for(default: Any) -> st.SearchStrategy[str]:
    """Override texts for a key whose default is ``default``: its own type at the edges, and every wrong type."""
    near: list[Any] = []
    if isinstance(default, bool):
        near = [not default]
    elif isinstance(default, int):
        near = [0, 1, -1, default + 1, -default, default * 1000, 2**31, 2**63, 2**64, 10**30]
    elif isinstance(default, float):
        near = [0.0, -0.0, -default, default * 1e6, 1e-300, 1e308, math.nan, math.inf, -math.inf]
    elif isinstance(default, list):
        near = [[], default[:1], default + default[:1], [[]], [None]]
    elif isinstance(default, str):
        near = ["", "zz_nosuch", default.upper(), default + "x"]
    wrong = [None, True, 0, -1, 3, 1.5, math.nan, -math.inf, 2**70, "zz_nosuch", [], [1, 2], ["a", "b"], {"a": 1}]
    raw = ["'我'", "我", "'é\u202e'", "'\U0001F600'", "' '", "''", "1e-5", "0x10", "'1'", "[1,[2,[3]]]", "${seed}",
           "${nosuch}", "a,b", "range(0,2)", "'a\\nb'", "~"]
    return st.one_of(st.sampled_from(near or [default]).map(_text), st.sampled_from(wrong).map(_text),
                     st.sampled_from(raw))


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, list[str]]:
    exp = draw(st.sampled_from(sorted(SCHEMA)))
    overrides = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["key"] * 6 + ["unknown", "plus_unknown", "plus_known", "del"]))
        if kind == "key":
            key, default = draw(st.sampled_from(SCHEMA[exp]))
            overrides.append(f"{key}={draw(_values_for(default))}")
        elif kind == "unknown":
            overrides.append(f"{draw(st.sampled_from(['zz_nosuch', 'model.zz', 'Seed']))}=1")
        elif kind == "plus_unknown":
            overrides.append(f"{draw(st.sampled_from(['+', '++']))}{draw(st.sampled_from(['zz_nosuch', 'a.b']))}=1")
        elif kind == "plus_known":
            key, default = draw(st.sampled_from(SCHEMA[exp]))
            overrides.append(f"+{key}={_text(default)}")
        else:
            key, _ = draw(st.sampled_from(SCHEMA[exp]))
            overrides.append(f"~{key}")
    return exp, overrides


def _small(overrides: list[str]) -> bool:
    """Whether every drawn value is small enough to run for real within the budget."""
    for o in overrides:
        value = o.split("=", 1)[-1]
        try:
            number = float(value)
        except ValueError:
            continue
        if not math.isfinite(number) or abs(number) > 8:
            return False
    return True


def _written(root: Path) -> list[Path]:
    return [p for p in (root / "runs").rglob("*")] if (root / "runs").exists() else []


def _check_case(exp: str, overrides: list[str]) -> None:
    COUNTS["cases"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["TFMOE_VALIDATE_ONLY"] = "1"
        try:
            r = run_cli([exp, *overrides], root)
        finally:
            del os.environ["TFMOE_VALIDATE_ONLY"]
        said = r.stdout + r.stderr
        assert "Traceback" not in said, (exp, overrides, said)
        assert r.exit_code in (0, 2), (exp, overrides, r.exit_code, said)
        assert not _written(root), (exp, overrides, _written(root))
        if r.exit_code == 2:
            COUNTS["refused"] += 1
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: "), (exp, overrides, r.stderr)
            return
        COUNTS["valid"] += 1
        if exp not in QUICK or COUNTS["real_runs"] >= REAL_RUNS or not _small(overrides):
            return
        COUNTS["real_runs"] += 1
        run = run_cli([exp, *QUICK[exp], *overrides], root)
        said = run.stdout + run.stderr
        COUNTS[f"exit_{run.exit_code}"] += 1
        assert "Traceback" not in said and run.exit_code in (0, 1, 2, 4), (exp, overrides, run.exit_code, said)
        if run.exit_code == 2:  # validation passed, the run refused it: nothing must have been written
            assert not _written(root), (exp, overrides, said)
            return
        from tfmoe.harness.store.notebook import load_run

        assert run.run_dir is not None, (exp, overrides, said)
        data = load_run(run.run_dir)  # every table readable
        assert data.run["exit_code"] == run.exit_code and data.run["status"] != "running", dict(data.run)
        assert (run.run_dir / "summary.md").exists()


FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG, database=None,
                         suppress_health_check=list(HealthCheck), print_blob=True)


@pytest.mark.fuzz
@FUZZ_SETTINGS
@given(cases())
def test_the_cli_fuzzed_from_its_own_schema(case: tuple[str, list[str]]) -> None:
    _check_case(*case)


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    print(f"\nfuzz counts: {dict(COUNTS)}")


# The fuzzer's findings, kept as plain regression cases (each one failed before its fix; see failures.md F-edges*).
FOUND = [
    ("shift-labels", ["seed=9223372036854775808"]),
    ("route-sim", ["+zz_nosuch=1"]),
    ("shift-labels", ["tensor_max_numel=-1"]),
    ("route-sim", ["impl='1'"]),  # F-edges: the form was checked only inside the run, after its directory existed
]


@pytest.mark.parametrize(("exp", "overrides"), FOUND, ids=[" ".join(o) for _, o in FOUND])
def test_what_the_fuzzer_found(exp: str, overrides: list[str]) -> None:
    _check_case(exp, overrides)
