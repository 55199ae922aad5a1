"""`tfmoe sql`'s kept views, extended by the runs changed after them (kept_views.view's Extension) instead of rebuilt.

The reference is always a catalog and views built afresh from the directories (``rebuilt``): the text `tfmoe sql`
prints for ``SELECT * FROM view`` with no ORDER BY (the view's own row and column order, as a user sees it) must be
the same. Each rule that keeps the extension exact has a planted test: without it, the text differs. The rules:
no kept run changed or was deleted, or (the runs view) the changed ones are its last runs by path, with exactly
its own columns; new runs come after all the others; their columns are the kept ones' types.
"""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.contract.status import Status
from tfmoe.harness.reading import sql
from tfmoe.harness.reading.sql_output import csv_text
from tfmoe.harness.store import catalog, kept_views, notebook, rundir

VIEWS = ("runs", "metrics", "checks", "timings")


def printed(root: Path, view: str) -> str:
    """What `tfmoe sql "SELECT * FROM view" --format csv` prints: the view's own order, no ORDER BY."""
    return csv_text(sql.query(root, f"SELECT * FROM {view}"))


def rebuilt(root: Path, view: str) -> str:
    """The same text from a catalog and views built afresh: the kept ones are moved aside, then put back."""
    aside = root.parent / f"{root.name}-aside"
    aside.mkdir()
    kept = [p for p in root.iterdir() if p.name.startswith(".tfmoe-")]
    for p in kept:
        p.rename(aside / p.name)
    try:
        return printed(root, view)
    finally:
        for p in root.iterdir():
            if p.name.startswith(".tfmoe-"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        for p in kept:
            (aside / p.name).rename(p)
        aside.rmdir()


def metrics(value: float, tag: object) -> pd.DataFrame:
    return pd.DataFrame({"name": ["loss", "acc"], "value": [value, value / 3], "step": [1, 2], "k": [tag, tag]})


def run_at(root: Path, rel: str, minute: int, status: str = "ok", tag: object = 7) -> notebook.RunWriter:
    """A real run directory started at 00:MM on 2026-01-01, with two checks and two metrics rows (tag column k)."""
    run_dir = root / rel
    writer = notebook.RunWriter(run_dir=run_dir, run_id=run_dir.name, experiment=rel.split("/")[0], seed=minute,
                                argv=[], overrides=[f"seed={minute}"], device="cpu", dtype="fp32",
                                started_at=dt.datetime(2026, 1, 1, 0, minute, tzinfo=dt.timezone.utc))
    writer.start()
    checks = pd.DataFrame({"check": ["c0", "c1"], "passed": [True, minute % 2 == 0], "observed": [0.5, minute + 0.25],
                           "threshold": 1.0, "detail": ["", f"run {minute}"]})
    rundir.write_parquet(checks, run_dir / "checks.parquet", schema=rundir.CHECKS_SCHEMA)
    rundir.write_parquet(metrics(minute + 0.1, tag), run_dir / "metrics.parquet")
    if status != "running":
        finish(writer, status)
    return writer


def finish(writer: notebook.RunWriter, status: str = "ok") -> None:
    writer.finish(None, Status(status), Status(status).exit_code, None, None, None, 100)


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(catalog, "RACY_S", 0.0)  # no run waits to settle: each query sees the runs as written
    return tmp_path / "runs"


@pytest.fixture
def extended(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The views (catalog names: run, metrics, checks, timings) each query extended rather than built."""
    got: list[str] = []
    real = kept_views._extensible

    def spy(conn: object, root: Path, name: str, *args: object) -> object:
        found = real(conn, root, name, *args)
        if found is not None:
            got.append(name)
        return found

    monkeypatch.setattr(kept_views, "_extensible", spy)
    return got


def same_as_rebuilt(root: Path) -> None:
    for view in VIEWS:
        assert printed(root, view) == rebuilt(root, view), view


def test_runs_added_after_the_kept_views_extend_them_and_print_as_rebuilt(root: Path, extended: list[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kept_views, "STALE_VIEW_S", 0.0)  # the files an extension replaced are deleted at once
    run_at(root, "fake/a", 1)
    run_at(root, "fake/b", 2)
    same_as_rebuilt(root)
    assert extended == []  # nothing kept before: built
    for minute in (3, 4):
        extended.clear()
        run_at(root, f"fake/r{minute}", minute)
        same_as_rebuilt(root)
        assert sorted(set(extended)) == ["checks", "metrics", "run", "timings"], extended  # timings: empty, still
    assert printed(root, "runs").count("\n") == 5  # header and four runs
    kept = sorted(f.name.split("-")[0] for f in (root / catalog.VIEWS_DIR).iterdir())
    assert kept == ["checks", "metrics", "run", "timings"]  # one file or empty mark per view (timings: no rows)


def test_the_first_run_extends_an_empty_root_and_a_change_undone_extends_by_nothing(root: Path,
                                                                                    extended: list[str]) -> None:
    root.mkdir()
    same_as_rebuilt(root)  # no run: the empty views
    run_at(root, "fake/a", 1)
    same_as_rebuilt(root)
    assert sorted(set(extended)) == ["checks", "metrics", "run", "timings"]  # from the empty table and marks
    extended.clear()
    run_at(root, "fake/b", 2)
    shutil.rmtree(root / "fake/b")  # added and deleted before any query: the generation moved, the runs did not
    same_as_rebuilt(root)
    assert printed(root, "runs").count("\n") == 2


def _only_order(versions: list[int | None], gen: int, held: int) -> bool:
    """Planted: the unchanged runs are not counted (a changed or deleted run is taken for kept)."""
    old = [v is not None and v <= gen for v in versions]
    return None not in versions and old == sorted(old, reverse=True)


def _only_count(versions: list[int | None], gen: int, held: int) -> bool:
    """Planted: the order is not checked (a run older than the kept ones is appended at the end)."""
    return None not in versions and sum(v <= gen for v in versions) == held  # type: ignore[operator]


def _finish_the_last_run(root: Path) -> None:
    run_at(root, "fake/a", 1)
    last = run_at(root, "fake/b", 2, status="running")
    assert printed(root, "runs") == rebuilt(root, "runs")
    finish(last)


def _delete_a_run(root: Path) -> None:
    for minute in (1, 2, 3):
        run_at(root, f"fake/r{minute}", minute)
    same_as_rebuilt(root)
    shutil.rmtree(root / "fake/r3")


def _add_a_run_older_than_the_kept_ones(root: Path) -> None:
    run_at(root, "fake/a", 1)
    run_at(root, "fake/c", 3)
    same_as_rebuilt(root)
    run_at(root, "fake/b", 2)  # copied in from elsewhere: started before c


def _delete_the_first_run_and_add_one(root: Path) -> None:
    run_at(root, "fake/a", 1)
    run_at(root, "fake/b", 2)
    assert printed(root, "runs") == rebuilt(root, "runs")
    shutil.rmtree(root / "fake/a")
    run_at(root, "fake/c", 3)


def _end_a_run_that_had_a_column_of_its_own(root: Path) -> None:
    """b's run.parquet has a column x no other run has while it runs; the row it ends with has none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run_at(root, "fake/a", 1)
    b = run_at(root, "fake/b", 2, status="running")
    table = pq.read_table(b.run_dir / "run.parquet")
    pq.write_table(table.append_column("x", pa.array([1.5])), b.run_dir / "run.parquet")
    assert printed(root, "runs").splitlines()[0].endswith(",x,path,checks_passed,checks_total")
    finish(b)


CHANGES = {"a run deleted": _delete_a_run, "a run older than the kept ones": _add_a_run_older_than_the_kept_ones,
           "the first run deleted, one added": _delete_the_first_run_and_add_one,
           "a run with a column of its own ends": _end_a_run_that_had_a_column_of_its_own}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_other_than_appended_runs_rebuilds_the_views(root: Path, extended: list[str], change: str) -> None:
    CHANGES[change](root)
    extended.clear()
    same_as_rebuilt(root)
    assert "run" not in extended, extended


def _replaced_without_paths(versions: list[int | None], gen: int, held: int, spelt: list[str], kept_paths: object,
                            kept: Path) -> int | None:
    """Planted: the kept runs' paths are not compared (a deleted run is taken for one that changed at the end)."""
    old = [v is not None and v <= gen for v in versions]
    return held - sum(old) if held > sum(old) and all(old[:sum(old)]) else None


PLANTED = {  # the change, the rule taken away, the planted stand-in
    "a run that ends": (_finish_the_last_run, "_only_appended", _only_order),
    "a run deleted": (_delete_a_run, "_only_appended", _only_order),
    "a run older than the kept ones": (_add_a_run_older_than_the_kept_ones, "_only_appended", _only_count),
    "the first run deleted, one added": (_delete_the_first_run_and_add_one, "_replaced_at_end",
                                         _replaced_without_paths),
    "a run with a column of its own ends": (_end_a_run_that_had_a_column_of_its_own, "sql._same_columns",
                                            lambda parts, schema: True),
}


@pytest.mark.parametrize("change", list(PLANTED))
def test_planted_without_its_rule_an_extended_view_differs_from_a_rebuilt_one(
        root: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    make_change, rule, planted = PLANTED[change]
    monkeypatch.setattr(sql if rule.startswith("sql.") else kept_views, rule.removeprefix("sql."), planted)
    make_change(root)
    assert printed(root, "runs") != rebuilt(root, "runs")


def test_runs_that_end_at_the_end_of_the_kept_runs_view_replace_its_last_rows(root: Path,
                                                                              extended: list[str]) -> None:
    """A sweep's last jobs end (and one more starts) after a query: the kept runs view is extended, its last rows
    replaced by theirs, not rebuilt; the file views, not kept while runs ran, are built."""
    run_at(root, "fake/a", 1)
    jobs = [run_at(root, f"fake/j{m}", m, status="running") for m in (2, 3)]
    same_as_rebuilt(root)
    assert extended == []
    for job in jobs:
        finish(job, "failed")
    run_at(root, "fake/j4", 4, status="running")
    same_as_rebuilt(root)
    assert extended == ["run"], extended  # by the first query; the next ones read the file it kept
    assert [line.split(",")[2] for line in printed(root, "runs").splitlines()[1:]] == ["ok", "failed", "failed",
                                                                                       "running"]


@pytest.mark.parametrize("tag", ["seven", 7.5, None])
def test_a_new_run_whose_columns_do_not_fit_rebuilds_that_view(root: Path, extended: list[str], tag: object) -> None:
    """Its tag k is a string, a double or all-null where the kept metrics view has int64: a rebuild promotes the
    column (or makes it strings), so the metrics view is rebuilt; the others, unchanged in kind, are extended."""
    run_at(root, "fake/a", 1)
    same_as_rebuilt(root)
    extended.clear()
    run_at(root, "fake/b", 2, tag=tag)
    same_as_rebuilt(root)
    assert sorted(set(extended)) == ["checks", "run", "timings"], extended


def test_planted_without_the_column_rule_a_new_type_breaks_the_view(root: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sql, "_fit", lambda parts, schema, new_columns: True)
    run_at(root, "fake/a", 1)
    assert printed(root, "metrics") == rebuilt(root, "metrics")
    run_at(root, "fake/b", 2, tag="seven")
    try:
        got = printed(root, "metrics")
    except Exception as exc:  # noqa: BLE001 (pyarrow refuses to concatenate int64 and string: also a difference)
        got = f"raised {type(exc).__name__}"
    assert got != rebuilt(root, "metrics")


def test_a_damaged_kept_view_is_built_again_not_extended(root: Path, extended: list[str]) -> None:
    run_at(root, "fake/a", 1)
    same_as_rebuilt(root)
    for f in (root / catalog.VIEWS_DIR).iterdir():
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] if f.suffix == ".parquet" else b"?")  # as after a failed copy
    run_at(root, "fake/b", 2)
    same_as_rebuilt(root)
    assert extended == []


def test_a_kept_view_that_vanishes_before_its_rows_are_read_is_built_from_every_run(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its footer read, then the file gone (a concurrent cleaner): the view is built from every run, same rows."""
    run_at(root, "fake/a", 1)
    assert printed(root, "runs") == rebuilt(root, "runs")
    run_at(root, "fake/b", 2)
    real, calls = kept_views._read_kept, []

    def vanished(path: Path) -> object:
        calls.append(path.name)
        path.unlink()
        return real(path)

    monkeypatch.setattr(kept_views, "_read_kept", vanished)
    assert printed(root, "runs") == rebuilt(root, "runs")
    assert len(calls) == 1 and calls[0].startswith("run-")


@pytest.mark.parametrize(("versions", "gen", "held", "expected"), [
    ([], 5, 0, True),  # no runs, none kept
    ([3, 5], 5, 2, True),  # nothing changed
    ([3, 5, 6, 9], 5, 2, True),  # two appended
    ([6], 5, 0, True),  # the first run
    ([3, 6], 5, 2, False),  # the last kept run changed
    ([3], 5, 2, False),  # one deleted
    ([3, 6, 5], 5, 2, False),  # one added before a kept one
    ([3, None, 6], 5, 1, False),  # a run the triggers never saw
    ([3, 5], 5, -1, False),  # a kept file that did not count its runs
])
def test_only_appended(versions: list[int | None], gen: int, held: int, expected: bool) -> None:
    assert kept_views._only_appended(versions, gen, held) is expected


def test_a_new_runs_metrics_in_another_column_order_or_with_a_new_tag_extend_the_view(
        root: Path, extended: list[str]) -> None:
    """The kept view's column order is the rebuild's (first seen first), whatever order a new run writes its columns
    in; a tag no run had before goes last in both."""
    run_at(root, "fake/a", 1)
    same_as_rebuilt(root)
    b = run_at(root, "fake/b", 2)
    rundir.write_parquet(metrics(2.5, 3)[["k", "step", "value", "name"]].assign(fresh=["x", "y"]),
                         b.run_dir / "metrics.parquet")  # before any query: the catalog caches this one
    extended.clear()
    same_as_rebuilt(root)
    assert "metrics" in extended
    assert printed(root, "metrics").splitlines()[0] == "run_id,name,value,step,k,fresh"


def _schema(**columns: object) -> object:
    import pyarrow as pa

    return pa.schema(list(columns.items()))


def test_fit_takes_the_kept_columns_in_any_order_and_new_ones_only_where_a_rebuild_puts_them_last() -> None:
    import pyarrow as pa

    kept = _schema(run_id=pa.string(), name=pa.string(), value=pa.float64())
    part = lambda **cols: _schema(**cols).empty_table()  # noqa: E731
    assert sql._fit([part(value=pa.float64(), run_id=pa.string())], kept, new_columns=False)
    assert sql._fit([], kept, new_columns=False)  # nothing to append
    assert not sql._fit([part(value=pa.float32())], kept, new_columns=True)  # a rebuild would promote it
    assert not sql._fit([part(value=pa.null())], kept, new_columns=True)  # all-null: a rebuild keeps float64
    assert not sql._fit([part(k=pa.int64())], kept, new_columns=False)  # the runs view: before path in a rebuild
    assert sql._fit([part(k=pa.int64()), part(k=pa.int64(), j=pa.string())], kept, new_columns=True)
    assert not sql._fit([part(k=pa.int64()), part(k=pa.string())], kept, new_columns=True)  # two kinds of k


@pytest.mark.parametrize(("versions", "spelt", "kept", "expected"), [
    ([3, 6], ["r/a", "r/b"], ["r/a", "r/b"], 1),  # the last kept run changed
    ([3, 6, 7, 9], ["r/a", "r/b", "r/c", "r/d"], ["r/a", "r/b", "r/c"], 2),  # two changed at the end, one new
    ([6, 7], ["r/a", "r/b"], ["r/a", "r/b"], 2),  # every kept run changed
    ([3, 5], ["r/a", "r/b"], ["r/a", "r/b"], None),  # nothing changed: _only_appended's case
    ([5, 6], ["r/b", "r/c"], ["r/a", "r/b"], None),  # the first deleted, one added: the paths differ
    ([6, 3], ["r/b", "r/a"], ["r/a", "r/b"], None),  # the changed run moved before a kept one
    ([3, None], ["r/a", "r/b"], ["r/a", "r/b"], None),  # a run the triggers never saw
    ([3, 6], ["r/a", "r/b"], ["r/a"], None),  # the kept file holds fewer rows than it counts
])
def test_replaced_at_end(versions: list[int | None], spelt: list[str], kept: list[str], expected: int | None) -> None:
    held = 2 if len(kept) != 3 else 3
    assert kept_views._replaced_at_end(versions, 5, held, spelt, lambda _: kept, Path("kept.parquet")) == expected
    assert kept_views._replaced_at_end(versions, 5, held, spelt, None, Path("kept.parquet")) is None  # no paths kept
