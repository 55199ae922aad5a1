"""What tfmoe's pytest plugin adds to a pytest session that uses none of its markers: the wall time of
`pytest -p no:cacheprovider -q` on a small project (20 plain tests, no tfmoe marker or fixture) with the plugin
loaded and with it disabled (`-p no:tfmoe`, or without `-p tfmoe.api.pytest_plugin` where tfmoe is not installed),
sampled in alternation so machine load hits both alike. Prints the medians, their ratio (target <= 1.05: no
noticeable cost) and the load average before and after. Usage:
python benchmarks/bench_plugin_startup.py [REPEATS]
"""

from __future__ import annotations

import importlib.metadata
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 1.05
TESTS = "\n".join(f"def test_{i}():\n    assert sum(range({i})) == {i * (i - 1) // 2}\n" for i in range(20))


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def plugin_flags() -> tuple[list[str], list[str]]:
    """(flags that load the plugin, flags that leave it out)."""
    installed = any(ep.value == "tfmoe.api.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
    return ([], ["-p", "no:tfmoe"]) if installed else (["-p", "tfmoe.api.pytest_plugin"], [])


def session(cwd: Path, flags: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-c", os.devnull,
                           "--rootdir", str(cwd), *flags, "."], cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or "20 passed" not in proc.stdout:
        raise SystemExit(f"pytest {' '.join(flags)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall


def main(repeats: int = 15) -> float:
    with_plugin, without = plugin_flags()
    with tempfile.TemporaryDirectory(prefix="bench-plugin-") as tmp:
        cwd = Path(tmp)
        (cwd / "test_plain.py").write_text(TESTS)
        print(load())
        session(cwd, with_plugin), session(cwd, without)  # warm-up: the page cache, bytecode
        on, off = [], []
        for _ in range(repeats):
            on.append(session(cwd, with_plugin))
            off.append(session(cwd, without))
        print(load())
    a, b = statistics.median(on), statistics.median(off)
    ratio = a / b
    print(f"pytest session, 20 plain tests, median of {repeats}: with the tfmoe plugin {a * 1000:.0f} ms, "
          f"without {b * 1000:.0f} ms")
    print(f"ratio {ratio:.3f} (target <= {TARGET}): {'ok' if ratio <= TARGET else 'OVER'}")
    return ratio


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
