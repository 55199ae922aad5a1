"""Measured memory, shared by the experiments: peak bytes of a call, and what the device has free."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tfmoe.recorder import reset_device_peak


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence C-level stderr for the duration (kineto prints 'profiler_start/stop' lines)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_memory_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before it.

    CUDA: ``max_memory_allocated`` after a reset (the run-wide peak is kept, see ``reset_device_peak``).
    CPU: ``torch.profiler(profile_memory=True)`` records every allocation and free of PyTorch's CPU allocator
    (op outputs and kernels' scratch buffers) as its own timestamped event; the peak is the maximum of their
    running sum in time order.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        reset_device_peak(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():
        prof.start()
    try:
        fn()
    finally:
        with quiet_stderr():
            prof.stop()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return int(peak)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device``: CUDA's free bytes, or the host's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)
