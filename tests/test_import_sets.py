"""What each notebook command imports (issue 23): a listing needs neither pandas nor pyarrow nor Hydra, so `tfmoe
runs` answers in a few tenths of a second. Each command runs in a fresh subprocess (imports are per process) through
``tfmoe.cli.main``; the guard then reads ``sys.modules``. One planted case puts a forbidden import back into the
listing's code path and sees the guard name it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfmoe.harness.store import notebook
from tfmoe.status import Status

HEAVY = ("pandas", "pyarrow", "numpy", "hydra", "omegaconf", "torch", "duckdb")
# Runs `tfmoe ARGV` in this process, then prints its exit code and the top-level modules loaded, as one JSON line.
WRAPPER = """
import json, sys
{plant}
from tfmoe.cli import main
try:
    main()
    code = 0
except SystemExit as exc:
    code = exc.code
print("\\n" + json.dumps({{"code": code, "modules": sorted({{m.split(".")[0] for m in sys.modules}})}}))
"""


def loaded(args: list[str], cwd: Path, plant: str = "") -> tuple[int, set[str], str]:
    """(exit code, top-level modules loaded, stdout before the report) of `tfmoe ARGS` in a fresh interpreter."""
    r = subprocess.run([sys.executable, "-c", WRAPPER.format(plant=plant), *args], cwd=cwd, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "COLUMNS": "160"})
    out, _, report = r.stdout.rstrip("\n").rpartition("\n")
    assert report.startswith("{"), f"tfmoe {' '.join(args)}: no report (rc {r.returncode}): {r.stderr[-2000:]}"
    got = json.loads(report)
    return got["code"], set(got["modules"]), out


def assert_imports_none_of(args: list[str], cwd: Path, forbidden: tuple[str, ...], plant: str = "") -> str:
    code, modules, out = loaded(args, cwd, plant)
    assert code == 0, f"tfmoe {' '.join(args)} exited {code}: {out[-2000:]}"
    heavy = sorted(set(forbidden) & modules)
    assert not heavy, f"tfmoe {' '.join(args)} imported {', '.join(heavy)} (it must not: issue 23)"
    return out


def make_run(root: Path, run_id: str, status: str = "ok") -> Path:
    """A real run directory written by the notebook layer (no experiment, no torch)."""
    writer = notebook.RunWriter(run_dir=root / "shift-labels" / run_id, run_id=run_id, experiment="shift-labels",
                                seed=0, argv=[], overrides=["seed=1", "hydra/launcher=basic"], device="cpu",
                                dtype="fp32")
    writer.start()
    if status != "running":
        writer.finish(None, Status(status), Status(status).exit_code, None, None, None, 100)
    return writer.run_dir


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory whose runs root holds two finished runs, its catalog already built."""
    cwd = tmp_path_factory.mktemp("lab")
    make_run(cwd / "runs", "20260101T000000Z-aaaaaaaa")
    make_run(cwd / "runs", "20260102T000000Z-bbbbbbbb", "failed")
    old = time.time() - 3600  # not racy: the catalog trusts these directories' mtimes
    for d in [cwd / "runs", *(cwd / "runs").rglob("*")]:
        if d.is_dir():
            os.utime(d, (old, old))
    from tfmoe.harness.store import catalog

    assert catalog.rebuild(cwd / "runs") == 2
    return cwd


@pytest.mark.parametrize("args", [
    ["runs", "--last", "5"],
    ["runs", "--experiment", "shift-labels", "--status", "failed", "--last", "5"],
    ["runs", "--format", "json"],
])
def test_runs_imports_no_pandas_pyarrow_or_hydra(lab: Path, args: list[str]) -> None:
    out = assert_imports_none_of(args, lab, HEAVY)
    assert "20260102T000000Z-bbbbbbbb" in out  # it listed the runs, not only started
    if "--status" in args:
        assert "20260101T000000Z-aaaaaaaa" not in out
    if "json" in args:
        assert [r["run_id"] for r in json.loads(out)] == ["20260101T000000Z-aaaaaaaa", "20260102T000000Z-bbbbbbbb"]


def test_import_guard_names_a_forbidden_import_put_back(lab: Path) -> None:
    # planted: the catalog's listing imports pandas again (as it did before issue 23)
    plant = ("import tfmoe.harness.store.catalog as c\n_listing = c.listing\n"
             "def listing(*a, **k):\n    import pandas\n    return _listing(*a, **k)\nc.listing = listing")
    with pytest.raises(AssertionError, match=r"imported .*pandas"):
        assert_imports_none_of(["runs", "--last", "5"], lab, HEAVY, plant=plant)
