"""`tfmoe sql`'s output: a DuckDB result as a terminal table, JSON or CSV, without importing pandas.

The text is what the command printed when it went through pandas (DuckDB's ``.df()``, then ``to_json(orient=
"records", date_format="iso", default_handler=str)``, ``to_csv(index=False)``, or a table of the frame's cells), so
scripts that read it see no change; pandas cost 0.3-1 s of the command's start-up. The rules below are
pandas' own, named where they come from; tests/test_sql_output.py holds every DuckDB type against pandas itself.

Where pandas printed something that is not the data, this prints the data (F-151): a NULL inside a list is ``null``
in JSON (pandas wrote the masked slot's 0), an ENUM list holds its labels (pandas wrote the codes), and BIT and
BIGNUM/VARINT/TIMETZ values print (pandas crashed or refused them). TIMESTAMP_NS values print to the microsecond,
as DuckDB's Python values hold them (pandas printed nanoseconds; tfmoe's views hold no TIMESTAMP_NS column).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

AS_FLOAT64 = {"hugeint", "uhugeint", "decimal"}  # DuckDB's .df() makes these float64
DATETIME_TYPES = {"date", "timestamp", "timestamp_s", "timestamp_ms", "timestamp_ns", "timestamp with time zone"}
NUMPY_DTYPES = {  # DuckDB's numpy type for a LIST's elements; others are objects
    "boolean": "bool", "tinyint": "int8", "smallint": "int16", "integer": "int32", "bigint": "int64",
    "utinyint": "uint8", "usmallint": "uint16", "uinteger": "uint32", "ubigint": "uint64", "hugeint": "float64",
    "uhugeint": "float64", "decimal": "float64", "float": "float32", "double": "float64", "date": "datetime64[us]",
    "timestamp": "datetime64[us]", "timestamp_s": "datetime64[s]", "timestamp_ms": "datetime64[ms]",
    "timestamp_ns": "datetime64[ns]", "timestamp with time zone": "datetime64[us]", "interval": "timedelta64[us]",
}
NESTED_TYPES = {"list", "array", "struct", "map", "union"}
_DAY_US = 86_400_000_000


@dataclass
class Result:
    """A query's result: column names as ``.df()`` named them (a repeated name gets ``_1``, ``_2``), each
    column's DuckDB type, and the rows as DuckDB's Python values."""

    columns: list[str]
    types: list[Any]  # duckdb.DuckDBPyType
    rows: list[tuple[Any, ...]]

    @classmethod
    def fetch(cls, cursor: Any) -> Result:
        """Every row of an executed DuckDB cursor."""
        rows = cursor.fetchall()
        return cls(deduplicate([d[0] for d in cursor.description]), [d[1] for d in cursor.description], rows)

    def __len__(self) -> int:
        return len(self.rows)

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]


def deduplicate(names: Sequence[str]) -> list[str]:
    """Column names made unique the way DuckDB's ``QueryResult::DeduplicateColumns`` does for ``.df()``: a name
    met before (case-insensitively) gets ``_N``, N counting up past names already taken."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        low = name.lower()
        if low not in seen:
            seen[low] = 1
            out.append(name)
            continue
        new = f"{name}_{seen[low]}"
        while new.lower() in seen:
            seen[low] += 1
            new = f"{name}_{seen[low]}"
        seen[new.lower()] = 1
        out.append(new)
    return out


# ------------------------------------------------------------------------------------- the frame's values
@dataclass
class Column:
    """One column as the DataFrame held it: its values (None where the frame held NA/NaN/NaT) and the ``kind`` the
    texts tell apart (float, float32, datetime, timedelta; any other is printed as its values are)."""

    kind: str
    values: list[Any]


def _child(duck_type: Any, name: str = "child") -> Any:
    return dict(duck_type.children)[name]


def frame_column(duck_type: Any, values: list[Any]) -> Column:
    """A fetched column as ``.df()`` turned it into a pandas column."""
    kind = duck_type.id
    if kind in AS_FLOAT64:
        return Column("float", [None if v is None else float(v) for v in values])
    if kind == "float":
        return Column("float32", values)
    if kind == "double":
        return Column("float", values)
    if kind == "date":
        return Column("datetime", [None if v is None else dt.datetime.combine(v, dt.time()) for v in values])
    if kind in DATETIME_TYPES:
        return Column("datetime", values)
    if kind == "interval":
        return Column("timedelta", values)
    if kind in ("list", "array"):
        return Column("object", [None if v is None else numpy_list(_child(duck_type), v) for v in values])
    if kind == "blob":
        return Column("object", [None if v is None else bytearray(v) for v in values])
    return Column("object", values)


def numpy_list(child: Any, items: Sequence[Any]) -> Any:
    """One LIST value as DuckDB's numpy conversion makes it: an array of the element type, masked where an
    element is NULL (a NULL string stays None in an object array)."""
    import numpy as np

    kind = child.id
    values = [_numpy_item(child, v) for v in items]
    missing = [v is None for v in values]
    dtype = NUMPY_DTYPES.get(kind)
    if dtype is None:
        array = np.empty(len(values), dtype=object)
        array[:] = values
        if any(missing) and kind in NESTED_TYPES:
            return np.ma.masked_array(array, mask=missing)
        return array
    if any(missing):
        fill = np.zeros(1, dtype)[0]
        return np.ma.masked_array(np.array([fill if m else v for v, m in zip(values, missing, strict=True)],
                                           dtype), mask=missing)
    return np.array(values, dtype)


def _numpy_item(child: Any, v: Any) -> Any:
    if v is None:
        return None
    kind = child.id
    if kind in ("list", "array"):
        return numpy_list(_child(child), v)
    if kind in AS_FLOAT64:
        return float(v)
    if kind == "timestamp with time zone":
        return v.astimezone(dt.timezone.utc).replace(tzinfo=None)
    return v


# ------------------------------------------------------------------------------------------- table
def table_cells(col: Column) -> list[Any]:
    """The values :func:`tfmoe.contract.tables.cell` formats as pandas' cells printed: intervals as pandas'
    ``str(Timedelta)``; all else as the Python value the frame's cell converts to."""
    if col.kind == "timedelta":
        return [None if v is None else timedelta_text(v, "long") for v in col.values]
    return col.values


def timedelta_text(td: dt.timedelta, fmt: str | None, fraction: bool = False) -> str:
    """pandas' ``Timedelta._repr_base``: ``3 days 00:00:05``, ``-1 days +23:59:55``, ``0 days 00:00:00.500000``;
    with ``fmt=None`` a whole number of days is just ``3 days``; ``fraction``: microseconds even when zero (a CSV
    column shows them on every value once one value has them)."""
    sign = " +" if td < dt.timedelta(0) else " "
    hours, rest = divmod(td.seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    secs = f"{seconds:02}.{td.microseconds:06}" if td.microseconds or fraction else f"{seconds:02}"
    if fmt == "long" or td.seconds or td.microseconds:
        return f"{td.days} days{sign}{hours:02}:{minutes:02}:{secs}"
    return f"{td.days} days"


# -------------------------------------------------------------------------------------------- json
def json_float(v: float) -> str:
    """A double as pandas' vendored ujson writes it (``double_precision=10``): ten decimals, trailing zeros
    dropped, rounded half to odd as its modp_dtoa code does; C's ``%.10g`` above 1e16-1 and below 1e-15;
    NaN and infinities as ``null``."""
    if math.isnan(v) or math.isinf(v):
        return "null"
    neg = v < 0
    x = -v if neg else v
    if x > 1e16 - 1 or (x != 0.0 and x < 1e-15):
        return f"{v:.10g}"  # C's %.10g
    whole = int(x)
    tmp = (x - whole) * 1e10
    frac = int(tmp)
    diff = tmp - frac
    if diff > 0.5 or (diff == 0.5 and (frac == 0 or frac & 1)):
        frac += 1
    if frac >= 10**10:
        frac, whole = 0, whole + 1
    if frac:
        count = 10
        while frac % 10 == 0:
            count -= 1
            frac //= 10
        text = f"{whole}.{str(frac).rjust(count, '0')}"
    else:
        text = f"{whole}.0"
    return "-" + text if neg else text


def json_string(s: str) -> str:
    """ujson's string: ASCII only (``\\uXXXX``, surrogate pairs), control characters escaped, ``/`` as ``\\/``,
    DEL (0x7f) left as it is."""
    text = "\x7f".join(json.dumps(part)[1:-1] for part in s.split("\x7f"))
    return '"' + text.replace("/", "\\/") + '"'


def iso_datetime(v: dt.datetime) -> str:
    """pandas' ISO date at millisecond precision (``date_unit="ms"``): a zone-aware value in UTC, with ``Z``."""
    zone = ""
    if v.tzinfo is not None:
        v, zone = v.astimezone(dt.timezone.utc), "Z"
    return f"{v:%Y-%m-%dT%H:%M:%S}.{v.microsecond // 1000:03}{zone}"


def iso_duration(td: dt.timedelta) -> str:
    """pandas' ISO 8601 duration of a timedelta: ``P3DT0H0M5S``, ``P0DT0H0M0.500S``, ``P-1DT23H59M55S``."""
    hours, rest = divmod(td.seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    ms, us = divmod(td.microseconds, 1000)
    frac = "" if not td.microseconds else f".{ms:03}" + (f"{us:03}" if us else "")
    return f"P{td.days}DT{hours}H{minutes}M{seconds}{frac}S"


def json_value(v: Any) -> str:
    """One value as pandas' ujson writes it (``default_handler=str`` for what it has no rule for)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return json_float(v)
    if isinstance(v, str):
        return json_string(v)
    if isinstance(v, dt.datetime):
        return json_string(iso_datetime(v))
    if isinstance(v, dt.date):
        return json_string(iso_datetime(dt.datetime.combine(v, dt.time())))
    if isinstance(v, dt.timedelta):
        return json_string(iso_duration(v))
    if isinstance(v, dt.time):
        return json_string(v.isoformat())
    if isinstance(v, dict):
        return "{" + ",".join(f"{json_string(str(k))}:{json_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(map(json_value, v)) + "]"
    if hasattr(v, "tolist"):  # numpy arrays (masked slots become None: null, F-151) and scalars
        return json_value(v.tolist())
    return json_string(str(v))


def json_records(result: Result) -> str:
    """``to_json(orient="records")``: one object per row, no spaces."""
    columns = [frame_column(t, vals) for t, vals in zip(result.types, _columns(result), strict=True)]
    keys = [json_string(c) + ":" for c in result.columns]
    rows = []
    for i in range(len(result.rows)):
        rows.append("{" + ",".join(k + json_value(c.values[i]) for k, c in zip(keys, columns, strict=True)) + "}")
    return "[" + ",".join(rows) + "]"


# --------------------------------------------------------------------------------------------- csv
def csv_texts(col: Column) -> list[str]:
    """One column's CSV fields as ``to_csv`` writes them (``na_rep=""``)."""
    values = col.values
    if col.kind == "float":
        return ["" if v is None or math.isnan(v) else repr(v) for v in values]
    if col.kind == "float32":
        import numpy as np

        return ["" if v is None or math.isnan(v) else str(np.float32(v)) for v in values]
    if col.kind == "datetime":
        return _csv_datetimes(values)
    if col.kind == "timedelta":
        present = [v for v in values if v is not None]
        fmt = None if all(v % dt.timedelta(days=1) == dt.timedelta(0) for v in present) else "long"
        fraction = any(v.microseconds for v in present)
        return ["" if v is None else timedelta_text(v, fmt, fraction) for v in values]
    return ["" if v is None else str(v) for v in values]


def _csv_datetimes(values: list[Any]) -> list[str]:
    """pandas' ``format_array_from_datetime``: a naive column all at midnight as dates; otherwise every value to
    the finest precision any value needs (s, ms or us), a zone-aware one in its zone with its offset."""
    present = [v for v in values if v is not None]
    aware = any(v.tzinfo is not None for v in present)
    if not aware and all(v.time() == dt.time() for v in present):
        return ["" if v is None else f"{v:%Y-%m-%d}" for v in values]
    if any(v.microsecond % 1000 for v in present):
        frac = lambda v: f".{v.microsecond:06}"  # noqa: E731
    elif any(v.microsecond for v in present):
        frac = lambda v: f".{v.microsecond // 1000:03}"  # noqa: E731
    else:
        frac = lambda v: ""  # noqa: E731
    return ["" if v is None else f"{v.year}-{v.month:02}-{v.day:02} {v.hour:02}:{v.minute:02}:{v.second:02}"
            f"{frac(v)}{_offset(v) if aware else ''}" for v in values]


def _offset(v: dt.datetime) -> str:
    """``+01:00``: a zone-aware value's UTC offset as ``str(Timestamp)`` ends."""
    total = int(v.utcoffset().total_seconds()) // 60  # type: ignore[union-attr]
    hours, minutes = divmod(abs(total), 60)
    return f"{'-' if total < 0 else '+'}{hours:02}:{minutes:02}"


def csv_text(result: Result) -> str:
    """``to_csv(index=False)``: Python's csv module (minimal quoting), ``\\n`` line ends."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(result.columns)
    columns = [csv_texts(frame_column(t, vals)) for t, vals in zip(result.types, _columns(result), strict=True)]
    writer.writerows(zip(*columns, strict=True) if columns else [])
    return buffer.getvalue()


def _columns(result: Result) -> Iterator[list[Any]]:
    for i in range(len(result.columns)):
        yield [r[i] for r in result.rows]


def table_rows(result: Result) -> list[tuple[Any, ...]]:
    """The rows of the terminal table, cell values as pandas' frame gave them."""
    columns = [table_cells(frame_column(t, vals)) for t, vals in zip(result.types, _columns(result), strict=True)]
    return list(zip(*columns, strict=True)) if columns else [() for _ in result.rows]
