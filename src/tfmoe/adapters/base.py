"""The adapter protocol: how attn-check drives an attention layer written in any layout.

An adapter tells the battery five things about one attention implementation, and nothing about how to compute
attention (the reference does that from first principles, see ``tfmoe.components.references``):

1. ``build(d_model, n_heads, n_kv_heads=, causal=, dropout=, seed=, dtype=, device=)``: a fresh layer with
   random weights (drawn after ``torch.manual_seed(seed)`` when a seed is given), in eval mode.
2. ``forward(module, x, padding_mask, causal=, cache=None)``: x (B, T, D) and a key padding mask (B, T), True =
   real token (or None), through the layer's own code path (its own mask builder, rotary, kv repetition) ->
   ``(output (B, T, D), weights (B, Hq, T, T) or None)``.
3. ``parameters(module)``: ``{name: tensor}`` of the parameters the projections are read from (the names are the
   module's own, so gradients can be taken through ``torch.func.functional_call``).
4. ``projections(params, n_heads, n_kv_heads)``: those tensors in ``nn.Linear`` layout (out, in) as a
   :class:`~tfmoe.components.references.Projections`, with the positional transform (RoPE and its theta) and
   the softmax scale the layer documents. Pure tensor ops (slicing, transposes), differentiable.
5. ``n_kv_heads``: GQA / MQA is a build argument; k and v projections are (Hkv·Dh, D).

The RoPE pairing (rotate-half or interleaved, :class:`~tfmoe.components.references.Rope`) and the kv-head mapping
(query head h reads kv head h // (Hq/Hkv)) are the reference's: an adapter states the pairing its layer uses.

Optional: ``set_projections(module, p)`` writes weights back (the dropout checks need it), ``hooks(module)``
names the fused qkv and output layers whose shapes the shapes check can observe, ``takes_cache`` (forward takes
a tfmoe ``KVCache``), ``takes_dropout``, ``returns_weights`` (False: the weight-based checks are not applicable).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from tfmoe.components.references import Projections
from tfmoe.contract.errors import BadInput, ContractError


class AttentionAdapter(ABC):
    """Base class of every adapter (the shipped ones and a user's)."""

    spec: str = "?"
    returns_weights: bool = True
    takes_dropout: bool = True
    takes_cache: bool = False
    supports_gqa: bool = True
    notes: tuple[str, ...] = ()  # what the adapter wants said in the run's notes
    # A shipped adapter names the distribution it drives and the releases it is tested on: an exception raised
    # inside tfmoe or that library is then tfmoe's error (crashed, exit 3), never the layer's (tfmoe.rules.faults).
    library: str | None = None
    supported: str = ""

    @abstractmethod
    def build(self, d_model: int, n_heads: int, *, n_kv_heads: int, causal: bool, dropout: float,
              seed: int | None, dtype: torch.dtype, device: torch.device) -> nn.Module: ...

    @abstractmethod
    def forward(self, module: nn.Module, x: torch.Tensor, padding_mask: torch.Tensor | None, *, causal: bool,
                cache: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    @abstractmethod
    def parameters(self, module: nn.Module) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def projections(self, params: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> Projections: ...

    def set_projections(self, module: nn.Module, p: Projections) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot write weights back")

    def hooks(self, module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        return None, None

    @property
    def can_set_projections(self) -> bool:
        return type(self).set_projections is not AttentionAdapter.set_projections

    @property
    def name(self) -> str:
        return self.spec


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """torch's CPU RNG starts from ``seed`` inside (and is restored after); no-op for None."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def copy_linear(layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Write an (out, in) weight (and bias, zeroed when None) into an nn.Linear in place."""
    with torch.no_grad():
        layer.weight.copy_(weight)
        if getattr(layer, "bias", None) is not None:
            layer.bias.copy_(torch.zeros_like(layer.bias) if bias is None else bias)


def checked_output(result: Any, who: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)
            and (result[1] is None or isinstance(result[1], torch.Tensor))):
        raise ContractError(f"{who} must return (output, attn_weights or None), got {type(result).__name__}")
    return result


def refuse(spec: str, what: str, fix: str) -> BadInput:
    return BadInput(f"impl={spec}: {what}: {fix}")


def require_tested_release(scheme: str, distribution: str, module: str, tested: str, supported: str, extra: str,
                           import_hint: Callable[[Exception], str | None] = lambda exc: None) -> Any:
    """Import ``module`` of the third-party ``distribution`` a shipped adapter drives, at the one release it is
    tested on (``tested``, read from the installed metadata; a local tag like ``+cpu`` is ignored).

    Not importable, or another release: BadInput (exit 2) naming ``supported`` and the extra to install, before any
    check runs. ``import_hint(exc)`` may give a better line for a known import failure."""
    try:
        found = importlib.metadata.version(distribution)
        imported = importlib.import_module(module)
    except Exception as exc:  # not installed, or failing at import (torchtune refusing its torchao, ...)
        raise BadInput(import_hint(exc) or f"impl={scheme}:...: needs {supported}: pip install -e '.[{extra}]' "
                       f"({type(exc).__name__}: {exc})") from None
    if found.split("+")[0] != tested:
        raise BadInput(f"impl={scheme}:...: found {distribution} {found}, the adapter is tested on {supported}: "
                       f"pip install -e '.[{extra}]'")
    return imported
