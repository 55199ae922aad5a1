"""`tfmoe sql`: read-only DuckDB over the runs, metrics, checks and timings views; writes and bad SQL exit 2."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.api.testing import launched, run_cli
from tfmoe.contract.errors import BadInput
from tfmoe.contract.status import Status
from tfmoe.harness.reading import sql


def _frame(runs_root: Path, query: str) -> pd.DataFrame:
    """A query's result as a DataFrame, for the assertions (tfmoe sql itself does not import pandas)."""
    result = sql.query(runs_root, query)
    return pd.DataFrame(result.rows, columns=result.columns)


@pytest.fixture
def two_runs(fake_experiment) -> list[Path]:
    dirs = []
    for args in (["seed=1"], ["seed=2", "mode=fail_check"]):
        dirs.append(launched(fake_experiment, args)[1][-1])
    return dirs


def test_views_join_runs_with_metrics_checks_and_timings(two_runs: list[Path]) -> None:
    df = _frame(Path("runs"), "SELECT r.run_id, r.seed, r.status, r.checks_passed, r.checks_total, "
                   "max(m.value) AS top FROM runs r JOIN metrics m USING (run_id) WHERE m.name = 'loss' "
                   "GROUP BY ALL ORDER BY r.seed")
    assert list(df["seed"]) == [1, 2] and list(df["status"]) == ["ok", "failed"]
    assert list(df["checks_passed"]) == [1, 0] and list(df["checks_total"]) == [1, 1]
    assert list(df["run_id"]) == [d.name for d in two_runs] and (df["top"] > 0).all()
    tags = _frame(Path("runs"), "SELECT DISTINCT variant, step FROM metrics WHERE name = 'loss' ORDER BY step")
    assert list(tags["variant"]) == ["a"] * 5 and list(tags["step"]) == list(range(5))  # tag columns and steps
    failed = _frame(Path("runs"), "SELECT run_id FROM checks WHERE NOT passed")
    assert list(failed["run_id"]) == [two_runs[1].name]
    stages = _frame(Path("runs"), "SELECT run_id, stage, wall_ms FROM timings ORDER BY run_id")
    assert list(stages["stage"]) == ["sum", "sum"] and (stages["wall_ms"] > 0).all()


def test_formats_json_is_a_list_of_rows_and_csv_parses(two_runs: list[Path], capsys) -> None:
    df = sql.query(Path("runs"), "SELECT run_id, seed, started_at FROM runs ORDER BY seed")
    sql.emit(df, "json")
    rows = json.loads(capsys.readouterr().out)
    assert [r["seed"] for r in rows] == [1, 2] and set(rows[0]) == {"run_id", "seed", "started_at"}
    sql.emit(df, "csv")
    parsed = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["run_id"] for r in parsed] == [d.name for d in two_runs]
    sql.emit(df, "table")
    assert two_runs[0].name in capsys.readouterr().out


@pytest.mark.parametrize("statement", [
    "DROP VIEW runs", "INSERT INTO runs SELECT * FROM runs", "COPY (SELECT * FROM runs) TO 'out.csv'",
    "ATTACH 'other.duckdb'", "CREATE TABLE t AS SELECT * FROM runs", "UPDATE runs SET status = 'ok'",
    "DELETE FROM runs", "PRAGMA enable_profiling", "SET threads = 1", "INSTALL httpfs", "EXPORT DATABASE 'dump'",
    "SELECT 1; DROP VIEW runs",
])
def test_writing_statements_are_refused_with_exit_2(workdir: Path, statement: str) -> None:
    from test_catalog import make_run

    make_run(workdir / "runs", "fake/20260101T000000Z-aaaaaaaa")
    r = run_cli(["sql", statement], workdir)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "read-only" in r.stderr or "statements given" in r.stderr
    assert not any((workdir / name).exists() for name in ("out.csv", "other.duckdb", "dump"))
    assert len(_frame(workdir / "runs", "SELECT * FROM runs")) == 1  # nothing was changed


def test_syntax_and_name_errors_are_one_line_exit_2(two_runs: list[Path]) -> None:
    r = run_cli(["sql", "SELEC run_id FROM runs"], Path.cwd())
    assert r.exit_code == 2 and r.stderr.startswith("error: Parser Error: syntax error") and r.stderr.count("\n") == 1
    r = run_cli(["sql", "SELECT nosuch FROM runs"], Path.cwd())
    assert r.exit_code == 2 and "Binder Error" in r.stderr and r.stderr.count("\n") == 1
    with pytest.raises(BadInput, match="no SQL statement"):
        _frame(Path("runs"), "  ")


def test_empty_runs_root_has_empty_views(tmp_path: Path) -> None:
    df = _frame(tmp_path / "none", "SELECT count(*) AS n FROM runs r JOIN metrics m USING (run_id)")
    assert int(df["n"].iloc[0]) == 0


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A real file outside the runs root (beside it), holding a secret a sandboxed query must not read."""
    f = tmp_path / "outside" / "secret.csv"
    f.parent.mkdir()
    f.write_text("secret\n42\n")
    return f


@pytest.mark.parametrize("template", [
    "SELECT * FROM read_text('{f}')", "SELECT * FROM read_csv('{f}')", "SELECT * FROM read_parquet('{f}')",
    "SELECT * FROM glob('{d}/*')", "SELECT * FROM read_blob('{f}')", "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM read_text('{root}/../outside/secret.csv')", "SELECT * FROM '{f}'",
])
def test_reading_outside_the_runs_root_is_refused_exit_2(two_runs: list[Path], outside: Path, template: str) -> None:
    root = Path("runs").resolve()
    r = run_cli(["sql", template.format(f=outside, d=outside.parent, root=root)], Path.cwd())
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "reads no file, only its views" in r.stderr and "secret" not in r.stdout


@pytest.mark.parametrize("statement", [
    "COPY (SELECT 1) TO '{f}.out'", "ATTACH '{d}/other.duckdb'", "INSTALL httpfs", "LOAD httpfs",
    "SET enable_external_access = true", "SET allowed_directories = ['/']", "RESET lock_configuration",
])
def test_writes_extensions_and_sandbox_settings_are_refused_exit_2(two_runs: list[Path], outside: Path,
                                                                   statement: str) -> None:
    r = run_cli(["sql", statement.format(f=outside, d=outside.parent)], Path.cwd())
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "read-only" in r.stderr
    assert statement.split()[0] in r.stderr or "SET" in r.stderr  # INSTALL said it was a LOAD (issue 24)
    assert sorted(p.name for p in outside.parent.iterdir()) == ["secret.csv"]


def test_install_is_refused_naming_install(workdir: Path) -> None:
    r = run_cli(["sql", "INSTALL httpfs"], workdir)
    assert r.exit_code == 2 and "INSTALL" in r.stderr and "extensions" in r.stderr


def test_the_sandbox_holds_even_past_the_statement_check(two_runs: list[Path], outside: Path) -> None:
    """DuckDB's own settings refuse the read, not only tfmoe's statement filter: a connection as `query` makes it."""
    import duckdb

    con = sql.connect(Path("runs"), "SELECT 1")
    try:
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"SELECT * FROM read_text('{outside}')").fetchall()
        with pytest.raises(duckdb.Error, match="locked"):
            con.execute("SET enable_external_access = true")
        assert con.execute("SELECT current_setting('enable_external_access')").fetchone()[0] is False
    finally:
        con.close()


def test_the_views_read_and_the_runs_own_files_are_not_reached(two_runs: list[Path]) -> None:
    """No file is reachable from a query, the runs' own included (DuckDB would let a query write wherever it may
    read): the views carry their rows."""
    root = Path("runs").resolve()
    n = _frame(Path("runs"), "SELECT count(*) AS n FROM runs r JOIN metrics m USING (run_id)")
    assert int(n["n"].iloc[0]) > 0
    for query in (f"SELECT count(*) AS n FROM read_parquet('{root}/**/metrics.parquet')",
                  f"SELECT count(*) AS n FROM glob('{root}/*/*/run.parquet')"):
        with pytest.raises(BadInput, match="reads no file, only its views"):
            _frame(Path("runs"), query)


# ------------------------------------------------------------------------------------------ unreadable runs
def _truncate(f: Path) -> None:
    """Cut a real parquet file in half: its footer (schema, row groups) is gone, as after a failed copy."""
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def test_a_run_with_a_truncated_metrics_file_is_unreadable_in_sql_and_runs(two_runs: list[Path]) -> None:
    assert run_cli(["runs"], Path.cwd()).exit_code == 0  # the catalog knew it as readable first
    bad = two_runs[0]
    _truncate(bad / "metrics.parquet")
    r = run_cli(["sql", "SELECT run_id, status FROM runs r JOIN metrics m USING (run_id) GROUP BY ALL"], Path.cwd())
    assert r.exit_code == 0, r.stderr
    warning = [line for line in r.stderr.splitlines() if bad.name in line]
    assert len(warning) == 1 and "unreadable" in warning[0] and "metrics.parquet" in warning[0]
    status = _frame(Path("runs"), "SELECT run_id, status, error FROM runs ORDER BY seed")
    assert list(status["status"]) == ["unreadable", "failed"] and "metrics.parquet" in status["error"].iloc[0]
    listed = run_cli(["runs", "--format", "json"], Path.cwd())
    assert {r["run_id"]: r["status"] for r in json.loads(listed.stdout)}[bad.name] == "unreadable"
    only = run_cli(["runs", "--status", "unreadable", "--format", "json"], Path.cwd())
    assert only.exit_code == 0 and [r["run_id"] for r in json.loads(only.stdout)] == [bad.name]


def test_a_truncated_file_seen_by_the_first_sync_is_unreadable(two_runs: list[Path]) -> None:
    _truncate(two_runs[1] / "checks.parquet")
    listed = run_cli(["runs", "--format", "json"], Path.cwd())
    assert {r["run_id"]: r["status"] for r in json.loads(listed.stdout)} == {
        two_runs[0].name: "ok", two_runs[1].name: "unreadable"}


def test_shows_advice_for_an_unreadable_run_is_a_command_that_works(two_runs: list[Path]) -> None:
    import re
    import shlex

    bad = two_runs[0]
    _truncate(bad / "metrics.parquet")
    shown = run_cli(["show", bad.name], Path.cwd())
    assert shown.exit_code == 2 and shown.stderr.count("\n") == 1 and "metrics.parquet" in shown.stderr
    advised = re.findall(r"`(tfmoe [^`]+)`", shown.stderr)
    assert len(advised) == 1, shown.stderr
    again = run_cli(shlex.split(advised[0])[1:], Path.cwd())
    assert again.exit_code == 0, again.stdout + again.stderr
    assert "unreadable" in again.stdout and "nothing to compare" in again.stdout
    new = again.run_dir
    assert new is not None and new != bad
    assert run_cli(["show", new.name], Path.cwd()).exit_code == 0  # the re-run is whole
    from tfmoe.harness.store.notebook import load_run

    assert load_run(new).run["seed"] == 1 and not load_run(new).metrics.empty


def test_with_run_parquet_unreadable_the_advice_is_hydras_recorded_command_line(two_runs: list[Path]) -> None:
    import re
    import shlex

    bad = two_runs[1]  # seed=2 mode=fail_check: a failed check, exit 1
    _truncate(bad / "run.parquet")
    shown = run_cli(["show", str(bad)], Path.cwd())
    assert shown.exit_code == 2 and shown.stderr.count("\n") == 1 and "run.parquet" in shown.stderr
    (advised,) = re.findall(r"`(tfmoe [^`]+)`", shown.stderr)
    assert advised == "tfmoe fake seed=2 mode=fail_check", shown.stderr
    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.harness.store.notebook import load_run

    # what `tfmoe fake …` runs (the CLI's experiment commands are made when tfmoe.cli is first imported, before
    # this test registered `fake`)
    experiment, *overrides = shlex.split(advised)[1:]
    code, made = launched(EXPERIMENTS[experiment], overrides)
    assert code == 1 and len(made) == 1  # the run again, its failed check included
    assert load_run(made[0]).run["seed"] == 2 and load_run(made[0]).run["status"] == "failed"


# ------------------------------------------------------------------------------------------ the kept runs view
def _runs_now(root: Path) -> pd.DataFrame:
    return _frame(root, "SELECT * FROM runs ORDER BY path")


def _same_as_rebuilt(root: Path) -> int:
    """How many runs the view has, after checking it equals a rebuilt catalog's (pandas compares NaN as equal)."""
    now = _runs_now(root)
    pd.testing.assert_frame_equal(now, _runs_rebuilt(root))
    return len(now)


def _runs_rebuilt(root: Path) -> pd.DataFrame:
    """The runs view from a catalog built afresh from the directories (the reference: no kept view)."""
    from tfmoe.harness.store import catalog

    catalog.rebuild(root)
    return _runs_now(root)


def _kept_views(root: Path) -> list[tuple[str, int, int]]:
    """(view, generation it was built at, the catalog's generation now) of each view file the catalog keeps."""
    import sqlite3

    from tfmoe.harness.store.catalog import CATALOG_FILE, VIEWS_DIR

    conn = sqlite3.connect(root / CATALOG_FILE)
    try:
        now = int(conn.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()[0])
    finally:
        conn.close()
    files = sorted((root / VIEWS_DIR).glob("*.parquet")) if (root / VIEWS_DIR).is_dir() else []
    return [(f.name.split("-")[0], int(f.stem.rsplit("-", 1)[1]), now) for f in files]


def test_the_runs_view_is_kept_until_a_run_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 10,000 runs `tfmoe sql` reads the runs view as one kept table: the same rows as a catalog rebuilt from the
    directories, after a run is added, finishes or is deleted."""
    from test_catalog import age, make_run

    from tfmoe.harness.store import catalog

    monkeypatch.setattr(catalog, "RACY_S", 0.0)
    root = tmp_path / "runs"
    make_run(root, "fake/20260101T000000Z-aaaaaaaa", checks=(True, False))
    running = make_run(root, "fake/20260102T000000Z-bbbbbbbb", "running")
    age(root)
    first = _runs_now(root)
    assert [(v, gen == now) for v, gen, now in _kept_views(root)] == [("run", True)]
    pd.testing.assert_frame_equal(_runs_now(root), first)  # read back from the kept view
    assert list(first["checks_passed"]) == [1, 0] and list(first["status"]) == ["ok", "running"]
    make_run(root, "fake/20260103T000000Z-cccccccc")  # a new run
    assert _same_as_rebuilt(root) == 3
    notebook_writer(running).finish(None, Status.OK, 0, None, None, None, 100)  # the running run ends
    assert list(_runs_now(root)["status"]) == ["ok", "ok", "ok"] and _same_as_rebuilt(root) == 3
    shutil.rmtree(root / "fake/20260103T000000Z-cccccccc")
    assert _same_as_rebuilt(root) == 2


def test_a_kept_view_without_the_generation_triggers_goes_stale(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: with the triggers that count the catalog's changes dropped, the kept view is read back after a run
    was added, and the test above's comparison would see the missing run."""
    import sqlite3

    from test_catalog import age, make_run

    from tfmoe.harness.store import catalog

    monkeypatch.setattr(catalog, "RACY_S", 0.0)
    monkeypatch.setattr(catalog, "TRIGGERS", {})  # no triggers made
    root = tmp_path / "runs"
    make_run(root, "fake/20260101T000000Z-aaaaaaaa")
    age(root)
    assert len(_runs_now(root)) == 1
    conn = sqlite3.connect(root / catalog.CATALOG_FILE)
    assert conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'trigger'").fetchone()[0] == 0
    conn.close()
    make_run(root, "fake/20260102T000000Z-bbbbbbbb")
    assert len(_runs_now(root)) == 1  # stale: the new run is missing
    assert len(catalog.listing(catalog.open_catalog(root), root)) == 2  # while the catalog itself has it


def notebook_writer(run_dir: Path):
    """The RunWriter of a run test_catalog.make_run left running (same id, experiment and start)."""
    from tfmoe.harness.store import notebook

    row = notebook.read_run_row(run_dir)
    return notebook.RunWriter(run_dir=run_dir, run_id=row["run_id"], experiment=row["experiment"], seed=0, argv=[],
                              overrides=["x=1"], device="cpu", dtype="fp32", started_at=row["started_at"])


def test_kept_view_files_of_older_generations_are_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each change to the runs keeps a new runs view file; the older ones (and leftovers of an interrupted write)
    are deleted once STALE_VIEW_S old (0 here), so the folder holds one file per view, not one per change."""
    from test_catalog import age, make_run

    from tfmoe.harness.store import catalog, kept_views

    monkeypatch.setattr(catalog, "RACY_S", 0.0)
    monkeypatch.setattr(kept_views, "STALE_VIEW_S", 0.0)
    root = tmp_path / "runs"
    make_run(root, "fake/20260101T000000Z-aaaaaaaa")
    age(root)
    assert len(_runs_now(root)) == 1
    (kept,) = (root / catalog.VIEWS_DIR).glob("*.parquet")
    (kept.parent / f".{kept.name}.12345-deadbeef.tmp").write_bytes(b"half a file")  # a write killed midway
    for i, rid in enumerate(("bbbbbbbb", "cccccccc")):
        make_run(root, f"fake/2026010{i + 2}T000000Z-{rid}")
        assert _same_as_rebuilt(root) == i + 2
        kept = _kept_views(root)
        assert len(kept) == 1 and kept[0][1] == kept[0][2], kept  # the one file is this generation's
    assert not list((root / catalog.VIEWS_DIR).glob(".*"))


def test_a_runs_view_that_cannot_be_kept_is_built_each_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no view file can be written (here a file stands where the folder would be), the view is built from the
    catalog's tables at each query: the same rows, no error."""
    from test_catalog import age, make_run

    from tfmoe.harness.store import catalog

    monkeypatch.setattr(catalog, "RACY_S", 0.0)
    root = tmp_path / "runs"
    make_run(root, "fake/20260101T000000Z-aaaaaaaa", checks=(True, False))
    age(root)
    (root / catalog.VIEWS_DIR).write_text("not a folder")
    first = _runs_now(root)
    assert list(first["checks_passed"]) == [1] and (root / catalog.VIEWS_DIR).read_text() == "not a folder"
    make_run(root, "fake/20260102T000000Z-bbbbbbbb")
    assert _same_as_rebuilt(root) == 2


def test_a_rebuilt_catalog_never_reads_the_view_files_of_the_one_before(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuilt catalog counts its generations from 0 again: its views are named by a new epoch, so a file kept by
    the catalog before, at the same generation number, is never taken for its own."""
    from test_catalog import age, make_run

    from tfmoe.harness.store import catalog

    monkeypatch.setattr(catalog, "RACY_S", 0.0)
    root = tmp_path / "runs"
    make_run(root, "fake/20260101T000000Z-aaaaaaaa")
    make_run(root, "fake/20260102T000000Z-bbbbbbbb")
    age(root)
    assert len(_runs_now(root)) == 2
    (before,) = (root / catalog.VIEWS_DIR).glob("*.parquet")
    shutil.rmtree(root / "fake/20260102T000000Z-bbbbbbbb")
    for p in root.glob(catalog.CATALOG_FILE + "*"):
        p.unlink()  # the catalog is only a cache: deleted, it is rebuilt from the directories
    now = _runs_now(root)
    assert list(now["run_id"]) == ["20260101T000000Z-aaaaaaaa"]
    assert before.name.split("-")[2] not in {f.name.split("-")[2] for f in (root / catalog.VIEWS_DIR).glob("*.parquet")
                                             if f != before}


def test_a_running_runs_rows_are_read_now_and_no_file_view_is_kept(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A running run's checks.parquet grows without the catalog's generation moving: while one runs, the checks
    view is built from its file at each query (a new row shows), never kept; once it ends, the view is kept."""
    from test_catalog import age, make_run

    from tfmoe.harness.store import catalog, rundir

    monkeypatch.setattr(catalog, "RACY_S", 0.0)
    root = tmp_path / "runs"
    make_run(root, "fake/20260101T000000Z-aaaaaaaa", checks=(True,))
    running = make_run(root, "fake/20260102T000000Z-bbbbbbbb", "running", checks=(False,))
    age(root)
    checks_kept = lambda: [v for v, *_ in _kept_views(root) if v == "checks"]  # noqa: E731

    def failed() -> list[str]:
        return list(_frame(root, "SELECT \"check\" FROM checks WHERE NOT passed ORDER BY 1")["check"])

    assert failed() == ["c0"] and checks_kept() == []
    df = pd.DataFrame({"check": ["c0", "c1"], "passed": [False, False], "observed": 1.0, "threshold": 2.0,
                       "detail": ""})
    rundir.write_parquet(df, running / "checks.parquet", schema=rundir.CHECKS_SCHEMA)  # the run records one more
    assert failed() == ["c0", "c1"] and checks_kept() == []
    notebook_writer(running).finish(None, Status.FAILED, 1, None, None, None, 100)
    assert failed() == ["c0", "c1"] and checks_kept() == ["checks"]
    assert failed() == ["c0", "c1"]  # read back from the kept file


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_or_vanished_kept_view_file_is_built_again(two_runs: list[Path], damage: str) -> None:
    """The kept view files are a cache: one cut in half (or deleted between the lookup and DuckDB's read, as a
    concurrent cleaner might) is dropped and the view built now, the same rows, no traceback."""
    from tfmoe.harness.store import catalog, kept_views

    query = "SELECT r.run_id, r.status, count(*) AS n FROM runs r JOIN metrics m USING (run_id) GROUP BY ALL ORDER BY 1"
    expected = _frame(Path("runs"), query)
    files = sorted((Path("runs") / catalog.VIEWS_DIR).glob("*.parquet"))
    assert [f.name.split("-")[0] for f in files] == ["metrics", "run"]
    if damage == "truncate":
        for f in files:
            _truncate(f)
        pd.testing.assert_frame_equal(_frame(Path("runs"), query), expected)
    else:
        real_view = kept_views.view

        def view_then_vanish(*args: object, **kwargs: object) -> object:
            kept = real_view(*args, **kwargs)
            if isinstance(kept, Path):
                kept.unlink()
            return kept

        import unittest.mock

        with unittest.mock.patch.object(kept_views, "view", view_then_vanish):
            pd.testing.assert_frame_equal(_frame(Path("runs"), query), expected)
    r = run_cli(["sql", query, "--format", "csv"], Path.cwd())
    assert r.exit_code == 0 and r.stderr == "" and r.stdout.count("\n") == 3, r.stdout + r.stderr


def test_statuses_fixed_in_the_view_sql_survive_quotes_and_braces(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The unreadable run's path and error go into the runs view's SQL as literals: a runs root whose name holds a
    quote and braces (`{source}` among them) still gives the right statuses."""
    from test_catalog import age, make_run

    from tfmoe.harness.store import catalog

    monkeypatch.setattr(catalog, "RACY_S", 0.0)
    root = tmp_path / "it's {source} {0}"
    bad = make_run(root, "fake/20260101T000000Z-aaaaaaaa", checks=(True,))
    make_run(root, "fake/20260102T000000Z-bbbbbbbb")
    age(root)
    _truncate(bad / "checks.parquet")
    got = _frame(root, "SELECT run_id, status, path FROM runs ORDER BY run_id")
    assert list(got["status"]) == ["unreadable", "ok"] and got["path"].iloc[0] == f"{root}/fake/{bad.name}"
