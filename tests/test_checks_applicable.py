"""checks.parquet's ``applicable`` column (Recorder.not_applicable: a check that cannot be judged on this layer) as
every reader shows it: `show` and summary.md print n/a, the outcome table counts "1/1 (+1 n/a)", diff compares it,
the sql `checks` view has the column and the runs view counts only judged checks; a run written before the column
existed reads as applicable (rundir.with_applicable, the one place)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from tfmoe.api.testing import launched, run_cli
from tfmoe.harness.store import notebook, rundir


def _sql(root: Path, query: str) -> list[dict]:
    r = run_cli(["sql", query, "--format", "json", "--runs-root", str(root)], root.parent)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_not_applicable_checks_read_as_na_everywhere(fake_experiment, capsys) -> None:
    from tfmoe.harness.reading.reports import print_outcome

    code, (na,) = launched(fake_experiment, ["mode=not_applicable"])
    assert code == 0
    _, (plain,) = launched(fake_experiment, [])
    root = na.parents[1]
    table = pq.read_table(na / rundir.TABLE_FILES["checks"])
    assert dict(zip(table["check"].to_pylist(), table["applicable"].to_pylist(), strict=True)) == {
        "needs_a_feature": False, "always_true_for_ok": True}
    capsys.readouterr()
    print_outcome([na], [])
    assert "1/1 (+1 n/a)" in capsys.readouterr().out
    assert "| needs_a_feature | n/a |" in (na / "summary.md").read_text()
    show = run_cli(["show", str(na), "--runs-root", str(root)], root.parent)
    assert "checks 1/1 (+1 n/a)" in show.stdout and "n/a" in show.stdout, show.stdout
    d = run_cli(["diff", str(plain), str(na), "--format", "json", "--runs-root", str(root)], root.parent)
    checks = {c["check"]: (c["A"], c["B"]) for c in json.loads(d.stdout)["checks"]}
    assert checks["needs_a_feature"] == (None, "n/a"), checks
    rows = _sql(root, "SELECT run_id, \"check\", applicable FROM checks ORDER BY run_id, \"check\"")
    assert {(r["check"], r["applicable"]) for r in rows if r["run_id"] == na.name} == {
        ("needs_a_feature", False), ("always_true_for_ok", True)}
    counts = {r["run_id"]: (r["checks_passed"], r["checks_total"])
              for r in _sql(root, "SELECT run_id, checks_passed, checks_total FROM runs")}
    assert counts == {na.name: (1, 1), plain.name: (1, 1)}


def test_a_run_older_than_the_column_reads_as_applicable(fake_experiment) -> None:
    _, (old,) = launched(fake_experiment, [])
    f = old / rundir.TABLE_FILES["checks"]
    pq.write_table(pq.read_table(f).drop(["applicable"]), f)  # as runs were written before the column
    data = notebook.load_run(old)
    assert [r["applicable"] for r in data.rows("checks")] == [True]
    root = old.parents[1]
    assert _sql(root, "SELECT applicable FROM checks") == [{"applicable": True}]
    assert rundir.checks_cell(data.rows("checks")) == "1/1"
    assert rundir.checks_cell([{"passed": True, "applicable": False}, {"passed": False}]) == "0/1 (+1 n/a)"
