"""`tfmoe sql`: read-only DuckDB SQL over every run under a runs root.

Views: ``runs`` (one row per run: run.parquet's columns, ``path``, ``checks_passed``, ``checks_total``), and
``metrics``, ``checks``, ``timings`` (each file's rows with the ``run_id`` of its run; experiments' different tag
columns lined up by name). The catalog keeps each view as one parquet file that DuckDB reads itself (kept_views.view:
extended by the rows of runs added since, where that gives the table a rebuild would (the Extensions here), else
rebuilt from the runs' cached tables; a view over runs still running is built at each query, their rows read from
their files now), so a query over 10,000 runs imports neither pandas nor pyarrow.
It cannot write, by construction: the views named by the query are copied into an in-memory DuckDB as tables,
then the connection loses every file (``enable_external_access=false`` with no allowed directory or path, no temp
directory, no extension installed or auto-loaded, the configuration locked), so COPY, EXPORT, ATTACH, INSTALL and
``read_text('/etc/passwd')`` are refused by DuckDB itself. Before that, only a statement DuckDB's parser reads as one
query runs (an allowlist, ``check_read_only``): a SELECT in any form, a dynamic PIVOT, or EXPLAIN [ANALYZE] of one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from tfmoe.contract.errors import BadInput
from tfmoe.contract.status import Status
from tfmoe.harness.reading.sql_output import Result, csv_text, json_records, table_rows
from tfmoe.harness.store.rundir import TABLE_FILES, int64_array, string_array, with_applicable

FILE_VIEWS = ("metrics", "checks", "timings")
EMPTY_COLUMNS = {
    "metrics": "CAST(NULL AS VARCHAR) AS name, CAST(NULL AS DOUBLE) AS value, CAST(NULL AS BIGINT) AS step",
    "checks": "CAST(NULL AS VARCHAR) AS \"check\", CAST(NULL AS BOOLEAN) AS passed, CAST(NULL AS DOUBLE) AS observed, "
              "CAST(NULL AS DOUBLE) AS threshold, CAST(NULL AS VARCHAR) AS detail, CAST(NULL AS BOOLEAN) AS applicable",
    "timings": "CAST(NULL AS VARCHAR) AS stage, CAST(NULL AS DOUBLE) AS wall_ms, CAST(NULL AS DOUBLE) AS device_ms, "
               "CAST(NULL AS BIGINT) AS repeats, CAST(NULL AS BIGINT) AS peak_device_mem_bytes",
}


def runs_schema() -> Any:
    """The runs view's columns: run.parquet's, then ``path``, ``checks_passed``, ``checks_total``."""
    import pyarrow as pa

    from tfmoe.harness.store.rundir import RUN_SCHEMA

    return pa.schema([*RUN_SCHEMA, ("path", pa.string()), ("checks_passed", pa.int64()), ("checks_total", pa.int64())])


def _duckdb() -> Any:
    try:
        import duckdb
    except ImportError:
        raise BadInput("tfmoe sql needs duckdb: pip install duckdb (a core dependency of tfmoe)") from None
    return duckdb


_QUERY_TYPES = ("SELECT",)  # and MULTI (a dynamic PIVOT) where it is a query: _is_query


def _statement(con: Any, text: str) -> Any:
    """The single statement DuckDB parses ``text`` into, or None (none, several, or a syntax error)."""
    try:
        statements = con.extract_statements(text)
    except _duckdb().Error:
        return None
    return statements[0] if len(statements) == 1 else None


def _is_query(con: Any, text: str) -> bool:
    """Whether DuckDB's parser reads ``text`` as one query: a SELECT statement (CTEs, SUMMARIZE, DESCRIBE, SHOW,
    VALUES, FROM-first, static PIVOT/UNPIVOT), or a statement DuckDB can nest as a subquery (a dynamic PIVOT parses
    as several statements, an in-memory ENUM type and the query; ``COPY (PIVOT …) TO`` parses the same way and
    cannot be nested)."""
    statement = _statement(con, text)
    if statement is None:
        return False
    if statement.type.name in _QUERY_TYPES:
        return True
    if statement.type.name != "MULTI":
        return False
    nested = _statement(con, f"SELECT * FROM (\n{statement.query}\n)")  # newlines: a trailing -- comment ends
    return nested is not None and nested.type.name in ("SELECT", "MULTI")


def _first_word(duckdb: Any, text: str) -> str:
    """The first token of ``text`` that is not a comment, upper-cased."""
    for pos, kind in duckdb.tokenize(text):
        if kind != duckdb.token_type.comment:
            return re.split(r"[\s(]", text[pos:], maxsplit=1)[0].upper()
    return ""


def _explained(duckdb: Any, con: Any, text: str) -> str | None:
    """The statement an EXPLAIN [ANALYZE] [(options)] wraps, from DuckDB's own tokens (comments skipped); None when
    there is none."""
    tokens = [(pos, kind) for pos, kind in duckdb.tokenize(text) if kind != duckdb.token_type.comment]
    words = [(pos, kind, text[pos:tokens[i + 1][0] if i + 1 < len(tokens) else len(text)].strip())
             for i, (pos, kind) in enumerate(tokens)]
    i = 1  # words[0] is EXPLAIN
    if i < len(words) and words[i][2].upper() == "ANALYZE":
        i += 1
    if i >= len(words):
        return None
    rest = text[words[i][0]:]
    if words[i][2] != "(":
        return rest
    depth = 0
    for j in range(i, len(words)):  # the option list's closing parenthesis (string constants are one token)
        depth += words[j][2] == "("
        depth -= words[j][2] == ")"
        if depth == 0:
            after = text[words[j + 1][0]:] if j + 1 < len(words) else ""
            # EXPLAIN (SELECT 1) [UNION …]: the parentheses are the query's, not an option list
            return after if after.strip() and _statement(con, after) is not None else rest
    return rest


def check_read_only(duckdb: Any, query: str, con: Any = None) -> None:
    """Refuse (BadInput) anything that is not one query, by DuckDB's own parser (an allowlist): a SELECT in any of
    its forms, a dynamic PIVOT, or EXPLAIN [ANALYZE] of one; report syntax errors in one line. ``con``: the
    connection to parse with (DuckDB's default one costs its own start, 15-25 ms)."""
    con = con or duckdb
    try:
        statements = con.extract_statements(query)
    except duckdb.Error as exc:
        raise BadInput(one_line(exc)) from None
    if not statements:
        raise BadInput("no SQL statement given: pass e.g. \"SELECT run_id, status FROM runs\"")
    if len(statements) > 1:
        raise BadInput(f"{len(statements)} statements given: tfmoe sql runs one read-only query")
    text, wrapper = statements[0].query, ""
    if _first_word(duckdb, text) == "EXPLAIN":  # an EXPLAIN of a dynamic PIVOT parses as MULTI
        inner = _explained(duckdb, con, text)
        if inner is not None and _is_query(con, inner):
            return
        kind = _statement(con, inner).type if inner is not None and _statement(con, inner) is not None else None
        wrapper, text = "EXPLAIN of ", inner or ""
    elif _is_query(con, text):
        return
    else:
        kind = statements[0].type
    if kind == duckdb.StatementType.LOAD:  # INSTALL and LOAD share a statement type
        word = "INSTALL" if re.match(r"\s*(FORCE\s+)?INSTALL\b", text, re.I) else "LOAD"
        raise BadInput(f"{wrapper}{word} statements are refused: tfmoe sql is read-only and loads no extensions "
                       "(a query over the views runs, metrics, checks, timings)")
    what = f"{kind.name} statement" if kind is not None and kind.name != "MULTI" else "statement that is not a query"
    raise BadInput(f"{'EXPLAIN of a' if wrapper else 'a'} {what} is refused: tfmoe sql is read-only: one query (SELECT, WITH, "
                   "PIVOT, SUMMARIZE, DESCRIBE, or EXPLAIN [ANALYZE] of one) over the views runs, metrics, checks, "
                   "timings; the run directories are changed only by tfmoe itself")


def one_line(exc: BaseException) -> str:
    """DuckDB's message, first line only (the rest repeats the query with a caret under the error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:400]


def _concat(tables: list[Any]) -> Any:
    """One table from many whose columns differ (experiments' tag columns): by name, types promoted; a column
    whose types cannot be reconciled (an int tag here, a string there) becomes a string column."""
    import pyarrow as pa

    try:
        return pa.concat_tables(tables)  # one schema, the usual case: 0.09 s for 10,000 runs (grouping: 0.5 s)
    except pa.ArrowInvalid:
        pass
    groups: dict[Any, list[Any]] = {}
    for t in tables:  # same schema: a cheap concatenation; only the few distinct schemas need promoting
        groups.setdefault(t.schema, []).append(t)
    tables = [pa.concat_tables(g) for g in groups.values()]
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        kinds: dict[str, set[Any]] = {}
        for t in tables:
            for f in t.schema:
                kinds.setdefault(f.name, set()).add(f.type)
        mixed = {n for n, k in kinds.items() if len(k - {pa.null()}) > 1}
        fixed = [t.cast(pa.schema([pa.field(f.name, pa.string()) if f.name in mixed else f for f in t.schema]))
                 for t in tables]
        return pa.concat_tables(fixed, promote_options="permissive")


def _with_run_id(run_id: str, table: Any) -> Any:
    return table.add_column(0, "run_id", string_array([run_id] * table.num_rows))


def _run_parts(cached: list[Any]) -> list[Any]:
    """The tables the runs view concatenates: each run's run.parquet row (its run_id and status alone when the
    catalog holds none)."""
    import pyarrow as pa

    return [t if t is not None else pa.table({"run_id": string_array([rid]), "status": string_array([status])})
            for rid, _, status, t, _, _ in cached]


def _every_run(cached: list[Any]) -> Any:
    """The runs view as the catalog keeps it: every run's run.parquet row, its path and checks passed / total
    (and an ``error`` column, which the statuses fixed at query time may fill)."""
    if not cached:
        return runs_schema().empty_table()
    table = _concat(_run_parts(cached)).combine_chunks()
    table = table.append_column("path", string_array([c[1] for c in cached]))
    table = table.append_column("checks_passed", int64_array([c[4] for c in cached]))
    table = table.append_column("checks_total", int64_array([c[5] for c in cached]))
    if "error" not in table.column_names:
        table = table.append_column("error", string_array([None] * table.num_rows))
    return table


_ADDED_COLUMNS = ["path", "checks_passed", "checks_total"]  # what _every_run adds after the runs' own columns


def _fit(parts: list[Any], schema: Any, new_columns: bool) -> bool:
    """Whether appending ``parts`` to a kept view of ``schema`` gives the table _concat makes from every run: each
    column the view has comes with its very type, in any order (no promotion, no string fallback: the rebuild
    keeps the view's columns, first seen first); a column the view lacks is allowed only when a rebuild puts it
    last too (``new_columns``) and with one type in all ``parts``."""
    kept = dict(zip(schema.names, schema.types, strict=True))
    added: dict[str, Any] = {}
    for part in parts:
        for f in part.schema:
            if f.name in kept:
                if f.type != kept[f.name]:
                    return False
            elif not new_columns or added.setdefault(f.name, f.type) != f.type:
                return False
    return True


def _runs_tables(schema: Any, cached: list[Any], replaced: int) -> list[Any] | None:
    """The runs view's Extension.tables (schema: the runs' own columns, then _ADDED_COLUMNS, then ``error`` when no
    run had one): the changed runs' rows as _every_run makes them, where they fit. A changed run that replaces one
    of the kept runs must have the kept own columns exactly, in their order (_same_columns): then a rebuild has the
    kept columns whatever the run had before, where a column only it had would otherwise stay
    (tests/test_sql_extended_views.py)."""
    if schema is None:
        return None  # never kept as empty: a runs root with no runs has an empty table
    names = schema.names
    own = len(names) - len(_ADDED_COLUMNS) - (names[-1:] == ["error"])
    if names[own:own + len(_ADDED_COLUMNS)] != _ADDED_COLUMNS:
        return None
    if not cached:
        return []
    import pyarrow as pa

    own_schema = pa.schema(list(schema)[:own])
    parts = _run_parts(cached)
    if not _same_columns(parts[:replaced], own_schema):
        return None
    # a new column of the runs' own would go before path in a rebuild: none is allowed
    if not _fit(parts, own_schema, new_columns=False):
        return None
    table = _every_run(cached)
    return [table] if _fit([table], schema, new_columns=False) else None


def _same_columns(parts: list[Any], schema: Any) -> bool:
    """Whether every table in ``parts`` has exactly ``schema``'s columns, names, types and order."""
    return all(part.schema.equals(schema) for part in parts)


def _kept_run_paths(kept: Path) -> list[str]:
    """The spelt paths of a kept runs view's runs, in order (one row per run)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(kept).read(columns=["path"]).column("path").to_pylist()


def _runs_extension() -> Any:
    from tfmoe.harness.store.kept_views import Extension

    return Extension(tables=_runs_tables, paths=_kept_run_paths)


def _sql_text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _running(conn: Any) -> list[str]:
    """The catalog's paths of runs still running (the unsettled runs' partial index, not a scan)."""
    from tfmoe.harness.store.catalog import UNSETTLED

    return [p for p, st in conn.execute(f"SELECT path, status FROM runs WHERE {UNSETTLED}") if st == Status.RUNNING]


def _statuses_now(runs_root: Path, unreadable: list[tuple[str, Path, str]],
                  running: list[str]) -> dict[str, tuple[str, Any]]:
    """{path: (status, error or None to keep it)} for the runs whose status readers show differs from the kept
    view's: ``unreadable`` ones (the catalog's, with why), and ``running`` ones that died (``lost``,
    effective_status)."""
    root = Path(runs_root)
    spelt = lambda rel: f"{root}/{rel}"  # noqa: E731 (as kept_views.arrow_tables spells the view's paths)
    fixed: dict[str, tuple[str, Any]] = {spelt(path.relative_to(root)): (Status.UNREADABLE.value, why)
                                         for _, path, why in unreadable}
    if running:
        from tfmoe.harness.store.notebook import read_run_row

        for rel in running:
            path = spelt(rel)
            status = read_run_row(root / rel)["status"]
            if status != Status.RUNNING and path not in fixed:
                fixed[path] = (status, None)
    return fixed


def _runs_select(fixed: dict[str, tuple[str, Any]]) -> str:
    """SELECT … FROM {source} for the runs view: the kept rows with THE status readers show (``fixed``)."""
    if not fixed:
        return "SELECT * FROM {source}"
    status = " ".join(f"WHEN {_sql_text(p)} THEN {_sql_text(st)}" for p, (st, _) in fixed.items())
    error = " ".join(f"WHEN {_sql_text(p)} THEN {_sql_text(e)}" for p, (_, e) in fixed.items() if e is not None)
    replace = f"CASE path {status} ELSE status END AS status"
    if error:
        replace += f", CASE path {error} ELSE error END AS error"
    return f"SELECT * REPLACE ({replace}) FROM " + "{source}"


def _file_parts(view: str, cached: list[Any]) -> list[Any]:
    """Each run's ``view`` rows with its run_id (runs without a row left out), from the catalog's cached tables, or
    read now for runs that are still running."""
    import pyarrow.parquet as pq

    from tfmoe.harness.store.catalog import FINAL_STATUSES

    tables = []
    for run_id, path, status, table, _, _ in cached:
        if status not in FINAL_STATUSES:
            f = Path(path) / TABLE_FILES[view]
            try:
                table = pq.ParquetFile(f).read() if f.exists() else None
            except Exception:
                table = None
        if table is not None and table.num_rows:
            if view == "checks":  # a run older than the column reads as applicable (rundir.with_applicable)
                table = with_applicable(table)
            tables.append(_with_run_id(run_id, table))
    return tables


def _file_rows(view: str) -> Any:
    """The builder of a file view (kept_views.view): every run's ``view`` rows with its run_id; None when no run has
    a row."""
    def build(cached: list[Any]) -> Any:
        tables = _file_parts(view, cached)
        return _concat(tables).combine_chunks() if tables else None

    return build


def _file_extension(view: str) -> Any:
    """How a kept file view takes the rows of runs added since (kept_views.Extension): theirs, where they fit; kept
    as empty, their rows alone are the view."""
    from tfmoe.harness.store.kept_views import Extension

    def tables(schema: Any, cached: list[Any], replaced: int) -> list[Any] | None:
        if schema is None:
            built = _file_rows(view)(cached)
            return [] if built is None else [built]
        if view == "checks" and "applicable" not in schema.names:
            return None  # kept before the column: its rows would lack what a rebuild gives them (True)
        parts = _file_parts(view, cached)
        return parts if _fit(parts, schema, new_columns=True) else None

    return Extension(tables=tables)


def _source(con: Any, name: str, kept: Any) -> str:
    """The FROM source of a view: DuckDB reads a kept parquet file itself; a table built now is registered."""
    if isinstance(kept, Path):
        return f"read_parquet({_sql_text(str(kept))})"
    con.register(f"_{name}", kept)
    return f"_{name}"


def _create_view(con: Any, name: str, select: str, kept: Any, build_now: Any) -> None:
    """The table ``name`` AS ``select`` (its ``{source}`` the kept view), copied into the in-memory database: the
    query itself then needs no file at all (``sandbox``). A kept file DuckDB cannot read (deleted or damaged since;
    it is only a cache) is dropped and the view built now instead (``build_now()``)."""
    if kept is None:  # no run has a row
        con.execute(f"CREATE TABLE {name} AS SELECT CAST(NULL AS VARCHAR) AS run_id, {EMPTY_COLUMNS[name]} "
                    "WHERE false")
        return
    try:
        head, _, tail = select.rpartition("{source}")  # not str.format: paths and errors may hold braces
        con.execute(f"CREATE TABLE {name} AS {head}{_source(con, name, kept)}{tail}")
    except _duckdb().Error:
        if not isinstance(kept, Path):
            raise
        kept.unlink(missing_ok=True)
        _create_view(con, name, select, build_now(), build_now)
    finally:
        if not isinstance(kept, Path) and kept is not None:
            con.unregister(f"_{name}")


def _connection() -> Any:
    """An in-memory DuckDB that installs and loads no extension."""
    return _duckdb().connect(":memory:", config={"autoinstall_known_extensions": False,
                                                 "autoload_known_extensions": False})


def connect(runs_root: Path, query: str, con: Any = None) -> Any:
    """An in-memory DuckDB (``con``, or a new one) with the views the query names, read from the catalog's kept
    views (kept_views.view), then sandboxed."""
    from tfmoe.harness.store import catalog, kept_views

    con = con if con is not None else _connection()
    conn = catalog.open_catalog(Path(runs_root)) if Path(runs_root).is_dir() else None
    try:
        if conn is None:
            _create_view(con, "runs", "SELECT * FROM {source}", runs_schema().empty_table(), None)
        else:
            kept = kept_views.view(conn, runs_root, "run", _every_run,  # reading the runs' tables marks unreadable ones
                                extend=_runs_extension())
            unreadable, running = catalog.unreadable(conn, runs_root), _running(conn)
            _create_view(con, "runs", _runs_select(_statuses_now(runs_root, unreadable, running)), kept,
                         lambda: kept_views.view(conn, runs_root, "run", _every_run, keep=False))
        for view in FILE_VIEWS:
            if not re.search(rf"\b{view}\b", query, re.I):
                continue  # only the views the query names are built
            if conn is None:
                _create_view(con, view, "", None, None)
                continue
            # a running run's files grow without the catalog's generation moving: such a view is not kept
            kept = kept_views.view(conn, runs_root, view, _file_rows(view), keep=not running,
                                extend=_file_extension(view))
            _create_view(con, view, "SELECT * FROM {source}", kept,
                         lambda v=view: kept_views.view(conn, runs_root, v, _file_rows(v), keep=False))
        for run_id, path, why in unreadable if conn is not None else []:
            from tfmoe.harness.store.notebook import rerun_advice

            sys.stderr.write(f"warning: run {run_id} is unreadable, its rows are missing from the views: {why}; "
                             f"{rerun_advice(path)}\n")
    finally:
        if conn is not None:
            conn.close()
    sandbox(con, runs_root)
    return con


def sandbox(con: Any, runs_root: Path) -> None:
    """Take every file away from ``con`` with DuckDB's own settings, then lock them: no external access (no file
    read or written, no COPY, EXPORT, ATTACH, INSTALL, no scan of Python objects), no allowed directory or path
    (DuckDB would let a query write there too), no temp directory (it would otherwise allow ``./.tmp``). The views
    are tables in the in-memory database by then (``connect``). ``runs_root`` names the refusal (``_refusal``)."""
    del runs_root
    con.execute("SET temp_directory = ''")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def _refusal(runs_root: Path, exc: BaseException) -> str:
    return (f"tfmoe sql reads no file, only its views runs, metrics, checks, timings (of the runs root "
            f"{Path(runs_root).resolve()}): {one_line(exc)}")


def query(runs_root: Path, sql: str) -> Result:
    """Run one read-only SELECT over the views; BadInput for writes, syntax errors and unknown names."""
    duckdb = _duckdb()
    con = _connection()
    try:
        check_read_only(duckdb, sql, con)
        connect(runs_root, sql, con)
        try:
            return Result.fetch(con.execute(sql))
        except duckdb.PermissionException as exc:
            raise BadInput(_refusal(runs_root, exc)) from None
        except duckdb.Error as exc:
            raise BadInput(one_line(exc)) from None
    finally:
        con.close()


def emit(result: Result, fmt: str) -> None:
    """table (rich), json (a list of row objects) or csv on stdout (sql_output: pandas' text, without pandas)."""
    if fmt == "json":
        print(json_records(result))
    elif fmt == "csv":
        print(csv_text(result), end="")
    else:
        from rich.console import Console

        from tfmoe.contract.tables import Rows, print_rows

        title = f"{len(result)} row{'s' if len(result) != 1 else ''}"
        print_rows(Rows(title, result.columns, table_rows(result)), "table", Console(highlight=False))
