"""Conclusions kept with the run: what it proved, what is inferred from it, what is not yet verified.

``tfmoe conclude RUN --proven "…" --inferred "…" --unverified "…"`` appends rows (kind, text, written_at) to the
run's conclusions.parquet. Earlier rows are never changed: each append reads them, refuses to go on if they no
longer read back, and writes old + new atomically under a file lock (concurrent appends are serialised).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
from filelock import FileLock, Timeout

from tfmoe.errors import BadInput
from tfmoe.harness.store.notebook import resolve_run
from tfmoe.harness.store.rundir import read_parquet, utcnow, write_parquet, write_text

CONCLUSIONS_FILE = "conclusions.parquet"
KINDS = {"proven": "Proven (a check or a number from this run)", "inferred": "Inferred (not shown by this run alone)",
         "unverified": "Not yet verified"}
SCHEMA = pa.schema([("kind", pa.string()), ("text", pa.string()), ("written_at", pa.timestamp("us", tz="UTC"))])
SUMMARY_MARK = "\n## Conclusions\n"


def read(run_dir: Path) -> pd.DataFrame:
    path = Path(run_dir) / CONCLUSIONS_FILE
    if not path.exists():
        return pd.DataFrame(columns=SCHEMA.names)
    return read_parquet(path)


def append(run_ref: str, runs_root: Path, entries: list[tuple[str, str]]) -> tuple[Path, pd.DataFrame]:
    """Append (kind, text) rows to RUN's conclusions.parquet; returns the run directory and every row."""
    if not entries:
        raise BadInput('nothing to conclude: pass --proven "…", --inferred "…" and/or --unverified "…"')
    for kind, text in entries:
        if kind not in KINDS:
            raise BadInput(f"conclusion kind {kind!r} is unknown: use {', '.join(KINDS)}")
        if not text.strip():
            raise BadInput(f"--{kind} is empty: write the conclusion as a sentence")
    run_dir = resolve_run(run_ref, runs_root)
    path = run_dir / CONCLUSIONS_FILE
    try:
        with FileLock(str(path) + ".lock", timeout=30):
            old = read(run_dir)
            now = utcnow()
            new = pd.DataFrame([{"kind": k, "text": t.strip(), "written_at": now} for k, t in entries])
            both = new if old.empty else pd.concat([old, new], ignore_index=True)
            write_parquet(both, path, schema=SCHEMA)
            _rewrite_summary(run_dir, both)
    except Timeout:
        raise BadInput(f"{path} is locked by another process for 30 s: retry, or remove a stale {path}.lock") from None
    except OSError as exc:  # read-only file system, permissions, a full disk: never a filelock traceback
        raise BadInput(f"cannot write {exc.filename or path}: {exc.strerror or exc}: conclusions are kept in the "
                       "run directory, which must be writable (remount it read-write, or copy the run)") from None
    return run_dir, both


def markdown(df: pd.DataFrame) -> list[str]:
    """The three headings with their conclusions, in the order written."""
    lines = []
    for kind, heading in KINDS.items():
        rows = df[df["kind"] == kind] if not df.empty else df
        lines += [f"### {heading}", ""]
        lines += [f"- {r['text']} *({pd.Timestamp(r['written_at']).strftime('%Y-%m-%d %H:%M')} UTC)*"
                  for r in rows.to_dict("records")] or ["- (none yet)"]
        lines.append("")
    return lines


def _rewrite_summary(run_dir: Path, df: pd.DataFrame) -> None:
    """summary.md keeps everything the run wrote; its Conclusions section (at the end) is regenerated."""
    path = run_dir / "summary.md"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    head = text.split(SUMMARY_MARK, 1)[0].rstrip() + "\n"
    write_text(path, head + SUMMARY_MARK + "\n" + "\n".join(markdown(df)).rstrip() + "\n")
