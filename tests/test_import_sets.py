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

from tfmoe.harness.store import notebook, rundir
from tfmoe.status import Status

HEAVY = ("pandas", "pyarrow", "numpy", "hydra", "omegaconf", "torch", "duckdb")
NO_CONFIG_NO_TORCH = ("hydra", "omegaconf", "torch")  # composes no config, builds no tensor
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


def assert_imports_none_of(args: list[str], cwd: Path, forbidden: tuple[str, ...], plant: str = "",
                           code: int = 0) -> str:
    got, modules, out = loaded(args, cwd, plant)
    assert got == code, f"tfmoe {' '.join(args)} exited {got}: {out[-2000:]}"
    heavy = sorted(set(forbidden) & modules)
    assert not heavy, f"tfmoe {' '.join(args)} imported {', '.join(heavy)} (it must not: issue 23)"
    return out


def make_run(root: Path, run_id: str, status: str = "ok", tensor: list[float] | None = None) -> Path:
    """A real run directory written by the notebook layer (no experiment, no torch), with one saved float32
    tensor in tensors.parquet's schema when ``tensor`` is given."""
    writer = notebook.RunWriter(run_dir=root / "shift-labels" / run_id, run_id=run_id, experiment="shift-labels",
                                seed=0, argv=[], overrides=["seed=1", "hydra/launcher=basic"], device="cpu",
                                dtype="fp32")
    writer.start()
    if status != "running":
        writer.finish(None, Status(status), Status(status).exit_code, None, None, None, 100)
    if tensor is not None:
        import pandas as pd

        row = {"name": "out", "dtype": "float32", "shape": [len(tensor)], "values": tensor, "numel": len(tensor),
               "summarised": False, "min": min(tensor), "max": max(tensor), "mean": sum(tensor) / len(tensor),
               "std": 0.0}
        rundir.write_parquet(pd.DataFrame([row]), writer.run_dir / "tensors.parquet", schema=rundir.TENSORS_SCHEMA)
    return writer.run_dir


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory whose runs root holds two finished runs, its catalog already built."""
    cwd = tmp_path_factory.mktemp("lab")
    make_run(cwd / "runs", "20260101T000000Z-aaaaaaaa", tensor=[0.5, 1.5])
    make_run(cwd / "runs", "20260102T000000Z-bbbbbbbb", "failed", tensor=[0.5, 2.5])
    old = time.time() - 3600  # not racy: the catalog trusts these directories' and run.parquet files' mtimes
    for d in [cwd / "runs", *(cwd / "runs").rglob("*")]:  # (else a later sync re-reads a run: with pyarrow)
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


READS_WITH_PYARROW_ALONE = (*NO_CONFIG_NO_TORCH, "duckdb", "pandas")  # show, failures add: pyarrow reads the run
SHOWS_A_PASSING_RUN = (*READS_WITH_PYARROW_ALONE, "yaml")  # no failed check to explain: no config parsed


@pytest.mark.parametrize(("args", "forbidden", "code"), [
    (["show", "20260101T000000Z-aaaaaaaa"], SHOWS_A_PASSING_RUN, 0),
    (["show", "20260101T000000Z-aaaaaaaa", "--format", "md"], SHOWS_A_PASSING_RUN, 0),
    (["show", "20260101T000000Z-aaaaaaaa", "--format", "json"], SHOWS_A_PASSING_RUN, 0),
    (["diff", "20260101T000000Z-aaaaaaaa", "20260102T000000Z-bbbbbbbb"], (*NO_CONFIG_NO_TORCH, "duckdb"), 1),
    (["sql", "SELECT run_id FROM runs"], NO_CONFIG_NO_TORCH, 0),
    (["failures", "add", "20260102T000000Z-bbbbbbbb", "--again", "--file", "failures-guard.md"],
     READS_WITH_PYARROW_ALONE, 0),
], ids=["show", "show-md", "show-json", "diff", "sql", "failures-add"])
def test_notebook_commands_import_neither_hydra_nor_torch(lab: Path, args: list[str], forbidden: tuple[str, ...],
                                                          code: int) -> None:
    out = assert_imports_none_of(args, lab, forbidden, code=code)
    if args[0] == "diff":  # the saved tensors were compared (numpy, not torch): 2.5 vs 1.5 differs
        assert "out" in out and "tensors" in out


@pytest.mark.parametrize("args", [["show", "20260101T000000Z-aaaaaaaa"],
                                  ["failures", "add", "20260102T000000Z-bbbbbbbb", "--again", "--file", "f-plant.md"]],
                         ids=["show", "failures-add"])
def test_import_guard_names_pandas_put_back_into_reading_a_run(lab: Path, args: list[str]) -> None:
    # planted: a run's tables are read through pandas again (DataFrame.to_dict, as before issue 23)
    plant = ("import tfmoe.harness.store.notebook as n\n"
             "def rows(self, key):\n    return self.frame(key).to_dict('records')\nn.RunData.rows = rows")
    with pytest.raises(AssertionError, match=r"imported .*pandas"):
        assert_imports_none_of(args, lab, READS_WITH_PYARROW_ALONE, plant=plant)


def test_show_json_of_a_run_without_an_end_time(lab: Path) -> None:
    """A run still running (or lost) has no finished_at: show --format json writes null (it raised on pandas' NaT)."""
    make_run(lab / "runs", "20260103T000000Z-cccccccc", "running")
    out = assert_imports_none_of(["show", "20260103T000000Z-cccccccc", "--format", "json"], lab,
                                 READS_WITH_PYARROW_ALONE)
    run = json.loads(out)["run"]
    assert run["finished_at"] is None and run["wall_s"] is None and run["started_at"].endswith("+00:00")
