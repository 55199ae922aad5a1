"""The run keeps the code it ran: user-supplied modules (``impl=pkg.mod:Class``, ``chunked.impl=…``, any
``module:Name`` value) and input files named in the config are copied into the run directory's ``code/`` with
their sha256 and the import root they were found on; a dirty tfmoe checkout adds its uncommitted diff
(``code/tfmoe.diff``). ``code.parquet`` lists them. ``replay`` uses the recorded copies (and says plainly when the
file on disk has changed, and how); ``diff`` reports a code difference.

tfmoe's own modules and installed libraries (site-packages, the standard library) are not copied: the run's
``git_commit`` and the library versions in run.parquet identify them.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from tfmoe.contract.paths import CODE_PATHSPECS, PACKAGE_ROOT

CODE_FILE = "code.parquet"
CODE_DIR = "code"
MAX_INPUT_BYTES = 20_000_000  # input files above this are hashed, not copied
SPEC_RE = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):(?P<attr>[A-Za-z_][\w.]*)$")
SCHEMA = pa.schema([
    ("key", pa.string()), ("kind", pa.string()), ("spec", pa.string()), ("module", pa.string()),
    ("source", pa.string()), ("import_root", pa.string()), ("copy", pa.string()), ("sha256", pa.string()),
    ("bytes", pa.int64()),
])
TFMOE_ROOT = PACKAGE_ROOT


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _library_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(p).resolve() for p in {paths.get("stdlib"), paths.get("purelib"), paths.get("platlib")} if p]


def _is_user_code(origin: Path) -> bool:
    origin = origin.resolve()
    if origin.is_relative_to(TFMOE_ROOT):
        return False
    return not any(origin.is_relative_to(d) for d in _library_dirs())


def _walk(value: Any, key: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for k, v in value.items():
            if k != "hydra":
                yield from _walk(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{key}[{i}]")
    elif isinstance(value, str):
        yield key, value


def find_module_file(module: str) -> tuple[Path, Path] | None:
    """(source file, import root) of ``module`` as the import system finds it now, or None."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError, AttributeError):
        return None
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        return None
    origin = Path(spec.origin).resolve()
    depth = len(module.split(".")) - (0 if origin.name == "__init__.py" else 1)
    root = origin.parent
    for _ in range(depth):
        root = root.parent
    return origin, root


def referenced_code(cfg_dict: dict[str, Any]) -> list[dict[str, Any]]:
    """What the config points at: user modules (``module:Name``) and existing files (``path`` or ``file:path``)."""
    out = []
    for key, value in _walk(cfg_dict):
        m = SPEC_RE.match(value)
        if m:
            found = find_module_file(m["module"])
            if found and _is_user_code(found[0]):
                origin, root = found
                out.append({"key": key, "kind": "module", "spec": value, "module": m["module"], "source": str(origin),
                            "import_root": str(root), "rel": str(origin.relative_to(root))})
            continue
        path_text = value.removeprefix("file:")
        if "/" in path_text or path_text.endswith((".txt", ".tsv", ".json", ".py", ".csv")):
            path = Path(path_text).expanduser()
            if path.is_file() and _is_user_code(path):
                out.append({"key": key, "kind": "file", "spec": value, "module": None, "source": str(path.resolve()),
                            "import_root": None, "rel": f"files/{_safe(key)}/{path.name}"})
    return out


def _safe(key: str) -> str:
    return re.sub(r"[^\w.-]", "_", key)


def tfmoe_diff() -> str | None:
    """``git diff HEAD`` of tfmoe's own code and configs (``CODE_PATHSPECS``) when they have uncommitted changes
    (None when clean or no git); the notebook's files (failures.md, runs/, docs) are not code."""
    try:
        out = subprocess.run(["git", "-C", str(TFMOE_ROOT), "diff", "HEAD", "--", *CODE_PATHSPECS],
                             capture_output=True, text=True, timeout=20)
        untracked = subprocess.run(["git", "-C", str(TFMOE_ROOT), "ls-files", "--others", "--exclude-standard",
                                    "--full-name", "--", *CODE_PATHSPECS], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    new = [f"# untracked (not in the diff): {name}" for name in untracked.stdout.split()] \
        if untracked.returncode == 0 else []
    return "\n".join(new + [out.stdout]) if new else out.stdout


def capture(cfg_dict: dict[str, Any], run_dir: Path) -> pd.DataFrame:
    """Copy the referenced code into ``run_dir/code`` and return the code.parquet rows."""
    rows = []
    for ref in referenced_code(cfg_dict):
        src = Path(ref.pop("source"))
        rel = ref.pop("rel")
        size = src.stat().st_size
        copy = None
        if ref["kind"] == "module" or size <= MAX_INPUT_BYTES:
            dest = run_dir / CODE_DIR / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
            copy = str(Path(CODE_DIR) / rel)
        rows.append({**ref, "source": str(src), "copy": copy, "sha256": sha256(src), "bytes": size})
    diff = tfmoe_diff()
    if diff is not None:
        dest = run_dir / CODE_DIR / "tfmoe.diff"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(diff, encoding="utf-8")
        rows.append({"key": "(tfmoe checkout)", "kind": "tfmoe_diff", "spec": "git diff HEAD -- src conf pyproject.toml", "module": None,
                     "source": str(TFMOE_ROOT), "import_root": None, "copy": str(Path(CODE_DIR) / "tfmoe.diff"),
                     "sha256": hashlib.sha256(diff.encode()).hexdigest(), "bytes": len(diff.encode())})
    return pd.DataFrame(rows, columns=SCHEMA.names)


def read(run_dir: Path) -> pd.DataFrame:
    from tfmoe.harness.store.rundir import read_parquet

    path = Path(run_dir) / CODE_FILE
    return read_parquet(path) if path.exists() else pd.DataFrame(columns=SCHEMA.names)


# ------------------------------------------------------------------------------------------- replay
def line_delta(old: Path, new: Path, shown: int, width: int) -> str:
    """'+1 −1 lines: -old line; +new line' between two text files."""
    a = old.read_text(encoding="utf-8", errors="replace").splitlines()
    b = new.read_text(encoding="utf-8", errors="replace").splitlines()
    delta = [ln for ln in difflib.unified_diff(a, b, lineterm="", n=0)
             if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    added, removed = sum(ln.startswith("+") for ln in delta), sum(ln.startswith("-") for ln in delta)
    return f"+{added} −{removed} lines: " + "; ".join(delta[:shown])[:width]


def changes_since(run_dir: Path) -> list[str]:
    """One plain sentence per recorded user file that changed on disk (or vanished) since the run."""
    out = []
    for r in read(run_dir).to_dict("records"):
        if r["kind"] == "tfmoe_diff":
            continue
        src = Path(r["source"])
        if not src.exists():
            out.append(f"{r['key']}: {src} no longer exists; replaying with the recorded copy {r['copy']}")
            continue
        now = sha256(src)
        if now == r["sha256"]:
            continue
        how = ""
        if r["copy"] and (Path(run_dir) / r["copy"]).exists():
            how = f" ({line_delta(Path(run_dir) / r['copy'], src, 4, 300)})"
        use = f"replaying with the recorded copy {r['copy']}" if r["copy"] and (r["kind"] == "module" or re.fullmatch(
            r"[\w.]+", r["key"])) else "the replay reads the file as it is now (no recorded copy can stand in)"
        out.append(f"{r['key']}: {src} changed since the run (sha256 {r['sha256'][:12]} → {now[:12]}){how}; {use}")
    return out


@contextlib.contextmanager
def recorded_code(run_dir: Path) -> Iterator[list[str]]:
    """Make the run's recorded module copies the ones imported (their import root first on sys.path, cached
    modules evicted), restoring sys.path and sys.modules afterwards. Yields the overrides that point file inputs
    at their recorded copies."""
    rows = read(run_dir).to_dict("records")
    modules = [r for r in rows if r["kind"] == "module" and r["copy"]]
    files = [r for r in rows if r["kind"] == "file" and r["copy"] and re.fullmatch(r"[\w.]+", r["key"])]
    root = str((Path(run_dir) / CODE_DIR).resolve())
    saved_path = list(sys.path)
    evicted = {}
    for r in modules:
        for name in list(sys.modules):
            if name == r["module"] or name.startswith(r["module"] + "."):
                evicted[name] = sys.modules.pop(name)
    if modules:
        sys.path.insert(0, root)
        importlib.invalidate_caches()
    overrides = []
    for r in files:  # an input file that changed or vanished: point its key at the recorded copy
        src = Path(r["source"])
        if not src.exists() or sha256(src) != r["sha256"]:
            prefix = "file:" if str(r["spec"]).startswith("file:") else ""
            overrides.append(f"{r['key']}={prefix}{(Path(run_dir) / r['copy']).resolve()}")
    try:
        yield overrides
    finally:
        sys.path[:] = saved_path
        for r in modules:
            for name in list(sys.modules):
                if name == r["module"] or name.startswith(r["module"] + "."):
                    sys.modules.pop(name, None)
        sys.modules.update(evicted)
        importlib.invalidate_caches()


def diff_code(a_dir: Path, b_dir: Path) -> pd.DataFrame:
    """Per recorded file (by config key and kind): sha256 in A and B; user code that differs counts as a
    difference, tfmoe's own uncommitted diff is context (like git_commit)."""
    ra = {(r["key"], r["kind"]): r for r in read(a_dir).to_dict("records")}
    rb = {(r["key"], r["kind"]): r for r in read(b_dir).to_dict("records")}
    rows = []
    for key in sorted(set(ra) | set(rb)):
        a, b = ra.get(key), rb.get(key)
        sha_a, sha_b = (None if r is None else r["sha256"] for r in (a, b))
        note = ""
        if a is not None and b is not None and sha_a != sha_b and a["copy"] and b["copy"] \
                and (Path(a_dir) / a["copy"]).exists() and (Path(b_dir) / b["copy"]).exists():
            note = line_delta(Path(a_dir) / a["copy"], Path(b_dir) / b["copy"], 3, 200)
        rows.append({"file": f"{key[0]} ({key[1]})", "A": (sha_a or "(absent)")[:12], "B": (sha_b or "(absent)")[:12],
                     "note": note, "differs": sha_a != sha_b and key[1] != "tfmoe_diff"})
    return pd.DataFrame(rows, columns=["file", "A", "B", "note", "differs"])
