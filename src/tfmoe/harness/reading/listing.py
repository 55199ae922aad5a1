"""`tfmoe runs`: the run listing, read from the catalog with sqlite3 and printed with rich.

The most typed command, so it imports only what it uses: no pandas, pyarrow or Hydra (a run still ``running`` has
its run.parquet's state columns read with pyarrow, to tell a live run from a lost one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from tfmoe.contract.status import Status
from tfmoe.contract.tables import Rows, print_rows
from tfmoe.harness.store import catalog

console = Console(highlight=False)


def runs(runs_root: Path, experiment: str | None, status: str | None, last: int | None, fmt: str) -> None:
    """List the runs under ``runs_root`` (only ``experiment``'s, only those in ``status``, the ``last`` N)."""
    if not Path(runs_root).is_dir():
        print(f"no runs under {runs_root}")
        return
    conn = catalog.open_catalog(Path(runs_root))
    try:
        if catalog.count(conn) == 0:
            print(f"no runs under {runs_root}")
            return
        where, params = [], []
        if experiment:
            where.append("experiment = ?")
            params.append(experiment)
        derived = status in (Status.RUNNING, Status.LOST)  # the catalog holds the recorded status: derive, filter
        if status:
            where.append("status = ?")
            params.append(Status.RUNNING.value if derived else status)
        clause = ("WHERE " + " AND ".join(where)) if where else ""
        if last and not derived:  # the newest N by start time (runs not started yet sort first, as before)
            clause += (" AND" if where else "WHERE") + (
                " path IN (SELECT path FROM runs " + clause + " ORDER BY started_at IS NULL, started_at DESC, "
                "path DESC LIMIT ?)")
            params = [*params, *params, last]
        rows = catalog.listing(conn, Path(runs_root), clause, tuple(params))
    finally:
        conn.close()
    if any(r["status"] == Status.RUNNING for r in rows):  # notebook (pyarrow, psutil) only for a run still running
        from tfmoe.harness.store.notebook import read_run_state, status_now, where_running

        for row in rows:
            row["status"] = status_now(row["status"], Path(row["path"]))
    if derived:
        rows = [r for r in rows if r["status"] == status]
        rows = rows[-last:] if last else rows
    columns = ["run_id", "experiment", "status", "started_at", "wall_s", "device", "dtype", "overrides"]
    if any(r["status"] == Status.RUNNING for r in rows):  # where each running run runs (another host: there)
        columns.insert(3, "where")
        for r in rows:
            r["where"] = where_running(read_run_state(Path(r["path"]))) if r["status"] == Status.RUNNING else ""
    for r in rows:
        r["overrides"] = " ".join(r["overrides"])
        r["wall_s"] = "" if r["wall_s"] is None else f"{r['wall_s']:.2f}"
        r["started_at"] = "" if r["started_at"] is None else r["started_at"].strftime("%Y-%m-%d %H:%M:%S")
    title = f"runs under {runs_root}"
    if fmt == "json":
        print(_json([{c: r[c] for c in columns} for r in rows]))
    else:
        print_rows(Rows(title, columns, [tuple(r[c] for c in columns) for r in rows]), fmt, console)


def _json(records: list[dict[str, Any]]) -> str:
    """Row objects written as pandas' ``to_json(orient="records")`` writes them (compact, ASCII, ``/`` escaped),
    so the listing's JSON is byte for byte what it was when a DataFrame printed it."""
    return json.dumps(records, separators=(",", ":")).replace("/", "\\/")
