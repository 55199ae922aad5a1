"""Hydra callbacks: a rich progress bar over a sweep's jobs, the sweep's faster composition (sweep_speed.py), and
``sweep.parquet`` at the end of a multirun (written by :mod:`tfmoe.harness.store.sweeps`).

``sweep.parquet`` is also written when a sweep ends badly (a job killed, a launcher error, Ctrl-C/SIGTERM in the
launching process: see launch.run_experiment, which calls :func:`complete_unfinished_sweeps`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from tfmoe.harness.store.sweeps import sweep_size, write_sweep_plots, write_sweep_table

log = logging.getLogger("tfmoe")

# Sweeps this process started (on_multirun_start) and the experiment of each: the ones that never reached
# on_multirun_end are completed by launch.run_experiment.
STARTED_SWEEPS: dict[Path, str] = {}
# The progress bar lives at module level: launchers pickle the callback objects to send jobs to workers,
# and a rich Progress (locks, threads) cannot be pickled.
_PROGRESS: dict[str, Any] = {}
# Sweeps whose sweep.parquet the file system refused (full disk, read-only): launch exits 2 for them.
UNWRITTEN_SWEEPS: list[Path] = []


def _write_or_say(sweep_dir: Path, experiment: str) -> bool:
    """sweep.parquet, then the sweep plots; a full disk or read-only file system is one line on stderr naming what
    was not written (and UNWRITTEN_SWEEPS), not a traceback through Hydra."""
    import sys

    from tfmoe.contract.errors import disk_problem

    table_written = False
    try:
        df = write_sweep_table(sweep_dir)
        table_written = True
        if df is not None:
            write_sweep_plots(sweep_dir, experiment, df)
    except Exception as exc:
        said = disk_problem(exc, sweep_dir if table_written else sweep_dir / "sweep.parquet")
        if said is None:
            raise
        what = "sweep.parquet written, its plots not" if table_written else "sweep.parquet not written"
        print(f"error: {said} ({what}: `tfmoe sweep-complete {sweep_dir}` writes {'them' if table_written else 'it'} "
              "later)", file=sys.stderr)
        UNWRITTEN_SWEEPS.append(sweep_dir)
        return False
    return True


class SweepCallback(Callback):
    """Progress over the jobs of a multirun; at the end writes sweep.parquet and the experiment's sweep plots."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        STARTED_SWEEPS[Path(str(config.hydra.sweep.dir))] = str(config.experiment)

        total = sweep_size(list(config.hydra.overrides.task))
        progress = Progress(TextColumn(f"sweep {config.experiment}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), transient=False)
        _PROGRESS["bar"], _PROGRESS["task"] = progress, progress.add_task("jobs", total=total)
        progress.start()
        from hydra.core.global_hydra import GlobalHydra

        from tfmoe.harness.launching.sweep_speed import faster_composition, faster_job_records

        undo = [faster_job_records()]
        if GlobalHydra.instance().is_initialized():  # derive jobs' configs, parse each YAML file once
            undo.append(faster_composition(GlobalHydra.instance().config_loader()))
        _PROGRESS["undo"] = lambda: [u() for u in undo]

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if "bar" in _PROGRESS:  # only in the launching process (basic launcher); workers have none
            _PROGRESS["bar"].advance(_PROGRESS["task"])
        # Hydra's launchers keep every JobReturn until the sweep ends, and nothing reads its configs after the job
        # (the sweepers read return_value): ~1,500 objects a job that a 1,000-job sweep would carry to its end
        job_return.cfg = job_return.hydra_cfg = None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        stop_progress(finished=True)
        sweep_dir = Path(str(config.hydra.sweep.dir))
        STARTED_SWEEPS.pop(sweep_dir, None)
        _write_or_say(sweep_dir, config.experiment)


def stop_progress(finished: bool) -> None:
    if "undo" in _PROGRESS:  # the sweep's faster composition (sweep_speed.py) ends with it
        _PROGRESS.pop("undo")()
    if "bar" in _PROGRESS:
        bar, task = _PROGRESS.pop("bar"), _PROGRESS.pop("task")
        if finished and bar.tasks[0].total is not None:  # jobs that ran in worker processes did not advance it
            bar.update(task, completed=bar.tasks[0].total)
        bar.stop()


def complete_unfinished_sweeps() -> list[Path]:
    """sweep.parquet for every sweep this process started that did not reach its end (a job killed, a launcher
    error, an interrupt): the jobs that finished and the state of the others. Returns those sweep dirs."""
    stop_progress(finished=False)
    done = []
    for sweep_dir, experiment in list(STARTED_SWEEPS.items()):
        STARTED_SWEEPS.pop(sweep_dir)
        try:
            if not _write_or_say(sweep_dir, experiment):
                continue
        except Exception as exc:  # completing must never hide why the sweep stopped
            log.error("could not complete %s/sweep.parquet: %s: %s", sweep_dir, type(exc).__name__, exc)
            continue
        done.append(sweep_dir)
    return done


