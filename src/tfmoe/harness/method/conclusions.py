"""Conclusions kept with the run: what it proved, what is inferred from it, what is not yet verified.

``tfmoe conclude RUN --proven "…" --inferred "…" --unverified "…"`` appends rows (kind, text, written_at) to the
run's conclusions.parquet. The text follows the rule `failures add` follows (safe_text: line breaks folded, control
and bidi characters refused; older rows shown with them escaped). Earlier rows are never changed: each append reads them, refuses to go on if they no
longer read back, and writes old + new atomically under a file lock (concurrent appends are serialised).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tfmoe.contract.errors import BadInput
from tfmoe.harness.store.notebook import resolve_run
from tfmoe.harness.store.rundir import read_table, records, utcnow, write_parquet, write_text
from tfmoe.rules.safe_text import shown_text, typed_text

CONCLUSIONS_FILE = "conclusions.parquet"
KINDS = {"proven": "Proven (a check or a number from this run)", "inferred": "Inferred (not shown by this run alone)",
         "unverified": "Not yet verified"}

def schema() -> Any:
    import pyarrow as pa

    return pa.schema([("kind", pa.string()), ("text", pa.string()), ("written_at", pa.timestamp("us", tz="UTC"))])

SUMMARY_MARK = "\n## Conclusions\n"


def read(run_dir: Path) -> list[dict[str, Any]]:
    """The run's conclusions (kind, text, written_at), in the order written; none without the file."""
    path = Path(run_dir) / CONCLUSIONS_FILE
    return records(read_table(path)) if path.exists() else []


def append(run_ref: str, runs_root: Path, entries: list[tuple[str, str]]) -> tuple[Path, list[dict[str, Any]]]:
    """Append (kind, text) rows to RUN's conclusions.parquet; returns the run directory and every row."""
    import pandas as pd
    from filelock import FileLock, Timeout

    if not entries:
        raise BadInput('nothing to conclude: pass --proven "…", --inferred "…" and/or --unverified "…"')
    for kind, text in entries:
        if kind not in KINDS:
            raise BadInput(f"conclusion kind {kind!r} is unknown: use {', '.join(KINDS)}")
        if not text.strip():
            raise BadInput(f"--{kind} is empty: write the conclusion as a sentence")
    entries = [(kind, typed_text(kind, text, "summary.md and `tfmoe show`")) for kind, text in entries]
    run_dir = resolve_run(run_ref, runs_root)
    path = run_dir / CONCLUSIONS_FILE
    try:
        with FileLock(str(path) + ".lock", timeout=30):
            old = read(run_dir)
            now = utcnow()
            both = [*({k: r[k] for k in ("kind", "text", "written_at")} for r in old),
                    *({"kind": k, "text": t, "written_at": now} for k, t in entries)]
            write_parquet(pd.DataFrame(both, columns=["kind", "text", "written_at"]), path, schema=schema())
            _rewrite_summary(run_dir, both)
    except Timeout:
        raise BadInput(f"{path} is locked by another process for 30 s: retry, or remove a stale {path}.lock") from None
    except OSError as exc:  # read-only file system, permissions, a full disk: never a filelock traceback
        raise BadInput(f"cannot write {exc.filename or path}: {exc.strerror or exc}: conclusions are kept in the "
                       "run directory, which must be writable (remount it read-write, or copy the run)") from None
    return run_dir, both


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The three headings with their conclusions (rows of :func:`read`), in the order written."""
    lines = []
    for kind, heading in KINDS.items():
        lines += [f"### {heading}", ""]
        lines += [f"- {shown_text(r['text'])} *({r['written_at'].strftime('%Y-%m-%d %H:%M')} UTC)*"
                  for r in rows if r["kind"] == kind] or ["- (none yet)"]
        lines.append("")
    return lines


def _rewrite_summary(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """summary.md keeps everything the run wrote; its Conclusions section (at the end) is regenerated."""
    path = run_dir / "summary.md"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    head = text.split(SUMMARY_MARK, 1)[0].rstrip() + "\n"
    write_text(path, head + SUMMARY_MARK + "\n" + "\n".join(markdown(rows)).rstrip() + "\n")
