"""hydra/launcher=ray: a sweep on a local Ray instance started for it (the `ray` extra, installed by make test)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.api.testing import run_cli
from tfmoe.harness.store import notebook


def test_ray_launcher_runs_a_sweep_on_a_local_ray(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="the `ray` extra: pip install -e '.[ray]'")
    proc = subprocess.run([sys.executable, "-m", "tfmoe.cli", "shift-labels", "-m", "pad_side=left,right",
                           "hydra/launcher=ray", "+hydra.launcher.ray.init.include_dashboard=false"],  # faster start
                          cwd=tmp_path, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "COLUMNS": "200", "RAY_USAGE_STATS_ENABLED": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Started a local Ray instance" in proc.stderr + proc.stdout
    (sweep,) = (tmp_path / "runs" / "shift-labels").glob("multirun-*")
    df = pd.read_parquet(sweep / "sweep.parquet")
    assert sorted(set(df["pad_side"])) == ["left", "right"] and (df["status"] == "ok").all()
    for job in ("0", "1"):
        run = notebook.load_run(sweep / job).run
        assert run["status"] == "ok" and run["sweep_dir"]  # ran in a Ray worker process
    loss = df[df["name"] == "loss"].set_index("pad_side")["value"]
    assert loss["left"] == pytest.approx(loss["right"], rel=1e-6)  # the padding side does not change the loss


def test_ray_launcher_without_the_extra_is_bad_input(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "hydra_plugins.hydra_ray_launcher" else real(name, *a))
    r = run_cli(["shift-labels", "-m", "seed=0,1", "hydra/launcher=ray"], workdir)
    assert r.exit_code == 2 and "pip install -e '.[ray]'" in r.stderr and r.run_dir is None
