"""decode's settings, built and validated by the recipe's ``settings(cfg)`` (:mod:`tfmoe.experiments.decode`): frozen, typed, already resolved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Settings:
    """Every value a decode run reads, validated by :func:`settings`."""

    corpus_path: str | None
    d_model: int
    n_heads: int
    n_layers: int
    max_len: int
    train_steps: int
    batch_size: int
    block_size: int
    lr: float
    val_fraction: float
    prompt: str
    prompt_ids: tuple[int, ...] | None  # overrides prompt
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    beam_width: int
    length_penalty: float
    check_tokens: int
    tiny_top_p: float
    tiny_temperature: float
    top_p_grid: tuple[float, ...]
    chi2_draws: int
    chi2_alpha: float
    logit_tol_eps: float
    timing_lengths: tuple[int, ...]
    timing_repeats: int
    expect_divergence: bool = False  # a stress test: training must go non-finite (tfmoe.rules.finite)
    lm: Any = None  # impl=...: the model battery's settings (tfmoe.experiments.lm_battery.LMSettings), else None
    own_lm: Any = None  # without impl: the battery's settings for the trained tiny LM's batched generation
