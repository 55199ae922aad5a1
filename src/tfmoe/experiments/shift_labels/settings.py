"""shift-labels's settings, built and validated by the recipe's ``settings(cfg)`` (:mod:`tfmoe.experiments.shift_labels`): frozen, typed, already resolved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Settings:
    """Every value a shift-labels run reads, validated by :func:`settings`; the sequences already encoded."""

    sequences: tuple[tuple[int, ...], ...]  # token ids, lengths may differ
    vocab: tuple[str, ...]  # id = index
    pad_token: str
    pad_id: int
    pad_side: str  # right | left
    ignore_index: int  # negative: never a vocabulary id
    d_model: int
    n_heads: int
    n_layers: int
    texts: tuple[str, ...] | None  # the user's sentences (None: `sequences` came from the config)
    tokenizer: str | None
    tokenizer_source: str | None  # where the tokenizer's vocabulary comes from
    tokenizer_ids: tuple[tuple[int, ...], ...]  # the tokenizer's own ids per text (empty without texts)
    lm: Any = None  # impl=...: the model battery's settings (tfmoe.experiments.lm_battery.LMSettings), else None
