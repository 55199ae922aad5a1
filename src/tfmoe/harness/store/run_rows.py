"""One run directory's rows as the run catalog keeps them: its run.parquet row (or a row saying
why it cannot be read) and its tables as Arrow IPC bytes."""

from __future__ import annotations

import datetime as dt
import math
import os
import sys
from pathlib import Path
from typing import Any

from tfmoe.contract.status import Status
from tfmoe.harness.store.rundir import (
    RUN_FILE,
    TABLE_FILES,
    python_values,
    read_parquet,
    with_applicable,
)

SQL_TABLES = {"run": RUN_FILE, "metrics": TABLE_FILES["metrics"], "checks": TABLE_FILES["checks"],
              "timings": TABLE_FILES["timings"]}


def _jsonable(v: Any) -> Any:
    pd = sys.modules.get("pandas")  # a pandas value can only be here once pandas is loaded
    if pd is not None and (v is pd.NA or v is pd.NaT):
        return None
    if isinstance(v, dt.datetime):  # pandas' Timestamp too
        return v.isoformat(timespec="microseconds")
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def _missing_run_row(run_dir: Path) -> dict[str, Any]:
    """The catalog row of a run directory without run.parquet: its id and experiment from where it lies."""
    parent = run_dir.parent
    sweep = parent.name.startswith("multirun-")
    return {"run_id": f"{parent.name.removeprefix('multirun-')}-{run_dir.name}" if sweep else run_dir.name,
            "experiment": (parent.parent if sweep else parent).name, "status": Status.UNREADABLE.value,
            "error": f"{run_dir / RUN_FILE} is missing: the run is unreadable (its other files are kept)",
            "overrides": []}


def _read_run(run_dir: Path) -> dict[str, Any]:
    """The catalog row of one run directory (unreadable runs are listed as status 'unreadable')."""
    import pyarrow.parquet as pq

    if not (run_dir / RUN_FILE).exists():
        row = _missing_run_row(run_dir)
        row["checks_passed"], row["checks_total"] = 0, 0
        return row
    try:
        table = pq.ParquetFile(run_dir / RUN_FILE).read()
        row = {k: _jsonable(python_values(col)[0]) for k, col in zip(table.column_names, table.columns, strict=True)}
    except Exception:  # corrupt parquet, or a file that vanished mid-read: say so the way load_run does
        try:
            read_parquet(run_dir / RUN_FILE)
            error = f"{run_dir / RUN_FILE} has no row"
        except Exception as exc:
            error = str(exc)
        row = {"run_id": run_dir.name, "status": Status.UNREADABLE.value, "error": error}
    else:
        bad = _unreadable_table(run_dir)
        if bad is not None:
            row.update(status=Status.UNREADABLE.value, error=bad)
    checks_file = run_dir / TABLE_FILES["checks"]
    passed = total = 0
    if checks_file.exists():
        try:  # the judged checks: a not-applicable row (rundir.with_applicable) is neither passed nor counted
            parquet = pq.ParquetFile(checks_file)
            table = with_applicable(parquet.read(columns=[c for c in ("passed", "applicable")
                                                          if c in parquet.schema_arrow.names]))
            rows = table.to_pylist()
            passed = sum(bool(r["passed"]) and r["applicable"] is not False for r in rows)
            total = sum(r["applicable"] is not False for r in rows)
        except Exception:
            pass
    row["checks_passed"], row["checks_total"] = passed, total
    return row


def _unreadable_table(run_dir: Path) -> str | None:
    """Why one of the run's table files that exists cannot be read (its footer: a truncated file has none), or None.
    Only the footer is read here, at index time; :func:`fill_tables` reads the whole files."""
    import pyarrow.parquet as pq

    for fname in TABLE_FILES.values():
        try:
            pq.ParquetFile(run_dir / fname).close()
        except FileNotFoundError:
            continue
        except Exception as exc:
            return _unreadable_message(run_dir / fname, exc)
    return None


def _unreadable_message(path: Path, exc: BaseException) -> str:
    return f"{path} is not readable parquet ({type(exc).__name__}): the run is unreadable"


def _read_tables(run_dir: Path) -> tuple[list[bytes | None], str | None]:
    """The run's SQL_TABLES as Arrow IPC streams, in SQL_TABLES' order, and why one that exists is unreadable."""
    blobs, bad = [], None
    for fname in SQL_TABLES.values():
        try:
            blobs.append(_ipc(run_dir / fname))
        except Exception as exc:
            blobs.append(None)
            bad = bad or _unreadable_message(run_dir / fname, exc)
    return blobs, bad


def _ipc(path: Path) -> bytes | None:
    """A parquet file's table as an Arrow IPC stream (None when missing; raises when it is unreadable)."""
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path).read().replace_schema_metadata(None)  # pandas' metadata: KBs per run
    except FileNotFoundError:
        return None
    return _ipc_bytes(table)


def _ipc_bytes(table: Any) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _read_runs(run_dirs: list[Path]) -> list[dict[str, Any]]:
    """Many runs at once: parquet reads release the GIL, so a few threads overlap the file system's latency."""
    if len(run_dirs) < 16:
        return [_read_run(d) for d in run_dirs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
        return list(pool.map(_read_run, run_dirs, chunksize=64))
