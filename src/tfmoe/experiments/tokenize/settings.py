"""tokenize's settings, built and validated by the recipe's ``settings(cfg)`` (:mod:`tfmoe.experiments.tokenize`): frozen, typed, already resolved."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """Every value a tokenize run reads, validated by :func:`settings`."""

    input: str | None  # a UTF-8 file; None = the shipped corpus
    tokenizers: tuple[str, ...]
    extras: tuple[str, ...]  # tokenizers skipped with a note when unavailable
    vocab_size: int  # of the trained BPE / WordPiece / Unigram
    train_categories: tuple[str, ...] | None  # None: train on every category
    numerator: str  # premium = tokens of numerator / tokens of denominator
    denominator: str
    fertility: tuple[str, ...]  # categories whose tokens per word are recorded
    digit_run_max: int
    show: int  # samples per category whose pieces summary.md shows
