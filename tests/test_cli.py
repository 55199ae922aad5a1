"""The CLI: help without torch, typed options, overrides, bad input (exit 2, one line), sweeps on real Hydra
launchers, diff/replay/show/runs, concurrent processes and concurrent failures appends."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
import torch

from tfmoe.api.testing import launched, run_cli
from tfmoe.contract.errors import BadInput
from tfmoe.contract.registry import EXPERIMENTS
from tfmoe.harness.method import failures
from tfmoe.harness.store import notebook, rundir

TFMOE = [sys.executable, "-m", "tfmoe.cli"]


def test_help_lists_every_command_without_importing_torch() -> None:
    code = ("import sys\nfrom tfmoe import cli\nsys.argv=['tfmoe','--help']\ntry:\n    cli.main()\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'tfmoe --help imported torch'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in [*EXPERIMENTS, "runs", "show", "diff", "replay", "failures", "all"]:
        assert name in out.stdout


def test_shift_labels_run_with_typed_options_and_override(workdir: Path) -> None:
    r = run_cli(["shift-labels", "--seed", "3", "--dtype", "fp64", "pad_side=left"], workdir)
    assert r.exit_code == 0, r.stderr
    run = notebook.load_run(r.run_dir).run
    assert run["seed"] == 3 and run["dtype"] == "fp64" and "pad_side=left" in list(run["overrides"])
    assert notebook.load_tensors(r.run_dir)["token_loss"].dtype == torch.float32


@pytest.mark.parametrize(("args", "needle"), [
    (["shift-labels", "nosuchkey=1"], "unknown config key 'nosuchkey'"),
    (["shift-labels", "seed=abc"], "expected an integer"),
    (["shift-labels", "seed"], "not an override"),
    (["shift-labels", "=3"], "bad override"),
    (["shift-labels", "pad_side=middle"], "pad_side='middle' is unknown"),
    (["shift-labels", "--device", "tpu"], "is not a device"),
    (["shift-labels", 'sequences=[[BOS,"我"]]', "vocab=[PAD,BOS]"], "not in the vocabulary"),
    (["shift-labels", "sequences=[[BOS,我]]"], "needs non-ASCII text quoted"),
])
def test_bad_input_exits_2_with_one_line(workdir: Path, args: list[str], needle: str) -> None:
    r = run_cli(args, workdir)
    assert r.exit_code == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_says_use_cpu(workdir: Path) -> None:
    r = run_cli(["shift-labels", "--device", "cuda"], workdir)
    assert r.exit_code == 2 and "--device cpu" in r.stderr
    assert r.run_dir is None and not (workdir / "runs").exists()  # refused before its run directory (issue 24)


@pytest.mark.parametrize("override", ["ignore_index=-1e2", "model.d_model=64", "seed=range(0,2)", "seed=3,4"])
def test_override_types_follow_hydras_grammar(override: str) -> None:
    """1e-5 is a float in Hydra's grammar (YAML 1.1 would read it as a string): no false type errors."""
    from tfmoe.harness.launching.launch import validate_overrides

    exp = EXPERIMENTS["shift-labels"]
    if override.startswith("ignore_index"):
        with pytest.raises(BadInput, match="expected an integer"):  # a float where an int belongs
            validate_overrides(exp, [override])
    else:
        validate_overrides(exp, [override])


def test_small_float_overrides_are_accepted_and_typed_checks_still_bite(workdir: Path) -> None:
    from tfmoe.harness.launching.launch import validate_overrides

    exp = EXPERIMENTS["route-sim"]
    for ok in (["aux_loss_coef=1e-5"], ["aux_loss_coef=1e-5,1e-3"], ["capacity_factor=1.25e0"], ["aux_loss_coef=0"]):
        validate_overrides(exp, ok)
    with pytest.raises(BadInput, match="expected a number"):
        validate_overrides(exp, ["aux_loss_coef=abc"])
    with pytest.raises(BadInput, match="expected a number"):
        validate_overrides(exp, ["aux_loss_coef=1e-5,abc"])  # every swept value is checked


def test_unknown_experiment_and_bad_dtype_exit_2(workdir: Path) -> None:
    assert run_cli(["nosuch"], workdir).exit_code == 2
    assert run_cli(["shift-labels", "--dtype", "fp8"], workdir).exit_code == 2


def test_unwritable_runs_root_exits_2_before_running(workdir: Path) -> None:
    blocker = workdir / "file"
    blocker.write_text("x")
    r = run_cli(["shift-labels", f"run_root={blocker}/runs"], workdir)
    assert r.exit_code == 2 and "cannot write runs" in r.stderr


def test_hydra_cfg_job_prints_config_and_runs_nothing(workdir: Path) -> None:
    r = run_cli(["shift-labels", "--cfg", "job", "pad_side=left"], workdir)
    assert r.exit_code == 0 and "pad_side: left" in r.stdout and r.run_dir is None
    info = run_cli(["shift-labels", "--info", "defaults"], workdir)
    assert info.exit_code == 0 and "shift_labels" in info.stdout and info.run_dir is None


def test_multirun_basic_launcher_writes_sweep_parquet(workdir: Path) -> None:
    r = run_cli(["shift-labels", "-m", "pad_side=left,right", "seed=0,1"], workdir)
    assert r.exit_code == 0, r.stderr
    assert "tfmoe sweep: 4 jobs" in r.stdout  # each job listed once
    sweep = next((workdir / "runs" / "shift-labels").glob("multirun-*"))
    df = pd.read_parquet(sweep / "sweep.parquet")
    assert set(df["job"]) == {"0", "1", "2", "3"}
    assert set(zip(df["pad_side"], df["seed"], strict=True)) == {("left", 0), ("left", 1), ("right", 0), ("right", 1)}
    assert (df["status"] == "ok").all()
    for job in range(4):  # one complete run directory per job
        assert notebook.load_run(sweep / str(job)).run["status"] == "ok"
    loss = df[df["name"] == "loss"].set_index(["pad_side", "seed"])["value"]
    assert loss[("left", 0)] == pytest.approx(loss[("right", 0)], rel=1e-6)  # padding side does not change the loss


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_multirun_on_real_launcher_plugins(workdir: Path, launcher: str) -> None:
    r = run_cli(["shift-labels", "-m", "pad_side=left,right", f"hydra/launcher={launcher}"], workdir)
    assert r.exit_code == 0, r.stderr
    sweep = next((workdir / "runs" / "shift-labels").glob("multirun-*"))
    df = pd.read_parquet(sweep / "sweep.parquet")
    assert sorted(set(df["pad_side"])) == ["left", "right"] and (df["status"] == "ok").all()


def test_multirun_range_sweep(workdir: Path) -> None:
    r = run_cli(["shift-labels", "-m", "seed=range(0,3)"], workdir)
    assert r.exit_code == 0, r.stderr
    df = pd.read_parquet(next((workdir / "runs" / "shift-labels").glob("multirun-*")) / "sweep.parquet")
    assert sorted(set(df["seed"])) == [0, 1, 2]


def test_multirun_exit_code_is_the_worst_job(workdir: Path) -> None:
    # device=tpu passes the settings built before the sweep (the runner refuses it inside the job), so job 1 runs
    # and ends `error`; a bad experiment setting (pad_side=middle) is refused before any job starts (item 7 test)
    r = run_cli(["shift-labels", "-m", "device=cpu,tpu"], workdir)
    assert r.exit_code == 2
    sweep = next((workdir / "runs" / "shift-labels").glob("multirun-*"))
    assert list(pd.read_parquet(sweep / "sweep.parquet").drop_duplicates("job")["status"]) == ["ok", "error"]


def test_runs_show_diff_replay(workdir: Path) -> None:
    a = run_cli(["shift-labels"], workdir).run_dir
    b = run_cli(["shift-labels"], workdir).run_dir
    c = run_cli(["shift-labels", "--dtype", "fp64"], workdir).run_dir
    listing = run_cli(["runs", "--format", "json"], workdir)
    assert listing.exit_code == 0 and len(json.loads(listing.stdout)) == 3
    assert json.loads(run_cli(["runs", "--experiment", "route-sim", "--format", "json"], workdir).stdout) == []
    assert len(json.loads(run_cli(["runs", "--status", "ok", "--format", "json"], workdir).stdout)) == 3
    assert run_cli(["runs", "--experiment", "nosuch"], workdir).exit_code == 2
    assert "| run_id |" in run_cli(["runs", "--format", "md"], workdir).stdout
    assert len(json.loads(run_cli(["runs", "--last", "1", "--format", "json"], workdir).stdout)) == 1
    shown = run_cli(["show", "latest", "--format", "json"], workdir)
    assert json.loads(shown.stdout)["run"]["run_id"] == c.name
    assert run_cli(["show", a.name, "--format", "md"], workdir).exit_code == 0
    # identical seed and config: nothing differs
    same = run_cli(["diff", str(a), str(b), "--format", "json"], workdir)
    assert same.exit_code == 0, same.stdout
    # a different dtype: the config differs; fp64-model token losses (computed in fp32) stay within
    # a few fp32 ulps of the fp32 run's, so the dtype-aware tensor comparison does not flag them
    moved = run_cli(["diff", str(a), str(c), "--format", "json"], workdir)
    body = json.loads(moved.stdout)
    assert moved.exit_code == 1 and {r["key"] for r in body["config"]} == {"dtype"}
    assert "token_loss" not in {r["tensor"] for r in body["tensors"]}
    # the public Python API rebuilds the saved tensor exactly
    import tfmoe

    saved = tfmoe.load_tensors(a)
    assert torch.equal(tfmoe.load_tensor(a, "labels"), saved["labels"]) and saved["labels"].dtype == torch.int64
    # replay reproduces bit for bit
    rep = run_cli(["replay", str(a)], workdir)
    assert rep.exit_code == 0 and "reproduced" in rep.stdout


def test_diff_catches_a_planted_tensor_change_and_metric_change(workdir: Path) -> None:
    a = run_cli(["shift-labels"], workdir).run_dir
    b = workdir / "copy"
    shutil.copytree(a, b)
    df = pd.read_parquet(b / "tensors.parquet")
    i = df.index[df["name"] == "token_loss"][0]
    vals = list(df.at[i, "values"])
    vals[0] += 1e-3  # far above fp32 tolerance
    df.at[i, "values"] = vals
    rundir.write_parquet(df, b / "tensors.parquet", schema=rundir.TENSORS_SCHEMA)
    r = run_cli(["diff", str(a), str(b), "--format", "json"], workdir)
    assert r.exit_code == 1 and [t["tensor"] for t in json.loads(r.stdout)["tensors"]] == ["token_loss"]
    m = pd.read_parquet(a / "metrics.parquet")
    m.loc[m["name"] == "loss", "value"] += 1e-6
    rundir.write_parquet(m, b / "metrics.parquet")
    df.at[i, "values"] = list(pd.read_parquet(a / "tensors.parquet").at[i, "values"])
    rundir.write_parquet(df, b / "tensors.parquet", schema=rundir.TENSORS_SCHEMA)
    r = run_cli(["diff", str(a), str(b), "--format", "json"], workdir)
    assert r.exit_code == 1 and [m["name"] for m in json.loads(r.stdout)["metrics"]] == ["loss"]


def test_diff_and_show_bad_input(workdir: Path) -> None:
    a = run_cli(["shift-labels"], workdir).run_dir
    other = workdir / "other"
    shutil.copytree(a, other)
    run = pd.read_parquet(other / "run.parquet")
    run["experiment"] = "route-sim"
    rundir.write_parquet(run, other / "run.parquet", schema=rundir.RUN_SCHEMA)
    r = run_cli(["diff", str(a), str(other)], workdir)
    assert r.exit_code == 2 and "different experiments" in r.stderr
    assert run_cli(["diff", str(a), str(other), "--force"], workdir).exit_code in (0, 1)
    (other / "metrics.parquet").write_bytes(b"garbage")
    r = run_cli(["show", str(other)], workdir)
    assert r.exit_code == 2 and "not readable parquet" in r.stderr
    assert run_cli(["show", "missing-run"], workdir).exit_code == 2
    assert run_cli(["show", str(workdir)], workdir).exit_code == 2  # a folder that is not a run


def _add_failure(args: tuple[str, str, str]) -> str:
    run, root, file = args
    return failures.add(run, Path(root), Path(file), None, "h", "f", "tests/t.py::test_y", again=True)


def test_failures_add_is_append_only_and_safe_concurrently(workdir: Path) -> None:
    bad = run_cli(["shift-labels", "--expect", "valid_labels < 0"], workdir)
    assert bad.exit_code == 4  # an expectation that misses: an `unexpected` run (a typo writes no run, issue 24)
    log = workdir / "failures.md"
    log.write_text("# Failures log\n\nhand-written entry that must survive\n")
    (workdir / "tests").mkdir()
    (workdir / "tests" / "t.py").write_text("def test():\n    pass\n\n\ndef test_y():\n    pass\n")
    before = log.read_text()
    r = run_cli(["failures", "add", str(bad.run_dir), "--hypothesis", "typo", "--test", "tests/t.py::test"], workdir)
    assert r.exit_code == 0, r.stderr
    text = log.read_text()
    assert text.startswith(before) and "## F-1:" in text and "**Hypothesis**: typo" in text
    assert "**Regression test**: tests/t.py::test" in text and str(bad.run_dir) in text
    with ProcessPoolExecutor(4) as pool:
        list(pool.map(_add_failure, [(str(bad.run_dir), "runs", str(log))] * 8))
    numbers = sorted(int(n) for n, _ in failures.ENTRY_RE.findall(log.read_text()))
    assert numbers == list(range(1, 10))
    listed = run_cli(["failures", "list"], workdir)
    assert listed.exit_code == 0 and listed.stdout.count("F-") == 9


def test_failures_add_refuses_a_passing_run(workdir: Path) -> None:
    ok = run_cli(["shift-labels"], workdir)
    r = run_cli(["failures", "add", str(ok.run_dir)], workdir)
    assert r.exit_code == 2 and "no failure to log" in r.stderr and not (workdir / "failures.md").exists()


def test_failures_add_from_a_failed_check_run_names_checks_and_evidence(fake_experiment) -> None:
    code, dirs = launched(fake_experiment, ["mode=fail_check"])
    assert code == 1
    run_dir = dirs[-1]
    title = failures.add(str(run_dir), Path("runs"), Path("failures.md"), None, "h", "f", "t")
    text = Path("failures.md").read_text()
    assert title == "F-1: fake: always_true_for_ok" and "\n\n## F-1:" in text  # a blank line after the header
    assert "`always_true_for_ok` observed 1 vs threshold 0" in text and "`failing.always_true_for_ok.x`" in text
    assert "nan" not in text.lower()  # no empty fields rendered as NaN


def test_concurrent_processes_get_separate_complete_runs(tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "120"}
    procs = [subprocess.Popen([*TFMOE, "shift-labels", f"seed={i}"], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(3)]
    for p in procs:
        assert p.wait(timeout=180) == 0, p.stderr.read()
    runs = notebook.find_runs(tmp_path / "runs")
    assert len(runs) == 3
    assert sorted(notebook.load_run(p).run["seed"] for p in runs) == [0, 1, 2]


def test_every_experiment_config_ships_in_the_package() -> None:
    from importlib.resources import files

    for exp in EXPERIMENTS.values():
        assert (files("tfmoe.conf") / f"{exp.config}.yaml").is_file(), exp.config
    assert (files("tfmoe.conf") / "base.yaml").is_file()


@pytest.mark.slow
def test_a_non_editable_wheel_runs_from_any_directory(tmp_path: Path) -> None:
    """Build the wheel, install it into a folder, and run an experiment with it from an unrelated directory."""
    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "whl"), str(repo)], check=True, timeout=300)
    wheel = next((tmp_path / "whl").glob("tfmoe-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, timeout=300)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "-m", "tfmoe.cli", "shift-labels"], cwd=work, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert str(tmp_path / "site" / "tfmoe" / "conf") in subprocess.run(
        [sys.executable, "-c", "from tfmoe.harness.launching.launch import config_dir; print(config_dir())"], cwd=work, env=env,
        capture_output=True, text=True, timeout=60).stdout
    assert len(notebook.find_runs(work / "runs")) == 1


def test_diff_starts_with_a_summary_signs_changes_and_narrows(fake_experiment) -> None:
    from tfmoe.harness.reading import reports

    a = launched(fake_experiment, ["seed=1"])[1][-1]
    b = launched(fake_experiment, ["seed=2"])[1][-1]
    r = run_cli(["diff", str(a), str(b)], Path.cwd())
    lines = r.stdout.splitlines()
    assert r.exit_code == 1 and lines[2] == "config: 1 key(s) differ (seed: 1 -> 2)"
    assert lines[3].startswith("differ: 5 of 6 metric rows, 1 of 1 tensors, 0 of 1 checks")
    assert lines[4].startswith("  largest: loss (step ")
    body = json.loads(run_cli(["diff", str(a), str(b), "--format", "json", "--metric", "loss", "--top", "2"],
                              Path.cwd()).stdout)
    ma = pd.read_parquet(a / "metrics.parquet").set_index(["name", "step"])["value"]
    mb = pd.read_parquet(b / "metrics.parquet").set_index(["name", "step"])["value"]
    assert len(body["metrics"]) == 2 and {m["name"] for m in body["metrics"]} == {"loss"}
    for m in body["metrics"]:  # signed: (B - A) / |A|, so a drop is negative
        va, vb = ma[("loss", float(m["step"]))], mb[("loss", float(m["step"]))]
        assert m["rel_delta"] == pytest.approx((vb - va) / abs(va)) and m["A"] == va
    top = max(abs(x["rel_delta"]) for x in body["metrics"])
    rest = reports.diff_runs(notebook.load_run(a), notebook.load_run(b), False)["metrics"]
    assert top == pytest.approx(rest[rest["name"] == "loss"]["rel_delta"].abs().max())  # the largest come first
    assert run_cli(["diff", str(a), str(b), "--top", "0"], Path.cwd()).exit_code == 2


def test_replay_that_cannot_start_is_bad_input_not_a_failed_reproduction(fake_experiment, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib


    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "my_dep.py").write_text("VALUE = 1\n")
    (plugins / "my_plugin.py").write_text("from my_dep import VALUE\nTHING = VALUE\n")
    monkeypatch.syspath_prepend(str(plugins))
    code, dirs = launched(fake_experiment, ["plugin=my_plugin:THING"])
    assert code == 0
    old = dirs[-1]
    (plugins / "my_dep.py").unlink()  # a library the user's module imports is gone (the module's copy is kept)
    for name in ("my_plugin", "my_dep"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.invalidate_caches()
    r = run_cli(["replay", old.name], Path.cwd())
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "could not start" in r.stderr and "No module named 'my_dep'" in r.stderr
    assert "reproduced" not in r.stdout and "differ" not in r.stdout


def test_launch_chooses_its_directories_and_respects_a_users_own(fake_experiment) -> None:
    """No module-level list hands directories back: launch passes hydra.run.dir / hydra.sweep.dir to Hydra
    (conf/base.yaml's rule, or the user's own override of it) and so knows them."""
    from tfmoe.harness.launching import hydra_callbacks, runner

    assert not hasattr(runner, "LAST_RUN_DIRS") and not hasattr(hydra_callbacks, "LAST_SWEEP_DIRS")
    code, dirs = launched(fake_experiment, [])
    assert code == 0 and len(dirs) == 1 and dirs[0].parent == (Path.cwd() / "runs" / "fake").resolve()
    assert notebook.load_run(dirs[0]).run["run_id"] == dirs[0].name
    code, dirs = launched(fake_experiment, ["hydra.run.dir=mine/${experiment}-${seed}", "seed=4"])
    assert code == 0 and dirs == [(Path.cwd() / "mine" / "fake-4").resolve()]
    assert notebook.load_run(dirs[0]).run["seed"] == 4
    code, dirs = launched(fake_experiment, ["seed=1,2", "hydra.sweep.dir=my sweep"], multirun=True)
    sweep = (Path.cwd() / "my sweep").resolve()
    assert code == 0 and dirs == [sweep / "0", sweep / "1"] and (sweep / "sweep.parquet").exists()
    code, dirs = launched(fake_experiment, ["seed=1,2"], multirun=True)
    assert code == 0 and [d.name for d in dirs] == ["0", "1"] and dirs[0].parent.name.startswith("multirun-")


@pytest.mark.parametrize(("sweep", "needle", "count"), [
    (["T=256,512"], "sweep job 0 (T=256): T=256 and D=None: give both T and D", "2 of 2"),  # D missing: all bad
    (["T=64", "D=64,62,128"], "sweep job 1 (T=64 D=62): D=62 is not divisible by n_heads=4", "1 of 3"),  # one bad
])
def test_a_sweep_with_bad_settings_is_refused_before_any_job_starts(workdir: Path, sweep: list[str], needle: str,
                                                                    count: str) -> None:
    """Issue 12 item 7: every job's settings(cfg) is built before the sweep starts; exit 2, one line, nothing
    written (no runs root, no sweep directory, no run directory)."""
    r = run_cli(["complexity", "-m", *sweep], workdir)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.stderr
    assert lines[0].endswith(f"({count} jobs refused); nothing was run") and "Traceback" not in r.stderr
    assert not (workdir / "runs").exists() and r.run_dir is None
