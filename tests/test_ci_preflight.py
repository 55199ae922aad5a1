"""scripts/check-free-space.sh, the first step of .ci/run (F-158): a disk too small for the three venvs fails in
one line before `pip install` fills it; bad arguments exit 2 naming the fix."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "check-free-space.sh"


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30)


def test_enough_free_space_passes_and_says_how_much(tmp_path: Path) -> None:
    free_gib = shutil.disk_usage(tmp_path).free // 2**30
    got = _check("1", str(tmp_path))
    assert got.returncode == 0, got.stderr
    said = re.fullmatch(rf"free space: (\d+) GiB on {re.escape(str(tmp_path))} \(needs 1\)", got.stdout.strip())
    assert said and abs(int(said.group(1)) - free_gib) <= 1, got.stdout  # free space moves while the test runs


def test_a_disk_with_less_than_asked_fails_in_one_line_naming_both_figures(tmp_path: Path) -> None:
    need = shutil.disk_usage(tmp_path).total // 2**30 + 1  # more than the whole disk: never free
    got = _check(str(need), str(tmp_path))
    assert got.returncode == 2 and got.stdout == ""
    lines = got.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path} has ")
    assert f"needs about {need} GiB" in lines[0] and "free some space" in lines[0]


def test_the_boundary_is_whole_gib_of_free_space(tmp_path: Path) -> None:
    free_gib = shutil.disk_usage(tmp_path).free // 2**30
    if free_gib < 2:
        pytest.skip("under 2 GiB free: no boundary above the smallest request to test")
    # one GiB either side of the free space (it moves by megabytes while the test runs)
    assert _check(str(free_gib - 1), str(tmp_path)).returncode == 0
    assert _check(str(free_gib + 2), str(tmp_path)).returncode == 2


def test_bad_arguments_exit_2_naming_the_usage(tmp_path: Path) -> None:
    for args in ([], ["x"], ["0"], ["-3"], ["1.5"]):
        got = _check(*args)
        assert got.returncode == 2, args
        assert got.stderr.count("\n") == 1 and "usage: check-free-space.sh GIB [DIR]" in got.stderr, args
    missing = _check("1", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert missing.stderr == f"error: check-free-space.sh cannot read the free space of '{tmp_path / 'nowhere'}': " \
                             "pass a directory that exists\n"


def test_ci_checks_the_disk_before_it_installs_anything() -> None:
    steps = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert steps[0].startswith("bash scripts/check-free-space.sh "), steps[0]
