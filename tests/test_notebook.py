"""The run-directory contract: tensors round-trip exactly, writes are atomic, runs resolve, crashes keep records."""

from __future__ import annotations

import decimal
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from tfmoe.api.testing import launched
from tfmoe.contract import runtime
from tfmoe.contract.errors import BadInput
from tfmoe.harness.launching import launch
from tfmoe.harness.store import notebook, rundir

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_roundtrip_is_bit_identical(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(3, 5, 2, generator=g) * 100).to(dtype)  # not zeros
    assert t.to(torch.float64).abs().sum() > 0
    df = pd.DataFrame([notebook.tensor_row("t", t, max_numel=1000)])
    back = notebook.tensors_from_frame(df)["t"]
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_tensor_roundtrip_through_parquet_keeps_nan_inf_and_scalars(tmp_path: Path) -> None:
    t = torch.tensor([1.5, float("nan"), float("inf"), -float("inf")], dtype=torch.float16)
    s = torch.tensor(3.25)  # 0-d
    df = pd.DataFrame([notebook.tensor_row("t", t, 100), notebook.tensor_row("s", s, 100)])
    rundir.write_parquet(df, tmp_path / "tensors.parquet", schema=rundir.TENSORS_SCHEMA)
    back = notebook.load_tensors(tmp_path)
    assert torch.equal(back["t"].isnan(), t.isnan()) and back["t"][0] == 1.5 and back["t"][2] == float("inf")
    assert back["s"].shape == () and back["s"].item() == 3.25


def test_large_tensor_is_summarised_and_refuses_exact_load(tmp_path: Path) -> None:
    t = torch.arange(1, 11, dtype=torch.float32)
    df = pd.DataFrame([notebook.tensor_row("big", t, max_numel=5)])
    row = df.iloc[0]
    assert bool(row["summarised"]) and row["values"] is None and row["max"] == 10.0 and row["numel"] == 10
    rundir.write_parquet(df, tmp_path / "tensors.parquet", schema=rundir.TENSORS_SCHEMA)
    assert notebook.load_tensors(tmp_path) == {}
    with pytest.raises(BadInput, match="summary only"):
        notebook.load_tensor(tmp_path, "big")


def test_atomic_write_keeps_old_file_when_writing_fails(tmp_path: Path) -> None:
    path = tmp_path / "metrics.parquet"
    rundir.write_parquet(pd.DataFrame({"name": ["a"], "value": [1.0]}), path)

    def explode(tmp: str) -> None:
        Path(tmp).write_text("half a file")
        raise OSError("disk full (planted)")

    with pytest.raises(OSError):
        rundir.atomic_replace(path, explode)
    assert pd.read_parquet(path)["value"].tolist() == [1.0]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.parquet"]  # no temp file left behind


def test_mixed_type_tag_column_is_written_as_strings(tmp_path: Path) -> None:
    df = rundir.metrics_frame([{"name": "a", "value": 1, "tag": 3}, {"name": "b", "value": 2, "tag": "x"}])
    rundir.write_parquet(df, tmp_path / "m.parquet")
    assert pd.read_parquet(tmp_path / "m.parquet")["tag"].tolist() == ["3", "x"]


def test_corrupt_parquet_is_bad_input_not_traceback(tmp_path: Path) -> None:
    (tmp_path / "run.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(BadInput, match="not readable parquet"):
        notebook.load_run(tmp_path)


def _run_fake(exp, *args: str) -> tuple[int, Path]:
    code, dirs = launched(exp, list(args))
    return code, dirs[-1]


def test_fake_ok_run_writes_the_whole_contract(fake_experiment) -> None:
    code, run_dir = _run_fake(fake_experiment)
    assert code == 0
    for name in ["run.parquet", "metrics.parquet", "checks.parquet", "tensors.parquet", "timings.parquet",
                 "summary.md", ".hydra/config.yaml", ".hydra/overrides.yaml", ".hydra/hydra.yaml", "fake.log"]:
        assert (run_dir / name).exists(), name
    run = pd.read_parquet(run_dir / "run.parquet").iloc[0]
    expected_cols = ("run_id experiment status started_at finished_at wall_s seed argv overrides git_commit git_dirty "
                     "hostname platform python torch cuda cudnn numpy pandas pyarrow hydra device device_name dtype "
                     "peak_device_mem_bytes peak_rss_bytes error").split()
    assert set(expected_cols) <= set(run.index)
    assert run["status"] == "ok" and run["seed"] == 0 and run["torch"] == torch.__version__
    assert run["peak_rss_bytes"] > 0 and pd.isna(run["peak_device_mem_bytes"])
    timings = pd.read_parquet(run_dir / "timings.parquet")
    assert timings.iloc[0]["stage"] == "sum" and timings.iloc[0]["wall_ms"] > 0
    checks = pd.read_parquet(run_dir / "checks.parquet")
    assert checks.dtypes["passed"] is pd.api.types.pandas_dtype(bool) and checks["passed"].all()


@pytest.mark.parametrize(("mode", "code", "status"), [("fail_check", 1, "failed"), ("bad_input", 2, "error"),
                                                      ("crash", 3, "crashed")])
def test_exit_codes_and_statuses(fake_experiment, mode: str, code: int, status: str) -> None:
    got, run_dir = _run_fake(fake_experiment, f"mode={mode}")
    data = notebook.load_run(run_dir)
    assert got == code and data.run["status"] == status
    if mode == "crash":  # the steps done before the crash are readable
        assert data.metrics["step"].tolist() == [0, 1, 2] and "planted crash" in data.run["error"]
    if mode == "fail_check":  # failing evidence saved for `tfmoe failures add`
        assert "failing.always_true_for_ok.x" in data.tensors


def test_interrupt_records_steps_so_far_and_propagates(fake_experiment) -> None:
    made: list[Path] = []
    with pytest.raises(KeyboardInterrupt):
        launch.run_experiment(fake_experiment, ["mode=interrupt"], quiet=True, made=made)
    run_dir = made[-1]
    data = notebook.load_run(run_dir)
    assert data.run["status"] == "interrupted" and data.run["exit_code"] == 130
    assert data.metrics["step"].tolist() == [0, 1, 2]


def test_same_seed_bit_identical_and_different_seed_differs(fake_experiment) -> None:
    _, a = _run_fake(fake_experiment, "seed=7")
    _, b = _run_fake(fake_experiment, "seed=7")
    _, c = _run_fake(fake_experiment, "seed=8")
    ta, tb, tc = (notebook.load_tensors(p)["x"] for p in (a, b, c))
    assert torch.equal(ta, tb) and not torch.equal(ta, tc)
    ma, mb = (pd.read_parquet(p / "metrics.parquet") for p in (a, b))
    results = [m[m["measured"].isna()].drop(columns="measured") for m in (ma, mb)]  # timings aside
    pd.testing.assert_frame_equal(*results)


def test_two_runs_in_the_same_second_get_distinct_directories(fake_experiment) -> None:
    dirs = {_run_fake(fake_experiment)[1] for _ in range(3)}
    assert len(dirs) == 3


def test_resolve_run_by_path_id_prefix_latest_and_errors(fake_experiment) -> None:
    _, a = _run_fake(fake_experiment)
    _, b = _run_fake(fake_experiment)
    root = Path("runs")
    assert notebook.resolve_run(str(a), root) == a
    assert notebook.resolve_run(b.name, root).resolve() == b
    assert notebook.resolve_run(b.name[:-3], root).resolve() == b  # unique prefix
    assert notebook.resolve_run("latest", root).resolve() == b
    with pytest.raises(BadInput, match="ambiguous"):
        notebook.resolve_run(a.name[:4], root)
    with pytest.raises(BadInput, match="not found"):
        notebook.resolve_run("nope", root)
    with pytest.raises(BadInput, match="not a run directory"):
        notebook.resolve_run(str(root), root)
    with pytest.raises(BadInput, match="no runs"):
        notebook.resolve_run("latest", Path("elsewhere"))


def test_atomic_write_uses_the_usual_file_mode(tmp_path: Path) -> None:
    import os

    umask = os.umask(0)
    os.umask(umask)
    path = tmp_path / "x.parquet"
    rundir.write_parquet(pd.DataFrame({"name": ["a"], "value": [1.5]}), path)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_diff_ignores_measured_metrics_and_timings_but_not_results(fake_experiment) -> None:
    from tfmoe.harness.reading import reports

    _, a = _run_fake(fake_experiment, "seed=7")
    _, b = _run_fake(fake_experiment, "seed=7")
    _, c = _run_fake(fake_experiment, "seed=8")
    sections = reports.diff_runs(notebook.load_run(a), notebook.load_run(b), all_rows=True)
    speed = sections["metrics"][sections["metrics"]["name"] == "sums_per_call"].iloc[0]
    assert bool(speed["measured"]) and not bool(speed["differs"])
    assert reports.diff(str(a), str(b), Path("runs"), False, False, "json") == 0
    assert reports.diff(str(a), str(c), Path("runs"), False, False, "json") == 1  # a different seed moves results


def test_integer_tags_missing_in_some_rows_stay_integers(tmp_path: Path) -> None:
    df = rundir.metrics_frame([{"name": "tokens", "value": 3, "sample": 0}, {"name": "total", "value": 9},
                                 {"name": "tokens", "value": 4, "sample": 1, "step": 2}])
    rundir.write_parquet(df, tmp_path / "m.parquet")
    back = pd.read_parquet(tmp_path / "m.parquet")
    assert str(back["sample"].dtype) == "Int64" and back["sample"].tolist()[0] == 0 and pd.isna(back["sample"][1])
    assert str(back["step"].dtype) == "Int64"


def test_device_peak_survives_resets_inside_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that resets CUDA's peak counter must not hide the run's earlier, higher peak (CUDA simulated)."""
    from tfmoe.contract import recorder

    state = {"peak": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=0))
    cuda = torch.device("cuda")
    recorder.forget_device_peak()
    state["peak"] = 900  # an early, large allocation
    recorder.reset_device_peak(cuda)  # a per-variant probe resets the counter
    state["peak"] = 100
    assert recorder.device_peak(cuda) == 900
    state["peak"] = 1200
    assert recorder.device_peak(cuda) == 1200
    assert recorder.device_peak(torch.device("cpu")) is None
    recorder.forget_device_peak()


def test_device_and_dtype_resolution_refuses_what_the_machine_cannot_do(monkeypatch: pytest.MonkeyPatch) -> None:
    assert runtime.resolve_device("cpu") == torch.device("cpu")
    assert runtime.resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(BadInput, match="fp64 is not supported on MPS"):
        runtime.resolve_dtype("fp64", torch.device("mps"))
    with pytest.raises(BadInput, match="unknown"):
        runtime.resolve_dtype("fp8", torch.device("cpu"))
    with pytest.raises(BadInput, match="is not a device"):
        runtime.resolve_device("gpu0")
    # a CUDA machine whose GPU cannot do bf16, and one with a single device (simulated)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(BadInput, match="cannot do bf16: use --dtype fp16"):
        runtime.resolve_dtype("bf16", torch.device("cuda"))
    with pytest.raises(BadInput, match="only 1 CUDA device"):
        runtime.resolve_device("cuda:1")
    assert runtime.resolve_device("auto") == torch.device("cuda")


def test_runner_applies_threads_and_restores_them(fake_experiment) -> None:
    before = torch.get_num_threads()
    code, run_dir = _run_fake(fake_experiment, "threads=1")
    assert code == 0 and torch.get_num_threads() == before
    assert any("1 torch intra-op thread" in n for n in notebook.load_run(run_dir).run["notes"])
    with pytest.raises(BadInput, match="threads=0"):  # bad input, refused before the run starts (exit 2)
        _run_fake(fake_experiment, "threads=0")
    with pytest.raises(KeyboardInterrupt):
        launch.run_experiment(fake_experiment, ["mode=interrupt", "threads=1"], quiet=True)
    assert torch.get_num_threads() == before


def _pandas_equal(mine: object, theirs: object) -> bool:
    """``mine`` (rundir.records) is the value pandas gives: NaN for NaN, None for None/NaT/NA, the same type kind
    (bool, int, float, str), a list for an array, a datetime equal to the Timestamp (same instant, both aware)."""
    import datetime as dt

    import numpy as np

    if theirs is None or theirs is pd.NaT or theirs is pd.NA:
        return mine is None
    if isinstance(theirs, np.ndarray):
        return isinstance(mine, list) and theirs.tolist() == mine
    if isinstance(theirs, pd.Timestamp):
        return isinstance(mine, dt.datetime) and mine.tzinfo is not None and theirs == pd.Timestamp(mine) \
            and str(theirs) == str(mine)
    if isinstance(theirs, float):
        return isinstance(mine, float) and (mine == theirs or (mine != mine and theirs != theirs))
    return type(mine) is type(theirs) and mine == theirs


def test_records_are_the_values_pandas_reads(fake_experiment, tmp_path: Path) -> None:
    """`tfmoe show` and `failures add` print rundir.records' rows: the values to_pandas().to_dict("records") gives
    (pandas is the reference here), for every table of real runs and for planted edge cases: missing values of
    each type, integer columns with gaps written by pyarrow (float in pandas) and by pandas as Int64 (None)."""
    import pyarrow as pa

    _run_fake(fake_experiment)
    _run_fake(fake_experiment, "mode=fail_check")
    files = sorted(Path("runs").rglob("*.parquet"))
    assert len(files) >= 8
    planted = pa.table({
        "s": ["a", None], "f": [1.5, None], "i": pa.array([10**7, None], pa.int64()), "i2": [1, 2],
        "b": [True, None], "ts": pa.array([1_700_000_000_123_456, None], pa.timestamp("us", tz="UTC")),
        "ts_s": pa.array([1_700_000_000, None], pa.timestamp("s", tz="UTC")),
        "l": pa.array([[1.5, 2.0], None], pa.list_(pa.float64())), "n": pa.array([None, None], pa.null()),
        "ls": pa.array([["x"], []], pa.list_(pa.string()))})
    written = tmp_path / "int64.parquet"
    rundir.write_parquet(rundir.metrics_frame([{"name": "m", "value": 1.0, "step": 3}, {"name": "m", "value": 2.0}]),
                         written)
    tables = [rundir.read_table(f) for f in [*files, written]] + [planted]
    for table in tables:
        theirs = table.to_pandas().to_dict("records")
        mine = rundir.records(table)
        assert len(mine) == len(theirs) and [list(r) for r in mine] == [list(r) for r in theirs]
        for a, b in zip(mine, theirs, strict=True):
            bad = {k: (a[k], b[k]) for k in b if not _pandas_equal(a[k], b[k])}
            assert not bad, f"{table.schema.names}: {bad}"


def test_records_reference_comparison_sees_a_wrong_missing_value() -> None:
    """Planted: a missing float given as None (pyarrow's own value, not pandas' NaN) is caught by the comparison."""
    import pyarrow as pa

    table = pa.table({"f": [1.0, None]})
    theirs = table.to_pandas().to_dict("records")
    assert not _pandas_equal(table.column("f").to_pylist()[1], theirs[1]["f"])
    assert _pandas_equal(rundir.records(table)[1]["f"], theirs[1]["f"])


def _tables_from_frames(run_dir: Path, fmt: str) -> dict[str, str]:
    """The reference: each table of `tfmoe show` as it was printed from a pandas DataFrame before issue 23
    (json: ``to_dict("records")`` dumped as show dumps it; md: one row per DataFrame row)."""
    import json

    from tfmoe.contract.tables import from_frame

    frames = {key: rundir.read_parquet(run_dir / name) for key, name in rundir.TABLE_FILES.items()}
    frames["tensors"] = frames["tensors"].drop(columns=["values"])
    if fmt == "json":
        return {k: f'"{k}": ' + json.dumps(df.to_dict("records"), default=lambda v: v.tolist()
                                          if hasattr(v, "tolist") else v.isoformat()) for k, df in frames.items()}
    frames["checks"] = frames["checks"].drop(columns=["applicable"])  # the table shows n/a in `passed` instead
    return {k: from_frame(df).markdown() for k, df in frames.items()}


def test_show_prints_what_it_printed_from_pandas_frames(fake_experiment, capsys) -> None:
    """show reads a run with pyarrow alone: its checks, metrics (NaN tags, Int64 steps), timings (missing device
    times: NaN) and tensors print byte for byte as they did from pandas DataFrames, in md and in JSON."""
    from tfmoe.harness.reading import reports

    _, run_dir = _run_fake(fake_experiment, "mode=fail_check")
    assert rundir.read_parquet(run_dir / "timings.parquet")["device_ms"].isna().all()  # a NaN to get right
    for fmt in ("md", "json"):
        reports.show(str(run_dir), Path("runs"), fmt)
        out = capsys.readouterr().out
        for table, expected in _tables_from_frames(run_dir, fmt).items():
            assert expected in out, f"show --format {fmt}: the {table} table differs from pandas' rendering"


@pytest.mark.parametrize(("value", "missing"), [
    (None, True), (float("nan"), True), (np.float32("nan"), True), (pd.NA, True), (pd.NaT, True),
    (np.datetime64("NaT"), True), (decimal.Decimal("NaN"), True),
    (0, False), (0.0, False), ("", False), ("nan", False), (False, False), ([], False), ({}, False),
    (np.array([np.nan]), False), (np.int64(3), False), (pd.Timestamp("2020-01-01"), False),
])
def test_is_missing_is_the_one_rule_for_an_unrecorded_value(value: object, missing: bool) -> None:
    """expectations (tag matching) and diff/show (`_same`, context flags) ask the same question with one rule; it
    never raises (an array is a value, not missing)."""
    from tfmoe.harness.store.rundir import is_missing

    assert is_missing(value) is missing
