"""`tfmoe sql`: read-only DuckDB SQL over every run under a runs root.

Views: ``runs`` (one row per run: run.parquet's columns, ``path``, ``checks_passed``, ``checks_total``), and
``metrics``, ``checks``, ``timings`` (each file's rows with the ``run_id`` of its run; experiments' different tag
columns lined up by name). All come from the catalog, which caches each run's tables as Arrow at sync time (runs
still running are read from their files now): one SQLite read instead of opening 40,000 parquet files.
Only one SELECT (or EXPLAIN) statement is run; anything that writes is refused before DuckDB executes it. The
connection is sandboxed by DuckDB's own settings: file access only under the runs root (``allowed_directories``,
``enable_external_access=false``, no temp directory), no extension installed or auto-loaded, and the configuration
locked, so ``read_text('/etc/passwd')`` or a ``SET`` of those settings is refused by DuckDB itself.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from tfmoe.errors import BadInput
from tfmoe.harness.store.rundir import RUN_SCHEMA, TABLE_FILES
from tfmoe.status import Status

FILE_VIEWS = ("metrics", "checks", "timings")
EMPTY_COLUMNS = {
    "metrics": "CAST(NULL AS VARCHAR) AS name, CAST(NULL AS DOUBLE) AS value, CAST(NULL AS BIGINT) AS step",
    "checks": "CAST(NULL AS VARCHAR) AS \"check\", CAST(NULL AS BOOLEAN) AS passed, CAST(NULL AS DOUBLE) AS observed, "
              "CAST(NULL AS DOUBLE) AS threshold, CAST(NULL AS VARCHAR) AS detail",
    "timings": "CAST(NULL AS VARCHAR) AS stage, CAST(NULL AS DOUBLE) AS wall_ms, CAST(NULL AS DOUBLE) AS device_ms, "
               "CAST(NULL AS BIGINT) AS repeats, CAST(NULL AS BIGINT) AS peak_device_mem_bytes",
}
RUNS_SCHEMA = pa.schema([*RUN_SCHEMA, ("path", pa.string()), ("checks_passed", pa.int64()),
                         ("checks_total", pa.int64())])


def _duckdb() -> Any:
    try:
        import duckdb
    except ImportError:
        raise BadInput("tfmoe sql needs duckdb: pip install duckdb (a core dependency of tfmoe)") from None
    return duckdb


def check_read_only(duckdb: Any, query: str) -> None:
    """Refuse (BadInput) anything but a single SELECT / EXPLAIN, and report syntax errors in one line."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as exc:
        raise BadInput(one_line(exc)) from None
    if not statements:
        raise BadInput("no SQL statement given: pass e.g. \"SELECT run_id, status FROM runs\"")
    if len(statements) > 1:
        raise BadInput(f"{len(statements)} statements given: tfmoe sql runs one read-only SELECT")
    kind = statements[0].type
    if kind == duckdb.StatementType.LOAD:  # INSTALL and LOAD share a statement type
        word = "INSTALL" if re.match(r"\s*(FORCE\s+)?INSTALL\b", query, re.I) else "LOAD"
        raise BadInput(f"{word} statements are refused: tfmoe sql is read-only and loads no extensions "
                       "(SELECT over the views runs, metrics, checks, timings)")
    if kind not in (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN):
        raise BadInput(f"{kind.name} statements are refused: tfmoe sql is read-only (SELECT over the views "
                       "runs, metrics, checks, timings); the run directories are changed only by tfmoe itself")


def one_line(exc: BaseException) -> str:
    """DuckDB's message, first line only (the rest repeats the query with a caret under the error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:400]


def _concat(tables: list[Any]) -> Any:
    """One table from many whose columns differ (experiments' tag columns): by name, types promoted; a column
    whose types cannot be reconciled (an int tag here, a string there) becomes a string column."""
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
    return table.add_column(0, "run_id", pa.array([run_id] * table.num_rows, pa.string()))


def _every_run(cached: list[Any]) -> Any:
    """The runs view as the catalog holds it: every run's run.parquet row, its path and checks passed / total."""
    if not cached:
        return RUNS_SCHEMA.empty_table()
    table = _concat([t if t is not None else pa.table({"run_id": [rid], "status": [status]})
                     for rid, _, status, t, _, _ in cached]).combine_chunks()
    table = table.append_column("path", pa.array([c[1] for c in cached], pa.string()))
    table = table.append_column("checks_passed", pa.array([c[4] for c in cached], pa.int64()))
    return table.append_column("checks_total", pa.array([c[5] for c in cached], pa.int64()))


def _runs_table(conn: Any, runs_root: Path) -> Any:
    """The runs view with THE status readers show: unreadable runs as the catalog says, running ones read now."""
    from tfmoe.harness.store.catalog import unreadable as catalog_unreadable
    from tfmoe.harness.store.catalog import view
    from tfmoe.harness.store.notebook import read_run_row

    table = view(conn, runs_root, "run", _every_run)
    if not table.num_rows:
        return table
    paths = table.column("path").to_pylist()
    statuses = table.column("status").to_pylist()
    bad = {str(path): why for _, path, why in catalog_unreadable(conn, runs_root)}
    if bad:  # run.parquet may be whole while another of the run's files is not: the catalog's status says so
        errors = table.column("error").to_pylist() if "error" in table.column_names else [None] * len(paths)
        for i, p in enumerate(paths):
            if p in bad:
                statuses[i], errors[i] = Status.UNREADABLE.value, bad[p]
        table = table.set_column(table.schema.get_field_index("status"), "status", pa.array(statuses, pa.string()))
        if "error" in table.column_names:
            table = table.set_column(table.schema.get_field_index("error"), "error", pa.array(errors, pa.string()))
        else:
            table = table.append_column("error", pa.array(errors, pa.string()))
    if Status.RUNNING in statuses:  # THE status readers show: a dead `running` run is `lost` (effective_status)
        for i, st in enumerate(statuses):
            if st == Status.RUNNING:
                statuses[i] = read_run_row(Path(paths[i]))["status"]
        table = table.set_column(table.schema.get_field_index("status"), "status", pa.array(statuses, pa.string()))
    return table


def _file_table(conn: Any, runs_root: Path, view: str) -> Any:
    """Every run's ``view`` rows with its run_id: from the catalog, or read now for runs that are still running."""
    import pyarrow.parquet as pq

    from tfmoe.harness.store.catalog import FINAL_STATUSES, arrow_tables

    tables = []
    for run_id, path, status, table, _, _ in arrow_tables(conn, runs_root, view):
        if status not in FINAL_STATUSES:
            f = Path(path) / TABLE_FILES[view]
            try:
                table = pq.ParquetFile(f).read() if f.exists() else None
            except Exception:
                table = None
        if table is not None and table.num_rows:
            tables.append(_with_run_id(run_id, table))
    return _concat(tables).combine_chunks() if tables else None


def connect(runs_root: Path, query: str) -> Any:
    """An in-memory DuckDB with the views the query names, built from the catalog's cached tables (one SQLite
    read instead of opening every run's parquet files)."""
    from tfmoe.harness.store import catalog
    from tfmoe.harness.store.notebook import rerun_advice

    duckdb = _duckdb()
    con = duckdb.connect(":memory:", config={"autoinstall_known_extensions": False,
                                             "autoload_known_extensions": False})
    conn = catalog.open_catalog(Path(runs_root)) if Path(runs_root).is_dir() else None
    try:
        runs = _runs_table(conn, runs_root) if conn is not None else RUNS_SCHEMA.empty_table()
        con.register("_runs", runs)
        con.execute("CREATE VIEW runs AS SELECT * FROM _runs")
        for view in FILE_VIEWS:
            if not re.search(rf"\b{view}\b", query, re.I):
                continue  # only the views the query names are built
            table = _file_table(conn, runs_root, view) if conn is not None else None
            if table is None:
                con.execute(f"CREATE VIEW {view} AS SELECT CAST(NULL AS VARCHAR) AS run_id, {EMPTY_COLUMNS[view]} "
                            "WHERE false")
                continue
            con.register(f"_{view}", table)
            con.execute(f"CREATE VIEW {view} AS SELECT * FROM _{view}")
        for run_id, path, why in catalog.unreadable(conn, runs_root) if conn is not None else []:
            sys.stderr.write(f"warning: run {run_id} is unreadable, its rows are missing from the views: {why}; "
                             f"{rerun_advice(path)}\n")
    finally:
        if conn is not None:
            conn.close()
    sandbox(con, runs_root)
    return con


def sandbox(con: Any, runs_root: Path) -> None:
    """Limit ``con``'s file access to ``runs_root`` with DuckDB's own settings, then lock them. The order
    matters: allowed_directories cannot change once external access is off. No temp directory: DuckDB would
    otherwise allow its default ``./.tmp`` as well."""
    root = str(Path(runs_root).resolve()).rstrip("/") + "/"
    con.execute("SET temp_directory = ''")
    con.execute("SET allowed_directories = [$1]", [root])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def _refusal(runs_root: Path, exc: BaseException) -> str:
    return (f"tfmoe sql reads only the runs root {Path(runs_root).resolve()} (and the views runs, metrics, "
            f"checks, timings): {one_line(exc)}")


def query(runs_root: Path, sql: str) -> pd.DataFrame:
    """Run one read-only SELECT over the views; BadInput for writes, syntax errors and unknown names."""
    duckdb = _duckdb()
    check_read_only(duckdb, sql)
    con = connect(runs_root, sql)
    try:
        return con.execute(sql).df()
    except duckdb.PermissionException as exc:
        raise BadInput(_refusal(runs_root, exc)) from None
    except duckdb.Error as exc:
        raise BadInput(one_line(exc)) from None
    finally:
        con.close()


def emit(df: pd.DataFrame, fmt: str) -> None:
    """table (rich), json (a list of row objects) or csv on stdout."""
    if fmt == "json":
        print(df.to_json(orient="records", date_format="iso", default_handler=str))
    elif fmt == "csv":
        print(df.to_csv(index=False), end="")
    else:
        from tfmoe.harness.reading.reports import print_frame

        print_frame(df, "table", f"{len(df)} row{'s' if len(df) != 1 else ''}")
