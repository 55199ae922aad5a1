"""Faults a cluster brings: SIGTERM (handled like Ctrl-C), SIGKILL (periodic writes survive it, readers say `lost`),
runs owned by another host, and sweeps whose jobs fail or are killed (sweep.parquet still complete)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.api.testing import launched, run_cli
from tfmoe.harness.store import notebook, rundir

TFMOE = [sys.executable, "-m", "tfmoe.cli"]
LONG_ROUTE_SIM = ["route-sim", "steps=1000000", "strategies=[none]", "flush_every_s=0.3"]


def _wait_for(predicate, what: str, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (exit {proc.returncode}) before {what}: {proc.stderr.read()}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _steps_on_disk(run_dir: Path) -> int:
    try:
        m = pd.read_parquet(run_dir / "metrics.parquet")
    except (FileNotFoundError, OSError, ValueError):
        return 0
    return int(m["step"].max()) + 1 if "step" in m and m["step"].notna().any() else 0


def _only_run(root: Path) -> Path:
    runs = notebook.find_runs(root / "runs")
    assert len(runs) == 1, runs
    return root / runs[0] if not runs[0].is_absolute() else runs[0]


def test_sigterm_and_sigkill_on_real_processes(tmp_path: Path) -> None:
    """Two long route-sim runs: SIGTERM ends one like Ctrl-C (exit 143, interrupted, records flushed); SIGKILL
    ends the other, whose periodic writes are still readable and which every reader then reports as `lost`."""
    env = {**os.environ, "COLUMNS": "200"}
    dirs = {name: tmp_path / name for name in ("term", "kill")}
    procs = {}
    for name, d in dirs.items():
        d.mkdir()
        procs[name] = subprocess.Popen([*TFMOE, *LONG_ROUTE_SIM], cwd=d, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    try:
        run_dirs = {}
        for name, d in dirs.items():
            _wait_for(lambda d=d: notebook.find_runs(d / "runs"), f"{name}'s run directory", procs[name])
            run_dirs[name] = _only_run(d)
            _wait_for(lambda r=run_dirs[name]: _steps_on_disk(r) >= 3, f"{name}'s metrics on disk while it runs",
                      procs[name])
        # while running: run.parquet names its process, and readers say running
        for name, proc in procs.items():
            row = notebook.read_run_row(run_dirs[name])
            assert row["status"] == "running" and row["pid"] == proc.pid and row["hostname"] == socket.gethostname()
            assert notebook.process_alive(proc.pid, row["process_started_at"])
        procs["term"].send_signal(signal.SIGTERM)
        procs["kill"].send_signal(signal.SIGKILL)
        out, errs = procs["term"].communicate(timeout=120)
        procs["kill"].wait(timeout=60)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs["term"].returncode == 143, errs
    assert "terminated by SIGTERM" in errs
    term = notebook.load_run(run_dirs["term"])
    assert term.run["status"] == "interrupted" and term.run["exit_code"] == 143
    assert "SIGTERM" in term.run["error"] and term.metrics["step"].max() >= 2
    assert (run_dirs["term"] / "summary.md").exists()

    assert procs["kill"].returncode == -signal.SIGKILL
    killed = run_dirs["kill"]
    assert pd.read_parquet(killed / "run.parquet").iloc[0]["status"] == "running"  # what the dead process left
    assert _steps_on_disk(killed) >= 3  # the steps written before the kill are readable parquet
    assert notebook.read_run_row(killed)["status"] == "lost"
    listing = run_cli(["runs", "--format", "json"], dirs["kill"])
    assert [r["status"] for r in json.loads(listing.stdout)] == ["lost"]
    assert json.loads(run_cli(["runs", "--status", "lost", "--format", "json"], dirs["kill"]).stdout)
    shown = run_cli(["show", "latest"], dirs["kill"])
    assert shown.exit_code == 0 and "lost (recorded running" in shown.stdout


def _planted_running(run_dir: Path, **fields) -> Path:
    """A finished run directory rewritten as if its process were still `running` with these process fields."""
    row = pd.read_parquet(run_dir / "run.parquet")
    row["status"] = "running"
    row["exit_code"] = pd.array([None], dtype="Int64")  # a running run has no exit code yet
    for k, v in fields.items():
        row[k] = [v]
    rundir.write_parquet(row, run_dir / "run.parquet", schema=rundir.RUN_SCHEMA)
    return run_dir


def test_effective_status_running_lost_and_other_hosts(fake_experiment) -> None:
    code, dirs = launched(fake_experiment, [])
    assert code == 0
    run_dir = dirs[-1]
    row = pd.read_parquet(run_dir / "run.parquet").iloc[0]
    me = notebook.process_identity()  # the finished run recorded this very process
    assert row["pid"] == os.getpid() and row["hostname"] == me["hostname"]
    assert pd.Timestamp(row["process_started_at"]) == pd.Timestamp(me["process_started_at"])
    assert notebook.effective_status({"status": "ok", "hostname": me["hostname"], "pid": 1 << 30}) == "ok"
    alive = {"status": "running", **me}
    assert notebook.effective_status(alive) == "running" and "this host" in notebook.where_running(alive)
    dead_pid = _dead_pid()
    assert notebook.effective_status({**alive, "pid": dead_pid}) == "lost"
    reused = {**alive, "process_started_at": pd.Timestamp(me["process_started_at"]) - pd.Timedelta(hours=1)}
    assert notebook.effective_status(reused) == "lost"  # same pid, another process: not ours
    elsewhere = {**alive, "hostname": "node-17.cluster", "pid": dead_pid}
    assert notebook.effective_status(elsewhere) == "running"
    assert notebook.where_running(elsewhere).startswith("on node-17.cluster") and "another host" in \
        notebook.where_running(elsewhere)
    assert notebook.effective_status({"status": "running", "hostname": me["hostname"], "pid": None}) == "running"
    # every reader goes through it: runs, show, the sweep collector and exit codes
    _planted_running(run_dir, pid=dead_pid)
    from tfmoe.harness.reading import reports

    assert notebook.load_run(run_dir).run["status"] == "lost"
    assert notebook.run_index(Path("runs"))["status"].tolist() == ["lost"]
    assert reports.exit_code_of([run_dir]) == 137
    sql = run_cli(["sql", "SELECT status FROM runs", "--format", "json"], Path.cwd())
    assert json.loads(sql.stdout) == [{"status": "lost"}], sql.stdout + sql.stderr
    _planted_running(run_dir, hostname="node-17.cluster")
    shown = run_cli(["runs", "--format", "json"], Path.cwd())
    body = json.loads(shown.stdout)
    assert body[0]["status"] == "running" and body[0]["where"].startswith("on node-17.cluster")


def test_worst_exit_code_ranks_signals() -> None:
    from tfmoe.contract.status import worst_exit_code

    assert worst_exit_code([0, 143, 1]) == 143
    assert worst_exit_code([143, 130]) == 130
    assert worst_exit_code([0, 140, 2]) == 140  # another signal (SIGUSR2) still makes the sweep fail
    assert worst_exit_code([137, 2, 3]) == 137
    assert worst_exit_code([]) == 0


def test_bad_flush_interval_is_bad_input(fake_experiment) -> None:
    from tfmoe.contract.errors import BadInput
    from tfmoe.harness.launching import launch

    with pytest.raises(BadInput, match="flush_every_s=0"):  # refused before the run directory (exit 2 in the CLI)
        launch.run_experiment(fake_experiment, ["flush_every_s=0"], quiet=True)
    assert not list(Path("runs").rglob("run.parquet"))
    assert launch.run_experiment(fake_experiment, ["flush_every_s=null"], quiet=True) == 0


def test_interrupted_sweep_still_writes_a_complete_sweep_parquet_and_can_be_completed_later(fake_experiment) -> None:
    """Jobs 0 ok, 1 crashes, 2 is interrupted (stops the in-process sweep), 3 never starts: sweep.parquet lists
    all four with their state; `tfmoe sweep-complete` rebuilds it, also after a job's process is lost."""
    from tfmoe.harness.launching import hydra_callbacks, launch

    made: list[Path] = []
    with pytest.raises(KeyboardInterrupt):
        launch.run_experiment(fake_experiment, ["mode=ok,crash,interrupt,ok"], multirun=True, quiet=True, made=made)
    sweep = made[-1].parent
    df = pd.read_parquet(sweep / "sweep.parquet")
    states = df.drop_duplicates("job").set_index("job")
    assert states["status"].to_dict() == {"0": "ok", "1": "crashed", "2": "interrupted", "3": "not_started"}
    assert states.loc["3", "mode"] == "ok" and pd.isna(states.loc["3", "run_id"])  # known from multirun.yaml
    assert "planted crash" in states.loc["1", "error"]
    assert df[(df["job"] == "2") & (df["name"] == "loss")]["step"].tolist() == [0, 1, 2]  # records so far
    assert not hydra_callbacks.STARTED_SWEEPS

    (sweep / "sweep.parquet").unlink()  # as if the launching process had been killed before writing it
    _planted_running(sweep / "0", pid=_dead_pid())
    r = run_cli(["sweep-complete", str(sweep)], Path.cwd())
    assert r.exit_code == 130, r.stdout + r.stderr  # the worst job: interrupted / not started
    assert "job 0 (mode=ok): lost" in r.stdout and "job 3 (mode=ok): not_started" in r.stdout
    states = pd.read_parquet(sweep / "sweep.parquet").drop_duplicates("job").set_index("job")["status"]
    assert states.to_dict() == {"0": "lost", "1": "crashed", "2": "interrupted", "3": "not_started"}
    bad = run_cli(["sweep-complete", str(sweep / "0")], Path.cwd())
    assert bad.exit_code == 2 and "not a tfmoe sweep directory" in bad.stderr


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_sweep_with_failed_jobs_names_them(fake_experiment) -> None:
    from tfmoe.harness.reading import reports

    code, dirs = launched(fake_experiment, ["mode=ok,fail_check,bad_input"], multirun=True)
    assert code == 2
    lines = reports.sweep_problem_lines(dirs[-1].parent)
    assert lines[0].startswith("job 1 (mode=fail_check): failed") and lines[1].startswith("job 2 (mode=bad_input): error")


@pytest.mark.parametrize(("mode", "code", "name"), [("sigterm", 143, "SIGTERM"), ("sigusr2", 140, "SIGUSR2")])
def test_a_signal_inside_the_run_is_recorded_and_stops_the_sweep(fake_experiment, monkeypatch: pytest.MonkeyPatch,
                                                                 mode: str, code: int, name: str) -> None:
    """SIGTERM always, and SIGUSR2 inside a submitit job (whose own handler would raise inside the experiment):
    the steps so far are written, status interrupted, the error names the signal, the in-process sweep stops."""
    import signal as signal_module

    from tfmoe.contract.errors import Terminated
    from tfmoe.harness.launching import launch

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    before = signal_module.getsignal(signal_module.SIGTERM)
    made: list[Path] = []
    with pytest.raises(Terminated) as stopped:
        launch.run_experiment(fake_experiment, [f"mode={mode}"], quiet=True, made=made)
    assert stopped.value.exit_code == code
    data = notebook.load_run(made[-1])
    assert data.run["status"] == "interrupted" and data.run["exit_code"] == code and name in data.run["error"]
    assert data.metrics["step"].tolist() == [0, 1, 2]
    assert signal_module.getsignal(signal_module.SIGTERM) == before  # the runner's handler is gone again


def test_a_system_exit_inside_the_run_is_never_recorded_ok(fake_experiment) -> None:
    code, dirs = launched(fake_experiment, ["mode=exit"])
    assert code != 0
    data = notebook.load_run(dirs[-1])
    assert data.run["status"] == "crashed" and "SystemExit" in data.run["error"]


def test_read_run_state_agrees_with_read_run_row_ok_lost_and_corrupt(fake_experiment, tmp_path: Path) -> None:
    """The fast state read (big sweeps' exit code and outcome) gives the same state as the full row, lost included."""
    from tfmoe.contract.errors import BadInput

    code, dirs = launched(fake_experiment, [])
    run_dir = dirs[-1]
    for planted in (None, _dead_pid()):
        if planted is not None:
            _planted_running(run_dir, pid=planted)
        full, fast = notebook.read_run_row(run_dir), notebook.read_run_state(run_dir)
        assert fast["status"] == full["status"] == ("ok" if planted is None else "lost")
        assert fast["recorded_status"] == full["recorded_status"] and fast["run_id"] == full["run_id"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "run.parquet").write_bytes(b"not parquet")
    with pytest.raises(BadInput, match="not readable parquet"):
        notebook.read_run_state(broken)


def test_a_big_sweep_outcome_is_one_row_per_status_and_names_the_bad_jobs(fake_experiment, capsys) -> None:
    """Past OUTCOME_TABLE_MAX jobs a per-job table is unreadable and slow (10 s at 1,000 jobs): one row per status."""
    import shutil

    from tfmoe.harness.reading import reports

    code, dirs = launched(fake_experiment, ["mode=ok,fail_check"], multirun=True)
    assert code == 1
    sweep = dirs[0].parent
    ok_dir, failed_dir = sorted(dirs, key=lambda d: d.name)
    copies = [ok_dir, failed_dir] + [shutil.copytree(ok_dir, sweep / f"copy{i}") for i in range(reports.OUTCOME_TABLE_MAX)]
    capsys.readouterr()
    reports.print_outcome(copies, [sweep])
    out = capsys.readouterr().out
    assert f"tfmoe sweep: {len(copies)} jobs" in out and "one row per status" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    assert set(rows) == {"ok", "failed"} and f" {len(copies) - 1} " in rows["ok"] and " 1 " in rows["failed"]
    assert "job 1 (mode=fail_check): failed" in out
    assert reports.exit_code_of(copies) == 1
