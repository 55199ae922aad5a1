"""The run catalog: a rebuildable SQLite cache of every run's run.parquet row under one runs root.

The run directories stay the truth. The catalog (``<runs_root>/.tfmoe-catalog.sqlite3``) remembers, for each
*container* directory (the runs root, ``runs/<experiment>/``, ``multirun-*/`` and run directories that have no
run.parquet yet), its mtime and ctime; and for each run its run.parquet row, its checks passed / total and a signature of
its run.parquet (inode, mtime, size). Every read first *syncs*: it stats the known containers (a few dozen even
at 10,000 runs) and re-lists only those whose mtime or ctime changed, so runs copied in (rsync, cp) appear and deleted ones
disappear with no manual step; it re-stats run.parquet of runs whose status can still change (``running``).
A container whose mtime or ctime is within ``RACY_S`` of now is rescanned next time too (a file system's clock tick can
hide a second change in the same tick — git's "racy" rule).

Why SQLite (stdlib) in WAL mode: readers never block each other or a writer, a sync is one ``BEGIN IMMEDIATE``
transaction (concurrent syncs serialise on SQLite's own lock, a crash mid-sync rolls back), and the runs
themselves never write the catalog, so a sweep's jobs (joblib, submitit, separate processes) cannot corrupt it or
lose an entry: a job's new directory changes its container's mtime and the next reader picks it up. A catalog
that is unreadable, from another schema version, or copied from another machine's runs root is rebuilt.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfmoe.harness.store.rundir import (
    RUN_FILE,
    TABLE_FILES,
)

if TYPE_CHECKING:
    import pandas as pd
from tfmoe.contract.status import Status
from tfmoe.harness.store.run_rows import _read_run, _read_runs, _read_tables

CATALOG_FILE = ".tfmoe-catalog.sqlite3"
SCHEMA_VERSION = "6"  # 6: symlinked run directories followed (an older catalog never listed them)
# Statuses a run never leaves; any other (running, unreadable) is re-checked at every sync.
FINAL_STATUSES = tuple(s.value for s in Status if s.final)
# The runs every sync re-stats: still changing, or indexed while their run.parquet was brand new. A partial index
# with this very condition keeps that a lookup at 10,000 runs (a scan of the runs table took 6-16 ms per command).
UNSETTLED = (f"status NOT IN ({', '.join(repr(s) for s in FINAL_STATUSES)}) OR sig IS NULL OR sig LIKE '%:racy'")
UNREADABLE = f"status = '{Status.UNREADABLE.value}'"  # a literal, as the partial index on it needs
RACY_S = 2.0
VIEWS_DIR = ".tfmoe-views"  # kept views (kept_views.view), one parquet file per view and generation
SKIP_DIRS = {".hydra", "__pycache__"}
LIST_COLUMNS = ["run_id", "experiment", "status", "started_at", "wall_s", "device", "dtype", "overrides"]

# meta's generation counts every change to what views show; versions holds, for each run, the generation of its last
# such change, so a view kept at generation G is extended by the runs changed after G (kept_views.view), not rebuilt.
_GENERATION = "(SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'generation')"
_BUMP_GENERATION = "UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'generation';"
# A run's settled signature replacing its racy one, the row unchanged, is no change to what views show.
_RUNS_UPDATE_WHEN = "WHEN " + " OR ".join(
    f"OLD.{c} IS NOT NEW.{c}" for c in ("path", "parent", "run_id", "experiment", "status", "started_at", "wall_s",
                                        "device", "dtype", "overrides", "checks_passed", "checks_total", "row"))
_TRIGGER_BODIES = {
    ("runs", "INSERT"): f"INSERT OR REPLACE INTO versions SELECT NEW.path, {_GENERATION};",
    ("runs", "UPDATE"): f"INSERT OR REPLACE INTO versions SELECT NEW.path, {_GENERATION};",
    ("runs", "DELETE"): "DELETE FROM versions WHERE path = OLD.path;",
    ("tables", "INSERT"): f"INSERT OR REPLACE INTO versions SELECT NEW.path, {_GENERATION};",
    ("tables", "UPDATE"): f"INSERT OR REPLACE INTO versions SELECT NEW.path, {_GENERATION};",
    ("tables", "DELETE"): f"INSERT OR REPLACE INTO versions SELECT OLD.path, {_GENERATION} "
                          "WHERE EXISTS (SELECT 1 FROM runs WHERE path = OLD.path);",
}
TRIGGERS = {  # name: its CREATE statement, as SQLite keeps it in sqlite_master (see _stale_triggers)
    f"{table}_{event.lower()}": f"CREATE TRIGGER {table}_{event.lower()} AFTER {event} ON {table} "
                                f"{_RUNS_UPDATE_WHEN + ' ' if (table, event) == ('runs', 'UPDATE') else ''}"
                                f"BEGIN {_BUMP_GENERATION} {body} END"
    for (table, event), body in _TRIGGER_BODIES.items()}
_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS containers (path TEXT PRIMARY KEY, parent TEXT, sig TEXT);
CREATE TABLE IF NOT EXISTS runs (
    path TEXT PRIMARY KEY, parent TEXT, sig TEXT, run_id TEXT, experiment TEXT, status TEXT, started_at TEXT,
    wall_s REAL, device TEXT, dtype TEXT, overrides TEXT, checks_passed INTEGER, checks_total INTEGER, row TEXT);
-- each run's run/metrics/checks/timings tables as Arrow IPC streams, cached by the first `tfmoe sql` that needs
-- them (one SQLite read, not 40,000 parquet files), dropped whenever the run is re-read
CREATE TABLE IF NOT EXISTS tables (path TEXT PRIMARY KEY, run BLOB, metrics BLOB, checks BLOB, timings BLOB);
-- each run's generation when what views show of it last changed (TRIGGERS count every change to runs and tables,
-- so no writer can forget to; a view kept under VIEWS_DIR names the generation it was built at)
CREATE TABLE IF NOT EXISTS versions (path TEXT PRIMARY KEY, version INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS versions_version ON versions (version);
DROP TABLE IF EXISTS views;  -- views kept in SQLite by an older tfmoe
CREATE INDEX IF NOT EXISTS runs_run_id ON runs (run_id);
CREATE INDEX IF NOT EXISTS runs_started ON runs (started_at);
CREATE INDEX IF NOT EXISTS runs_parent ON runs (parent);
CREATE INDEX IF NOT EXISTS runs_unsettled ON runs (path) WHERE """ + UNSETTLED + """;
CREATE INDEX IF NOT EXISTS runs_unreadable ON runs (path) WHERE """ + UNREADABLE + """;
CREATE INDEX IF NOT EXISTS containers_parent ON containers (parent);
"""


# --------------------------------------------------------------------------------------------- opening
def _identity(root: Path) -> str:
    """Which directory this catalog describes: a catalog rsync'ed in from another machine's runs root differs."""
    st = root.stat()
    return f"{os.uname().nodename}:{st.st_dev}:{st.st_ino}"


def _connect(db: str) -> sqlite3.Connection:
    conn = sqlite3.connect(db, timeout=60, isolation_level=None)  # autocommit; transactions are explicit
    conn.execute("PRAGMA busy_timeout = 60000")
    if db != ":memory:":
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
    conn.executescript(_DDL)
    if _stale_triggers(conn):
        _replace_triggers(conn)
    return conn


def _stale_triggers(conn: sqlite3.Connection) -> bool:
    """Whether the catalog's triggers differ from TRIGGERS: a new catalog, or one an older tfmoe made."""
    have = {name: " ".join(sql.split()) for name, sql in conn.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'trigger'")}
    return have != {name: " ".join(sql.split()) for name, sql in TRIGGERS.items()}


def _replace_triggers(conn: sqlite3.Connection) -> None:
    """Put TRIGGERS in place of whatever triggers the catalog has, once, without a rebuild. Every run counts as
    changed now (its version is the current generation), so a view kept before is built again, not extended."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        if _stale_triggers(conn):  # another process may have replaced them while this one waited for the lock
            for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
                conn.execute(f'DROP TRIGGER "{name}"')
            for sql in TRIGGERS.values():
                conn.execute(sql)
            conn.execute(f"INSERT OR REPLACE INTO versions SELECT path, coalesce({_GENERATION}, 0) FROM runs")
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back the open transaction, if SQLite still has one: on a full disk it rolls back by itself, and a
    second ROLLBACK would raise "cannot rollback - no transaction is active" over the real cause."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass


def _fresh(conn: sqlite3.Connection, root: Path) -> bool:
    got = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    return got.get("version") == SCHEMA_VERSION and got.get("identity") == _identity(root)


def _reset(conn: sqlite3.Connection, root: Path) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        if not _fresh(conn, root):  # another process may have reset it while we waited for the lock
            conn.execute("DELETE FROM runs")
            conn.execute("DELETE FROM tables")
            conn.execute("DELETE FROM containers")
            conn.execute("DELETE FROM versions")
            conn.execute("DELETE FROM meta")
            conn.executemany("INSERT INTO meta VALUES (?, ?)",  # epoch: kept views of a catalog before are not its
                             [("version", SCHEMA_VERSION), ("identity", _identity(root)), ("generation", "0"),
                              ("epoch", os.urandom(4).hex())])
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise


_IN_MEMORY: list[bool] = [False]  # set by read_through_full_disk: this process lists runs from a full scan


def read_through_full_disk(read: Callable[[], Any], runs_root: Path) -> Any:
    """``read()``, a reader of the catalog (`runs`, `show`, `sql`, `diff`, `export`); when the disk fills while it
    writes the catalog (a cache: rows, cached tables), ``read()`` again over an in-memory catalog, with one warning
    line, never SQLite's traceback. A reader prints only after its catalog work, so nothing is printed twice."""
    _WARNED[0] = False
    try:
        return read()
    except (sqlite3.OperationalError, OSError) as exc:
        if not _disk_full(exc) or _IN_MEMORY[0]:
            raise
        said = exc
    _IN_MEMORY[0] = True
    try:
        _warn_full(Path(runs_root) / CATALOG_FILE, said)
        return read()
    finally:
        _IN_MEMORY[0] = False


_WARNED: list[bool] = [False]  # one warning per command, however many times it opens the catalog


def _warn_full(db: Path, exc: BaseException) -> None:
    if not _WARNED[0]:
        _WARNED[0] = True
        print(f"warning: cannot write the run catalog {db} ({exc}): listing the runs from a full scan; free space "
              "there", file=sys.stderr)


def open_catalog(runs_root: Path) -> sqlite3.Connection:
    """The catalog of ``runs_root``, synced with the directories. An unwritable runs root gets an in-memory
    catalog (a full scan); a corrupt or foreign catalog file is rebuilt."""
    root = Path(runs_root)
    db = root / CATALOG_FILE
    if _IN_MEMORY[0] or not os.access(root, os.W_OK) or (db.exists() and not os.access(db, os.W_OK)):
        return _in_memory(root)
    conn = None
    try:
        try:
            conn = _connect(str(db))
            conn.execute("SELECT count(*) FROM runs").fetchone()
        except sqlite3.DatabaseError as exc:  # not a database / malformed: it is only a cache, rebuild it
            if _disk_full(exc):
                raise
            for suffix in ("", "-wal", "-shm"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)
            conn = _connect(str(db))
        if not _fresh(conn, root):
            _reset(conn, root)
        sync(conn, root)
    except (sqlite3.OperationalError, OSError) as exc:
        if not _disk_full(exc):
            raise
        if conn is not None:
            conn.close()
        _warn_full(db, exc)  # the catalog is only a cache: the runs are listed from a full scan, said once
        return _in_memory(root)
    return conn


def _in_memory(root: Path) -> sqlite3.Connection:
    conn = _connect(":memory:")
    _reset(conn, root)
    sync(conn, root)
    return conn


def _disk_full(exc: BaseException) -> bool:
    """A full disk or quota, or a read-only file system, as SQLite or the OS reports it."""
    import errno

    text = str(exc)
    return getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) or any(
        t in text for t in ("database or disk is full", "readonly database", "disk I/O error"))


def rebuild(runs_root: Path) -> int:
    """Drop the catalog and index every run again; returns how many runs it holds."""
    root = Path(runs_root)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{root / CATALOG_FILE}{suffix}").unlink(missing_ok=True)
    conn = open_catalog(root)
    try:
        return int(conn.execute("SELECT count(*) FROM runs").fetchone()[0])
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------- syncing
def _sig(run_file: Path) -> str | None:
    try:
        st = run_file.stat()
    except OSError:
        return None
    racy = time.time() - st.st_mtime < RACY_S
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}{':racy' if racy else ''}"


def _dir_sig(st: os.stat_result) -> str | None:
    """A directory's (mtime, ctime): adding or removing an entry moves both, and restoring the mtime afterwards
    (rsync -a, cp -a, touch -d) moves the ctime. None while either is within RACY_S of now (rescan next time)."""
    if time.time() - max(st.st_mtime, st.st_ctime) < RACY_S:
        return None
    return f"{st.st_mtime_ns}:{st.st_ctime_ns}"


# What marks a directory as a run's even without its run.parquet (deleted, or never written): one of the files a run
# writes after run.parquet (its tables, summary.md). Such a directory is listed as an ``unreadable`` run, not dropped
# Hydra's .hydra/ alone is not a mark: a run that is starting has it before its run.parquet.
RUN_MARKS = ("summary.md", *TABLE_FILES.values())


def _lost_run_file(path: Path) -> bool:
    """A run directory whose run.parquet is missing: it holds a run's marks. At any timing: a run writes its
    run.parquet before any mark, and replaces it by a rename, so a mark without it is never a run that is starting."""
    return not (path / RUN_FILE).exists() and any((path / m).exists() for m in RUN_MARKS)


def _same_row(conn: sqlite3.Connection, rel: str, parent: str, row: dict[str, Any]) -> bool:
    """Whether the catalog already holds exactly this row for the run (a re-read found nothing new)."""
    got = conn.execute("SELECT parent, row FROM runs WHERE path = ?", (rel,)).fetchone()
    return got is not None and got[0] == parent and got[1] == _row_json(row)


def _row_json(row: dict[str, Any]) -> str:
    return json.dumps(row, default=str)


def _upsert_run(conn: sqlite3.Connection, rel: str, parent: str, sig: str | None, row: dict[str, Any]) -> None:
    conn.execute("DELETE FROM tables WHERE path = ?", (rel,))  # stale: `tfmoe sql` caches it again when asked
    conn.execute(
        "INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (rel, parent, sig, str(row.get("run_id")), row.get("experiment"), row.get("status"), row.get("started_at"),
         row.get("wall_s"), row.get("device"), row.get("dtype"), json.dumps(row.get("overrides") or []),
         row["checks_passed"], row["checks_total"], _row_json(row)),
    )


def _forget(conn: sqlite3.Connection, rel: str) -> None:
    """Remove a run or container (and everything under a container) from the catalog."""
    like = rel.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "/%"
    for table in ("runs", "containers", "tables"):
        conn.execute(f"DELETE FROM {table} WHERE path = ? OR path LIKE ? ESCAPE '\\'", (rel, like))


def _scan(conn: sqlite3.Connection, root: Path, rel: str, parent: str | None) -> None:
    """(Re)list one container: add new runs and containers, forget vanished ones, then record its mtime."""
    path = root / rel if rel else root
    try:
        st = path.stat()  # before listing: a change during the listing moves the mtime again
        entries = [e for e in os.scandir(path) if _followed_dir(e)]
    except OSError:
        _forget(conn, rel)
        return
    if rel and ((path / RUN_FILE).exists() or _lost_run_file(path)):  # a run directory since the last sync
        _forget(conn, rel)
        _upsert_run(conn, rel, parent or "", _sig(path / RUN_FILE), _read_run(path))
        return
    conn.execute("INSERT OR REPLACE INTO containers VALUES (?,?,?)", (rel, parent, _dir_sig(st)))
    known_runs = {p for (p,) in conn.execute("SELECT path FROM runs WHERE parent = ?", (rel,))}
    known_containers = {p for (p,) in conn.execute("SELECT path FROM containers WHERE parent = ?", (rel,))}
    seen = set()
    new_runs: list[tuple[str, Path]] = []
    for entry in entries:
        if entry.name in SKIP_DIRS or entry.name.startswith("."):
            continue
        child = f"{rel}/{entry.name}" if rel else entry.name
        seen.add(child)
        if child in known_runs or child in known_containers:
            continue  # known runs are re-read only when their status can still change (see sync)
        run_file = Path(entry.path) / RUN_FILE
        if run_file.exists() or _lost_run_file(Path(entry.path)):
            new_runs.append((child, Path(entry.path)))
        else:
            _scan(conn, root, child, rel)
    sigs = [_sig(d / RUN_FILE) for _, d in new_runs]  # before reading: a rewrite during the read moves it
    for (child, _), sig, row in zip(new_runs, sigs, _read_runs([d for _, d in new_runs]), strict=True):
        _upsert_run(conn, child, rel, sig, row)
    for gone in (known_runs | known_containers) - seen:
        _forget(conn, gone)


def _followed_dir(entry: os.DirEntry) -> bool:
    """Whether a container's entry is a directory to list: a real one, or a symlink to one, followed (a run moved to
    another disk and linked back is still a run). A symlink to a directory that holds it (a loop) is not
    followed, with one warning line; a dangling one is a broken link, not a run, and is left alone."""
    if entry.is_dir(follow_symlinks=False):
        return True
    if not entry.is_symlink() or not entry.is_dir():
        return False
    target, holder = Path(entry.path).resolve(), Path(entry.path).parent.resolve()
    if target == holder or target in holder.parents:
        sys.stderr.write(f"warning: {entry.path} links to {target}, which holds it (a loop): not followed\n")
        return False
    return True


def _recheck_run_files(conn: sqlite3.Connection, root: Path) -> None:
    """A settled run whose run.parquet was deleted (its directory kept) becomes ``unreadable``: deleting a file in a
    run directory moves no container's mtime, so each settled run's run.parquet is stat'ed (one ``lstat`` per run,
    about 1 ms per 1,000 runs) rather than trusting the catalog's row."""
    rows = conn.execute(f"SELECT path, parent FROM runs WHERE NOT ({UNSETTLED}) AND NOT ({UNREADABLE})").fetchall()
    for rel, parent in rows:
        if not os.path.lexists(f"{root}/{rel}/{RUN_FILE}"):
            if os.path.isdir(f"{root}/{rel}"):  # it held a run: listed as unreadable, never dropped
                _upsert_run(conn, rel, parent, None, _read_run(root / rel))
            else:
                _forget(conn, rel)


def sync(conn: sqlite3.Connection, runs_root: Path) -> None:
    """Bring the catalog up to date with the directories (one transaction; concurrent syncs serialise)."""
    root = Path(runs_root)
    if not root.is_dir():
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        known = conn.execute("SELECT path, parent, sig FROM containers ORDER BY length(path)").fetchall()
        if not known:
            _scan(conn, root, "", None)
        alive: set[str] | None = {rel for rel, _, _ in known}  # the containers known now (None: read again)
        for rel, parent, sig in known:
            if alive is None:  # after a rescan or a forget: one query, not one per container
                alive = {p for (p,) in conn.execute("SELECT path FROM containers")}
            if rel not in alive:
                continue  # forgotten while rescanning its parent
            try:
                now = _dir_sig(os.stat(f"{root}/{rel}" if rel else root))
            except OSError:
                _forget(conn, rel)
                alive = None
                continue
            if sig is None or now != sig:
                _scan(conn, root, rel, parent)
                alive = None
        _recheck_run_files(conn, root)
        # runs whose status can still change, and runs indexed while their run.parquet was brand new
        for rel, parent, sig in conn.execute(f"SELECT path, parent, sig FROM runs WHERE {UNSETTLED}").fetchall():
            new_sig = _sig(root / rel / RUN_FILE)
            if new_sig is None:
                if sig is not None and os.path.isdir(root / rel):  # its run.parquet deleted, the directory kept
                    _upsert_run(conn, rel, parent, None, _read_run(root / rel))
                continue  # gone: its container's rescan forgets it
            if new_sig != sig:
                row = _read_run(root / rel)
                if _same_row(conn, rel, parent, row):  # settled, unchanged: its cached tables and views still hold
                    conn.execute("UPDATE runs SET sig = ? WHERE path = ?", (new_sig, rel))
                else:
                    _upsert_run(conn, rel, parent, new_sig, row)
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise


# --------------------------------------------------------------------------------------------- reading
def frame(conn: sqlite3.Connection, runs_root: Path) -> pd.DataFrame:
    """The catalog as one row per run: run.parquet's columns, ``path``, checks passed/total."""
    import pandas as pd

    from tfmoe.harness.store.rundir import RUN_SCHEMA

    root = Path(runs_root)
    got = conn.execute("SELECT path, checks_passed, checks_total, row FROM runs ORDER BY started_at, path").fetchall()
    df = pd.DataFrame([json.loads(row) for *_, row in got], columns=RUN_SCHEMA.names)
    df["path"] = [str(root / p) for p, *_ in got]
    df["checks_passed"] = pd.array([r[1] for r in got], dtype="Int64")
    df["checks_total"] = pd.array([r[2] for r in got], dtype="Int64")
    for col in ("started_at", "finished_at"):
        df[col] = pd.to_datetime(df[col], utc=True, format="ISO8601")
    return df


def listing(conn: sqlite3.Connection, runs_root: Path, where: str = "",
            params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """The :data:`LIST_COLUMNS` of the runs matching ``where`` (SQL over the catalog's columns), oldest first, as
    plain rows (``path`` absolute, ``overrides`` a list, ``started_at`` an aware datetime or None): sqlite3 only."""
    root = Path(runs_root)
    conn.row_factory = sqlite3.Row
    try:
        got = conn.execute(f"SELECT {', '.join(LIST_COLUMNS)}, path FROM runs {where} ORDER BY started_at, path",
                           params).fetchall()
    finally:
        conn.row_factory = None
    rows = []
    for r in got:
        row = dict(r)
        row["path"] = str(root / row["path"])
        row["overrides"] = json.loads(row["overrides"]) if row["overrides"] else []
        row["started_at"] = _utc(row["started_at"])
        rows.append(row)
    return rows


def _utc(text: str | None) -> dt.datetime | None:
    """An ISO 8601 time as an aware UTC datetime (a naive one is taken as UTC, as pandas' ``utc=True`` does)."""
    if not text:
        return None
    t = dt.datetime.fromisoformat(text)
    return t.replace(tzinfo=dt.timezone.utc) if t.tzinfo is None else t.astimezone(dt.timezone.utc)


def paths(conn: sqlite3.Connection, runs_root: Path) -> Iterator[tuple[str, Path]]:
    """(run_id, directory) of every run in the catalog."""
    root = Path(runs_root)
    for run_id, path in conn.execute("SELECT run_id, path FROM runs ORDER BY started_at, path"):
        yield run_id, root / path


def lookup(conn: sqlite3.Connection, runs_root: Path, ref: str) -> list[tuple[str, Path]]:
    """Runs matching ``ref``: ``latest``, an exact run id, else every run whose id starts with it."""
    root = Path(runs_root)
    if ref == "latest":
        q = conn.execute("SELECT run_id, path FROM runs WHERE started_at IS NOT NULL "
                         "ORDER BY started_at DESC, path DESC LIMIT 1")
    else:
        q = conn.execute("SELECT run_id, path FROM runs WHERE run_id = ?", (ref,))
    found = [(r, root / p) for r, p in q.fetchall()]
    if found or ref == "latest":
        return found
    return [(r, root / p) for r, p in conn.execute(
        "SELECT run_id, path FROM runs WHERE substr(run_id, 1, ?) = ? ORDER BY run_id LIMIT 6", (len(ref), ref))]


def count(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT count(*) FROM runs").fetchone()[0])


def fill_tables(conn: sqlite3.Connection, runs_root: Path) -> int:
    """Cache the SQL tables of every run that has none yet (after a sync); returns how many were read."""
    root = Path(runs_root)
    missing = [p for (p,) in conn.execute("SELECT r.path FROM runs r LEFT JOIN tables t USING (path) "
                                          "WHERE t.path IS NULL")]
    if not missing:
        return 0
    if len(missing) < 16:
        read = [_read_tables(root / p) for p in missing]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
            read = list(pool.map(_read_tables, [root / p for p in missing], chunksize=64))
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany("INSERT OR REPLACE INTO tables SELECT ?, ?, ?, ?, ? WHERE EXISTS "
                         "(SELECT 1 FROM runs WHERE path = ?)",
                         [(p, *blobs, p) for p, (blobs, _) in zip(missing, read, strict=True)])
        for p, (_, bad) in zip(missing, read, strict=True):
            if bad is not None:  # a file whose footer read at index time but whose data does not (or since)
                _mark_unreadable(conn, p, bad)
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise
    return len(missing)


def _mark_unreadable(conn: sqlite3.Connection, rel: str, error: str) -> None:
    got = conn.execute("SELECT row FROM runs WHERE path = ?", (rel,)).fetchone()
    if got is None:
        return
    row = {**json.loads(got[0]), "status": Status.UNREADABLE.value, "error": error}
    conn.execute("UPDATE runs SET status = ?, row = ? WHERE path = ?",
                 (Status.UNREADABLE.value, json.dumps(row, default=str), rel))


def unreadable(conn: sqlite3.Connection, runs_root: Path) -> list[tuple[str, Path, str]]:
    """(run_id, directory, why) of every run the catalog holds as unreadable."""
    root = Path(runs_root)
    rows = conn.execute(f"SELECT run_id, path, row, started_at FROM runs WHERE {UNREADABLE}").fetchall()
    return [(rid, root / p, json.loads(row).get("error") or "unreadable")
            for rid, p, row, _ in sorted(rows, key=lambda r: (r[3] is not None, r[3] or "", r[1]))]
