"""`tfmoe sql`'s kept views, extended by the runs added after them (catalog.view's Extension) instead of rebuilt.

The reference is always a catalog and views built afresh from the directories (``rebuilt``): the text `tfmoe sql`
prints for ``SELECT * FROM view`` with no ORDER BY (the view's own row and column order, as a user sees it) must be
the same. Each rule that keeps the extension exact (no changed or deleted run, new runs after all the others, their
columns a subset of the kept ones with the same types) has a planted test: without it, the text differs.
"""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.harness.reading import sql
from tfmoe.harness.reading.sql_output import csv_text
from tfmoe.harness.store import catalog, notebook, rundir
from tfmoe.status import Status

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
    real = catalog._extensible

    def spy(conn: object, root: Path, name: str, *args: object) -> object:
        found = real(conn, root, name, *args)
        if found is not None:
            got.append(name)
        return found

    monkeypatch.setattr(catalog, "_extensible", spy)
    return got


def same_as_rebuilt(root: Path) -> None:
    for view in VIEWS:
        assert printed(root, view) == rebuilt(root, view), view


def test_runs_added_after_the_kept_views_extend_them_and_print_as_rebuilt(root: Path, extended: list[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog, "STALE_VIEW_S", 0.0)  # the files an extension replaced are deleted at once
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


CHANGES = {"a run that ends": (_finish_the_last_run, _only_order),
           "a run deleted": (_delete_a_run, _only_order),
           "a run older than the kept ones": (_add_a_run_older_than_the_kept_ones, _only_count)}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_other_than_appended_runs_rebuilds_the_views(root: Path, extended: list[str], change: str) -> None:
    CHANGES[change][0](root)
    extended.clear()
    same_as_rebuilt(root)
    assert extended == [], extended


@pytest.mark.parametrize("change", list(CHANGES))
def test_planted_without_its_rule_an_extended_view_differs_from_a_rebuilt_one(
        root: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    make_change, planted = CHANGES[change]
    monkeypatch.setattr(catalog, "_only_appended", planted)
    make_change(root)
    assert printed(root, "runs") != rebuilt(root, "runs")


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
    real, calls = catalog._read_kept, []

    def vanished(path: Path) -> object:
        calls.append(path.name)
        path.unlink()
        return real(path)

    monkeypatch.setattr(catalog, "_read_kept", vanished)
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
    assert catalog._only_appended(versions, gen, held) is expected


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
