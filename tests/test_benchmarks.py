"""The notebook benchmarks still run to their end at a small size (F-156: bench_catalog stopped at `failures add`
for two sessions, once the command refused a run already logged, and nothing noticed). The figures themselves are
the benchmarks' business (docs/performance.md); here only that every command they time works."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *args: str) -> str:
    r = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{script} exited {r.returncode}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    return r.stdout


def test_the_startup_benchmark_times_every_command() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from bench_notebook_startup import TARGETS
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = _run("bench_notebook_startup.py", "12", "1")
    rows = [line.split("  ")[0] for line in out.splitlines()]
    assert [label for label in TARGETS if label not in rows] == [], out
    assert "worst ratio / target:" in out


@pytest.mark.slow
def test_the_catalog_benchmark_times_every_command() -> None:
    out = _run("bench_catalog.py", "12")
    for label in ("runs --last 5", "show latest", "diff A B", "failures add ID", "sql join", "replay ID"):
        assert any(line.startswith(label) for line in out.splitlines()), (label, out)
    assert "sql join over 12 runs" in out
    assert "(views rebuilt)" in out and "new run arrived (views extended)" in out and "ended (views extended)" in out
