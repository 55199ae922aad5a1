"""The notebook at 10,000 runs (issue 16). Makes a few real runs (shift-labels: single runs, a 3-job sweep, a bad-input
run), copies them into a runs root of 10 and one of 10,000 run directories (copies get their own run ids; big files
are hard links), then times the notebook commands in both. Targets: each command at 10,000 runs within 2x its time at
10 runs; the first listing after 10,000 runs arrive (the catalog indexing them) <= 120 s; a `tfmoe sql` join over
10,000 runs <= 10 s. Prints the figures and the ratios. Usage: python benchmarks/bench_catalog.py [N]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tfmoe.harness.store.catalog import CATALOG_FILE

TFMOE = str(Path(sys.executable).with_name("tfmoe"))
SQL_JOIN = ("SELECT r.experiment, r.status, count(DISTINCT r.run_id) AS runs, avg(m.value) AS mean_loss, "
            "sum(r.checks_passed) AS checks_ok FROM runs r JOIN metrics m USING (run_id) "
            "WHERE m.name = 'loss' GROUP BY ALL ORDER BY runs DESC")


def tfmoe(args: list[str], cwd: Path, check: bool = True) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([TFMOE, *args], cwd=cwd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "160"})
    took = time.perf_counter() - t0
    if check and r.returncode not in (0, 1):
        raise SystemExit(f"tfmoe {' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}")
    return took


def seed_runs(work: Path) -> dict[str, Path]:
    """Real runs to copy from: a single ok run, a 3-job sweep, and a run whose expectation missed (`unexpected`;
    bad input is refused before a run directory exists, so it leaves no run to copy)."""
    tfmoe(["shift-labels"], work)
    tfmoe(["shift-labels", "-m", "seed=1,2,3"], work)
    tfmoe(["shift-labels", "--expect", "loss < 0"], work, check=False)
    runs = work / "runs" / "shift-labels"
    singles = sorted(p for p in runs.iterdir() if p.is_dir() and not p.name.startswith("multirun-"))
    status = {p: pd.read_parquet(p / "run.parquet").iloc[0]["status"] for p in singles}
    sweep = next(runs.glob("multirun-*"))
    return {"ok": next(p for p in singles if status[p] == "ok"),
            "error": next(p for p in singles if status[p] != "ok"),
            "job0": sweep / "0", "job1": sweep / "1"}


_SOURCE_ROWS: dict[Path, pa.Table] = {}


def copy_run(src: Path, dst: Path, run_id: str, sweep_dir: Path | None, offset_s: float) -> None:
    """A copy of run ``src`` under its own id (files hard-linked, run.parquet rewritten)."""
    shutil.copytree(src, dst, copy_function=os.link, ignore=shutil.ignore_patterns("run.parquet"))
    if src not in _SOURCE_ROWS:
        _SOURCE_ROWS[src] = pq.read_table(src / "run.parquet")
    row = _SOURCE_ROWS[src]
    for col, value in (("run_id", run_id), ("sweep_dir", str(sweep_dir) if sweep_dir else None)):
        row = row.set_column(row.schema.get_field_index(col), col, pa.array([value], pa.string()))
    for col in ("started_at", "finished_at"):
        shifted = pc.subtract(row.column(col), pa.scalar(pd.Timedelta(seconds=offset_s), pa.duration("us")))
        row = row.set_column(row.schema.get_field_index(col), col, shifted.cast(row.schema.field(col).type))
    pq.write_table(row, dst / "run.parquet")


def build_root(root: Path, seeds: dict[str, Path], n: int) -> None:
    """``n`` run directories: the seed runs themselves, then copies (70 % single runs, 30 % sweeps of 10 jobs)."""
    exp = root / "shift-labels"
    exp.mkdir(parents=True)
    for key in ("ok", "error"):
        shutil.copytree(seeds[key], exp / seeds[key].name, copy_function=os.link)
    sweep = exp / seeds["job0"].parent.name
    for key in ("job0", "job1"):
        shutil.copytree(seeds[key], sweep / seeds[key].name, copy_function=os.link)
    made, i = 4, 0
    sources = [seeds["ok"], seeds["job0"], seeds["job1"], seeds["error"]]
    while made < n:
        stamp = f"2026{(i // 86400) % 12 + 1:02d}{(i // 3600) % 28 + 1:02d}T{(i // 60) % 24:02d}{i % 60:02d}00Z"
        if i % 10 < 7 or n - made < 10:
            name = f"{stamp}-{uuid.uuid4().hex[:8]}"
            copy_run(sources[i % len(sources)], exp / name, name, None, 10 * (n - made))
            made += 1
        else:
            sweep_name = f"multirun-{stamp}-{uuid.uuid4().hex[:8]}"
            for job in range(10):
                copy_run(sources[job % 3], exp / sweep_name / str(job),
                         f"{sweep_name.removeprefix('multirun-')}-{job}", exp / sweep_name, 10 * (n - made))
                made += 1
        i += 1


def paired_times(args: list[str], small: Path, big: Path, repeats: int = 5) -> tuple[float, float]:
    """Median wall of ``tfmoe ARGS`` in the small and the big root, interleaved so machine load hits both alike."""
    tfmoe(args, small)
    tfmoe(args, big)  # warm: the catalog is synced, files are in the page cache
    ts, tb = [], []
    for _ in range(repeats):
        ts.append(tfmoe(args, small))
        tb.append(tfmoe(args, big))
    return statistics.median(ts), statistics.median(tb)


def main(n: int = 10_000) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-catalog-"))
    try:
        seeds = seed_runs(work)
        small, big = work / "small", work / "big"
        t0 = time.perf_counter()
        build_root(small / "runs", seeds, 10)
        build_root(big / "runs", seeds, n)
        print(f"built runs roots of 10 and {n} run directories in {time.perf_counter() - t0:.1f} s")
        first = tfmoe(["runs", "--last", "5"], big)
        print(f"first listing after {n} runs arrived (catalog indexes them): {first:.1f} s  (target 120 s; "
              f"ratio {first / 120:.2f}x of target)")
        ok, err, a, b = (seeds[k].name for k in ("ok", "error", "job0", "job1"))
        a = f"{seeds['job0'].parent.name.removeprefix('multirun-')}-{a}"
        b = f"{seeds['job1'].parent.name.removeprefix('multirun-')}-{b}"
        commands = {
            "runs --last 5": ["runs", "--last", "5"],
            "runs --experiment X --status ok --last 5": ["runs", "--experiment", "shift-labels", "--status", "ok",
                                                        "--last", "5"],
            "show ID": ["show", ok],
            "show PREFIX": ["show", ok[:-2]],
            "show latest": ["show", "latest"],
            "diff A B": ["diff", a, b],
            "failures add ID": ["failures", "add", err, "--again", "--file", "failures-bench.md"],
            "sql join": ["sql", SQL_JOIN],
        }
        print(f"{'command':44s} {'10 runs':>9s} {f'{n} runs':>11s} {'ratio':>7s}  (target <= 2x)")
        for label, args in commands.items():
            ts, tb = paired_times(args, small, big)
            print(f"{label:44s} {ts:8.2f}s {tb:10.2f}s {tb / ts:6.2f}x")
        ts, tb = paired_times(["replay", ok], small, big, 1)
        print(f"{'replay ID (reruns the experiment)':44s} {ts:8.2f}s {tb:10.2f}s {tb / ts:6.2f}x")
        # a run rsync'ed in, then a listing: found without a manual step
        copy_run(seeds["ok"], big / "runs" / "shift-labels" / "20991231T000000Z-0000beef", "20991231T000000Z-0000beef",
                 None, 0)
        t = tfmoe(["show", "20991231T000000Z-0000beef"], big)
        print(f"show of a run copied in after the catalog was built: {t:.2f} s")
        # that run started with the seed runs, before the sweep's: the kept views are rebuilt, not extended
        first = tfmoe(["sql", SQL_JOIN], big)
        print(f"first sql join after a run older than others arrived (views rebuilt): {first:.2f} s")
        sql_t = statistics.median(tfmoe(["sql", SQL_JOIN], big) for _ in range(3))
        print(f"sql join over {n} runs (runs x metrics): {sql_t:.2f} s  (target 10 s; ratio {sql_t / 10:.2f}x of target)")
        # a run that started after all the others, as a run just made does: the kept views are extended
        extended = []
        for k in range(3):
            copy_run(seeds["ok"], big / "runs" / "shift-labels" / f"20991231T00000{k}Z-0000cafe",
                     f"20991231T00000{k}Z-0000cafe", None, -3600 * (k + 1))
            extended.append(tfmoe(["sql", SQL_JOIN], big))
        print(f"first sql join after a new run arrived (views extended): {statistics.median(extended):.2f} s "
              f"(median of 3 new runs, each query the first after its run)")
        # a run seen running by a query, then ended: the runs view's last row is replaced, metrics extended
        ended = []
        for k in range(3):
            run = big / "runs" / "shift-labels" / f"20991231T00001{k}Z-0000dead"
            copy_run(seeds["ok"], run, run.name, None, -3600 * (k + 10))
            finished = pq.read_table(run / "run.parquet")
            status = finished.schema.get_field_index("status")
            pq.write_table(finished.set_column(status, "status", pa.array(["running"], pa.string())),
                           run / "run.parquet")
            tfmoe(["sql", SQL_JOIN], big)
            pq.write_table(finished, run / "run.parquet")
            ended.append(tfmoe(["sql", SQL_JOIN], big))
        print(f"first sql join after a run seen running ended (views extended): {statistics.median(ended):.2f} s "
              f"(median of 3)")
        print(f"catalog file: {(big / 'runs' / CATALOG_FILE).stat().st_size / 1e6:.1f} MB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
