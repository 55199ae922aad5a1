"""block-stats's settings, built and validated by the recipe's ``settings(cfg)`` (:mod:`tfmoe.experiments.block_stats`): frozen, typed, already resolved."""

from __future__ import annotations

from dataclasses import dataclass

from tfmoe.experiments.block_stats.stacks import Variant


@dataclass(frozen=True)
class Settings:
    """Every value a block-stats run reads, validated by :func:`settings`."""

    variants: tuple[Variant, ...]
    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    batch_size: int
    seq_len: int
    eps: float
    init: str  # xavier | torch
    lowp_dtypes: tuple[str, ...]  # keys of LOWP: the stats_finite checks' extra dtypes
    lowp_stress_scale: float  # input scale of the low-precision stress run
