"""`tfmoe sql` cannot write, by construction: the views are tables in an in-memory DuckDB that then loses every file
(no external access, no allowed directory, configuration locked), and only a statement DuckDB's own parser reads as
one query runs (an allowlist that sees through EXPLAIN [ANALYZE], dynamic PIVOT and CTEs). A fuzzer draws statements
from DuckDB's own keywords and checks that no file under the working directory changes.

Long run: TFMOE_SQL_FUZZ_EXAMPLES=5000 pytest tests/test_sql_read_only.py -m fuzz -p no:cacheprovider
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tfmoe.api.testing import run_cli
from tfmoe.contract.errors import BadInput
from tfmoe.harness.reading import sql

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

LONG = "TFMOE_SQL_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("TFMOE_SQL_FUZZ_EXAMPLES", "150"))


@pytest.fixture
def one_run(workdir: Path) -> Path:
    from test_catalog import make_run

    run = make_run(workdir / "runs", "fake/20260101T000000Z-aaaaaaaa", status="failed", checks=(True, False))
    assert run_cli(["runs"], workdir).exit_code == 0  # the catalog and its kept views settle
    assert run_cli(["sql", "SELECT * FROM runs r JOIN metrics USING (run_id) JOIN checks USING (run_id) "
                           "JOIN timings USING (run_id)"], workdir).exit_code == 0
    return run


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its bytes, but the catalog's own cache (runs/.tfmoe-*: an index
    every reader keeps current, the kept views), which a query never names (test_the_connection_itself...)."""
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not str(p.relative_to(root)).startswith("runs/.tfmoe-")}


FORGERY = "COPY (SELECT * REPLACE ('ok' AS status, 0 AS exit_code) FROM runs) TO '{run}/run.parquet' (FORMAT parquet)"


@pytest.mark.parametrize("statement", [
    "EXPLAIN ANALYZE " + FORGERY, "EXPLAIN " + FORGERY, "EXPLAIN (FORMAT json) " + FORGERY,
    "EXPLAIN ANALYZE /* a comment */ " + FORGERY, FORGERY.replace("(FORMAT parquet)", "(USE_TMP_FILE false)"),
    "EXPLAIN ANALYZE CREATE TABLE t AS SELECT 1", "EXPLAIN ANALYZE INSERT INTO runs SELECT * FROM runs",
    "EXPLAIN ANALYZE EXPORT DATABASE '{run}/dump'", "EXPLAIN ATTACH '{run}/x.duckdb'", "EXPLAIN ANALYZE LOAD parquet",
    "COPY (PIVOT runs ON status USING count(*)) TO '{run}/p.csv'", "CREATE TABLE t AS PIVOT runs ON status USING count(*)",
    "WITH a AS (SELECT 1) INSERT INTO runs SELECT * FROM runs", "CALL pragma_version()", "PRAGMA version",
    "EXPLAIN ANALYZE SET threads = 1", "EXPLAIN", "EXPLAIN ANALYZE",
])
def test_wrapped_writes_are_refused_and_nothing_changes(one_run: Path, workdir: Path, statement: str) -> None:
    before = snapshot(workdir)
    r = run_cli(["sql", statement.format(run=one_run)], workdir)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "read-only" in r.stderr or "syntax error" in r.stderr
    assert snapshot(workdir) == before
    assert run_cli(["sql", "SELECT status FROM runs"], workdir).stdout.count("failed") == 1


@pytest.mark.parametrize("query", [
    "SELECT run_id FROM runs", "FROM runs", "WITH a AS (SELECT * FROM runs) SELECT count(*) FROM a -- trailing",
    "PIVOT runs ON status USING count(*)", "PIVOT runs ON status IN ('failed') USING count(*)",
    "UNPIVOT (SELECT 1 AS a, 2 AS b) ON a, b", "SUMMARIZE runs", "DESCRIBE runs", "SHOW TABLES", "VALUES (1)",
    "EXPLAIN SELECT * FROM runs", "EXPLAIN ANALYZE SELECT * FROM runs", "EXPLAIN (SELECT 1)",
    "EXPLAIN (FORMAT json) SELECT 1", "EXPLAIN ANALYZE PIVOT runs ON status USING count(*)",
    "SELECT * FROM (PIVOT runs ON status USING count(*))", "SELECT 1;",
])
def test_every_form_of_a_query_answers(one_run: Path, workdir: Path, query: str) -> None:
    before = snapshot(workdir)
    r = run_cli(["sql", query], workdir)
    assert r.exit_code == 0, r.stderr
    assert snapshot(workdir) == before


def test_the_connection_itself_cannot_write_even_past_the_statement_check(one_run: Path, workdir: Path) -> None:
    """DuckDB's own settings refuse every file, the runs root included: COPY straight to run.parquet, with or without
    DuckDB's temporary file, reading a run's file, ATTACH; a table made in memory stays there."""
    import duckdb

    before = snapshot(workdir)
    con = sql.connect(Path("runs"), "SELECT * FROM runs, metrics, checks, timings")
    try:
        for statement in [FORGERY, FORGERY.replace("(FORMAT parquet)", "(USE_TMP_FILE false)"),
                          "EXPORT DATABASE '{run}'", "ATTACH '{run}/x.duckdb'",
                          "SELECT * FROM read_parquet('{run}/run.parquet')"]:
            with pytest.raises(duckdb.PermissionException):
                con.execute(statement.format(run=one_run.resolve()))
        with pytest.raises(duckdb.Error, match="locked"):
            con.execute("SET allowed_directories = ['/']")
        con.execute("CREATE TABLE t AS SELECT 1")
        assert con.execute("SELECT count(*) FROM checks").fetchone()[0] == 2  # the views were copied in first
    finally:
        con.close()
    assert snapshot(workdir) == before


def test_the_allowlist_reads_duckdbs_parse_not_words() -> None:
    import duckdb

    for text in ["EXPLAIN ANALYZE COPY (SELECT 1) TO 'x'", "COPY (PIVOT (SELECT 1 a) ON a USING sum(a)) TO 'x'",
                 "EXPLAIN (FORMAT json) CREATE TABLE t (a INT)"]:
        with pytest.raises(BadInput, match="read-only"):
            sql.check_read_only(duckdb, text)
    for text in ["SELECT 'COPY x TO y'", "SELECT 1 AS \"explain\"", "PIVOT (SELECT 1 a) ON a USING sum(a)",
                 "EXPLAIN (SELECT 1) UNION ALL (SELECT 2)"]:
        sql.check_read_only(duckdb, text)


# ------------------------------------------------------------------------------------------ fuzz
def _keywords() -> list[str]:
    import duckdb

    return sorted(k for (k,) in duckdb.connect(":memory:").execute("SELECT keyword_name FROM duckdb_keywords()")
                  .fetchall())


KEYWORDS = _keywords()
TARGETS = ["'runs/fake/20260101T000000Z-aaaaaaaa/run.parquet'", "'runs/fake/20260101T000000Z-aaaaaaaa/checks.parquet'",
           "'out.csv'", "'dump'", "'x.duckdb'", "'runs'"]
FRAGMENTS = ["runs", "metrics", "checks", "(SELECT * FROM runs)", "(FORMAT parquet)", "(USE_TMP_FILE false)",
             "AS SELECT 1", "ON status USING count(*)", "t", "(a INT)", "*", "1", ";", "(", ")", ",", "=", *TARGETS]
WRAPPERS = ["", "EXPLAIN ", "EXPLAIN ANALYZE ", "EXPLAIN (FORMAT json) ", "WITH a AS (SELECT 1) "]


@st.composite
def statements(draw: st.DrawFn) -> str:
    words = draw(st.lists(st.one_of(st.sampled_from(KEYWORDS), st.sampled_from(FRAGMENTS)), min_size=1, max_size=8))
    head = draw(st.sampled_from(["COPY", "EXPORT", "ATTACH", "CREATE", "INSERT", "INSTALL", "LOAD", "SET", "PIVOT",
                                 "SELECT", "FROM", "PRAGMA", "CALL", "UPDATE", "DELETE", "CHECKPOINT", "VACUUM",
                                 "DETACH", "USE", "IMPORT", "ALTER", "DROP", "PREPARE", "EXECUTE", "MERGE"]))
    return draw(st.sampled_from(WRAPPERS)) + " ".join([head, *words])


_SEEN: dict[str, int] = {}


@pytest.mark.fuzz
@settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG, database=None,
          suppress_health_check=list(HealthCheck))
@given(statement=statements())
def test_no_statement_drawn_from_duckdbs_keywords_changes_a_file(one_run: Path, workdir: Path,
                                                                  statement: str) -> None:
    before = snapshot(workdir)
    try:
        sql.query(Path("runs"), statement)
        _SEEN["answered"] = _SEEN.get("answered", 0) + 1
    except BadInput as exc:
        assert "\n" not in str(exc)
        _SEEN["refused"] = _SEEN.get("refused", 0) + 1
    assert snapshot(workdir) == before, statement
    assert sorted(p.name for p in workdir.iterdir()) == ["runs"], statement
