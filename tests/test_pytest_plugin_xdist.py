"""tfmoe's pytest plugin in a user's real test suite: under pytest-xdist (``-n 2``), with ``-p no:cacheprovider``,
run from another directory. The docs' example passes; with a bug planted, each failed check's table is readable in
the report and each keeps its own run directory under ``--tfmoe-record``; nothing is written into the user's tree
(or the current directory) that ``--tfmoe-record`` did not name."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tfmoe
from tfmoe.api import checking as checks

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
PLANTED = ("/ math.sqrt(self.d_head)", "/ math.sqrt(D)")  # scale by d_model, not d_head


def plugin_args() -> list[str]:
    installed = any(ep.value == "tfmoe.api.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "tfmoe.api.pytest_plugin"]


def tree(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def run_pytest(project: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # Python's own bytecode aside, nothing may appear
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", *plugin_args(), "-p", "no:cacheprovider", "-n", "2",
                           "--rootdir", str(project), "-c", os.devnull, *args, str(project)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    for name in ("my_attention.py", "test_my_attention.py"):
        shutil.copy(EXAMPLES / name, project / name)
    return project


@pytest.mark.slow  # two pytest sessions of the example's batteries (~1 min quiet); scripts/test-torch-range.sh runs it
def test_the_example_under_xdist_from_another_directory(project: Path, tmp_path: Path) -> None:
    pytest.importorskip("xdist", reason="the dev extra's pytest-xdist is not installed")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    before = tree(project)

    ok = run_pytest(project, elsewhere, "-q")
    assert ok.returncode == 0, ok.stdout[-4000:] + ok.stderr[-2000:]
    assert re.search(r"\b4 passed\b", ok.stdout), ok.stdout[-2000:]
    assert tree(project) == before and tree(elsewhere) == {}

    layer = project / "my_attention.py"
    layer.write_text(layer.read_text().replace(*PLANTED))
    before = tree(project)
    record = tmp_path / "kept"
    bad = run_pytest(project, elsewhere, "-q", f"--tfmoe-record={record}", "-k", "not test_my_attention_conforms")
    out = bad.stdout
    assert bad.returncode == 1 and re.search(r"\b3 failed\b", out), out[-4000:] + bad.stderr[-2000:]
    assert "[gw0]" in out or "[gw1]" in out, out[:2000]  # the failures came from xdist's workers
    # each failure's table arrives whole from its worker: the header, the failed row, the likely cause
    assert out.count("check(s) failed") >= 3
    assert re.search(r"^\s+check\s+outcome\s+observed\s+limit\s+detail$", out, re.M), out[-4000:]
    assert re.search(r"^\s+sdpa_match\s+failed\s+[\d.e+-]+\s+[\d.e+-]+", out, re.M), out[-4000:]
    assert "likely cause (inferred, not proven)" in out
    # the fixture's and the marker's failed checks: one run directory each, each complete
    kept = sorted((record / "attn-check").iterdir())
    assert len(kept) == 2, kept
    for run_dir in kept:
        assert tfmoe.load_run(run_dir).run["status"] == "failed"
        assert str(run_dir) in out  # the table names it
    # nothing written into the user's tree or the current directory
    assert tree(project) == before and tree(elsewhere) == {}


def test_two_records_in_one_microsecond_get_two_run_directories(tmp_path: Path) -> None:
    """Two xdist workers sharing one --tfmoe-record may name a run in the same microsecond: the second one gets
    its own directory (name-1), never the first one's."""
    first = checks._new_run_dir(tmp_path / "attn-check", "2026-12-04_20-00-00-000001")
    second = checks._new_run_dir(tmp_path / "attn-check", "2026-12-04_20-00-00-000001")
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name == "2026-12-04_20-00-00-000001-1"
