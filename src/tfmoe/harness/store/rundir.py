"""The run directory's files: their names and schemas, atomic writes and plain reads.

The lowest layer of the notebook: it knows how a run directory's parquet files are named, typed, written (temp
file + rename, so a crash leaves readable parquet) and read (one file, no unpickling), and nothing about runs,
sweeps or the catalog, so every reader and writer above it (notebook, catalog, code_capture, sweeps) can import it.

pandas and pyarrow are imported by the functions that use them, and the schemas are built on first use (module
``__getattr__``), so a command that only lists the catalog (``tfmoe runs``) never pays for importing them.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfmoe.contract.errors import BadInput

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

RUN_FILE = "run.parquet"
TABLE_FILES = {
    "metrics": "metrics.parquet",
    "checks": "checks.parquet",
    "timings": "timings.parquet",
    "tensors": "tensors.parquet",
}
EXPECTATIONS_FILE = "expectations.parquet"


# ------------------------------------------------------------------ checks: judged, or not applicable ("n/a")
# checks.parquet's ``applicable`` column (False: the check could not be judged on this layer, Recorder.not_applicable;
# such a row has passed=True and never fails a run). Runs written before the column existed read as applicable.
# Every reader goes through these: show, summary.md, the outcome table, diff, the catalog's counts, sql's view.
def with_applicable(table: pa.Table | None) -> pa.Table | None:
    """checks.parquet's table with its ``applicable`` column (all True when the run predates it)."""
    if table is None or "applicable" in table.column_names:
        return table
    import pyarrow as pa

    return table.append_column("applicable", pa.array([True] * table.num_rows, pa.bool_()))


def check_applicable(row: dict[str, Any]) -> bool:
    """A check row's ``applicable`` (True when the row has none: an older run)."""
    value = row.get("applicable", True)
    return True if is_missing(value) else bool(value)


def check_mark(row: dict[str, Any], yes: str = "yes", no: str = "NO") -> str:
    """How a check row reads: ``n/a`` when not applicable, else ``yes`` / ``NO``."""
    return "n/a" if not check_applicable(row) else (yes if bool(row.get("passed")) else no)


def checks_count(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(passed, judged, n/a) of a run's check rows: n/a rows are neither passed nor judged."""
    na = sum(not check_applicable(r) for r in rows)
    passed = sum(bool(r.get("passed")) and check_applicable(r) for r in rows)
    return passed, len(rows) - na, na


def checks_cell(rows: list[dict[str, Any]]) -> str:
    """A run's checks in one cell: ``11/11``, ``11/11 (+2 n/a)``, or ``9/9 (+2 n/a, +2 not judged)``, as the
    battery tables label those rows (a not-applicable row whose detail starts "not judged" is counted as such)."""
    passed, judged, na = checks_count(rows)
    unjudged = sum(not check_applicable(r) and str(r.get("detail") or "").startswith("not judged") for r in rows)
    parts = [f"+{na - unjudged} n/a"] if na > unjudged else []
    parts += [f"+{unjudged} not judged"] if unjudged else []
    return f"{passed}/{judged}" + (f" ({', '.join(parts)})" if parts else "")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_replace(path: Path, write: Any) -> None:
    """Write via ``write(tmp_path)`` into a temp file beside ``path``, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_parquet(df: pd.DataFrame, path: Path, schema: pa.Schema | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if schema is not None and "applicable" in schema.names and "applicable" not in df.columns:
        df = df.assign(applicable=True)  # check rows made without the column are judged checks
    table = pa.Table.from_pandas(_parquet_safe(df), schema=schema, preserve_index=False)
    atomic_replace(path, lambda tmp: pq.write_table(table, tmp))


def write_text(path: Path, text: str) -> None:
    atomic_replace(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _parquet_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Object columns that mix types (e.g. a tag that is an int in some rows, a str in others) become str."""
    import pandas as pd

    df = df.copy()
    for col in df.columns:
        if df[col].dtype == object:
            kinds = {type(v) for v in df[col] if v is not None and not (isinstance(v, float) and pd.isna(v))}
            if len(kinds) > 1 and not kinds <= {int, float} and not any(k in (list, tuple, dict) for k in kinds):
                df[col] = df[col].map(lambda v: None if v is None else str(v))
    return df


METRICS_BASE = ["name", "value", "step"]
TIMINGS_BASE = ["stage", "wall_ms", "device_ms", "repeats", "peak_device_mem_bytes"]


def metrics_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame(rows)
    if df.empty:
        df = pd.DataFrame({"name": pd.Series(dtype="string"), "value": pd.Series(dtype="float64")})
    df["value"] = df["value"].astype("float64")
    for col in df.columns:  # integer tags missing in some rows stay integers (nullable), not floats
        if col in ("name", "value"):
            continue
        present = [r[col] for r in rows if r.get(col) is not None]
        if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
            df[col] = pd.array([r.get(col) for r in rows], dtype="Int64")
    return df[[c for c in METRICS_BASE if c in df.columns] + [c for c in df.columns if c not in METRICS_BASE]]


def timings_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame(rows, columns=None if rows else TIMINGS_BASE)
    for col in ("wall_ms", "device_ms"):
        df[col] = df[col].astype("float64")
    for col in ("repeats", "peak_device_mem_bytes"):
        df[col] = df[col].astype("Int64")
    return df


SCHEMA_NAMES = ("EXPECTATIONS_SCHEMA", "CHECKS_SCHEMA", "TENSORS_SCHEMA", "RUN_SCHEMA")


def _schemas() -> dict[str, pa.Schema]:
    """The run directory's fixed parquet schemas (built once, on first use: pyarrow costs a tenth of a second)."""
    import pyarrow as pa

    EXPECTATIONS_SCHEMA = pa.schema([
        ("label", pa.string()), ("metric", pa.string()), ("selector", pa.string()), ("aggregate", pa.string()),
        ("expected", pa.string()), ("observed", pa.float64()), ("held", pa.bool_()), ("miss", pa.float64()),
        ("rows", pa.int64()), ("detail", pa.string()), ("written_at", pa.timestamp("us", tz="UTC")),
        ("judged_at", pa.timestamp("us", tz="UTC")),
    ])
    CHECKS_SCHEMA = pa.schema([("check", pa.string()), ("passed", pa.bool_()), ("observed", pa.float64()),
                               ("threshold", pa.float64()), ("detail", pa.string()), ("applicable", pa.bool_())])
    TENSORS_SCHEMA = pa.schema([
        ("name", pa.string()), ("dtype", pa.string()), ("shape", pa.list_(pa.int64())),
        ("values", pa.list_(pa.float64())), ("numel", pa.int64()), ("summarised", pa.bool_()),
        ("min", pa.float64()), ("max", pa.float64()), ("mean", pa.float64()), ("std", pa.float64()),
    ])
    RUN_SCHEMA = pa.schema([
        ("run_id", pa.string()), ("experiment", pa.string()), ("status", pa.string()),
        ("started_at", pa.timestamp("us", tz="UTC")), ("finished_at", pa.timestamp("us", tz="UTC")),
        ("wall_s", pa.float64()), ("seed", pa.int64()), ("argv", pa.list_(pa.string())),
        ("overrides", pa.list_(pa.string())), ("git_commit", pa.string()), ("git_dirty", pa.bool_()),
        ("hostname", pa.string()), ("platform", pa.string()), ("python", pa.string()), ("torch", pa.string()),
        ("cuda", pa.string()), ("cudnn", pa.string()), ("numpy", pa.string()), ("pandas", pa.string()),
        ("pyarrow", pa.string()), ("hydra", pa.string()), ("device", pa.string()), ("device_name", pa.string()),
        ("dtype", pa.string()), ("peak_device_mem_bytes", pa.int64()), ("peak_rss_bytes", pa.int64()),
        ("error", pa.string()), ("exit_code", pa.int64()), ("sweep_dir", pa.string()), ("notes", pa.list_(pa.string())),
        # the process that ran (runs) the job, so a reader can tell a live run from a lost one (effective_status)
        ("pid", pa.int64()), ("process_started_at", pa.timestamp("us", tz="UTC")),
        ("heartbeat_at", pa.timestamp("us", tz="UTC")),
    ])
    return {"EXPECTATIONS_SCHEMA": EXPECTATIONS_SCHEMA, "CHECKS_SCHEMA": CHECKS_SCHEMA,
            "TENSORS_SCHEMA": TENSORS_SCHEMA, "RUN_SCHEMA": RUN_SCHEMA}


def __getattr__(name: str) -> Any:
    if name in SCHEMA_NAMES:
        globals().update(_schemas())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class UnreadableFile(BadInput):
    """A run's parquet file exists but cannot be read (truncated, corrupt): bad input naming ``path``; the layers
    above add which command re-makes the run (notebook.rerun_advice)."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(message)
        self.path = Path(path)


def read_parquet(path: Path) -> pd.DataFrame:
    return read_table(path).to_pandas()


NULLABLE_PANDAS_DTYPES = ("Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64", "boolean")


def is_missing(v: Any) -> bool:
    """Whether ``v`` is a value a table did not record: None, NaN (Python, numpy or Decimal), pandas' NA or NaT,
    numpy's NaT. Never raises, never imports pandas; a container (list, array) is a value, not missing."""
    if v is None:
        return True
    pd = sys.modules.get("pandas")
    if pd is not None and v is pd.NA:
        return True
    try:
        return (v != v) is True or bool(getattr(v, "shape", None) == () and v != v)
    except (TypeError, ValueError):
        return False


def records(table: pa.Table | None) -> list[dict[str, Any]]:
    """``table``'s rows as the values ``table.to_pandas().to_dict("records")`` gives (pandas 3), without importing
    pandas: a missing float or string is NaN, an integer column with a missing value is float (NaN there) unless
    pandas wrote it as nullable ``Int64`` (then None), a missing bool, list or timestamp is None; timestamps are
    datetimes and lists are lists (where pandas gives Timestamps and arrays: the same text, the same JSON).
    ``None`` (no file) gives no rows. Readers that print rows (show, failures add) get pandas' semantics this way."""
    import pyarrow as pa

    if table is None:
        return []
    nullable = {c["name"] for c in (table.schema.pandas_metadata or {}).get("columns", [])
                if c.get("numpy_type") in NULLABLE_PANDAS_DTYPES}
    columns = {}
    nan = float("nan")
    for name, col in zip(table.column_names, table.columns, strict=True):
        t = col.type
        values = python_values(col)
        if col.null_count and name not in nullable:
            if pa.types.is_floating(t) or pa.types.is_string(t) or pa.types.is_large_string(t):
                values = [nan if v is None else v for v in values]
            elif pa.types.is_integer(t):
                values = [nan if v is None else float(v) for v in values]
        columns[name] = values
    return [dict(zip(columns, row, strict=True)) for row in zip(*columns.values(), strict=True)] \
        if columns else [{} for _ in range(table.num_rows)]


def python_values(col: pa.ChunkedArray | pa.Array) -> list[Any]:
    """``col.to_pylist()``, except that a timezone-aware timestamp column is converted here: pyarrow imports all of
    pandas (0.4 s) to convert one, which `tfmoe runs` would pay on the first listing after every new run."""
    import pyarrow as pa

    return _datetimes(col) if pa.types.is_timestamp(col.type) and col.type.tz else col.to_pylist()


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


def _datetimes(col: pa.ChunkedArray | pa.Array) -> list[dt.datetime | None]:
    """A timezone-aware timestamp column as datetimes in its zone (as ``to_pylist`` gives them, without its
    import of pandas for the zone): its int64 values read as that many units since the epoch (nanoseconds to
    microseconds, as datetime holds them)."""
    import pyarrow as pa

    zone: dt.tzinfo = dt.timezone.utc
    if col.type.tz not in ("UTC", "+00:00", "Z"):
        import zoneinfo

        zone = zoneinfo.ZoneInfo(col.type.tz)
    per_second = _PER_SECOND[col.type.unit]
    out: list[dt.datetime | None] = []
    for chunk in col.chunks if isinstance(col, pa.ChunkedArray) else [col]:
        for v in chunk.view(pa.int64()).to_pylist():
            if v is None:
                out.append(None)
                continue
            t = _EPOCH + dt.timedelta(microseconds=v * 1_000_000 // per_second)
            out.append(t if zone is dt.timezone.utc else t.astimezone(zone))
    return out


def string_array(values: list[str | None]) -> pa.Array:
    """``pa.array(values, pa.string())`` built from its buffers: pyarrow imports all of pandas (0.3-1 s) to convert
    any list of Python values, which `tfmoe sql` would pay for every view it adds a column to."""
    import array

    import pyarrow as pa

    data, offsets, valid, nulls = bytearray(), array.array("i", [0]), bytearray((len(values) + 7) // 8), 0
    for i, v in enumerate(values):
        if v is None:
            nulls += 1
        else:
            data += v.encode()
            valid[i // 8] |= 1 << (i % 8)
        offsets.append(len(data))
    return pa.Array.from_buffers(pa.string(), len(values), [pa.py_buffer(valid) if nulls else None,
                                 pa.py_buffer(offsets.tobytes()), pa.py_buffer(bytes(data))], null_count=nulls)


def int64_array(values: list[int]) -> pa.Array:
    """``pa.array(values, pa.int64())`` for a list without None, built from its buffer (see :func:`string_array`)."""
    import array

    import pyarrow as pa

    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(array.array("q", values).tobytes())])


def read_table(path: Path, columns: tuple[str, ...] | None = None) -> pa.Table:
    """One parquet file as an arrow table (only ``columns``, those the file has, when given); BadInput, one line,
    when it is missing or unreadable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)  # one file: no dataset discovery (about 2x faster)
        names = set(parquet.schema_arrow.names)
        return parquet.read(columns=None if columns is None else [c for c in columns if c in names])
    except FileNotFoundError:
        raise BadInput(f"{path} is missing: is this a complete tfmoe run directory?") from None
    except (pa.ArrowException, OSError) as exc:
        raise UnreadableFile(path, f"{path} is not readable parquet ({type(exc).__name__}): the run is "
                                   "unreadable") from None
