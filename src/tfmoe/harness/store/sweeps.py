"""A sweep directory: its jobs (from multirun.yaml), sweep.parquet (every job's metrics with its overrides as
columns and its state) and the experiment's sweep plots.

``sweep.parquet`` is written at the end of a multirun (hydra_callbacks), when a sweep ends badly (launch), and by
``tfmoe sweep-complete DIR`` for a sweep whose launching process died: every job of the sweep (enumerated from its
multirun.yaml) gets rows, with the state it is in (``ok``..., ``lost``, ``running`` or ``not_started``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfmoe.contract.status import Status

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger("tfmoe")


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
        listed = OmegaConf.select(cfg, "hydra.overrides.task", default=None) if OmegaConf.is_dict(cfg) else None
        if listed is None:  # empty or cut short (a write the disk refused): its jobs are unknown, never guessed
            return None
        task = [str(o) for o in listed]
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

    from tfmoe.harness.store.notebook import read_run_row, read_run_state
    from tfmoe.harness.store.rundir import RUN_FILE, TABLE_FILES, read_parquet

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
        run = read_run_state(job_dir)  # the state columns only: this loop reads every job of the sweep
        mfile = job_dir / TABLE_FILES["metrics"]
        metrics = read_parquet(mfile) if mfile.exists() else pd.DataFrame()
        if metrics.empty:
            metrics = pd.DataFrame({"name": [None], "value": [float("nan")]})
        ofile = job_dir / ".hydra" / "overrides.yaml"
        _override_columns(metrics, yaml.load(ofile.read_text(), Loader=SAFE_LOADER) if ofile.exists()
                          else list(read_run_row(job_dir)["overrides"]))
        metrics.insert(0, "job", name)
        metrics.insert(1, "run_id", run["run_id"])
        metrics.insert(2, "status", run["status"])
        metrics.insert(3, "error", run.get("error") if run["status"] != Status.LOST else
                       f"lost: its process (pid {run.get('pid')} on {run.get('hostname')}) died without a word")
        frames.append(metrics)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()



def has_unstarted_jobs(sweep_dir: Path) -> bool:
    import pandas as pd

    path = Path(sweep_dir) / "sweep.parquet"
    return path.exists() and bool((pd.read_parquet(path, columns=["status"])["status"] == Status.NOT_STARTED).any())



def sweep_experiment(sweep_dir: Path) -> str:
    """The experiment of a sweep directory (from its multirun.yaml)."""
    from omegaconf import OmegaConf

    from tfmoe.contract.errors import BadInput

    try:
        return str(OmegaConf.load(sweep_dir / "multirun.yaml").experiment)
    except Exception:
        raise BadInput(f"{sweep_dir} is not a tfmoe sweep directory (no readable multirun.yaml): pass a "
                       "runs/<experiment>/multirun-<...> directory") from None



def write_sweep_outputs(sweep_dir: Path, experiment: str) -> None:
    """sweep.parquet (+ the experiment's ``sweep_plots(df)`` PNGs) for a finished sweep directory."""
    df = write_sweep_table(sweep_dir)
    if df is not None:
        write_sweep_plots(sweep_dir, experiment, df)


def write_sweep_table(sweep_dir: Path) -> pd.DataFrame | None:
    """sweep.parquet of a sweep directory; its rows (None when no job has a run.parquet yet)."""
    from tfmoe.harness.store.rundir import write_parquet

    df = collect_sweep(sweep_dir)
    if df.empty:
        return None
    write_parquet(df, sweep_dir / "sweep.parquet")
    return df


def write_sweep_plots(sweep_dir: Path, experiment: str, df: pd.DataFrame) -> None:
    """The experiment's ``sweep_plots(df)`` PNGs in the sweep directory (a plot that raises is logged, not raised;
    a file system that refuses the PNG raises)."""
    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.harness.store.rundir import atomic_replace

    plots = EXPERIMENTS[experiment].sweep_plots()
    if plots is None:
        return
    try:
        figures = plots(df)
    except Exception as exc:  # a plot must not lose the sweep's data
        log.error("sweep_plots failed: %s", exc)
        return
    for name, fig in figures.items():
        atomic_replace(sweep_dir / f"{name}.png", lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=110))
