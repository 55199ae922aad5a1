"""A full disk and a read-only runs root, on a REAL small tmpfs (issue 24, item 5): at every stage a run or sweep
says so in one line on stderr naming the cause and the path, never a traceback, and its status tells the truth.

Mounting needs root (CAP_SYS_ADMIN); where it is not permitted these tests skip, saying why.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.api.testing import run_cli

TFMOE = [sys.executable, "-m", "tfmoe.cli"]
ROUTE = ["route-sim", "steps=6", "train_tokens=64"]


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) on this machine: the tmpfs tests need it")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip() or p.returncode}): needs root / CAP_SYS_ADMIN")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted afterwards."""
    with _tmpfs(tmp_path / "mnt", "2m") as mnt:
        yield mnt


def _fill(mnt: Path, leave: int) -> None:
    """Fill the file system to ``leave`` bytes free (a real file of zeros). With ``leave`` 0 a run writing at the same
    time can take space between the measure and the write: the write's ENOSPC then means the disk is full, the goal."""
    filler = mnt / "filler"
    filler.unlink(missing_ok=True)
    free = shutil.disk_usage(mnt).free
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * max(0, free - leave))
        except OSError as exc:
            if exc.errno != errno.ENOSPC or leave != 0:
                raise
    assert abs(shutil.disk_usage(mnt).free - leave) <= 8192, shutil.disk_usage(mnt).free


def _one_clean_line(stderr: str, *said: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and all(s in lines[0] for s in said), stderr
    return lines[0]


def _remount(mnt: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], check=True)


def test_read_only_runs_root_refuses_runs_and_sweeps_and_still_lists(small_fs: Path, tmp_path: Path) -> None:
    (tmp_path / "made").mkdir()
    ok = run_cli([*ROUTE, "steps=0"], tmp_path / "made")
    assert ok.exit_code == 0, ok.stderr
    shutil.copytree(tmp_path / "made" / "runs", small_fs / "runs")  # (this process keeps the run's log file open)
    _remount(small_fs, "ro")
    try:
        for args in ([*ROUTE], [*ROUTE, "-m", "top_k=1,2"]):
            r = run_cli(args, small_fs)
            assert r.exit_code == 2, r.stdout + r.stderr
            _one_clean_line(r.stderr, "cannot write runs under runs", "Read-only file system")
        listing = run_cli(["runs", "--format", "json"], small_fs)
        assert listing.exit_code == 0 and "Traceback" not in listing.stderr, listing.stderr
        assert [r["status"] for r in json.loads(listing.stdout)] == ["ok"]
        joined = run_cli(["sql", "SELECT r.status, count(*) AS n FROM runs r JOIN metrics m USING (run_id) "
                                 "GROUP BY ALL", "--format", "json"], small_fs)  # no view file can be kept there
        assert joined.exit_code == 0 and "Traceback" not in joined.stderr, joined.stderr
        assert [r["status"] for r in json.loads(joined.stdout)] == ["ok"] and json.loads(joined.stdout)[0]["n"] > 0
    finally:
        _remount(small_fs, "rw")
    assert len(list((small_fs / "runs").rglob("run.parquet"))) == 1  # nothing was written by the refused ones


def test_a_full_disk_refuses_the_run_before_its_directory(small_fs: Path) -> None:
    _fill(small_fs, 100 * 1024)
    r = run_cli(ROUTE, small_fs)
    assert r.exit_code == 2
    _one_clean_line(r.stderr, "only 100 KiB free", "free space there, or pass run_root=DIR")
    assert not list(small_fs.rglob("run.parquet"))


def _sizes(run_dir: Path) -> tuple[int, int]:
    """(bytes of everything but the plots, bytes of the plots) of a finished run directory."""
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    used = {p: -(-p.stat().st_size // 4096) * 4096 for p in files}  # whole pages, as tmpfs counts them
    plots = sum(n for p, n in used.items() if p.suffix == ".png")
    return sum(used.values()) - plots, plots


def test_plots_the_disk_refuses_are_best_effort_and_said(small_fs: Path, tmp_path: Path) -> None:
    """Plots are best-effort: when the disk refuses them the run's records are complete, its status stays (here
    ok, exit 0), one warning line says which part was not written, and run.parquet's notes say so too. (Before:
    an ok run became `error` exit 2 by rewriting run.parquet on the same full disk, and when that rewrite was
    refused too, an 81-line traceback and exit 2 while run.parquet said ok.)"""
    (tmp_path / "ref").mkdir()
    ref = run_cli(ROUTE, tmp_path / "ref")  # the same run on a roomy disk: how much its records and plots take
    records, plots = _sizes(ref.run_dir)
    assert plots > 64 * 1024, plots
    from tfmoe.harness.launching.launch import MIN_FREE_BYTES

    leave = max(MIN_FREE_BYTES + 4096, records + 64 * 1024)  # the records fit (with tmpfs' page rounding), the plots not
    assert leave < records + plots - 32 * 1024, (records, plots)
    _fill(small_fs, leave)
    r = run_cli(ROUTE, small_fs)
    run = pd.read_parquet(r.run_dir / "run.parquet").iloc[0]
    assert r.exit_code == run["exit_code"] == 0 and run["status"] == "ok", r.stdout + r.stderr
    line = _one_clean_line(r.stderr, "warning:", "could not write plots", "No space left on device", "best-effort")
    assert any("could not write plots" in n for n in run["notes"]), (list(run["notes"]), line)
    assert (r.run_dir / "metrics.parquet").exists() and (r.run_dir / "checks.parquet").exists()  # records kept
    shown = run_cli(["show", r.run_dir.name], small_fs)
    assert shown.exit_code == 0 and "could not write plots" in shown.stdout


def test_plots_and_the_status_rewrite_both_refused_end_as_the_record_says(small_fs: Path) -> None:
    """The disk full to the last byte after run.parquet said ok: the plot is refused, and so is the rewrite of
    run.parquet that would note it. No exception, the status returned is the one on disk (ok, 0), and the writer
    says what was not written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tfmoe.contract.recorder import Recorder
    from tfmoe.contract.status import Status
    from tfmoe.harness.store.notebook import RunWriter

    run_dir = small_fs / "runs" / "fake" / "20260101T000000Z-aaaaaaaa"
    writer = RunWriter(run_dir=run_dir, run_id=run_dir.name, experiment="fake", seed=0, argv=[], overrides=[],
                       device="cpu", dtype="fp32")
    writer.start()
    import torch

    rec = Recorder(cfg={}, device=torch.device("cpu"), dtype=torch.float32, seed=0)
    rec.metric("loss", 1.5)
    fig, ax = plt.subplots()
    ax.plot(range(1000), [i ** 0.5 for i in range(1000)])
    rec.plot("curve", fig)
    assert writer.finish(rec, Status.OK, 0, None, None, None, 1000, extras=False)[0] == Status.OK
    _fill(small_fs, 0)
    status, code, error = writer.finish_extras(rec)
    plt.close(fig)
    on_disk = pd.read_parquet(run_dir / "run.parquet").iloc[0]
    assert (status, code) == (Status.OK, 0) == (on_disk["status"], on_disk["exit_code"])
    assert writer.unwritten and all("No space left on device" in u for u in writer.unwritten), writer.unwritten


def test_a_disk_that_fills_during_the_run_is_one_line_and_the_run_not_ok(small_fs: Path) -> None:
    """The disk fills while the run flushes its records (a real process): today exit 2 with 107 lines of stderr and 5
    tracebacks, its final table saying `running`; `tfmoe runs` then fails with an sqlite traceback."""
    proc = subprocess.Popen([*TFMOE, "route-sim", "steps=400", "strategies=[none,aux_loss]", "flush_every_s=0.2"],
                            cwd=small_fs, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(small_fs.rglob("metrics.parquet")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        _fill(small_fs, 0)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err
    _one_clean_line(err, "No space left on device", str(small_fs / "runs"))
    assert "running" not in out  # no outcome table claiming it still runs
    from tfmoe.harness.store import notebook

    (run_dir,) = [small_fs / p if not p.is_absolute() else p for p in notebook.find_runs(small_fs / "runs")]
    assert notebook.read_run_row(run_dir)["status"] in ("lost", "error")  # never ok, never a live `running`
    listing = subprocess.run([*TFMOE, "runs", "--format", "json"], cwd=small_fs, capture_output=True, text=True,
                             timeout=120)
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr
    assert "cannot write the run catalog" in listing.stderr and len(listing.stderr.strip().splitlines()) == 1
    assert "ok" not in [r["status"] for r in json.loads(listing.stdout)]


def test_the_catalog_on_a_full_disk_falls_back_to_a_full_scan(small_fs: Path) -> None:
    (small_fs.parent / "made").mkdir()
    r = run_cli([*ROUTE, "steps=0"], small_fs.parent / "made")
    assert r.exit_code == 0
    shutil.copytree(small_fs.parent / "made" / "runs", small_fs / "runs")
    for p in small_fs.joinpath("runs").glob(".tfmoe-catalog*"):
        p.unlink()
    _fill(small_fs, 0)
    listing = run_cli(["runs", "--format", "json"], small_fs)
    assert listing.exit_code == 0 and [r["status"] for r in json.loads(listing.stdout)] == ["ok"], listing.stderr
    _one_clean_line(listing.stderr, "cannot write the run catalog", "database or disk is full")
    sql = run_cli(["sql", "SELECT status FROM runs", "--format", "json"], small_fs)
    assert sql.exit_code == 0 and '"ok"' in sql.stdout, sql.stdout + sql.stderr


@pytest.mark.parametrize("leave_kib", [0, 20, 44, 60, 100])
def test_readers_answer_when_the_disk_fills_under_a_settled_catalog(small_fs: Path, leave_kib: int) -> None:
    """A catalog that exists, a run added since, then the disk filled to a few KiB: the sync's write fails, SQLite
    rolls back by itself, and a second ROLLBACK used to raise "cannot rollback" over it (a 60-line traceback from
    `runs`, `sql` and `show`). Each reader answers, with at most one warning line."""
    made = small_fs.parent / "made"
    made.mkdir()
    for seed in (1, 2):
        assert run_cli([*ROUTE, "steps=0", f"seed={seed}"], made).exit_code == 0
    shutil.copytree(made / "runs", small_fs / "runs")
    newest = sorted((small_fs / "runs" / "route-sim").iterdir())[-1]
    moved = small_fs.parent / "later"
    shutil.move(str(newest), moved)
    assert run_cli(["sql", "SELECT * FROM runs JOIN metrics USING (run_id)"], small_fs).exit_code == 0  # settled
    shutil.move(str(moved), newest)  # a run added since: the next sync writes
    _fill(small_fs, leave_kib * 1024)
    for args in (["runs", "--format", "json"], ["sql", "SELECT count(*) AS n FROM runs r JOIN metrics USING (run_id)"],
                 ["show", newest.name], ["diff", newest.name, newest.name]):
        r = run_cli(args, small_fs)
        assert r.exit_code == 0 and "Traceback" not in r.stderr, (args, r.stderr)
        assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) <= 1, (args, r.stderr)
    assert newest.name in run_cli(["runs", "--format", "json"], small_fs).stdout


def test_a_disk_that_fills_between_sweep_parquet_and_its_plots_says_which(small_fs: Path, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """sweep.parquet fits, its plot does not: the one line says sweep.parquet was written and its plots not (it said
    "sweep.parquet not written"), and `tfmoe sweep-complete` writes them once there is room."""
    from tfmoe.harness.launching import hydra_callbacks

    (tmp_path / "made").mkdir()
    made = run_cli([*ROUTE, "-m", "top_k=1,2"], tmp_path / "made")
    assert made.exit_code == 0, made.stderr
    (sweep,) = (tmp_path / "made" / "runs" / "route-sim").glob("multirun-*")
    assert (sweep / "sweep.parquet").stat().st_size < 16384 < min(p.stat().st_size for p in sweep.glob("sweep_*.png"))
    copy = small_fs / "runs" / "route-sim" / sweep.name
    shutil.copytree(sweep, copy)
    for f in [copy / "sweep.parquet", *copy.glob("sweep_*.png")]:
        f.unlink()
    _fill(small_fs, 16384)
    capsys.readouterr()
    try:
        assert hydra_callbacks._write_or_say(copy, "route-sim") is False
    finally:
        hydra_callbacks.UNWRITTEN_SWEEPS.clear()
    _one_clean_line(capsys.readouterr().err, "sweep.parquet written, its plots not", "No space left on device",
                    f"tfmoe sweep-complete {copy}")
    assert set(pd.read_parquet(copy / "sweep.parquet")["job"]) == {"0", "1"} and not list(copy.glob("sweep_*.png"))
    (small_fs / "filler").unlink()
    done = run_cli(["sweep-complete", str(copy)], small_fs)
    assert done.exit_code == 0 and list(copy.glob("sweep_*.png")), done.stdout + done.stderr


def test_a_disk_that_fills_during_a_sweep_stops_it_in_lines_without_a_traceback(small_fs: Path) -> None:
    """140 KiB free passes the check before the sweep; its jobs then fill the disk, one of them in the middle of its
    records or before its `.hydra/` files (Hydra printed a traceback there). Every line names what was not written,
    the exit is 2, and no job that did end is lost."""
    _fill(small_fs, 140 * 1024)
    r = subprocess.run([*TFMOE, "shift-labels", "-m", "seed=1,2,3,4,5,6"], cwd=small_fs, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr and lines, r.stderr
    assert all(ln.startswith("error: cannot write ") and "No space left on device" in ln for ln in lines), r.stderr
    assert len(lines) <= 4, r.stderr  # a job's records, the next job's .hydra/ files, sweep.parquet


def test_a_sweep_jobs_hydra_records_refused_stop_the_sweep_in_one_line(small_fs: Path) -> None:
    """The moment itself, made certain: with the disk full, the sweep's faster `.hydra/` writer raises
    JobNotStarted naming the job's directory (not an Exception: Hydra's job runner would print a traceback)."""
    import hydra.core.utils as hydra_utils
    from omegaconf import OmegaConf

    from tfmoe.harness.launching import runner, sweep_speed

    undo = sweep_speed.faster_job_records()
    try:
        _fill(small_fs, 0)
        job = small_fs / "runs" / "x" / "multirun-1" / "3"
        with pytest.raises(runner.JobNotStarted) as caught:
            hydra_utils._save_config(OmegaConf.create({"seed": 1}), "config.yaml", job / ".hydra")
    finally:
        undo()
    assert not isinstance(caught.value, Exception) and caught.value.job_dir == job
    assert caught.value.said.startswith(f"cannot write {job}: No space left on device"), caught.value.said


def test_disk_problem_names_only_file_system_refusals() -> None:
    import errno

    from tfmoe.contract.errors import disk_problem

    full = OSError(errno.ENOSPC, "No space left on device", "/runs/x/run.parquet")
    assert disk_problem(full) == ("cannot write /runs/x/run.parquet: No space left on device (errno ENOSPC): free "
                                  "space there, or pass run_root=DIR on another disk")
    ro = OSError(errno.EROFS, "Read-only file system")
    assert "pass run_root=DIR that you can write" in disk_problem(ro, "/runs")
    wrapped = RuntimeError("flush failed")
    wrapped.__cause__ = OSError("[Errno 28] Error writing bytes to file. Detail: No space left on device")
    assert "No space left on device" in disk_problem(wrapped, "/runs/y")
    assert disk_problem(OSError(errno.ENOENT, "No such file")) is None
    assert disk_problem(ValueError("bad")) is None
    assert os.strerror(errno.ENOSPC) in disk_problem(full)


def test_disk_problem_ends_on_an_exception_chain_that_loops() -> None:
    """An exception re-raised while handling itself chains back to itself: the walk must end (it hung a run, F-130)."""
    from tfmoe.contract.errors import AdapterError, disk_problem

    first, second = AdapterError("the mask builder wants block_table"), RuntimeError("while handling it")
    first.__context__, second.__context__ = second, first
    assert disk_problem(first, "/runs/z") is None
