"""Hydra callbacks: a rich progress bar over a sweep's jobs, and ``sweep.parquet`` at the end of a multirun.

``sweep.parquet`` is also written when a sweep ends badly (a job killed, a launcher error, Ctrl-C/SIGTERM in the
launching process: see launch.run_experiment), and ``tfmoe sweep-complete DIR`` writes it for a sweep whose
launching process died: every job of the sweep (enumerated from its multirun.yaml) gets rows, with the state it
is in (``ok``..., ``lost``, ``running`` or ``not_started``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from tfmoe import runner
from tfmoe.status import Status, worst_exit_code

# Sweeps this process started (on_multirun_start) and the experiment of each: the ones that never reached
# on_multirun_end are completed by launch.run_experiment.
STARTED_SWEEPS: dict[Path, str] = {}
# The progress bar lives at module level: launchers pickle the callback objects to send jobs to workers,
# and a rich Progress (locks, threads) cannot be pickled.
_PROGRESS: dict[str, Any] = {}


def sweep_size(task_overrides: list[str]) -> int | None:
    """Number of jobs the basic sweeper makes from these overrides (None when it can't tell)."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(list(task_overrides))
        return math.prod(len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1 for o in parsed)
    except Exception:
        return None


def parse_override_value(text: str) -> Any:
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (int, float, str, bool)) or value is None else text


def sweep_jobs(sweep_dir: Path) -> list[list[str]] | None:
    """Each job's overrides, in job-number order, from the sweep's multirun.yaml (what Hydra's basic sweeper
    enumerates); None when the sweep has no readable multirun.yaml."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.load(sweep_dir / "multirun.yaml")
        task = [str(o) for o in OmegaConf.select(cfg, "hydra.overrides.task", default=[])]
        parsed = OverridesParser.create().parse_overrides(task)
        return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except Exception:
        return None


def _override_columns(frame: Any, overrides: list[str]) -> None:
    for item in overrides or []:
        key, _, value = str(item).partition("=")
        key = key.lstrip("+~")
        if key and key not in frame.columns and not key.startswith("hydra"):
            frame[key] = parse_override_value(value)


def _safe_loader() -> Any:
    """yaml.safe_load's loader, through libyaml's parser when PyYAML has it (the same result, a 1,000-job
    sweep.parquet reads 1,000 overrides.yaml files)."""
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


SAFE_LOADER = _safe_loader()


def collect_sweep(sweep_dir: Path) -> Any:
    """Every job's metrics with its overrides as columns, plus ``job``, ``run_id``, ``status`` (the derived one:
    ``lost`` for a job whose process died) and ``error``. A job without metrics, or that never started
    (``not_started``, known from multirun.yaml), still has one row, with empty ``name``/``value``."""
    import pandas as pd
    import yaml

    from tfmoe.notebook import read_run_row
    from tfmoe.rundir import RUN_FILE, TABLE_FILES, read_parquet

    frames = []
    job_dirs = {p.parent.name: p.parent for p in sweep_dir.glob(f"*/{RUN_FILE}")}
    expected = sweep_jobs(sweep_dir) or []
    names = sorted(set(job_dirs) | {str(i) for i in range(len(expected))}, key=lambda n: (len(n), n))
    for name in names:
        job_dir = job_dirs.get(name)
        if job_dir is None:  # the sweep stopped before this job began
            job = pd.DataFrame({"name": [None], "value": [float("nan")]})
            _override_columns(job, expected[int(name)] if name.isdigit() and int(name) < len(expected) else [])
            job.insert(0, "job", name)
            job.insert(1, "run_id", None)
            job.insert(2, "status", Status.NOT_STARTED.value)
            job.insert(3, "error", "the sweep stopped before this job started")
            frames.append(job)
            continue
        run = read_run_row(job_dir)
        mfile = job_dir / TABLE_FILES["metrics"]
        metrics = read_parquet(mfile) if mfile.exists() else pd.DataFrame()
        if metrics.empty:
            metrics = pd.DataFrame({"name": [None], "value": [float("nan")]})
        ofile = job_dir / ".hydra" / "overrides.yaml"
        _override_columns(metrics, yaml.load(ofile.read_text(), Loader=SAFE_LOADER) if ofile.exists()
                          else list(run["overrides"]))
        metrics.insert(0, "job", name)
        metrics.insert(1, "run_id", run["run_id"])
        metrics.insert(2, "status", run["status"])
        metrics.insert(3, "error", run.get("error") if run["status"] != Status.LOST else
                       f"lost: its process (pid {run.get('pid')} on {run.get('hostname')}) died without a word")
        frames.append(metrics)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


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

        from tfmoe.sweep_speed import faster_composition, faster_job_records

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
        write_sweep_outputs(sweep_dir, config.experiment)


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
            write_sweep_outputs(sweep_dir, experiment)
        except Exception as exc:  # completing must never hide why the sweep stopped
            runner.log.error("could not complete %s/sweep.parquet: %s: %s", sweep_dir, type(exc).__name__, exc)
            continue
        done.append(sweep_dir)
    return done


def has_unstarted_jobs(sweep_dir: Path) -> bool:
    import pandas as pd

    path = Path(sweep_dir) / "sweep.parquet"
    return path.exists() and bool((pd.read_parquet(path, columns=["status"])["status"] == Status.NOT_STARTED).any())


def complete_sweep(sweep_dir: Path) -> int:
    """`tfmoe sweep-complete DIR`: write sweep.parquet (and sweep plots) for a sweep whose launching process died,
    print its jobs, and return the exit code the sweep would have had (a job not started counts as interrupted)."""
    from tfmoe.errors import BadInput
    from tfmoe.reports import exit_code_of, print_outcome
    from tfmoe.rundir import RUN_FILE

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise BadInput(f"{sweep_dir} is not a directory: pass a sweep directory, runs/<experiment>/multirun-<...>")
    experiment = sweep_experiment(sweep_dir)
    write_sweep_outputs(sweep_dir, experiment)
    dirs = sorted((p.parent for p in sweep_dir.glob(f"*/{RUN_FILE}")), key=lambda p: (len(p.name), p.name))
    if dirs:
        print_outcome(dirs, [sweep_dir])
    else:
        from tfmoe.reports import console, sweep_problem_lines

        console.print(f"sweep: {sweep_dir}/sweep.parquet", soft_wrap=True)
        for line in sweep_problem_lines(sweep_dir):
            console.print(line, soft_wrap=True, markup=False, highlight=False)
    codes = [exit_code_of(dirs)] if dirs else []
    if has_unstarted_jobs(sweep_dir):
        codes.append(Status.NOT_STARTED.exit_code)
    return worst_exit_code(codes)


def sweep_experiment(sweep_dir: Path) -> str:
    """The experiment of a sweep directory (from its multirun.yaml)."""
    from omegaconf import OmegaConf

    from tfmoe.errors import BadInput

    try:
        return str(OmegaConf.load(sweep_dir / "multirun.yaml").experiment)
    except Exception:
        raise BadInput(f"{sweep_dir} is not a tfmoe sweep directory (no readable multirun.yaml): pass a "
                       "runs/<experiment>/multirun-<...> directory") from None


def write_sweep_outputs(sweep_dir: Path, experiment: str) -> None:
    """sweep.parquet (+ the experiment's ``sweep_plots(df)`` PNGs) for a finished sweep directory."""
    from tfmoe.registry import EXPERIMENTS
    from tfmoe.rundir import atomic_replace, write_parquet

    df = collect_sweep(sweep_dir)
    if df.empty:
        return
    write_parquet(df, sweep_dir / "sweep.parquet")
    plots = EXPERIMENTS[experiment].sweep_plots()
    if plots is None:
        return
    try:
        figures = plots(df)
    except Exception as exc:  # a plot must not lose the sweep's data
        runner.log.error("sweep_plots failed: %s", exc)
        return
    for name, fig in figures.items():
        atomic_replace(sweep_dir / f"{name}.png", lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=110))
