"""How a run is set up on its machine: device, dtype, seed and torch threads, from the config's common keys.

Shared by the runner (every run), the test utilities and experiments that need the same rule (e.g. complexity reads
``threads`` for its timings); each refusal is one BadInput line naming the key and the fix.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig

from tfmoe.contract.errors import BadInput

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}
DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d+|mps|auto)$")


def resolve_device(name: str) -> Any:
    """'cpu' | 'cuda' | 'cuda:N' | 'mps' | 'auto' -> torch.device, refusing devices this machine lacks."""
    import torch

    name = str(name)
    if not DEVICE_RE.match(name):
        raise BadInput(f"device={name!r} is not a device: use cpu, cuda, cuda:N, mps or auto")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BadInput(f"--device {name} asked for CUDA, but this torch ({torch.__version__}) sees no CUDA "
                           "device: use --device cpu (or install a CUDA build of torch, see README)")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise BadInput(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s): use cuda:0")
    if name == "mps" and not torch.backends.mps.is_available():
        raise BadInput("--device mps asked for Apple MPS, which is not available here: use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: Any) -> Any:
    import torch

    if str(name) not in DTYPES:
        raise BadInput(f"dtype={name!r} is unknown: use one of {', '.join(DTYPES)}")
    dtype = getattr(torch, DTYPES[str(name)])
    if device.type == "mps" and dtype == torch.float64:
        raise BadInput("dtype fp64 is not supported on MPS: use --dtype fp32")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise BadInput(f"{torch.cuda.get_device_name(device)} cannot do bf16: use --dtype fp16 or fp32")
    return dtype


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# torch.manual_seed takes up to 2**64-1, but a run's seed is stored as a signed 64-bit integer (run.parquet, the
# catalog, replay reads it back): the largest seed a run can record is the bound.
MAX_SEED = 2**63 - 1


def check_seed(cfg: DictConfig) -> int:
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise BadInput(f"seed={seed!r} is not a non-negative integer: pass e.g. --seed 0")
    if seed > MAX_SEED:
        raise BadInput(f"seed={seed} is above {MAX_SEED} (2**63-1, the largest seed a run can record): "
                       "pass e.g. --seed 0")
    return seed


def check_tensor_max_numel(cfg: DictConfig) -> int:
    """``tensor_max_numel``: tensors with more elements are saved as a summary; 0 keeps summaries only."""
    limit = cfg.get("tensor_max_numel", 1_000_000)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise BadInput(f"tensor_max_numel={limit!r} must be a non-negative integer (0: summaries only): "
                       "pass tensor_max_numel=1000000")
    return limit


def check_threads(cfg: DictConfig) -> int | None:
    threads = cfg.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise BadInput(f"threads={threads!r} must be a positive integer or null (torch's default): pass threads=1")
    return threads


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` intra-op threads (None: torch's setting), restored afterwards, also after Ctrl-C."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
