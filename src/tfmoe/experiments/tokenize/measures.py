"""tokenize's measures: per-sample counts, totals and rates per (tokenizer, category), how digit runs split (with
the 3-digit grouping check of cl100k/o200k) and the tokenization premium (with the check that it is a ratio of
totals)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.tokenize import tokenizers_lab as lab
from tfmoe.experiments.tokenize.samples import Sample

ALL = "all"
# Tokenizers whose pre-tokenizer splits digit runs into groups of at most this many digits (\p{N}{1,3}).
DIGIT_GROUP = {"cl100k_base": 3, "o200k_base": 3}
# Digits of pi: the digit runs tokenized alone (1..digit_run_max digits).
PI_DIGITS = "31415926535897932384626433832795028841971693993751058209749445923078164062862089986280348253421170679"
ASCII_DIGITS = frozenset(b"0123456789")


@dataclass
class Encoded:
    """One tokenizer's output on every sample (same order as the samples)."""

    adapter: lab.Adapter
    ids: list[list[int]]


def premium_ratio(tokens_by_category: dict[str, int], numerator: str, denominator: str) -> float:
    """Tokenization premium: total tokens of one side / total tokens of the other (a ratio of totals)."""
    return tokens_by_category[numerator] / tokens_by_category[denominator]


def digit_count(b: bytes) -> int:
    return sum(1 for x in b if x in ASCII_DIGITS)


def digit_groups(run: str, group: int) -> list[str]:
    """How a \\p{N}{1,group} pre-tokenizer splits a digit run: from the left, 1234567 -> 123|456|7."""
    return [run[i:i + group] for i in range(0, len(run), group)]


def digit_violations(adapter: lab.Adapter, ids: list[list[int]], group: int, run_max: int) -> tuple[int, int, list[str]]:
    """Tokens with more than ``group`` digits in the encoded samples, plus digit runs of length 1..run_max
    (encoded alone) whose pieces are not the left-to-right groups (1234567 -> 123|456|7; right-to-left grouping
    1|234|567 has the same token count, so the pieces themselves are compared). Returns (count, max digits per
    token seen, examples)."""
    bad: list[str] = []
    most = 0
    for seq in ids:
        for piece in adapter.token_bytes(seq):
            n = digit_count(piece)
            most = max(most, n)
            if n > group:
                bad.append(f"token {lab.display_bytes(piece)!r} has {n} digits")
    runs = [PI_DIGITS[:n] for n in range(1, run_max + 1)]
    for run, seq in zip(runs, adapter.encode_batch(runs), strict=True):
        pieces = [lab.display_bytes(b) for b in adapter.token_bytes(seq)]
        want = digit_groups(run, group)
        if pieces != want:
            bad.append(f"{len(run)}-digit run -> {'|'.join(pieces)}, expected {'|'.join(want)} (groups of "
                       f"{group} from the left)")
    return len(bad), most, bad


def record_samples(rec: Recorder, samples: list[Sample], encoded: list[Encoded]) -> None:
    """Per sample: chars and bytes; per (tokenizer, sample): tokens, with the ids and pieces as tags."""
    for x in samples:
        rec.metric("chars", len(x.text), category=x.category, sample=x.line)
        rec.metric("bytes", len(x.text.encode("utf-8")), category=x.category, sample=x.line)
    for e in encoded:
        for x, ids in zip(samples, e.ids, strict=True):
            rec.metric("tokens", len(ids), tokenizer=e.adapter.name, category=x.category, sample=x.line,
                       ids=" ".join(map(str, ids)), pieces=json.dumps(e.adapter.pieces(ids), ensure_ascii=False))


def record_aggregates(rec: Recorder, samples: list[Sample], encoded: list[Encoded], categories: list[str],
                      fertility_cats: Sequence[str]) -> dict[str, dict[str, int]]:
    """Totals and rates per (tokenizer, category) and over all samples. Returns tokens_total[tok][cat]."""
    groups = {cat: [i for i, x in enumerate(samples) if x.category == cat] for cat in categories}
    groups[ALL] = list(range(len(samples)))
    for cat, idx in groups.items():
        rec.metric("chars_total", sum(len(samples[i].text) for i in idx), category=cat)
        rec.metric("bytes_total", sum(len(samples[i].text.encode("utf-8")) for i in idx), category=cat)
    totals: dict[str, dict[str, int]] = {}
    for e in encoded:
        name = e.adapter.name
        rec.metric("vocab_size", e.adapter.vocab_size, tokenizer=name)
        totals[name] = {}
        for cat, idx in groups.items():
            n_tok = sum(len(e.ids[i]) for i in idx)
            n_chr = sum(len(samples[i].text) for i in idx)
            n_byt = sum(len(samples[i].text.encode("utf-8")) for i in idx)
            n_unk = sum(t == e.adapter.unk_id for i in idx for t in e.ids[i]) if e.adapter.unk_id is not None else 0
            exact = sum(e.adapter.decode(e.ids[i]) == samples[i].text for i in idx)
            totals[name][cat] = n_tok
            tags = {"tokenizer": name, "category": cat}
            rec.metric("tokens_total", n_tok, **tags)
            rec.metric("tokens_per_char", n_tok / n_chr, **tags)
            rec.metric("bytes_per_token", n_byt / n_tok if n_tok else float("nan"), **tags)
            rec.metric("unk_rate", n_unk / n_tok if n_tok else 0.0, **tags)
            rec.metric("round_trip_exact", exact / len(idx), **tags)
            if cat in fertility_cats:
                words = sum(len(samples[i].text.split()) for i in idx)
                if words:
                    rec.metric("fertility", n_tok / words, **tags)
    return totals


def record_digits(rec: Recorder, encoded: list[Encoded], run_max: int) -> dict[str, list[int]]:
    """How digit runs split: tokens per run of 1..run_max digits (alone), the most digits in one token of
    the input, and the 3-digit grouping check for cl100k/o200k."""
    runs = [PI_DIGITS[:n] for n in range(1, run_max + 1)]
    rows: dict[str, list[int]] = {}
    for e in encoded:
        counts = [len(seq) for seq in e.adapter.encode_batch(runs)]
        rows[e.adapter.name] = counts
        for n, c in enumerate(counts, start=1):
            rec.metric("digit_run_tokens", c, step=n, tokenizer=e.adapter.name)
        most = max((digit_count(p) for seq in e.ids for p in e.adapter.token_bytes(seq)), default=0)
        rec.metric("digits_per_token_max", most, tokenizer=e.adapter.name)
        group = DIGIT_GROUP.get(e.adapter.name)
        if group is not None:
            n_bad, most, bad = digit_violations(e.adapter, e.ids, group, run_max)
            rec.check(f"digits_grouped_by_{group}[{e.adapter.name}]", n_bad == 0, n_bad, 0,
                      bad[0] if bad else f"no token holds more than {group} digits (most: {most}); runs of "
                      f"1..{run_max} digits split into groups of {group} from the left (1234567 -> 123|456|7)")
    return rows


def record_premium(rec: Recorder, samples: list[Sample], encoded: list[Encoded], totals: dict[str, dict[str, int]],
                   num: str, den: str) -> dict[str, float]:
    """Premium per tokenizer, and a check that it equals the ratio of the recorded per-sample totals."""
    n_num = sum(x.category == num for x in samples)
    n_den = sum(x.category == den for x in samples)
    if n_num == 0 or n_den == 0:
        rec.note(f"premium not computed: the input has no '{num if n_num == 0 else den}' samples")
        return {}
    if n_num != n_den:
        rec.note(f"premium not computed: {n_num} '{num}' vs {n_den} '{den}' samples is not a parallel corpus")
        return {}
    premiums = {}
    for e in encoded:
        name = e.adapter.name
        p = premium_ratio(totals[name], num, den)
        premiums[name] = p
        rec.metric("premium", p, tokenizer=name, numerator=num, denominator=den)
        side = {c: sum(r["value"] for r in rec.metrics_rows
                       if r["name"] == "tokens" and r.get("tokenizer") == name and r.get("category") == c)
                for c in (num, den)}
        expected = side[num] / side[den]
        rec.check(f"premium_from_totals[{name}]", math.isclose(p, expected, rel_tol=1e-12), abs(p - expected), 0.0,
                  f"{name}: {side[num]:.0f} {num} tokens / {side[den]:.0f} {den} tokens = {expected:.4f}")
    return premiums
