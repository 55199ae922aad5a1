"""A tiny experiment for testing the notebook core's promises (statuses, exit codes, crash/interrupt safety).

``mode`` picks the behaviour: ok | fail_check | crash | interrupt | bad_input | sigterm | sigusr2 | exit |
not_applicable.
It keeps the experiment contract (registry.ExperimentModule) like every real experiment. ``bad_input`` is refused
in run(), as a problem only the run can find (a missing file, an unimportable module) would be.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.rules.validate import require_int

MODES = ("ok", "fail_check", "crash", "interrupt", "bad_input", "sigterm", "sigusr2", "exit", "not_applicable")


@dataclass(frozen=True)
class Settings:
    mode: str
    steps: int
    plugin: str | None  # plugin=module:Name: a user's module, imported the way attn-check imports impl=
    coef: float | None = None  # set: a `scaled_loss` metric, scaled by it as a loss coefficient scales a loss


def settings(cfg: DictConfig) -> Settings:
    if cfg.mode not in MODES:
        raise BadInput(f"mode={cfg.mode!r} is not a fake-experiment mode: pass one of {', '.join(MODES)}")
    return Settings(mode=str(cfg.mode), steps=require_int(cfg, "steps"), plugin=cfg.get("plugin") or None,
                    coef=None if cfg.get("coef") is None else float(cfg.coef))


def run(s: Settings, rec: Recorder) -> None:
    if s.plugin:
        from tfmoe.rules.user_code import load_object

        load_object(s.plugin, "plugin")
    x = torch.randn(3, 4, dtype=rec.dtype, device=rec.device)  # seeded by the runner
    rec.tensor("x", x)
    for step in range(s.steps):
        rec.metric("loss", float(x.double().abs().mean()) / (step + 1), step=step, variant="a")
        if s.coef is not None:
            rec.metric("scaled_loss", s.coef * float(x.double().abs().mean()) / (step + 1), step=step, variant="a")
        if s.mode == "interrupt" and step == 2:
            raise KeyboardInterrupt
        if s.mode == "crash" and step == 2:
            raise RuntimeError("planted crash")
        if s.mode in ("sigterm", "sigusr2") and step == 2:  # a real signal to this process, as kill/SLURM send
            os.kill(os.getpid(), getattr(signal, s.mode.upper()))
        if s.mode == "exit" and step == 2:  # a library calling sys.exit inside the run
            sys.exit(5)
    if s.mode == "bad_input":
        raise BadInput("mode=bad_input was asked for: pick another mode")
    if s.mode == "not_applicable":  # a check this "layer" cannot be judged on (Recorder.not_applicable)
        rec.not_applicable("needs_a_feature", "not applicable: the layer declares it lacks the feature")
    rec.check("always_true_for_ok", s.mode != "fail_check", 1.0, 0.0, "planted failure when mode=fail_check",
              evidence={"x": x})
    wall_ms = rec.time("sum", lambda: x.sum(), repeats=3)
    rec.metric("sums_per_call", 1e3 / max(wall_ms, 1e-6), measured=True)  # a machine measurement: varies
