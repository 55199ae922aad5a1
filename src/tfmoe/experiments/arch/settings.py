"""arch's settings, built and validated by the recipe's ``settings(cfg)`` (:mod:`tfmoe.experiments.arch`): frozen, typed, already resolved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Settings:
    """Every value an arch run reads, validated by :func:`settings`."""

    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    n_classes: int
    batch_size: int
    seq_len: int  # T of the encoder / decoder-only input, T_src of the encoder-decoder
    tgt_len: int  # T_tgt of the encoder-decoder
    rope: bool
    visibility_tol_eps: float  # an output "changes" when it moves by > this x dtype eps x output scale
    equivariance_tol_eps: float  # permuted outputs agree within this x dtype eps x output scale
    min_position_effect: float  # positions must move the permuted outputs by >= this (relative)
    lm: Any = None  # impl=...: the model battery's settings (tfmoe.experiments.lm_battery.LMSettings), else None
