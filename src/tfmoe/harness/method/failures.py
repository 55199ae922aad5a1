"""failures.md: an append-only log of real failures, one entry per failed run, safe under concurrent appends."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from tfmoe.contract.errors import BadInput
from tfmoe.contract.status import Status
from tfmoe.harness.store.notebook import RunData, load_run, read_run_row, resolve_run
from tfmoe.rules.safe_text import shown_text as run_text
from tfmoe.rules.safe_text import typed_text

HEADER = ("# Failures log\n\nReal failures met while running experiments: phenomenon, hypothesis, evidence, fix and the "
          "regression test that now guards it. Append-only (`tfmoe failures add RUN`).\n")
# An entry's heading: at the start of the file or after a blank line (format_entry writes one; a field's text never
# holds a newline: user text is folded onto one line), so a heading forged inside a field of an older entry is not one.
ENTRY_RE = re.compile(r"(?:\A|(?<=\n\n))## F-(\d+)(?: \([^)\n]*\))?: (.*)$", re.M)


def user_text(option: str, text: str, required: bool = True) -> str:
    """A --title/--hypothesis/--fix/--test value as the log may hold it (safe_text.typed_text, the rule `conclude`
    shares)."""
    return typed_text(option, text, "failures.md", required)


def _lock(path: Path) -> FileLock:
    return FileLock(str(path) + ".lock", timeout=30)


def format_entry(number: int, run_ref: str, runs_root: Path, title: str | None, hypothesis: str, fix: str,
                 test: str) -> str:
    data = load_run(resolve_run(run_ref, runs_root))
    run = data.run
    failed = [c for c in data.rows("checks") if not c["passed"]]
    missed = [e for e in data.rows("expectations") if e["held"] is False]  # held is nullable: not yet judged
    if not failed and not missed and run["status"] == Status.OK:
        raise BadInput(f"run {run['run_id']} passed all its checks and met its expectations: there is no failure "
                       "to log (pass a failed or surprising run, e.g. from `tfmoe runs --status failed`)")
    lines = []
    for e in missed:
        obs = "no rows" if e["observed"] is None or e["observed"] != e["observed"] else f"{e['observed']:.6g}"
        by = "" if e["miss"] is None or e["miss"] != e["miss"] else f" (misses by {e['miss']:.4g})"
        lines.append(f"  - expected `{run_text(e['selector'])} {run_text(e['expected'])}` (written "
                     f"{_when(e['written_at'])}), observed {obs}{by} — {run_text(e['detail'])}")
    for c in failed:
        obs = "" if c["observed"] is None or c["observed"] != c["observed"] else f" observed {c['observed']:.6g}"
        thr = "" if c["threshold"] is None or c["threshold"] != c["threshold"] else \
            f" vs threshold {c['threshold']:.6g}"
        lines.append(f"  - `{run_text(c['check'])}`{obs}{thr}{' — ' + run_text(c['detail']) if c['detail'] else ''}")
    error = run.get("error")
    if isinstance(error, str) and error:
        lines.append(f"  - run status `{run['status']}`: {run_text(error)}")
    saved = [r["name"] for r in data.rows("tensors") if str(r["name"]).startswith("failing.")]
    if title is None and not failed and missed:
        title = f"{run['experiment']}: expected " + ", ".join(f"{e['selector']} {e['expected']}" for e in missed)
    title = title or (f"{run['experiment']}: " + ", ".join(c["check"] for c in failed) if failed
                      else f"{run['experiment']}: {run['status']}")
    title = run_text(title)
    overrides = run_text(" ".join(run["overrides"])) or "(none)"
    day = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    return "\n".join([
        f"## F-{number}: {title}",
        "",
        f"*Logged {day} from run `{run['run_id']}`.*",
        "",
        "- **Phenomenon**:",
        *lines,
        f"- **Hypothesis**: {hypothesis}",
        f"- **Evidence**: run `{data.path}` (experiment `{run['experiment']}`, overrides `{overrides}`, seed "
        f"{run['seed']}, device {run['device']} / {run['dtype']}; torch {run['torch']}, python {run['python']}, "
        f"git {str(run['git_commit'])[:12]}{' dirty' if run['git_dirty'] else ''}); failing tensors saved: "
        f"{', '.join(f'`{s}`' for s in saved) or 'none'}",
        *[f"  - {line}" for line in _metric_evidence(data, missed)],
        f"- **Fix**: {fix}",
        f"- **Regression test**: {test}",
        "",
    ])


def _when(t: dt.datetime | None) -> str:
    return "?" if t is None else t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _metric_evidence(data: RunData, missed: list[dict[str, Any]], max_rows: int = 8) -> list[str]:
    """The metrics rows each missed expectation was judged on (the run's own numbers), as short lines."""
    from tfmoe.harness.method.expectations import parse_one, select_rows

    out = []
    rows = data.rows("metrics")
    for e in missed:
        picked = select_rows(parse_one(e["label"], f"{e['selector']} {e['expected']}"), rows)
        shown = []
        for r in picked[-max_rows:]:
            tags = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("name", "value", "measured")
                            and v is not None and not (isinstance(v, float) and v != v) and str(v) != "<NA>")
            shown.append(f"{r['value']:.6g}" + (f" ({run_text(tags)})" if tags else ""))
        more = f" (last {max_rows} of {len(picked)})" if len(picked) > max_rows else ""
        out.append(f"metrics.parquet rows of `{e['selector']}` in run `{data.run['run_id']}`{more}: "
                   + ("; ".join(shown) or "none"))
    return out


# A pytest node in --test's text: FILE.py, FILE.py::name, FILE.py::Class::name, FILE.py::name[param-id]
NODE_RE = re.compile(r"(?P<file>[\w./-]+\.py)(?:::(?P<node>[A-Za-z_]\w*(?:::[A-Za-z_]\w*)*)(?:\[[^\]\s]*\])?)?")


def check_test_nodes(test: str, bases: list[Path]) -> None:
    """Every pytest node named in ``test`` exists: its file (relative to one of ``bases``) and, read with
    :mod:`ast` (nothing imported), the function or class (and method) it names. Text naming no ``.py`` file
    ("none yet") is accepted as it is."""
    import ast

    for m in NODE_RE.finditer(test):
        rel = Path(m["file"])
        path = next((b / rel for b in bases if (b / rel).is_file()), None)
        if path is None:
            raise BadInput(f"--test {m[0]}: no file {rel} (looked in {', '.join(str(b) for b in bases)}): name "
                           "an existing test, e.g. tests/test_cli.py::test_name")
        if not m["node"]:
            continue
        try:
            body: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
        except (SyntaxError, UnicodeDecodeError, OSError) as exc:
            raise BadInput(f"--test {m[0]}: {path} cannot be read as Python ({exc})") from None
        for part in m["node"].split("::"):
            found = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                          and n.name == part), None)
            if found is None:
                raise BadInput(f"--test {m[0]}: {rel} defines no test {part!r}: name an existing test function "
                               "or class (tfmoe failures add ... --test FILE::NAME)")
            body = found.body if isinstance(found, ast.ClassDef) else []


def logged_as(text: str, run_id: str) -> str | None:
    """The entry ("F-N") of a failures log ``text`` that was logged from run ``run_id``, if any."""
    logged = re.search(rf"^\*Logged \S+ from run `{re.escape(run_id)}`\.\*$", text, re.M)
    if logged is None:
        return None
    heads = [h for h in ENTRY_RE.finditer(text) if h.start() < logged.start()]
    return f"F-{heads[-1][1]}" if heads else "an entry"


def _unwritable(path: Path, exc: OSError) -> BadInput:
    """One line for a log that cannot be written (read-only file system, permissions, a full disk)."""
    return BadInput(f"cannot write {exc.filename or path}: {exc.strerror or exc}: make it writable or pass "
                    "--file (and --runs-root) on a writable file system")


def add(run_ref: str, runs_root: Path, file: Path, title: str | None, hypothesis: str, fix: str, test: str,
        again: bool = False) -> str:
    """Append one entry (never rewriting earlier ones); returns its heading. Refuses a --test naming a pytest node
    that does not exist, and a run already logged unless ``again``."""
    if file.exists() and not file.is_file():
        raise BadInput(f"{file} is not a file: pass --file path/to/failures.md")
    title = None if title is None else user_text("title", title)
    hypothesis, fix, test = user_text("hypothesis", hypothesis), user_text("fix", fix), user_text("test", test)
    check_test_nodes(test, list(dict.fromkeys([Path.cwd(), file.resolve().parent])))
    run_id = str(read_run_row(resolve_run(run_ref, runs_root))["run_id"])
    try:
        with _lock(file):
            text = file.read_text(encoding="utf-8") if file.exists() else ""
            entry_of = logged_as(text, run_id)
            if entry_of and not again:
                raise BadInput(f"run {run_id} is already logged as {entry_of} in {file}: pass --again to log it "
                               "once more")
            numbers = [int(n) for n, _ in ENTRY_RE.findall(text)]
            number = max(numbers, default=0) + 1
            entry = format_entry(number, run_ref, runs_root, title, hypothesis, fix, test)
            with open(file, "a", encoding="utf-8") as fh:
                if not text:
                    fh.write(HEADER + "\n")
                fh.write(("\n" if text and not text.endswith("\n\n") else "") + entry)
    except Timeout:
        raise BadInput(f"{file} is locked by another process for 30 s: retry, or remove a stale {file}.lock") from None
    except OSError as exc:  # read-only file system, permissions, a full disk: never a filelock traceback
        raise _unwritable(file, exc) from None
    return entry.splitlines()[0].removeprefix("## ")


def list_entries(file: Path) -> None:
    if not file.exists():
        raise BadInput(f"{file} does not exist: `tfmoe failures add RUN` creates it")
    for number, title in ENTRY_RE.findall(file.read_text(encoding="utf-8")):
        print(f"F-{number}: {title}")
