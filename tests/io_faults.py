"""In-process I/O fault injection, as SQLite tests its own: count every write a command makes under a directory
(a dry pass), then fail the Nth one (ENOSPC, EIO) or the Nth rename, for every N.

What counts, for files under ``root`` only (pytest's own files, caches and /tmp are never touched):
  write   opening a file for writing (builtins/io.open in a writing mode: it may fail to create), each write() call
          on it, each pyarrow.parquet.write_table / ParquetWriter.write_table, each writing SQL statement (INSERT,
          UPDATE, DELETE, REPLACE, CREATE, DROP, ALTER, COMMIT, ...) on an sqlite3 connection to a file under root
          (SQLAlchemy, as MLflow uses it, through sqlite3.dbapi2.connect)
  rename  os.replace / os.rename (and so Path.replace / Path.rename)
A failed file operation raises OSError(errno) naming the path, as the kernel's refusal reaches Python; a failed SQL
statement raises sqlite3.OperationalError with SQLite's own words ("database or disk is full", "disk I/O error").
"""

from __future__ import annotations

import builtins
import errno as errno_mod
import io
import os
import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WRITING_MODES = set("wax+")
SQL_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP", "ALTER", "COMMIT", "END", "VACUUM",
              "PRAGMA USER_VERSION =")
SQLITE_SAYS = {errno_mod.ENOSPC: "database or disk is full", errno_mod.EIO: "disk I/O error"}


@dataclass
class Fault:
    kind: str  # "write" | "rename"
    n: int  # 1-based: the Nth event of that kind fails
    errno: int = errno_mod.ENOSPC


@dataclass
class IOFaults:
    """A context manager: counts write and rename events under ``root``; with ``fault``, fails that one (once)."""

    root: Path
    fault: Fault | None = None
    events: list[tuple[str, str]] = field(default_factory=list)
    fired: tuple[str, str] | None = None
    active: bool = False
    only: Any = None  # a predicate on the path: the events counted (default: all under root)

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.events if k == kind)

    def _under(self, path: Any) -> bool:
        try:
            p = Path(os.fsdecode(path)).absolute()
        except TypeError:
            return False
        return p == self.root or self.root in p.parents

    def event(self, kind: str, path: Any, sql: bool = False) -> None:
        """Count an event; raise the planned fault if this is it. Nothing once the block has ended (a connection
        opened inside it, kept in a pool, outlives it)."""
        if not self.active or (self.only is not None and not self.only(os.fsdecode(path))):
            return
        self.events.append((kind, os.fsdecode(path) if not isinstance(path, int) else str(path)))
        if os.environ.get("TFMOE_IO_FAULTS_TRACE") == self.events[-1][1]:  # where a write comes from
            import traceback

            traceback.print_stack(limit=12, file=sys.__stderr__)
        f = self.fault
        if f is not None and self.fired is None and f.kind == kind and self.count(kind) == f.n:
            self.fired = self.events[-1]
            if sql:
                raise sqlite3.OperationalError(SQLITE_SAYS.get(f.errno, os.strerror(f.errno)))
            raise OSError(f.errno, os.strerror(f.errno), os.fsdecode(path))

    # ------------------------------------------------------------------------------------------ patching
    def __enter__(self) -> IOFaults:
        import pyarrow.parquet as pq

        self.root = Path(self.root).absolute()
        self.active = True
        faults = self
        real_open, real_replace, real_rename = builtins.open, os.replace, os.rename
        real_write_table, real_writer, real_connect = pq.write_table, pq.ParquetWriter, sqlite3.connect

        class CountedFile(io.IOBase):  # a proxy: every write() is an event
            def __init__(self, inner: Any, path: Any) -> None:
                self._inner, self._path = inner, path

            def write(self, data: Any) -> Any:
                faults.event("write", self._path)
                return self._inner.write(data)

            def writelines(self, lines: Any) -> None:
                for line in lines:
                    self.write(line)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._inner, name)

            def __enter__(self) -> Any:
                return self

            def __exit__(self, *exc: Any) -> None:
                self._inner.close()

            def __iter__(self) -> Any:
                return iter(self._inner)

            def close(self) -> None:
                self._inner.close()

            @property
            def closed(self) -> bool:
                return self._inner.closed

            def fileno(self) -> int:
                return self._inner.fileno()

            def flush(self) -> None:
                self._inner.flush()

            def seekable(self) -> bool:
                return self._inner.seekable()

            def seek(self, *a: Any) -> int:
                return self._inner.seek(*a)

            def tell(self) -> int:
                return self._inner.tell()

            def writable(self) -> bool:
                return True

            def readable(self) -> bool:
                return self._inner.readable()

            def read(self, *a: Any) -> Any:
                return self._inner.read(*a)

        def counted_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, int) or not (WRITING_MODES & set(mode)) or not faults._under(file) \
                    or os.path.isdir(file):  # a directory: tempfile's O_TMPFILE probe, which falls back on failure
                return real_open(file, mode, *args, **kwargs)
            faults.event("write", file)
            return CountedFile(real_open(file, mode, *args, **kwargs), file)

        def counted_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if faults._under(src) or faults._under(dst):
                faults.event("rename", dst)
            return real_replace(src, dst, *args, **kwargs)

        def counted_rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if faults._under(src) or faults._under(dst):
                faults.event("rename", dst)
            return real_rename(src, dst, *args, **kwargs)

        def counted_write_table(table: Any, where: Any, *args: Any, **kwargs: Any) -> None:
            if not hasattr(where, "write") and faults._under(where):
                faults.event("write", where)
            return real_write_table(table, where, *args, **kwargs)

        class CountedWriter(real_writer):  # type: ignore[misc, valid-type]
            def __init__(self, where: Any, *args: Any, **kwargs: Any) -> None:
                self._tfmoe_where = where if not hasattr(where, "write") and faults._under(where) else None
                if self._tfmoe_where is not None:
                    faults.event("write", where)
                super().__init__(where, *args, **kwargs)

            def write_table(self, table: Any, *args: Any, **kwargs: Any) -> None:
                if self._tfmoe_where is not None:
                    faults.event("write", self._tfmoe_where)
                return super().write_table(table, *args, **kwargs)

        class CountedConnection(sqlite3.Connection):
            _tfmoe_db: str | None = None

            def _check(self, sql: Any) -> None:
                if self._tfmoe_db is not None and isinstance(sql, str) \
                        and sql.lstrip().upper().startswith(SQL_WRITES):
                    faults.event("write", self._tfmoe_db, sql=True)

            def execute(self, sql: Any, *args: Any) -> Any:  # type: ignore[override]
                self._check(sql)
                return super().execute(sql, *args)

            def executemany(self, sql: Any, *args: Any) -> Any:  # type: ignore[override]
                self._check(sql)
                return super().executemany(sql, *args)

            def executescript(self, sql: Any) -> Any:  # type: ignore[override]
                self._check(sql)
                return super().executescript(sql)

            def cursor(self, *args: Any) -> Any:  # type: ignore[override]
                cur = super().cursor(CountedCursor)
                cur._tfmoe_conn = self
                return cur

            def commit(self) -> None:
                self._check("COMMIT")
                return super().commit()

        class CountedCursor(sqlite3.Cursor):
            _tfmoe_conn: Any = None

            def execute(self, sql: Any, *args: Any) -> Any:  # type: ignore[override]
                if self._tfmoe_conn is not None:
                    self._tfmoe_conn._check(sql)
                return super().execute(sql, *args)

            def executemany(self, sql: Any, *args: Any) -> Any:  # type: ignore[override]
                if self._tfmoe_conn is not None:
                    self._tfmoe_conn._check(sql)
                return super().executemany(sql, *args)

        def counted_connect(database: Any, *args: Any, **kwargs: Any) -> Any:
            if "factory" in kwargs or not isinstance(database, (str, os.PathLike)) \
                    or str(database).startswith(":") or not faults._under(database):
                return real_connect(database, *args, **kwargs)
            conn = real_connect(database, *args, factory=CountedConnection, **kwargs)
            conn._tfmoe_db = os.fsdecode(database)
            return conn

        self._undo = [(builtins, "open", real_open), (io, "open", io.open), (os, "replace", real_replace),
                      (os, "rename", real_rename), (pq, "write_table", real_write_table),
                      (pq, "ParquetWriter", real_writer), (sqlite3, "connect", real_connect),
                      (sqlite3.dbapi2, "connect", real_connect)]
        builtins.open = io.open = counted_open  # type: ignore[assignment]
        os.replace, os.rename = counted_replace, counted_rename  # type: ignore[assignment]
        pq.write_table, pq.ParquetWriter = counted_write_table, CountedWriter  # type: ignore[assignment, misc]
        sqlite3.connect = sqlite3.dbapi2.connect = counted_connect  # type: ignore[assignment]  # SQLAlchemy: dbapi2
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        for module, name, value in reversed(self._undo):
            setattr(module, name, value)


def count(root: Path, run: Any, only: Any = None) -> tuple[int, int, list[tuple[str, str]]]:
    """A dry pass: (writes, renames, the events) of ``run()`` under ``root`` (those whose path passes ``only``)."""
    with IOFaults(root, only=only) as faults:
        run()
    return faults.count("write"), faults.count("rename"), faults.events


def plans(writes: int, renames: int, errnos: tuple[int, ...] = (errno_mod.ENOSPC, errno_mod.EIO),
          rename_errno: int | None = errno_mod.EIO) -> list[Fault]:
    """Every fault point: the Nth write for every N and errno, the Nth rename for every N (``rename_errno``)."""
    out = [Fault("write", n, e) for e in errnos for n in range(1, writes + 1)]
    if rename_errno is None:
        return out
    return out + [Fault("rename", n, rename_errno) for n in range(1, renames + 1)]
