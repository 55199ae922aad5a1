"""scripts/first_contact.py (issue 28, item 6): the case list keeps its promises and the verdict rule is right.

The measurement itself needs the libraries (bash scripts/first-contact.sh, not CI); these tests need none of them.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "first_contact.py"


@pytest.fixture(scope="module")
def fc():
    spec = importlib.util.spec_from_file_location("first_contact_driver", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_five_libraries_each_with_a_correct_case_and_two_planted_bugs(fc):
    kinds = {lib: Counter(c.kind for c in fc.CASES if c.library == lib) for lib in {c.library for c in fc.CASES}}
    assert len(kinds) >= 5
    for lib, k in kinds.items():
        assert k["correct"] >= 1 and k["bug"] >= 2, (lib, k)
    assert len({c.id for c in fc.CASES}) == len(fc.CASES)
    reserved = ("litgpt", "diffusers", "torchtitan", "olmo-core", "open-clip", "open_clip")
    assert not [r for r in reserved if r in SCRIPT.read_text().lower()]


def test_every_analysed_cause_names_a_case_and_an_exit_code(fc):
    ids = {c.id for c in fc.CASES}
    for case_id, (code, cause) in fc.CAUSES.items():
        assert case_id in ids and code in (0, 1, 2, 3) and cause.startswith("C"), case_id


@pytest.mark.parametrize(("kind", "code", "measured", "expected"), [
    ("correct", 0, False, "ok"),
    ("correct", 1, True, "false alarm"),
    ("correct", 3, False, "false alarm"),
    ("refusal", 2, False, "ok"),
    ("refusal", 3, False, "false alarm"),
    ("adapter-error", 1, False, "ok"),
    ("adapter-error", 2, False, "ok"),
    ("adapter-error", 3, False, "false alarm"),
    ("bug", 1, True, "ok"),
    ("bug", 1, False, "bug not judged (every failed check raised)"),  # only the layer's exception: not caught
    ("bug", 0, False, "missed bug"),
    ("bug", 3, False, "bug not judged (exit 3)"),
])
def test_verdict(fc, kind, code, measured, expected):
    assert fc.verdict(kind, code, measured) == expected


def test_read_run_tells_a_measured_failure_from_a_raised_one(fc, tmp_path):
    d = tmp_path / "runs" / "attn-check" / "r1"
    d.mkdir(parents=True)
    pd.DataFrame([{"status": "failed", "notes": None}]).to_parquet(d / "run.parquet")
    checks = pd.DataFrame({"check": ["shapes", "sdpa_match", "grad_match"], "passed": [True, False, False],
                           "observed": [0.0, 1.0, 2.0], "threshold": [0.0, 0.5, 1.0],
                           "detail": ["ok", "raised ValueError: no", "max err 2 (limit 1)"]})
    checks.to_parquet(d / "checks.parquet")
    status, failed, na, run_dir, measured = fc._read_run(tmp_path / "runs")
    assert (status, failed, measured) == ("failed", ["sdpa_match", "grad_match"], True)
    checks.iloc[:2].to_parquet(d / "checks.parquet")
    assert fc._read_run(tmp_path / "runs")[4] is False  # the only failure raised
    assert fc._read_run(tmp_path / "nothing")[0] == "no run"


def test_table_and_summary_count_false_alarms_and_missed_bugs(fc):
    def row(case, kind, code, verdict):
        return fc.Row(case, "lib", "1.0", kind, "x", f"tfmoe attn-check impl={case}", code, "s", verdict=verdict)

    rows = [row("a", "correct", 0, "ok"), row("b", "correct", 1, "false alarm"), row("c", "refusal", 3, "false alarm"),
            row("d", "bug", 1, "ok"), row("e", "bug", 0, "missed bug")]
    assert fc.summary(rows).startswith("5 cases: 1 of 3 correct layers / refusals as expected, 2 false alarm(s) "
                                       "(1 correct layers failed or crashed); 1 of 2 planted bugs caught, 1 missed")
    table = fc.markdown(rows)
    assert table.count("\n") == 7 and "| yes |" in table and "| missed |" in table
