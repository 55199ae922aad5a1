"""An instant notebook (issue 23): each notebook command's wall time as a multiple of `tfmoe --help`, timed in the
same run, paired A/B (each sample of a command is taken right after a sample of `--help`, so machine load hits both
alike), at 10 runs and at 10,000 runs. Runs roots are made the way bench_catalog.py makes them (a few real
shift-labels runs, copied under their own ids). Prints the medians, the ratio beside its target, and the load
average (os.getloadavg) before and after, since a loaded machine moves the figures, and whether Python caches
bytecode (with PYTHONDONTWRITEBYTECODE set, each command compiles every tfmoe module it imports at each start, as
--help compiles fewer). Usage:
python benchmarks/bench_notebook_startup.py [N] [REPEATS]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_catalog import build_root, seed_runs, tfmoe  # noqa: E402 (the benchmarks folder is not a package)

TARGETS = {  # command label -> (arguments, with {ok}/{err}/{a}/{b} run ids filled in; target ratio to --help)
    "runs --last 5": (["runs", "--last", "5"], 3.0),
    "runs -e X --status ok --last 5": (["runs", "--experiment", "shift-labels", "--status", "ok", "--last", "5"], 3.0),
    "runs --last 5 --format json": (["runs", "--last", "5", "--format", "json"], 3.0),
    "show ID": (["show", "{ok}"], 5.0),
    "sql (one table)": (["sql", "SELECT run_id, status, wall_s FROM runs WHERE status = 'ok' LIMIT 5"], 6.0),
    "sql (metrics)": (["sql", "SELECT name, avg(value) AS mean FROM metrics GROUP BY name ORDER BY name LIMIT 5"],
                      6.0),
    "diff A B": (["diff", "{a}", "{b}"], 9.0),
    "failures add ID": (["failures", "add", "{err}", "--again", "--file", "failures-bench.md"], 6.0),
}


def paired(args: list[str], cwd: Path, repeats: int) -> tuple[float, float]:
    """Median wall of `tfmoe --help` and of `tfmoe ARGS`, sampled in alternation (after one warm-up of each)."""
    tfmoe(["--help"], cwd)
    tfmoe(args, cwd)
    helps, cmds = [], []
    for _ in range(repeats):
        helps.append(tfmoe(["--help"], cwd))
        cmds.append(tfmoe(args, cwd))
    return statistics.median(helps), statistics.median(cmds)


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def main(n: int = 10_000, repeats: int = 7) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    try:
        seeds = seed_runs(work)
        roots = {10: work / "small", n: work / "big"}
        for size, cwd in roots.items():
            build_root(cwd / "runs", seeds, size)
            tfmoe(["runs", "--last", "1"], cwd)  # the catalog indexes the runs once (bench_catalog times that)
        ids = {"ok": seeds["ok"].name, "err": seeds["error"].name}
        for key, job in (("a", "job0"), ("b", "job1")):
            ids[key] = f"{seeds[job].parent.name.removeprefix('multirun-')}-{seeds[job].name}"
        print(f"before: {load()}; Python's bytecode cache "
              + ("off (PYTHONDONTWRITEBYTECODE: every tfmoe module is compiled at each start)"
                 if os.environ.get("PYTHONDONTWRITEBYTECODE") else "on"))
        print(f"{'command':32s} {'target':>7s} " + " ".join(
            f"{f'{size} runs: --help / command / ratio':>40s}" for size in roots))
        worst = 0.0
        for label, (args, target) in TARGETS.items():
            args = [a.format(**ids) for a in args]
            cells = []
            for cwd in roots.values():
                h, c = paired(args, cwd, repeats)
                ratio = c / h
                worst = max(worst, ratio / target)
                cells.append(f"{h:8.3f}s {c:8.3f}s {ratio:6.2f}x {'ok' if ratio <= target else 'MISS':>4s}")
            print(f"{label:32s} {target:6.1f}x " + " ".join(f"{c:>40s}" for c in cells))
        print(f"after: {load()}")
        print(f"worst ratio / target: {worst:.2f} ({'every command within target' if worst <= 1 else 'a target missed'})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000, int(sys.argv[2]) if len(sys.argv) > 2 else 7)
    print(f"({time.perf_counter() - t0:.0f} s in all)")
