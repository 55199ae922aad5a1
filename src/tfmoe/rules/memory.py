"""Memory, shared by the experiments: peak bytes of a call, what the device has free, and the size guard that
refuses (exit 2) a size that cannot fit before anything is allocated, naming the knob that dominates the estimate
and a value of it that fits (:func:`refuse_oversized`)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import reset_device_peak


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


# ------------------------------------------------------------------------------------------ the size guard
MEMORY_FRACTION = 0.8  # of the memory available: what a run may plan to use


@dataclass(frozen=True)
class Knob:
    """One size key of a config, as the guard may lower it: its value, the smallest value the settings accept (a
    number, or a function of the other sizes: route-sim's n_experts >= top_k) and the step its values must keep (a
    d_model that must stay a multiple of n_heads)."""

    value: int
    minimum: int | Callable[[dict[str, int]], int] = 1
    multiple: int = 1

    def floor(self, sizes: dict[str, int]) -> int:
        """The smallest accepted value (a multiple of the step) given the other sizes."""
        low = self.minimum(sizes) if callable(self.minimum) else self.minimum
        return -(-low // self.multiple) * self.multiple


def host_available_bytes() -> int:
    """The host's available RAM (psutil), what a CPU run's settings are judged against before the run starts."""
    import psutil

    return int(psutil.virtual_memory().available)


def _accepted(estimate: Callable[[dict[str, int]], int], knobs: dict[str, Knob], sizes: dict[str, int],
              budget: float) -> bool:
    return estimate(sizes) <= budget and all(sizes[k] >= kb.floor(sizes) for k, kb in knobs.items())


def _largest_fitting(estimate: Callable[[dict[str, int]], int], knobs: dict[str, Knob], sizes: dict[str, int],
                     key: str, budget: float) -> int | None:
    """The largest value of ``key`` (a multiple of its step, at least its floor, at most its value) whose estimate
    fits ``budget`` and keeps every knob at or above its floor, the other sizes as given; None when not even the
    floor fits."""
    knob = knobs[key]
    low = knob.floor(sizes)
    if not _accepted(estimate, knobs, {**sizes, key: low}, budget):
        return None
    lo, hi = low // knob.multiple, max(low, knob.value) // knob.multiple  # in units of the step
    while lo < hi:  # estimates grow with each size: the largest fitting multiple
        mid = (lo + hi + 1) // 2
        if _accepted(estimate, knobs, {**sizes, key: mid * knob.multiple}, budget):
            lo = mid
        else:
            hi = mid - 1
    return lo * knob.multiple


def size_advice(estimate: Callable[[dict[str, int]], int], knobs: dict[str, Knob],
                budget: float) -> list[tuple[str, int]]:
    """The knobs to lower, most dominant first, with a value for each, such that the estimate fits ``budget``.

    The dominant knob is the one whose lowering to its floor (with the knobs whose floor it holds up: route-sim's
    top_k for n_experts) shrinks the estimate most. It is lowered to the
    largest value that fits; only when not even its floor fits is it set to its floor and the next knob (by the
    same rule) lowered as well, after which the earlier ones are raised back as far as still fits. Empty when
    nothing can fit."""
    sizes = {k: kb.value for k, kb in knobs.items()}
    lowered: list[str] = []
    free = dict(knobs)

    def freed(k: str) -> int:  # the estimate with k at its floor, and the knobs k held up (floor > half their value)
        z = {**sizes, k: free[k].floor(sizes)}
        held = {j: kb.floor(z) for j, kb in free.items()
                if j != k and 2 * kb.floor(sizes) > sizes[j] and 2 * kb.floor(z) <= sizes[j]}
        return estimate({**z, **held})

    while free:
        key = min(free, key=lambda k: (freed(k), k))
        del free[key]
        fits = _largest_fitting(estimate, knobs, sizes, key, budget)
        lowered.append(key)
        if fits is not None:
            sizes[key] = fits
            for earlier in reversed(lowered[:-1]):
                sizes[earlier] = _largest_fitting(estimate, knobs, sizes, earlier, budget) or sizes[earlier]
            return [(k, sizes[k]) for k in lowered if sizes[k] != knobs[k].value]  # never advise what is already so
        sizes[key] = knobs[key].floor(sizes)
    return []


def refuse_oversized(estimate: Callable[[dict[str, int]], int], knobs: dict[str, Knob], available: int, where: str,
                     what: str, fraction: float = MEMORY_FRACTION, pinned: dict[str, int] | None = None) -> None:
    """BadInput (exit 2), before anything is allocated, when ``estimate(sizes)`` (bytes) exceeds ``fraction`` of
    ``available``: one line naming the estimate, the knob that dominates it and a value of it that fits (itself
    accepted: the estimate of the advised sizes fits). ``pinned`` keys are written into the advised fix with their
    value where the fix needs them to stand alone (complexity's T with D)."""
    sizes = {k: kb.value for k, kb in knobs.items()}
    need, budget = estimate(sizes), fraction * available
    if need <= budget:
        return
    gib = 2 ** 30
    free = (f"but only {budget / gib:,.1f} GiB ({fraction:.0%} of {where} {available / gib:,.1f} GiB available) "
            "is free")
    advice = size_advice(estimate, knobs, budget)
    if not advice:
        raise BadInput(f"{what} needs about {need / gib:,.1f} GiB (estimate) even at the smallest sizes {free}: "
                       "run it on a device with more memory")
    dominant, lowered = advice[0][0], dict(advice)
    shown = [*advice, *((k, v) for k, v in (pinned or {}).items() if k not in lowered and set(pinned or {}) & set(lowered))]
    raise BadInput(f"{dominant}={knobs[dominant].value} needs about {need / gib:,.1f} GiB for {what} (estimate; "
                   f"{dominant} dominates it) {free}: lower {' and '.join(lowered)} (at most about "
                   f"{' '.join(f'{k}={v}' for k, v in shown)})")


def block_params(d_model: int, d_ff: int | None = None) -> int:
    """Parameters of one Transformer block (attention 4·D², FFN 2·D·d_ff, d_ff = 4·D by default; biases and
    norms are below 1 % and counted as 1·D·16): what the size guards' estimates build on."""
    d_ff = 4 * d_model if d_ff is None else d_ff
    return 4 * d_model * d_model + 2 * d_model * d_ff + 16 * d_model


def block_activation_elements(tokens: int, d_model: int, n_heads: int, seq: int, d_ff: int | None = None) -> int:
    """Elements one block's forward creates for ``tokens`` tokens in sequences of ``seq``: the D-wide stages (q, k, v,
    attention out, residuals, norms: ~10·D), the FFN's hidden (2·d_ff) and the H·seq attention scores per token
    (twice: scores and weights)."""
    d_ff = 4 * d_model if d_ff is None else d_ff
    return tokens * (10 * d_model + 2 * d_ff + 2 * n_heads * seq)


DTYPE_BYTES = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2}  # a config's dtype name -> bytes per element
