"""The experiment-side half of the lab notebook: an in-memory recorder.

An experiment is ``run(cfg, rec)``: it computes and calls ``rec.metric/check/tensor/timing/plot/...``.
It never touches the disk; :mod:`tfmoe.harness.store.notebook` writes what the recorder holds (also after a crash
or Ctrl-C, so the steps done so far stay readable).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console


@dataclass
class CheckRow:
    check: str
    passed: bool
    observed: float | None
    threshold: float | None
    detail: str
    applicable: bool = True  # False: the check could not be judged here (a declared lack, a NotImplementedError)

    @property
    def outcome(self) -> str:
        """passed | failed | n/a"""
        return "n/a" if not self.applicable else ("passed" if self.passed else "failed")


@dataclass
class Recorder:
    """Collects one run's records. Attributes set by the runner before ``run`` is called."""

    cfg: Any
    device: torch.device
    dtype: torch.dtype
    seed: int
    console: Console = field(default_factory=lambda: Console(stderr=False))
    metrics_rows: list[dict[str, Any]] = field(default_factory=list)
    checks_rows: list[CheckRow] = field(default_factory=list)
    tensors_saved: dict[str, torch.Tensor] = field(default_factory=dict)
    timings_rows: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)  # name -> matplotlib Figure
    summary_parts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # facts the run wants in run.parquet/summary
    # False where no figure is kept (tfmoe.api.checking without record=): a recipe may skip drawing them
    wants_plots: bool = True

    # ----------------------------------------------------------------- metrics
    def metric(self, name: str, value: float, step: int | None = None, measured: bool = False, **tags: Any) -> None:
        """One long-format metrics row: ``name``, ``value`` (float64), optional ``step``, tag columns.

        ``measured=True`` marks a measurement of this machine (a time, a throughput, a memory peak): ``tfmoe diff``
        and ``tfmoe replay`` report it but, like timings, do not count it as a difference."""
        if isinstance(value, torch.Tensor):
            value = value.detach().double().item()
        row: dict[str, Any] = {"name": name, "value": float(value)}
        if step is not None:
            row["step"] = int(step)
        if measured:
            row["measured"] = True
        row.update(tags)
        self.metrics_rows.append(row)

    # ------------------------------------------------------------------ checks
    def check(
        self,
        name: str,
        passed: bool,
        observed: float | None = None,
        threshold: float | None = None,
        detail: str = "",
        evidence: dict[str, torch.Tensor] | None = None,
    ) -> bool:
        """Record one assertion. A NaN ``observed`` never passes a ``<=`` style check: callers should
        compute ``passed`` with NaN-safe comparisons (see :func:`within`). On failure, ``evidence``
        tensors are saved as ``failing.<check>.<name>`` so ``tfmoe failures add`` can point at them."""
        if isinstance(observed, torch.Tensor):
            observed = observed.detach().double().item()
        if isinstance(threshold, torch.Tensor):
            threshold = threshold.detach().double().item()
        passed = bool(passed)
        self.checks_rows.append(
            CheckRow(name, passed, None if observed is None else float(observed),
                     None if threshold is None else float(threshold), detail)
        )
        if not passed and evidence:
            for key, t in evidence.items():
                self.tensor(f"failing.{name}.{key}", t)
        return passed

    def not_applicable(self, name: str, detail: str) -> None:
        """Record a check that is not applicable to this layer (tfmoe.rules.capabilities): listed with ``detail``
        ("not applicable: ..."), never counted as a failure."""
        self.checks_rows.append(CheckRow(name, True, None, None, detail, applicable=False))

    def check_le(self, name: str, observed: float, threshold: float, detail: str = "",
                 evidence: dict[str, torch.Tensor] | None = None) -> bool:
        """Check ``observed <= threshold`` (NaN/inf observed fails)."""
        obs = float(observed)
        return self.check(name, within(obs, threshold), obs, threshold, detail, evidence)

    @property
    def all_passed(self) -> bool:
        return all(c.passed for c in self.checks_rows)

    # ----------------------------------------------------------------- tensors
    def tensor(self, name: str, t: torch.Tensor) -> None:
        """Save a tensor (a detached CPU copy). Large ones are summarised by the notebook layer."""
        self.tensors_saved[name] = t.detach().to("cpu").clone()

    # ----------------------------------------------------------------- timings
    def timing(self, stage: str, wall_ms: float, device_ms: float | None = None, repeats: int = 1,
               peak_device_mem_bytes: int | None = None, **tags: Any) -> None:
        row = {"stage": stage, "wall_ms": float(wall_ms),
               "device_ms": None if device_ms is None else float(device_ms),
               "repeats": int(repeats),
               "peak_device_mem_bytes": None if peak_device_mem_bytes is None else int(peak_device_mem_bytes)}
        row.update(tags)
        self.timings_rows.append(row)

    def time(self, stage: str, fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
             **tags: Any) -> float:
        """Time ``fn`` (median over ``repeats`` after ``warmup``); CUDA events and peak memory on CUDA.
        Records a timings row and returns the median wall time in ms."""
        wall_ms, device_ms, peak = measure(fn, self.device, repeats=repeats, warmup=warmup)
        self.timing(stage, wall_ms, device_ms, repeats, peak, **tags)
        return wall_ms

    @contextlib.contextmanager
    def stage(self, stage: str, **tags: Any) -> Iterator[None]:
        """Time one phase of the run (once, wall clock) as a timings row, also when it raises."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timing(stage, (time.perf_counter() - t0) * 1e3, **tags)

    # ------------------------------------------------------------ plots & text
    def plot(self, name: str, fig: Any) -> None:
        """Keep a matplotlib figure; written as ``<name>.png`` by the notebook layer."""
        self.figures[name] = fig

    def summary(self, markdown: str) -> None:
        """Append a paragraph to the run's human ``summary.md``."""
        self.summary_parts.append(markdown.rstrip() + "\n")

    def note(self, text: str) -> None:
        """A one-line fact about how the run was done (shown by ``tfmoe show`` and in summary.md)."""
        self.notes.append(text)

    def print(self, *objects: Any) -> None:
        """Print a rich renderable (table, text) to the terminal."""
        self.console.print(*objects)

    def progress(self, iterable: Iterable[Any], total: int | None = None, description: str = "") -> Iterable[Any]:
        """A rich progress bar over ``iterable`` (plain iteration when not on a terminal)."""
        from rich.progress import track

        if not self.console.is_terminal:
            return iterable
        return track(iterable, total=total, description=description, console=self.console, transient=True)


_DEVICE_PEAK_SEEN: dict[str, int] = {}


def reset_device_peak(device: torch.device) -> None:
    """``torch.cuda.reset_peak_memory_stats`` that first remembers the peak so far, so the run's
    ``peak_device_mem_bytes`` (see :func:`device_peak`) still covers the whole run."""
    if device.type == "cuda":
        key = str(device)
        _DEVICE_PEAK_SEEN[key] = max(_DEVICE_PEAK_SEEN.get(key, 0), int(torch.cuda.max_memory_allocated(device)))
        torch.cuda.reset_peak_memory_stats(device)


def device_peak(device: torch.device) -> int | None:
    """The highest CUDA memory allocated since the run started (across any resets); None on CPU."""
    if device.type != "cuda":
        return None
    return max(_DEVICE_PEAK_SEEN.get(str(device), 0), int(torch.cuda.max_memory_allocated(device)))


def forget_device_peak() -> None:
    _DEVICE_PEAK_SEEN.clear()


def within(observed: float, threshold: float) -> bool:
    """``observed <= threshold``, with NaN and inf never within."""
    return math.isfinite(observed) and observed <= threshold


def measure(fn: Callable[[], Any], device: torch.device, repeats: int = 5,
            warmup: int = 1) -> tuple[float, float | None, int | None]:
    """Median wall time (ms), median CUDA-event time (ms, None on CPU) and peak CUDA memory of ``fn``."""
    is_cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    if is_cuda:
        torch.cuda.synchronize(device)
        reset_device_peak(device)
    walls: list[float] = []
    devs: list[float] = []
    for _ in range(max(1, repeats)):
        if is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        if is_cuda:
            end.record()
            torch.cuda.synchronize(device)
            devs.append(start.elapsed_time(end))
        walls.append((time.perf_counter() - t0) * 1e3)
    peak = int(torch.cuda.max_memory_allocated(device)) if is_cuda else None
    return statistics.median(walls), (statistics.median(devs) if devs else None), peak
