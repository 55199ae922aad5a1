"""Test utilities: run the CLI in-process, compose configs, make recorders like the runner does."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str
    run_dir: Path | None  # the newest run directory under cwd/runs made by this call (None if none)


def run_cli(args: list[str], cwd: Path) -> CliResult:
    """Run `tfmoe ARGS` in-process with cwd as the current directory (runs go to cwd/runs)."""
    from typer.testing import CliRunner

    from tfmoe.cli import app
    from tfmoe.harness.store.notebook import find_runs

    cwd = Path(cwd)
    before = set(find_runs(cwd / "runs"))
    old = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, args, catch_exceptions=False)
    finally:
        os.chdir(old)
    new = [p for p in find_runs(cwd / "runs") if p not in before]
    new_abs = sorted((cwd / p if not p.is_absolute() else p for p in new), key=lambda p: p.stat().st_mtime)
    return CliResult(result.exit_code, result.stdout, result.stderr, new_abs[-1] if new_abs else None)


def launched(exp, args: list[str], multirun: bool = False) -> tuple[int, list[Path]]:
    """``launch.run_experiment`` (quiet) -> (its exit code, the run directories it made: a sweep's job dirs)."""
    from tfmoe.harness.launching.launch import run_experiment

    made: list[Path] = []
    code = run_experiment(exp, list(args), multirun=multirun, quiet=True, made=made)
    return code, made


def compose(experiment: str, overrides: list[str] | None = None) -> DictConfig:
    """The experiment's config as the CLI would compose it (Hydra Compose API, no run directory)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.harness.launching import runner
    from tfmoe.harness.launching.launch import config_dir

    del runner  # imported for its resolver
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name=EXPERIMENTS[experiment].config, overrides=list(overrides or []))
    GlobalHydra.instance().clear()
    return cfg


def make_recorder(cfg: DictConfig):
    """A Recorder with device/dtype resolved and seeds set exactly as the runner does."""
    from tfmoe.contract.recorder import Recorder
    from tfmoe.contract.runtime import resolve_device, resolve_dtype, seed_everything

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    seed_everything(int(cfg.seed))
    return Recorder(cfg=cfg, device=device, dtype=dtype, seed=int(cfg.seed))


def cpu_recorder(seed: int = 0, dtype=None):
    """A bare fp32 CPU Recorder for calling check functions directly in tests."""
    import torch

    from tfmoe.contract.recorder import Recorder

    return Recorder(cfg=None, device=torch.device("cpu"), dtype=dtype or torch.float32, seed=seed)


def check_passed(rec, name: str) -> bool:
    """Whether the one check called ``name`` passed (fails the test if it was recorded 0 or 2+ times)."""
    rows = [c for c in rec.checks_rows if c.check == name]
    assert len(rows) == 1, f"check {name} recorded {len(rows)} times"
    return rows[0].passed


def run_recorded(experiment: str, overrides: list[str] | None = None):
    """compose + make_recorder + the experiment's run(); returns the Recorder (no files written)."""
    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.contract.runtime import check_threads, torch_threads
    from tfmoe.harness.launching.runner import run_module

    cfg = compose(experiment, overrides)
    rec = make_recorder(cfg)
    with torch_threads(check_threads(cfg)):
        run_module(EXPERIMENTS[experiment], cfg, rec)
    return rec


__all__ = ["CliResult", "run_cli", "launched", "compose", "make_recorder", "run_recorded", "cpu_recorder", "check_passed"]


def caught(fn, *args, **kwargs) -> BaseException:
    """The exception ``fn(*args, **kwargs)`` raises, its traceback intact (what the whose-fault rule reads);
    AssertionError if it raises nothing."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return exc
    raise AssertionError(f"{fn} did not raise")
