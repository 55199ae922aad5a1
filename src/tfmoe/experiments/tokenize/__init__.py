"""tfmoe tokenize — course §2.1: the same text costs different numbers of tokens in different tokenizers.

Question: how many tokens do real public tokenizers (cl100k_base, o200k_base), the three algorithm
families trained here (BPE, WordPiece, Unigram) and the byte/char baselines spend on Chinese, English,
code and numbers, and why? The run saves every sample's ids and pieces, the tokenization premium of
Chinese over English on parallel text, fertility, UNK rate and how digit runs are split, and checks
round-trips, counts against the libraries' own calls, an independent BPE for the OpenAI vocabularies,
the 3-digit grouping of cl100k/o200k and that the premium is a ratio of totals.

This module is the recipe: :class:`Settings`, :func:`settings`, :func:`run`. The parts it runs:
  tokenize_input.py     the samples of the input file (or the shipped corpus)
  tokenize_measures.py  counts, totals, rates, digit runs and the premium (with their two checks)
  tokenize_checks.py    counts vs an independent count, round trips, the reference BPE
  tokenize_report.py    the table, summary.md, the figures and :func:`sweep_plots`
  tokenizers_lab.py     the tokenizers themselves (adapters, trained families, the reference BPE)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.tokenize import tokenizers_lab as lab
from tfmoe.experiments.tokenize.checks import check_counts, check_reference_bpe, check_round_trips
from tfmoe.experiments.tokenize.measures import (
    PI_DIGITS,
    Encoded,
    record_aggregates,
    record_digits,
    record_premium,
    record_samples,
)
from tfmoe.experiments.tokenize.report import (
    bar_chart,
    digit_chart,
    results_rows,
    summary_markdown,
    sweep_plots,
)
from tfmoe.experiments.tokenize.samples import read_samples
from tfmoe.experiments.tokenize.settings import Settings


def _categories(value: Any, key: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BadInput(f"{key}={value!r} is not a list of category names: pass e.g. {key}=[en,code]")
    return tuple(value)


def settings(cfg: DictConfig) -> Settings:
    """The run's settings, refusing unusable values with one-line fixes (the input file is read by :func:`run`)."""
    c = OmegaConf.to_container(cfg, resolve=True)
    names = c.get("tokenizers")
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise BadInput(f"tokenizers={names!r} is empty or not a list of names: pass e.g. tokenizers=[cl100k_base,bytes]")
    names = [n.strip() for n in names]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BadInput(f"tokenizer {dupes[0]} is listed twice: list each tokenizer once")
    extras = c.get("extras") or []
    if isinstance(extras, str):
        extras = [extras]
    if not isinstance(extras, list) or not all(isinstance(n, str) for n in extras):
        raise BadInput(f"extras={extras!r} is not a list of names: pass e.g. extras=[bert_uncased] or extras=[]")
    train = c.get("train") or {}
    vocab_size = train.get("vocab_size")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 256 <= vocab_size <= 1_000_000:
        raise BadInput(f"train.vocab_size={vocab_size!r} is out of range: pass an integer from 256 (the byte "
                       "alphabet of the trained BPE) to 1000000")
    premium = c.get("premium") or {}
    num, den = premium.get("numerator"), premium.get("denominator")
    if not (isinstance(num, str) and isinstance(den, str) and num and den and num != den):
        raise BadInput(f"premium.numerator={num!r} / premium.denominator={den!r}: pass two different category "
                       "names, e.g. premium.numerator=zh premium.denominator=en")
    run_max = c.get("digit_run_max")
    if isinstance(run_max, bool) or not isinstance(run_max, int) or not 1 <= run_max <= len(PI_DIGITS):
        raise BadInput(f"digit_run_max={run_max!r} is out of range: pass an integer from 1 to {len(PI_DIGITS)}")
    show = c.get("show_per_category")
    if isinstance(show, bool) or not isinstance(show, int) or show < 0:
        raise BadInput(f"show_per_category={show!r} is not a count: pass an integer >= 0")
    return Settings(
        input=c.get("input"), tokenizers=tuple(names), extras=tuple(e.strip() for e in extras if e.strip()),
        vocab_size=vocab_size, train_categories=_categories(train.get("categories"), "train.categories"),
        numerator=num, denominator=den,
        fertility=_categories(c.get("fertility_categories"), "fertility_categories") or (),
        digit_run_max=run_max, show=show)


def load_adapters(names: Sequence[str], extras: Sequence[str], train_texts: list[str], vocab_size: int,
                  rec: Recorder) -> list[lab.Adapter]:
    adapters = []
    for name in [*names, *(e for e in extras if e not in names)]:
        t0 = time.perf_counter()
        try:
            adapter = lab.load_tokenizer(name, train_texts, vocab_size)
        except BadInput as exc:
            if name in names:
                raise
            rec.note(f"extra tokenizer {name} skipped: {exc}")
            continue
        rec.timing("load", (time.perf_counter() - t0) * 1e3, tokenizer=name)
        rec.note(f"{name}: {adapter.source}; vocabulary {adapter.vocab_size}; "
                 f"{'lossless' if adapter.lossless else 'not promised lossless'}")
        adapters.append(adapter)
    return adapters


def run(s: Settings, rec: Recorder) -> None:
    """Read the samples, load every tokenizer, encode, record, check, report."""
    samples, source, skipped = read_samples(s.input)
    rec.note(f"input: {source}: {len(samples)} samples" + (f", {skipped} empty lines skipped" if skipped else ""))
    categories = list(dict.fromkeys(x.category for x in samples))
    train_cats = s.train_categories
    if train_cats is not None:
        unknown = [c for c in train_cats if c not in categories]
        if unknown:
            raise BadInput(f"train.categories names {unknown[0]!r}, which the input lacks (it has "
                           f"{', '.join(categories)}): pick among those")
    train_texts = [x.text for x in samples if train_cats is None or x.category in train_cats]
    rec.note(f"trained tokenizers learn from {len(train_texts)} samples of "
             f"{', '.join(train_cats) if train_cats else 'every category'} (and are measured on the same input)")

    adapters = load_adapters(s.tokenizers, s.extras, train_texts, s.vocab_size, rec)
    texts = [x.text for x in samples]
    encoded: list[Encoded] = []
    for adapter in rec.progress(adapters, total=len(adapters), description="encoding"):
        ids = adapter.encode_batch(texts)
        rec.time("encode", lambda a=adapter: a.encode_batch(texts), repeats=3, warmup=0, tokenizer=adapter.name)
        encoded.append(Encoded(adapter, ids))

    record_samples(rec, samples, encoded)
    totals = record_aggregates(rec, samples, encoded, categories, s.fertility)
    check_counts(rec, samples, encoded)
    check_round_trips(rec, samples, encoded)
    check_reference_bpe(rec, samples, encoded)
    digit_rows = record_digits(rec, encoded, s.digit_run_max)
    premiums = record_premium(rec, samples, encoded, totals, s.numerator, s.denominator)

    results_rows(encoded, categories, totals, premiums).print_to(rec.console)
    rec.plot("tokens_by_category", bar_chart(encoded, categories, totals))
    rec.plot("digit_runs", digit_chart(digit_rows))
    rec.summary(summary_markdown(samples, encoded, categories, totals, premiums, s))


__all__ = ["Settings", "settings", "run", "sweep_plots", "load_adapters"]
