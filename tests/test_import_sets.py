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

from tfmoe.contract.status import Status
from tfmoe.harness.store import notebook, rundir

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
        metrics = [{"name": "loss", "value": v, "step": i} for i, v in enumerate(tensor)]
        rundir.write_parquet(rundir.metrics_frame(metrics), writer.run_dir / rundir.TABLE_FILES["metrics"])
    return writer.run_dir


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory whose runs root holds two finished runs, its catalog already built."""
    return _make_lab(tmp_path_factory.mktemp("lab"))


@pytest.fixture(scope="module")
def finished_lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same, for tests that need every run finished (``lab`` gets a running run)."""
    return _make_lab(tmp_path_factory.mktemp("finished-lab"))


def _make_lab(cwd: Path) -> Path:
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
    plant = ("import tfmoe.harness.store.catalog as c, tfmoe.harness.store.kept_views as kv\n_listing = c.listing\n"
             "def listing(*a, **k):\n    import pandas\n    return _listing(*a, **k)\nc.listing = listing")
    with pytest.raises(AssertionError, match=r"imported .*pandas"):
        assert_imports_none_of(["runs", "--last", "5"], lab, HEAVY, plant=plant)


READS_WITH_PYARROW_ALONE = (*NO_CONFIG_NO_TORCH, "duckdb", "pandas")  # show, failures add: pyarrow reads the run
SQL_WITHOUT_PANDAS = (*NO_CONFIG_NO_TORCH, "pandas")  # DuckDB over the catalog's arrow tables; text without pandas
SHOWS_A_PASSING_RUN = (*READS_WITH_PYARROW_ALONE, "yaml")  # no failed check to explain: no config parsed


@pytest.mark.parametrize(("args", "forbidden", "code"), [
    (["show", "20260101T000000Z-aaaaaaaa"], SHOWS_A_PASSING_RUN, 0),
    (["show", "20260101T000000Z-aaaaaaaa", "--format", "md"], SHOWS_A_PASSING_RUN, 0),
    (["show", "20260101T000000Z-aaaaaaaa", "--format", "json"], SHOWS_A_PASSING_RUN, 0),
    (["diff", "20260101T000000Z-aaaaaaaa", "20260102T000000Z-bbbbbbbb"], (*NO_CONFIG_NO_TORCH, "duckdb"), 1),
    (["sql", "SELECT run_id FROM runs"], SQL_WITHOUT_PANDAS, 0),
    (["sql", "SELECT * FROM runs", "--format", "json"], SQL_WITHOUT_PANDAS, 0),
    (["sql", "SELECT * FROM runs", "--format", "csv"], SQL_WITHOUT_PANDAS, 0),
    (["sql", "SELECT r.run_id, count(*) AS n FROM runs r JOIN metrics m USING (run_id) JOIN checks c "
             "USING (run_id) JOIN timings t USING (run_id) GROUP BY ALL"], SQL_WITHOUT_PANDAS, 0),
    (["failures", "add", "20260102T000000Z-bbbbbbbb", "--again", "--file", "failures-guard.md"],
     READS_WITH_PYARROW_ALONE, 0),
], ids=["show", "show-md", "show-json", "diff", "sql", "sql-json", "sql-csv", "sql-every-view", "failures-add"])
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


@pytest.mark.parametrize("plant", [
    # planted: the result goes through a DataFrame again (DuckDB's .df(), as before issue 23)
    "import tfmoe.harness.reading.sql_output as o\n_csv = o.csv_text\n"
    "def csv_text(result):\n    import pandas\n    return _csv(result)\no.csv_text = csv_text",
    # planted: a view's run_id column is built by pyarrow from Python strings, which imports pandas
    "import pyarrow as pa\nimport tfmoe.harness.reading.sql as s\n"
    "s.string_array = lambda values: pa.array(values, pa.string())",
], ids=["frame", "pyarrow-conversion"])
def test_import_guard_names_pandas_put_back_into_sql(lab: Path, plant: str) -> None:
    args = ["sql", "SELECT run_id, count(*) AS n FROM metrics GROUP BY ALL ORDER BY run_id", "--format", "csv"]
    out = assert_imports_none_of(args, lab, SQL_WITHOUT_PANDAS)  # unplanted: the metrics view has rows, no pandas
    assert out.splitlines()[1:3] == ["20260101T000000Z-aaaaaaaa,2", "20260102T000000Z-bbbbbbbb,2"]
    with pytest.raises(AssertionError, match=r"imported .*pandas"):
        assert_imports_none_of(args, lab, SQL_WITHOUT_PANDAS, plant=plant)


SQL_FROM_KEPT_VIEWS = (*SQL_WITHOUT_PANDAS, "pyarrow", "numpy")  # DuckDB reads the catalog's kept view files itself


@pytest.mark.parametrize("query", ["SELECT run_id, status FROM runs",
                                   "SELECT r.run_id, count(m.name) AS n FROM runs r LEFT JOIN metrics m USING (run_id) "
                                   "LEFT JOIN checks c USING (run_id) LEFT JOIN timings t USING (run_id) GROUP BY ALL"],
                         ids=["runs", "every-view"])
def test_sql_over_kept_views_imports_no_pyarrow(finished_lab: Path, query: str) -> None:
    for fmt in ("csv", "json", "table"):  # the first query may build the views (pyarrow); then they are kept
        assert_imports_none_of(["sql", query, "--format", fmt], finished_lab, SQL_WITHOUT_PANDAS)
        out = assert_imports_none_of(["sql", query, "--format", fmt], finished_lab, SQL_FROM_KEPT_VIEWS)
        assert "20260102T000000Z-bbbbbbbb" in out


def test_import_guard_names_pyarrow_when_the_views_are_not_kept(finished_lab: Path) -> None:
    # planted: the catalog keeps no view file (as before issue 23's last step), so each query builds them with pyarrow
    plant = "import tfmoe.harness.store.catalog as c, tfmoe.harness.store.kept_views as kv\nkv._on_disk = lambda conn: False"
    with pytest.raises(AssertionError, match=r"imported .*pyarrow"):
        assert_imports_none_of(["sql", "SELECT run_id FROM runs"], finished_lab, SQL_FROM_KEPT_VIEWS, plant=plant)


EVERY_VIEW = ("SELECT r.run_id, count(m.name) AS n FROM runs r LEFT JOIN metrics m USING (run_id) LEFT JOIN checks c "
              "USING (run_id) LEFT JOIN timings t USING (run_id) GROUP BY ALL")


def _lab_with_a_new_run(cwd: Path) -> Path:
    """A lab whose views are kept, then one more finished run (the views are extended by the next query)."""
    _make_lab(cwd)
    assert_imports_none_of(["sql", EVERY_VIEW], cwd, SQL_WITHOUT_PANDAS)
    make_run(cwd / "runs", "20260103T000000Z-cccccccc", tensor=[0.25, 3.5])
    return cwd


SAY_EXTENDED = """import tfmoe.harness.store.catalog as c, tfmoe.harness.store.kept_views as kv
real = kv._extensible
def spy(*args):
    found = real(*args)
    print("extended", args[2]) if found is not None else None
    return found
kv._extensible = spy"""  # prints each view extended, not built (stdlib only: the import set stays the command's)


def test_sql_right_after_a_new_run_extends_the_views_without_pandas(tmp_path: Path) -> None:
    from tfmoe.harness.store import catalog, kept_views

    out = assert_imports_none_of(["sql", EVERY_VIEW, "--format", "csv"], _lab_with_a_new_run(tmp_path),
                                 SQL_WITHOUT_PANDAS, plant=SAY_EXTENDED)
    assert "20260103T000000Z-cccccccc,2" in out
    assert sorted(line for line in out.splitlines() if line.startswith("extended ")) == [
        "extended checks", "extended metrics", "extended run", "extended timings"], out
    import pyarrow.parquet as pq

    newest = max((tmp_path / "runs" / catalog.VIEWS_DIR).glob("metrics-*.parquet"),
                 key=lambda f: int(f.stem.rsplit("-", 1)[1]))  # the one before stays a minute (STALE_VIEW_S)
    assert int(pq.read_schema(newest).metadata[kept_views.VIEW_RUNS_KEY]) == 3  # the extended view: 3 runs


def test_import_guard_names_pandas_put_back_into_extending_a_view(tmp_path: Path) -> None:
    # planted: the kept view read with pq.read_table, whose pyarrow.dataset imports pandas (0.25 s)
    plant = ("import tfmoe.harness.store.catalog as c, tfmoe.harness.store.kept_views as kv, pyarrow.parquet as pq\n"
             "kv._read_kept = lambda p: None if p.suffix == '.empty' else pq.read_table(p)")
    with pytest.raises(AssertionError, match=r"imported .*pandas"):
        assert_imports_none_of(["sql", EVERY_VIEW], _lab_with_a_new_run(tmp_path), SQL_WITHOUT_PANDAS, plant=plant)
