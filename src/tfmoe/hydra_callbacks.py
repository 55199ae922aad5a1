"""Hydra callbacks: a rich progress bar over a sweep's jobs, and ``sweep.parquet`` at the end of a multirun."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from tfmoe import runner

LAST_SWEEP_DIRS: list[Path] = []
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


def collect_sweep(sweep_dir: Path) -> Any:
    """Every job's metrics with its overrides as columns (plus ``job``, ``run_id``, ``status``)."""
    import pandas as pd
    import yaml

    from tfmoe.notebook import RUN_FILE, TABLE_FILES, read_parquet

    frames = []
    job_dirs = sorted((p.parent for p in sweep_dir.glob(f"*/{RUN_FILE}")), key=lambda p: (len(p.name), p.name))
    for job_dir in job_dirs:
        run = read_parquet(job_dir / RUN_FILE).iloc[0]
        mfile = job_dir / TABLE_FILES["metrics"]
        metrics = read_parquet(mfile) if mfile.exists() else pd.DataFrame({"name": [], "value": []})
        ofile = job_dir / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(ofile.read_text()) if ofile.exists() else list(run["overrides"])
        for item in overrides or []:
            key, _, value = str(item).partition("=")
            key = key.lstrip("+~")
            if key and key not in metrics.columns:
                metrics[key] = parse_override_value(value)
        metrics.insert(0, "job", job_dir.name)
        metrics.insert(1, "run_id", run["run_id"])
        metrics.insert(2, "status", run["status"])
        frames.append(metrics)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


class SweepCallback(Callback):
    """Progress over the jobs of a multirun; at the end writes sweep.parquet and the experiment's sweep plots."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        total = sweep_size(list(config.hydra.overrides.task))
        progress = Progress(TextColumn(f"sweep {config.experiment}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), transient=False)
        _PROGRESS["bar"], _PROGRESS["task"] = progress, progress.add_task("jobs", total=total)
        progress.start()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if "bar" in _PROGRESS:  # only in the launching process (basic launcher); workers have none
            _PROGRESS["bar"].advance(_PROGRESS["task"])

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if "bar" in _PROGRESS:
            bar, task = _PROGRESS.pop("bar"), _PROGRESS.pop("task")
            if bar.tasks[0].total is not None:  # jobs that ran in worker processes did not advance the bar
                bar.update(task, completed=bar.tasks[0].total)
            bar.stop()
        sweep_dir = Path(str(config.hydra.sweep.dir))
        LAST_SWEEP_DIRS.append(sweep_dir)
        write_sweep_outputs(sweep_dir, config.experiment)


def write_sweep_outputs(sweep_dir: Path, experiment: str) -> None:
    """sweep.parquet (+ the experiment's ``sweep_plots(df)`` PNGs) for a finished sweep directory."""
    from tfmoe.notebook import _atomic_replace, write_parquet
    from tfmoe.registry import EXPERIMENTS

    df = collect_sweep(sweep_dir)
    if df.empty:
        return
    write_parquet(df, sweep_dir / "sweep.parquet")
    module = importlib.import_module(f"tfmoe.experiments.{EXPERIMENTS[experiment].module}")
    plots = getattr(module, "sweep_plots", None)
    if plots is None:
        return
    try:
        figures = plots(df)
    except Exception as exc:  # a plot must not lose the sweep's data
        runner.log.error("sweep_plots failed: %s", exc)
        return
    for name, fig in figures.items():
        _atomic_replace(sweep_dir / f"{name}.png", lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=110))
