"""I/O faults injected at every write (tests/io_faults.py), as SQLite tests its own: each notebook-writing command
is counted in a dry pass, then run once per fault point (the Nth write failing with ENOSPC, then EIO, for every N;
the Nth rename for every N), and after each fault the notebook's promises are checked:

* no record claims ``ok`` unless every one of its files is complete (load_run reads every table), and the exit code
  agrees with the record (0 only for ok);
* no traceback reaches the user; the command's refusal is at most a line or two on stderr;
* every reader (``runs``, ``show``, ``sql``, ``diff``) still answers, with at most one warning line;
* a rerun (or ``sweep-complete`` for a sweep, or the next ``export mlflow``) recovers.

The default suite covers the fake experiment's run (EIO), ``conclude``, ``failures add`` and the catalog sync at
every point, a sweep at every 6th and ``export mlflow`` at 4 chosen points (its first and last store statement, its
first artifact, its first rename). Under ``pytest tests/test_io_faults.py -m slow``: ENOSPC too, every point of the
sweep, of ``export mlflow`` (~580: hours) and of each experiment's run (20-100 each, 5-140 s a run: hours). Each
test prints its number of fault points.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import pytest
from io_faults import Fault, IOFaults, count, plans

from tfmoe.api.testing import run_cli

RUN = ["fake", "flush_every_s=null"]


def _run_dirs(root: Path) -> set[Path]:
    return {p for p in (root / "runs").glob("*/*") if p.is_dir() and not p.name.startswith(".")}


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _said(plan: Fault, what: str) -> str:
    return f"{plan.kind} #{plan.n} ({errno.errorcode[plan.errno]}): {what}"


def _readers(root: Path, plan: Fault, run_ref: str | None, baseline: str) -> list[str]:
    """Every reader answers, with at most one warning line and no traceback."""
    problems = []
    calls = [["runs"], ["sql", "SELECT run_id, status FROM runs"]]
    if run_ref is not None:
        calls += [["show", run_ref], ["diff", baseline, run_ref]]
    for args in calls:
        try:
            res = run_cli(args, root)
        except BaseException as exc:  # noqa: BLE001 (a reader that raises is the finding)
            problems.append(_said(plan, f"`{' '.join(args[:1])}` raised {type(exc).__name__}: {exc}"))
            continue
        ok_codes = {0, 1} if args[0] == "diff" else {0}
        if res.exit_code not in ok_codes or "Traceback" in res.stderr or len(_lines(res.stderr)) > 1:
            problems.append(_said(plan, f"`{args[0]}` exit {res.exit_code}, stderr {res.stderr[-300:]!r}"))
    return problems


def _consistent(run_dir: Path, code: int, plan: Fault) -> list[str]:
    """ok only with every table complete; exit 0 only for ok."""
    from tfmoe.harness.store.notebook import effective_status, load_run, read_run_row

    try:
        row = read_run_row(run_dir)
    except Exception:  # noqa: BLE001 (no readable run.parquet: nothing claims ok)
        return [] if code != 0 else [_said(plan, f"exit 0 but {run_dir.name}/run.parquet is unreadable")]
    status = str(effective_status(row)) if callable(effective_status) else str(row["status"])
    problems = []
    if status == "ok":
        try:
            load_run(run_dir)
        except Exception as exc:  # noqa: BLE001
            problems.append(_said(plan, f"status ok but a table is incomplete: {type(exc).__name__}: {exc}"))
    if (code == 0) != (status == "ok"):
        problems.append(_said(plan, f"exit {code} but the record says {status}"))
    return problems


faults_hit: list[str] = []  # the path each injected fault hit, in order


def _best_effort(path: str) -> bool:
    """A write whose loss the run may survive with exit 0: the run's log (its records are the parquet files)."""
    return path.endswith(".log")


def _inject(root: Path, plan: Fault, command: Callable[[], object],
            only: Callable[[str], bool] | None = None) -> tuple[object | None, list[str]]:
    faults_hit.append("")
    with IOFaults(root, plan, only=only) as faults:
        try:
            res = command()
        except BaseException as exc:  # noqa: BLE001 (an exception through the CLI is the finding)
            return None, [_said(plan, f"raised {type(exc).__name__}: {exc}")]
    faults_hit[-1] = faults.fired[1] if faults.fired else ""
    # a command may write a little less than in the dry pass (a cache or catalog row already made): a point past
    # its last write is no fault point this time
    missed = faults.fired is None and plan.n <= faults.count(plan.kind)
    problems = [_said(plan, "never fired (the dry count was not this command's)")] if missed else []
    out = getattr(res, "stdout", "") + getattr(res, "stderr", "")
    if "Traceback" in out:
        problems.append(_said(plan, f"a traceback: {out[-400:]!r}"))
    return res, problems


def _points(root: Path, command: list[str], errnos: tuple[int, ...]) -> tuple[list[Fault], int]:
    """Every fault point of ``command`` (a dry pass counts its writes): the writes with each of ``errnos``, and the
    renames (with EIO) along with the first errno."""
    writes, renames, _events = count(root, lambda: run_cli(command, root))
    points = plans(writes, renames, errnos, errno.EIO if errno.EIO in errnos else None)
    return points, len(points)


pytestmark = pytest.mark.timeout(1200)  # minutes of wall time on a loaded machine
SLOW = pytest.mark.slow
HOURS = pytest.mark.timeout(6 * 3600)  # the exhaustive versions (-m slow)
# EIO at every write and rename in the default suite; ENOSPC at every write too under -m slow (the tmpfs tests in
# test_faults_disk.py fill a real disk)
ERRNOS = [pytest.param((errno.EIO,), id="EIO"), pytest.param((errno.ENOSPC,), id="ENOSPC", marks=[SLOW, HOURS])]


# ------------------------------------------------------------------------------------------ a run
def _run_at_every_point(root: Path, command: list[str], errnos: tuple[int, ...], stride: int = 1) -> tuple[int, list[str]]:
    """``command`` (a run) once per fault point (every ``stride``-th), the promises checked after each."""
    baseline = run_cli(command, root)
    assert baseline.exit_code in (0, 1), baseline.stderr  # (a run may fail a check: the promises are the same)
    points, _n = _points(root, command, errnos)
    points = points[::stride]
    problems: list[str] = []
    for i, plan in enumerate(points):
        before = _run_dirs(root)
        res, found = _inject(root, plan, lambda: run_cli(command, root))
        problems += found
        if res is None:
            continue
        made = sorted(_run_dirs(root) - before)
        for d in made:
            problems += _consistent(d, res.exit_code, plan)
        if res.exit_code == 0 and faults_hit[-1] and not _best_effort(faults_hit[-1]):
            problems.append(_said(plan, f"exit 0 although writing {faults_hit[-1]} failed"))
        recorded = [d for d in made if (d / "run.parquet").exists()]
        problems += _readers(root, plan, str(recorded[0]) if recorded else None, str(baseline.run_dir))
        if i % 8 == 0 or i == len(points) - 1:  # a rerun recovers
            again = run_cli(command, root)
            if again.exit_code != baseline.exit_code:
                problems.append(_said(plan, f"the rerun exited {again.exit_code}: {again.stderr[-300:]!r}"))
    return len(points), problems


@pytest.mark.parametrize("errnos", ERRNOS)
def test_every_write_of_a_run_failing_leaves_an_honest_notebook(fake_experiment, tmp_path: Path, capsys,
                                                                 errnos: tuple[int, ...]) -> None:
    n, problems = _run_at_every_point(tmp_path, RUN, errnos)
    with capsys.disabled():
        print(f"\n[io faults] fake run: {n} fault points")
    assert not problems, "\n".join(problems)


# each experiment with a small config (its writes: the tables, the summary, its plots, .hydra/)
EXPERIMENT_RUNS = {
    "tokenize": ["tokenize"],
    "attn-check": ["attn-check", "d_model=16", "n_heads=4", "T=6", "checks=[masks,sdpa]"],
    "arch": ["arch"],
    "block-stats": ["block-stats"],
    "shift-labels": ["shift-labels"],
    "decode": ["decode"],
    "route-sim": ["route-sim", "steps=6", "train_tokens=64"],
    "complexity": ["complexity"],
}


@SLOW
@HOURS
@pytest.mark.parametrize("experiment", sorted(EXPERIMENT_RUNS))
def test_every_write_of_each_experiment_failing_leaves_an_honest_notebook(tmp_path: Path, capsys,
                                                                          experiment: str) -> None:
    """Every experiment at every fault point (EIO): `pytest tests/test_io_faults.py -m slow -k each_experiment`."""
    n, problems = _run_at_every_point(tmp_path, [*EXPERIMENT_RUNS[experiment], "flush_every_s=null"], (errno.EIO,))
    with capsys.disabled():
        print(f"\n[io faults] {experiment} run: {n} fault points")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------ a sweep
SWEEP = ["fake", "-m", "seed=0,1", "flush_every_s=null"]


def _sweeps(root: Path) -> set[Path]:
    return set((root / "runs").glob("*/multirun-*"))


@pytest.mark.parametrize("stride", [6, pytest.param(1, marks=[SLOW, HOURS])])
def test_every_write_of_a_sweep_failing_leaves_an_honest_notebook(fake_experiment, tmp_path: Path, capsys,
                                                                   stride: int) -> None:
    """Every fault point under -m slow; every 6th in the default suite."""
    from tfmoe.harness.store.notebook import effective_status, load_run, read_run_row
    from tfmoe.harness.store.sweeps import sweep_jobs

    baseline = run_cli(RUN, tmp_path)
    points, _n = _points(tmp_path, SWEEP, (errno.EIO,))
    points = points[::stride]
    n = len(points)
    problems: list[str] = []
    for plan in points:
        before = _sweeps(tmp_path)
        res, found = _inject(tmp_path, plan, lambda: run_cli(SWEEP, tmp_path))
        problems += found
        if res is None:
            continue
        made = sorted(_sweeps(tmp_path) - before)
        jobs = [d for s in made for d in sorted(s.iterdir()) if (d / "run.parquet").exists()]
        statuses = []
        for d in jobs:
            try:
                statuses.append(str(effective_status(read_run_row(d))))
            except Exception:  # noqa: BLE001
                statuses.append("unreadable")
            if statuses[-1] == "ok":
                try:
                    load_run(d)
                except Exception as exc:  # noqa: BLE001
                    problems.append(_said(plan, f"job {d.name} ok but incomplete: {exc}"))
        if res.exit_code == 0 and faults_hit[-1] and (len(statuses) != 2 or set(statuses) != {"ok"}
                                                       or not _best_effort(faults_hit[-1])):
            problems.append(_said(plan, f"exit 0 with jobs {statuses} after writing {faults_hit[-1]} failed"))
        problems += _readers(tmp_path, plan, str(jobs[0]) if jobs else None, str(baseline.run_dir))
        for s in made:  # sweep-complete recovers the table
            if sweep_jobs(s) is None:  # multirun.yaml refused: its jobs unknown, so the recovery is a rerun
                again = run_cli(SWEEP, tmp_path)
                if again.exit_code != 0:
                    problems.append(_said(plan, f"the sweep's rerun exited {again.exit_code}"))
                continue
            done = run_cli(["sweep-complete", str(s)], tmp_path)
            if "Traceback" in done.stderr or not (s / "sweep.parquet").exists():
                problems.append(_said(plan, f"sweep-complete exit {done.exit_code}: {done.stderr[-300:]!r}"))
            else:
                import pandas as pd

                listed = pd.read_parquet(s / "sweep.parquet")["job"].astype(str).nunique()
                if listed != 2:
                    problems.append(_said(plan, f"sweep-complete lists {listed} of 2 jobs"))
    with capsys.disabled():
        print(f"\n[io faults] fake sweep (2 jobs): {n} fault points")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------ conclude, failures add
def test_every_write_of_conclude_failing_keeps_the_conclusions_readable(fake_experiment, tmp_path: Path,
                                                                        capsys) -> None:
    from tfmoe.harness.method import conclusions

    run = run_cli(RUN, tmp_path).run_dir
    texts = iter(f"conclusion {i}" for i in range(10_000))

    def conclude(text: str) -> object:
        return run_cli(["conclude", str(run), "--proven", text], tmp_path)

    points, n = [], 0
    writes, renames, _ = count(tmp_path, lambda: conclude(next(texts)))
    points = plans(writes, renames)
    n = len(points)
    problems: list[str] = []
    for plan in points:
        text = next(texts)
        res, found = _inject(tmp_path, plan, lambda text=text: conclude(text))
        problems += found
        if res is None:
            continue
        try:
            rows = [r["text"] for r in conclusions.read(run)]
        except Exception as exc:  # noqa: BLE001
            problems.append(_said(plan, f"conclusions.parquet unreadable: {exc}"))
            continue
        if res.exit_code == 0 and text not in rows:
            problems.append(_said(plan, "exit 0 but the conclusion is not recorded"))
        if res.exit_code != 0 and len(_lines(res.stderr)) != 1:
            problems.append(_said(plan, f"exit {res.exit_code} with stderr {res.stderr!r}"))
        problems += _readers(tmp_path, plan, str(run), str(run))
        again = conclude(text + " again")
        if again.exit_code != 0 or text + " again" not in (run / "summary.md").read_text():
            problems.append(_said(plan, f"conclude again exited {again.exit_code}: {again.stderr!r}"))
    with capsys.disabled():
        print(f"\n[io faults] conclude: {n} fault points")
    assert not problems, "\n".join(problems)


def test_every_write_of_failures_add_failing_leaves_whole_entries(fake_experiment, tmp_path: Path, capsys) -> None:
    from tfmoe.harness.method.failures import ENTRY_RE

    run = run_cli([*RUN, "mode=fail_check"], tmp_path).run_dir  # a failure to log
    log = tmp_path / "failures.md"
    add = ["failures", "add", str(run), "--file", str(log), "--again", "--hypothesis", "a cause", "--fix", "a fix"]
    assert run_cli(add, tmp_path).exit_code == 0  # the file exists: each later add appends
    writes, renames, _ = count(tmp_path, lambda: run_cli(add, tmp_path))
    points = plans(writes, renames)
    problems: list[str] = []
    for plan in points:
        before = log.read_text()
        res, found = _inject(tmp_path, plan, lambda: run_cli(add, tmp_path))
        problems += found
        if res is None:
            continue
        after = log.read_text()
        grown = len(ENTRY_RE.findall(after)) - len(ENTRY_RE.findall(before))
        if res.exit_code == 0 and grown != 1:
            problems.append(_said(plan, f"exit 0 but {grown} entries were added"))
        if res.exit_code != 0 and after != before:
            problems.append(_said(plan, f"exit {res.exit_code} but failures.md changed: {after[len(before):]!r}"))
        if res.exit_code != 0 and len(_lines(res.stderr)) != 1:
            problems.append(_said(plan, f"exit {res.exit_code} with stderr {res.stderr!r}"))
        listed = run_cli(["failures", "list", "--file", str(log)], tmp_path)
        if listed.exit_code != 0:
            problems.append(_said(plan, f"failures list exit {listed.exit_code}: {listed.stderr!r}"))
        again = run_cli(add, tmp_path)
        if again.exit_code != 0:
            problems.append(_said(plan, f"the rerun exited {again.exit_code}: {again.stderr!r}"))
    with capsys.disabled():
        print(f"\n[io faults] failures add: {len(points)} fault points")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------ the catalog sync
def test_every_write_of_the_catalog_sync_failing_still_lists_every_run(fake_experiment, tmp_path: Path,
                                                                       capsys) -> None:
    """`runs` after new runs syncs the catalog (SQLite): a refused write still lists every run, warning at most once,
    and the next `runs` catches up."""
    run_cli(RUN, tmp_path)
    assert run_cli(["runs"], tmp_path).exit_code == 0
    run_cli(RUN, tmp_path)  # a run the catalog has not seen
    writes, renames, _ = count(tmp_path, lambda: run_cli(["runs"], tmp_path))
    points = plans(writes, renames)
    problems: list[str] = []
    for plan in points:
        new = run_cli(RUN, tmp_path).run_dir
        res, found = _inject(tmp_path, plan, lambda: run_cli(["runs"], tmp_path))
        problems += found
        if res is None:
            continue
        if res.exit_code != 0 or len(_lines(res.stderr)) > 1 or new.name[:20] not in res.stdout:
            problems.append(_said(plan, f"`runs` exit {res.exit_code}, stderr {res.stderr!r}, new run listed: "
                                        f"{new.name[:20] in res.stdout}"))
        total = len(_run_dirs(tmp_path))
        problems += _readers(tmp_path, plan, str(new), str(new))
        sql = run_cli(["sql", "SELECT count(*) AS n FROM runs", "--format", "csv"], tmp_path)
        if sql.exit_code != 0 or str(total) not in sql.stdout:
            problems.append(_said(plan, f"after the fault, sql counts {sql.stdout!r} of {total} runs"))
    with capsys.disabled():
        print(f"\n[io faults] catalog sync: {len(points)} fault points")
    assert not problems, "\n".join(problems)


def test_a_multirun_yaml_cut_short_lists_no_guessed_jobs(tmp_path: Path) -> None:
    """Found by the sweep's fault points: the disk refused multirun.yaml's one write, leaving it empty, and
    sweep-complete listed one job with no overrides for a sweep of two."""
    from tfmoe.harness.store.sweeps import sweep_jobs

    (tmp_path / "multirun.yaml").write_text("")
    assert sweep_jobs(tmp_path) is None
    (tmp_path / "multirun.yaml").write_text("hydra:\n  run:\n")
    assert sweep_jobs(tmp_path) is None


# ------------------------------------------------------------------------------------------ export mlflow
def _mlflow_runs(uri: str) -> dict[str, list[dict[str, str]]]:
    """tfmoe run id -> the tags of every MLflow run exported for it."""
    import mlflow
    from mlflow.entities import ViewType

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    found: dict[str, list[dict[str, str]]] = {}
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL):
            if "tfmoe.run_id" in run.data.tags:
                found.setdefault(run.data.tags["tfmoe.run_id"], []).append(run.data.tags)
    return found


def _store(path: str) -> bool:
    """The export's own writes: the MLflow store and its artifacts (the catalog's are test_..._catalog_sync's)."""
    return not path.endswith(".sqlite3")


def _mlflow_points(events: list[tuple[str, str]], exhaustive: bool) -> list[int]:
    """The write numbers to fail: all, or the first and the last statement written to the store and the first
    artifact."""
    writes = [path for kind, path in events if kind == "write"]
    if exhaustive:
        return list(range(1, len(writes) + 1))
    db = [i for i, p in enumerate(writes, 1) if p.endswith(".db")]  # the store, not the catalog (.sqlite3)
    artifacts = [i for i, p in enumerate(writes, 1) if "mlruns" in p or "mlartifacts" in p]
    return sorted({db[0], db[-1], *(artifacts[:1])})


@pytest.mark.parametrize("exhaustive", [False, pytest.param(True, marks=[SLOW, HOURS])])
def test_a_failed_first_mlflow_export_is_completed_by_the_next(fake_experiment, tmp_path: Path, capsys,
                                                               exhaustive: bool) -> None:
    """A first export into a new store, its Nth write failing (creating the store's schema, an artifact, the final
    tags): no traceback, and the next export completes it — exactly one MLflow run per tfmoe run, each complete."""
    pytest.importorskip("mlflow")
    from tfmoe.harness.reading.export_mlflow import COMPLETE_TAG

    ids = {run_cli(RUN, tmp_path).run_dir.name, run_cli([*RUN, "mode=fail_check"], tmp_path).run_dir.name}
    run_cli(["runs"], tmp_path)  # the catalog is in sync: the points below are the export's own

    def export(uri: str) -> object:
        return run_cli(["export", "mlflow", "--tracking-uri", uri], tmp_path)

    _w, renames, events = count(tmp_path, lambda: export(f"sqlite:///{tmp_path}/dry.db"), only=_store)
    points = [Fault("write", n, errno.EIO) for n in _mlflow_points(events, exhaustive)]
    points += [Fault("rename", n, errno.EIO) for n in range(1, (renames if exhaustive else 1) + 1)]
    problems: list[str] = []
    for i, plan in enumerate(points):
        uri = f"sqlite:///{tmp_path}/store-{i}.db"
        res, found = _inject(tmp_path, plan, lambda uri=uri: export(uri), only=_store)
        problems += found
        if res is not None and res.exit_code != 0 and len(_lines(res.stderr)) > 2:
            problems.append(_said(plan, f"exit {res.exit_code} with stderr {res.stderr[-500:]!r}"))
        again = export(uri)
        if again.exit_code != 0:
            problems.append(_said(plan, f"the next export exited {again.exit_code}: {again.stderr[-400:]!r}"))
            continue
        exported = _mlflow_runs(uri)
        for run_id in ids:
            tags = exported.get(run_id, [])
            if len(tags) != 1 or tags[0].get(COMPLETE_TAG) != "true":
                problems.append(_said(plan, f"{run_id}: {len(tags)} MLflow run(s) after the next export, complete: "
                                            f"{[t.get(COMPLETE_TAG) for t in tags]}"))
    with capsys.disabled():
        print(f"\n[io faults] export mlflow: {len(points)} fault points (of {_w} writes, {renames} renames)")
    assert not problems, "\n".join(problems)


def test_a_store_left_half_created_by_an_earlier_export_is_made_again(fake_experiment, tmp_path: Path) -> None:
    """Before: a first export stopped inside MLflow's migrations left `_alembic_tmp_*` tables, and every later
    export refused the store with a 21-line SQL dump."""
    import sqlite3

    pytest.importorskip("mlflow")
    run = run_cli(RUN, tmp_path).run_dir
    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.execute("CREATE TABLE _alembic_tmp_endpoints (x INTEGER)")
    res = run_cli(["export", "mlflow", "--tracking-uri", f"sqlite:///{db}"], tmp_path)
    assert res.exit_code == 0, res.stderr
    assert _lines(res.stderr) == [ln for ln in _lines(res.stderr) if "half-created" in ln] and len(_lines(res.stderr)) == 1
    assert list(tmp_path.glob("mlflow.db.half-created-*"))
    assert len(_mlflow_runs(f"sqlite:///{db}")[run.name]) == 1
