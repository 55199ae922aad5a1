"""The run catalog: a cache rebuilt from the run directories, following copied-in, deleted and still-running runs,
and safe with concurrent writer and reader processes."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.contract.errors import BadInput
from tfmoe.contract.status import Status
from tfmoe.harness.store import catalog, notebook, rundir

OLD = time.time() - 3600  # directories "written an hour ago": their mtimes are trusted (not racy)


def make_run(root: Path, rel: str, status: str = "ok", checks: tuple[bool, ...] = ()) -> Path:
    """A real run directory written by the notebook layer (no experiment needed)."""
    run_dir = root / rel
    sweep = str(run_dir.parent) if run_dir.parent.name.startswith("multirun-") else None
    run_id = f"{run_dir.parent.name.removeprefix('multirun-')}-{run_dir.name}" if sweep else run_dir.name
    writer = notebook.RunWriter(run_dir=run_dir, run_id=run_id, experiment=rel.split("/")[0], seed=0, argv=[],
                                overrides=["x=1"], device="cpu", dtype="fp32", sweep_dir=sweep)
    writer.start()
    if checks:
        df = pd.DataFrame({"check": [f"c{i}" for i in range(len(checks))], "passed": list(checks),
                           "observed": 1.0, "threshold": 2.0, "detail": ""})
        rundir.write_parquet(df, run_dir / "checks.parquet", schema=rundir.CHECKS_SCHEMA)
    if status != "running":
        writer.finish(None, status, Status(status).exit_code, None, None, None, 100)
    return run_dir


def age(root: Path, when: float = OLD) -> None:
    """Set every directory's mtime an hour back, as if the runs were old."""
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        os.utime(d, (when, when))


def ids(root: Path) -> set[str]:
    return set(notebook.run_index(root)["run_id"])


def test_indexes_single_runs_and_sweep_jobs_with_checks(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    make_run(root, "fake/20260101T000000Z-aaaaaaaa", checks=(True, False, True))
    make_run(root, "fake/20260101T000001Z-bbbbbbbb", status="failed")
    make_run(root, "other/multirun-20260101T000002Z-cccccccc/0")
    make_run(root, "other/multirun-20260101T000002Z-cccccccc/1")
    index = notebook.run_index(root)
    assert set(index["run_id"]) == {"20260101T000000Z-aaaaaaaa", "20260101T000001Z-bbbbbbbb",
                                    "20260101T000002Z-cccccccc-0", "20260101T000002Z-cccccccc-1"}
    first = index[index["run_id"] == "20260101T000000Z-aaaaaaaa"].iloc[0]
    assert (first["checks_passed"], first["checks_total"], first["status"]) == (2, 3, "ok")
    assert set(index.columns) >= set(rundir.RUN_SCHEMA.names) | {"path", "checks_passed", "checks_total"}
    assert isinstance(first["started_at"], pd.Timestamp) and list(first["overrides"]) == ["x=1"]
    assert notebook.resolve_run("20260101T000002Z-cccccccc-1", root) == root / "other/multirun-20260101T000002Z-cccccccc/1"
    with pytest.raises(BadInput, match="ambiguous"):
        notebook.resolve_run("20260101T000002Z-cccccccc", root)


def test_rebuild_from_the_directories_and_a_corrupt_or_foreign_catalog(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for i in range(3):
        make_run(root, f"fake/2026010{i}T000000Z-0000000{i}")
    assert len(ids(root)) == 3
    assert catalog.rebuild(root) == 3
    (root / catalog.CATALOG_FILE).write_bytes(b"not a database at all" * 100)
    for suffix in ("-wal", "-shm"):
        Path(f"{root / catalog.CATALOG_FILE}{suffix}").unlink(missing_ok=True)
    assert len(ids(root)) == 3  # a corrupt cache is rebuilt, the runs are the truth
    # a catalog copied in from another runs root (rsync of a whole runs/) describes other directories
    other = tmp_path / "elsewhere"
    make_run(other, "fake/20250101T000000Z-ffffffff")
    ids(other)
    conn = sqlite3.connect(other / catalog.CATALOG_FILE)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{root / catalog.CATALOG_FILE}{suffix}").unlink(missing_ok=True)
    shutil.copy(other / catalog.CATALOG_FILE, root / catalog.CATALOG_FILE)
    assert len(ids(root)) == 3 and "20250101T000000Z-ffffffff" not in ids(root)


def test_runs_copied_in_appear_and_deleted_ones_disappear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog, "RACY_S", 0.0)  # trust every signature at once: they alone must tell
    root, source = tmp_path / "runs", tmp_path / "cluster" / "runs"
    make_run(root, "fake/20260101T000000Z-aaaaaaaa")
    make_run(source, "fake/20260102T000000Z-bbbbbbbb")
    make_run(source, "route/multirun-20260103T000000Z-cccccccc/0")
    make_run(source, "route/multirun-20260103T000000Z-cccccccc/1")
    age(root)
    age(source)  # the very same mtimes as ours: only the ctime tells that cp -a / rsync -a changed a directory
    assert ids(root) == {"20260101T000000Z-aaaaaaaa"}
    subprocess.run(["cp", "-a", f"{source}/.", str(root)], check=True)  # like rsync -a: source's mtimes kept
    assert (root / "fake").stat().st_mtime == OLD
    assert ids(root) == {"20260101T000000Z-aaaaaaaa", "20260102T000000Z-bbbbbbbb",
                         "20260103T000000Z-cccccccc-0", "20260103T000000Z-cccccccc-1"}
    assert ids(root) == ids(root)  # a second listing changes nothing
    shutil.rmtree(root / "fake" / "20260101T000000Z-aaaaaaaa")
    shutil.rmtree(root / "route" / "multirun-20260103T000000Z-cccccccc" / "1")
    assert ids(root) == {"20260102T000000Z-bbbbbbbb", "20260103T000000Z-cccccccc-0"}
    shutil.rmtree(root / "route")
    assert ids(root) == {"20260102T000000Z-bbbbbbbb"}
    with pytest.raises(BadInput, match="not found"):
        notebook.resolve_run("20260103T000000Z-cccccccc-0", root)


def test_running_runs_and_half_made_directories_are_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog, "RACY_S", 0.0)
    root = tmp_path / "runs"
    running = make_run(root, "fake/20260101T000000Z-aaaaaaaa", status="running")
    half = root / "fake" / "20260101T000001Z-bbbbbbbb" / ".hydra"
    half.mkdir(parents=True)  # Hydra made the directory; run.parquet is not written yet
    age(root)
    index = notebook.run_index(root)
    assert list(index["status"]) == ["running"]
    writer = notebook.RunWriter(run_dir=running, run_id=running.name, experiment="fake", seed=0, argv=[],
                                overrides=[], device="cpu", dtype="fp32")
    writer.finish(None, "failed", 1, None, None, None, 100)
    make_run(root, "fake/20260101T000001Z-bbbbbbbb")
    os.utime(root / "fake", (OLD, OLD))  # the experiment directory itself did not change
    index = notebook.run_index(root).set_index("run_id")
    assert index.loc["20260101T000000Z-aaaaaaaa", "status"] == "failed"
    assert index.loc["20260101T000001Z-bbbbbbbb", "status"] == "ok"


def test_an_unreadable_run_is_listed_as_such(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    bad = root / "fake" / "20260101T000000Z-aaaaaaaa"
    bad.mkdir(parents=True)
    (bad / "run.parquet").write_bytes(b"PAR1 garbage")
    index = notebook.run_index(root)
    assert list(index["status"]) == ["unreadable"] and "not readable parquet" in index.iloc[0]["error"]


WRITER = textwrap.dedent("""
    import sys, uuid
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_catalog import make_run
    root, who, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for i in range(n):
        if i % 3 == 0:
            make_run(root, f"fake/20260101T0000{{i:02d}}Z-{{who}}{{uuid.uuid4().hex[:4]}}")
        else:
            make_run(root, f"sweep/multirun-20260101T000000Z-{{who}}0000/{{i}}")
""")
READER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tfmoe.harness.store import notebook
    root = Path(sys.argv[1])
    for _ in range(int(sys.argv[2])):
        if root.exists():
            notebook.run_index(root)
""")


def test_concurrent_writer_and_reader_processes_lose_no_entry(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    tests_dir = str(Path(__file__).resolve().parent)
    writer = WRITER.format(tests=tests_dir)
    n = 12
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(root), f"w{k}", str(n)], stderr=subprocess.PIPE)
             for k in range(4)]
    procs += [subprocess.Popen([sys.executable, "-c", READER, str(root), "25"], stderr=subprocess.PIPE)
              for _ in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()[-2000:]
    on_disk = {p.parent for p in root.rglob("run.parquet")}
    index = notebook.run_index(root)
    assert len(on_disk) == 4 * n and {Path(p) for p in index["path"]} == on_disk
    conn = sqlite3.connect(root / catalog.CATALOG_FILE)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


def _generation(root: Path) -> int:
    import sqlite3

    conn = sqlite3.connect(root / catalog.CATALOG_FILE)
    try:
        return int(conn.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()[0])
    finally:
        conn.close()


def test_a_run_settling_unchanged_moves_no_generation_and_a_changed_one_does(tmp_path: Path) -> None:
    """A run indexed while its run.parquet was brand new is re-read once it settles. Found unchanged, only its
    signature is updated: the views kept for this generation (tfmoe sql) stay valid. Changed meanwhile, it is
    re-indexed and the generation moves, so no view built before is read back."""
    root = tmp_path / "runs"
    same = make_run(root, "fake/20260101T000000Z-aaaaaaaa")  # run.parquet written just now: racy
    changed = make_run(root, "fake/20260102T000000Z-bbbbbbbb")
    age(root)
    catalog.open_catalog(root).close()
    before = _generation(root)
    os.utime(same / "run.parquet", (OLD, OLD))  # settled: a new signature, the same row
    catalog.open_catalog(root).close()
    assert _generation(root) == before
    row = pd.read_parquet(changed / "run.parquet")
    row["notes"] = [["a note written in the same tick"]]
    rundir.write_parquet(row, changed / "run.parquet", schema=rundir.RUN_SCHEMA)
    os.utime(changed / "run.parquet", (OLD, OLD))  # rewritten, then settled
    conn = catalog.open_catalog(root)
    rows = {p: json.loads(r) for p, r in conn.execute("SELECT path, row FROM runs")}
    sigs = [sig for (sig,) in conn.execute("SELECT sig FROM runs")]
    conn.close()
    assert rows["fake/20260102T000000Z-bbbbbbbb"]["notes"] == ["a note written in the same tick"]
    assert _generation(root) > before and not any(sig.endswith(":racy") for sig in sigs)


def _triggers_and_versions(root: Path) -> tuple[dict[str, str], dict[str, int], int]:
    import sqlite3

    conn = sqlite3.connect(root / catalog.CATALOG_FILE)
    try:
        triggers = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'").fetchall())
        versions = dict(conn.execute("SELECT path, version FROM versions").fetchall())
        return triggers, versions, int(conn.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()[0])
    finally:
        conn.close()


@pytest.mark.parametrize("made_by", ["the settled rule", "run versions"])
def test_a_catalog_made_before_gets_this_codes_triggers_once(tmp_path: Path, made_by: str) -> None:
    """Planted: the catalog's triggers as they were before the settled rule (an update trigger counting every
    update, a signature's too), or before run versions (none set). Opening it puts TRIGGERS in their place, with
    every run's version set to the generation then (its kept views are rebuilt once, not extended), without a
    rebuild; a second open changes nothing."""
    import sqlite3

    root = tmp_path / "runs"
    make_run(root, "fake/20260101T000000Z-aaaaaaaa")
    make_run(root, "fake/20260102T000000Z-bbbbbbbb")
    age(root)
    catalog.open_catalog(root).close()
    bump = "BEGIN UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'generation'; END;"
    conn = sqlite3.connect(root / catalog.CATALOG_FILE)
    conn.executescript("".join(f"DROP TRIGGER {name}; " for name in catalog.TRIGGERS) + "DELETE FROM versions;"
                       + "".join(
        f"CREATE TRIGGER {t}_{e.lower()} AFTER {e} ON {t} "
        f"{catalog._RUNS_UPDATE_WHEN + ' ' if (t, e) == ('runs', 'UPDATE') and made_by == 'run versions' else ''}"
        f"{bump}" for t in ("runs", "tables") for e in ("INSERT", "UPDATE", "DELETE")))
    conn.close()
    before = _triggers_and_versions(root)
    assert before[1] == {} and (" WHEN " in before[0]["runs_update"]) == (made_by == "run versions")
    ids_before = ids(root)
    for _ in range(2):
        catalog.open_catalog(root).close()
        triggers, versions, generation = _triggers_and_versions(root)
        assert {n: " ".join(t.split()) for n, t in triggers.items()} == catalog.TRIGGERS
        assert versions == {"fake/20260101T000000Z-aaaaaaaa": before[2], "fake/20260102T000000Z-bbbbbbbb": before[2]}
        assert generation == before[2]  # no rebuild: the same rows, the same generation
    assert ids(root) == ids_before


# ------------------------------------------------------------------------------------------ runs never vanish
@pytest.mark.parametrize("settle_first", [True, False])
@pytest.mark.parametrize("wait_s", [0.0, 2.5])
def test_a_deleted_run_parquet_is_unreadable_at_every_timing(tmp_path: Path, settle_first: bool,
                                                             wait_s: float) -> None:
    """Deleting run.parquet moves its directory's mtime: a listing within the catalog's racy window once forgot
    the run for good (its parent container never changes). At once, later, and after a listing in between, it
    is listed `unreadable` in `runs` and in `sql`."""
    root = tmp_path / "runs"
    run = make_run(root, "fake/20260101T000000Z-aaaaaaaa", checks=(True,))
    (run / "summary.md").write_text("# a run\n")
    if settle_first:
        age(root)
    assert ids(root) == {run.name}
    (run / "run.parquet").unlink()
    for _ in range(2):  # right away (inside RACY_S), then again after wait_s
        listed = notebook.run_index(root)
        assert list(listed["run_id"]) == [run.name] and list(listed["status"]) == ["unreadable"]
        time.sleep(wait_s)
    from tfmoe.harness.reading import sql

    result = sql.query(root, "SELECT run_id, status FROM runs")
    assert result.rows == [(run.name, "unreadable")]


def test_a_symlinked_run_directory_is_followed_by_runs_sql_and_show(tmp_path: Path, capsys,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tfmoe.harness.reading import sql

    root = tmp_path / "runs"
    kept = make_run(root, "fake/20260101T000000Z-aaaaaaaa")
    moved = make_run(tmp_path / "other-disk", "fake/20260101T000001Z-bbbbbbbb", status="failed")
    (root / "fake" / moved.name).symlink_to(moved, target_is_directory=True)
    (root / "fake" / "dangling").symlink_to(tmp_path / "nowhere", target_is_directory=True)
    (root / "fake" / "loop").symlink_to(root, target_is_directory=True)
    assert ids(root) == {kept.name, moved.name}
    assert "loop" in capsys.readouterr().err  # the loop is named, once, not followed
    assert sorted(sql.query(root, "SELECT run_id, status FROM runs").rows) == [(kept.name, "ok"),
                                                                             (moved.name, "failed")]
    assert notebook.resolve_run(moved.name, root).resolve() == moved.resolve()
    monkeypatch.setattr(catalog, "RACY_S", 0.0)  # the directories settled
    ids(root)
    capsys.readouterr()
    ids(root)
    assert "loop" not in capsys.readouterr().err  # a settled catalog does not list the directory again


def test_a_symlinked_experiment_directory_is_followed(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    moved = make_run(tmp_path / "big-disk", "fake/20260101T000001Z-bbbbbbbb")
    (root / "fake").symlink_to(moved.parent, target_is_directory=True)
    assert ids(root) == {moved.name}
