"""A tiny experiment for testing the notebook core's promises (statuses, exit codes, crash/interrupt safety).

``mode`` picks the behaviour: ok | fail_check | crash | interrupt | bad_input | sigterm | sigusr2 | exit.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from omegaconf import DictConfig

from tfmoe.errors import BadInput
from tfmoe.recorder import Recorder


def run(cfg: DictConfig, rec: Recorder) -> None:
    if cfg.get("plugin"):  # +plugin=module:Name: a user's module, imported the way attn-check imports impl=
        from tfmoe.user_code import load_object

        load_object(cfg.plugin, "plugin")
    x = torch.randn(3, 4, dtype=rec.dtype, device=rec.device)  # seeded by the runner
    rec.tensor("x", x)
    for step in range(cfg.steps):
        rec.metric("loss", float(x.double().abs().mean()) / (step + 1), step=step, variant="a")
        if cfg.mode == "interrupt" and step == 2:
            raise KeyboardInterrupt
        if cfg.mode == "crash" and step == 2:
            raise RuntimeError("planted crash")
        if cfg.mode in ("sigterm", "sigusr2") and step == 2:  # a real signal to this process, as kill/SLURM send
            os.kill(os.getpid(), getattr(signal, cfg.mode.upper()))
        if cfg.mode == "exit" and step == 2:  # a library calling sys.exit inside the run
            sys.exit(5)
    if cfg.mode == "bad_input":
        raise BadInput("mode=bad_input was asked for: pick another mode")
    rec.check("always_true_for_ok", cfg.mode != "fail_check", 1.0, 0.0, "planted failure when mode=fail_check",
              evidence={"x": x})
    wall_ms = rec.time("sum", lambda: x.sum(), repeats=3)
    rec.metric("sums_per_call", 1e3 / max(wall_ms, 1e-6), measured=True)  # a machine measurement: varies
