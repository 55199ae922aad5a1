"""`tfmoe sql`: read-only DuckDB SQL over every run under a runs root.

Views: ``runs`` (one row per run: run.parquet's columns, ``path``, ``checks_passed``, ``checks_total``; from the
catalog), and ``metrics``, ``checks``, ``timings`` (each file's rows with the ``run_id`` of its run; DuckDB reads
the parquet files the catalog lists, with ``union_by_name`` so experiments' different tag columns line up).
Only one SELECT (or EXPLAIN) statement is run; anything that writes is refused before DuckDB executes it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from tfmoe.errors import BadInput
from tfmoe.notebook import RUN_SCHEMA, TABLE_FILES

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
    if kind not in (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN):
        raise BadInput(f"{kind.name} statements are refused: tfmoe sql is read-only (SELECT over the views "
                       "runs, metrics, checks, timings); the run directories are changed only by tfmoe itself")


def one_line(exc: BaseException) -> str:
    """DuckDB's message, first line only (the rest repeats the query with a caret under the error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:400]


def _runs_table(runs_root: Path) -> pa.Table:
    from tfmoe.notebook import run_index

    df = run_index(runs_root)
    if df.empty:
        df = pd.DataFrame(columns=RUNS_SCHEMA.names)
    df = df.reindex(columns=RUNS_SCHEMA.names)
    for col in ("argv", "overrides", "notes"):
        df[col] = df[col].map(lambda v: list(v) if isinstance(v, (list, tuple)) or hasattr(v, "tolist") else None)
    for col in ("started_at", "finished_at"):
        df[col] = pd.to_datetime(df[col], utc=True)
    return pa.Table.from_pandas(df, schema=RUNS_SCHEMA, preserve_index=False, safe=False)


def connect(runs_root: Path, query: str) -> Any:
    """An in-memory DuckDB with the views the query names (a view over 10,000 files is only built when used)."""
    duckdb = _duckdb()
    con = duckdb.connect(":memory:", config={"autoinstall_known_extensions": False})
    runs = _runs_table(runs_root)
    con.register("_runs", runs)
    con.execute("CREATE VIEW runs AS SELECT * FROM _runs")
    for view in FILE_VIEWS:
        if not re.search(rf"\b{view}\b", query, re.I):
            continue
        fname = TABLE_FILES[view]
        files = [(rid, f"{p}/{fname}") for rid, p in zip(runs.column("run_id").to_pylist(),
                                                         runs.column("path").to_pylist(), strict=True)
                 if Path(p, fname).exists()]
        if not files:
            con.execute(f"CREATE VIEW {view} AS SELECT CAST(NULL AS VARCHAR) AS run_id, {EMPTY_COLUMNS[view]} "
                        "WHERE false")
            continue
        mapping = pa.table({"run_id": [r for r, _ in files], "_file": [f for _, f in files]})
        con.register(f"_{view}_files", mapping)
        file_list = "[" + ", ".join("'" + f.replace("'", "''") + "'" for _, f in files) + "]"
        con.execute(f"CREATE VIEW {view} AS SELECT f.run_id, t.* EXCLUDE (filename) FROM "
                    f"read_parquet({file_list}, union_by_name = true, filename = true) t "
                    f"JOIN _{view}_files f ON t.filename = f._file")
    con.execute("SET lock_configuration = true")
    return con


def query(runs_root: Path, sql: str) -> pd.DataFrame:
    """Run one read-only SELECT over the views; BadInput for writes, syntax errors and unknown names."""
    duckdb = _duckdb()
    check_read_only(duckdb, sql)
    con = connect(runs_root, sql)
    try:
        return con.execute(sql).df()
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
        from tfmoe.reports import _emit

        _emit(df, "table", f"{len(df)} row{'s' if len(df) != 1 else ''}")
