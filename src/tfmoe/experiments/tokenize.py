"""tfmoe tokenize — course §2.1: the same text costs different numbers of tokens in different tokenizers.

Question: how many tokens do real public tokenizers (cl100k_base, o200k_base), the three algorithm
families trained here (BPE, WordPiece, Unigram) and the byte/char baselines spend on Chinese, English,
code and numbers, and why? The run saves every sample's ids and pieces, the tokenization premium of
Chinese over English on parallel text, fertility, UNK rate and how digit runs are split, and checks
round-trips, counts against the libraries' own calls, an independent BPE for the OpenAI vocabularies,
the 3-digit grouping of cl100k/o200k and that the premium is a ratio of totals.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from tfmoe import tokenizers_lab as lab
from tfmoe.errors import BadInput
from tfmoe.recorder import Recorder

CORPUS_FILE = "corpus_parallel.tsv"
CATEGORY_RE = re.compile(r"^([A-Za-z][A-Za-z0-9_-]{0,31})\t(.*)$", re.DOTALL)
DEFAULT_CATEGORY = "text"
ALL = "all"
# Tokenizers whose pre-tokenizer splits digit runs into groups of at most this many digits (\p{N}{1,3}).
DIGIT_GROUP = {"cl100k_base": 3, "o200k_base": 3}
# Digits of pi: the digit runs tokenized alone (1..digit_run_max digits).
PI_DIGITS = "31415926535897932384626433832795028841971693993751058209749445923078164062862089986280348253421170679"
ASCII_DIGITS = frozenset(b"0123456789")


@dataclass(frozen=True)
class Sample:
    line: int  # 0-based line number in the input
    category: str
    text: str


@dataclass
class Encoded:
    """One tokenizer's output on every sample (same order as the samples)."""

    adapter: lab.Adapter
    ids: list[list[int]]


# ----------------------------------------------------------------------------------------------- input
def shipped_corpus() -> Path:
    return Path(str(resources.files("tfmoe") / "data" / CORPUS_FILE))


def read_samples(path: str | Path | None) -> tuple[list[Sample], str, int]:
    """Samples of a UTF-8 file (None = the shipped corpus), its description and the number of skipped
    empty lines. Lines are split on '\\n' only (a trailing '\\r' is dropped); a leading BOM is ignored."""
    file = shipped_corpus() if path is None else Path(str(path)).expanduser()
    if not file.exists():
        raise BadInput(f"input file {file} does not exist: pass input=PATH to a UTF-8 text file (or input=null)")
    if file.is_dir():
        raise BadInput(f"input {file} is a directory: pass input=PATH to a UTF-8 text file")
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise BadInput(f"input file {file} cannot be read ({exc.strerror}): fix its permissions or pass "
                       "another file") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n")
        raise BadInput(f"input file {file} is not UTF-8 (byte {exc.start}, line {line}: {exc.reason}): "
                       "convert it, e.g. iconv -t UTF-8") from None
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in text.split("\n")]
    if lines and lines[-1] == "" and text.endswith("\n"):
        lines.pop()
    filled = [(i, ln) for i, ln in enumerate(lines) if ln.strip()]
    tsv = bool(filled) and all(CATEGORY_RE.match(ln) for _, ln in filled)
    samples: list[Sample] = []
    for i, ln in filled:
        if tsv:
            category, body = CATEGORY_RE.match(ln).groups()
            if not body.strip():
                continue
            samples.append(Sample(i, category, body))
        else:
            samples.append(Sample(i, DEFAULT_CATEGORY, ln))
    if not samples:
        raise BadInput(f"input file {file} has no text (only empty lines): give at least one non-empty line")
    desc = "shipped corpus " + CORPUS_FILE if path is None else str(file)
    return samples, desc, sum(1 for ln in lines if not ln.strip()) + (len(filled) - len(samples))


# -------------------------------------------------------------------------------------------- measures
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


# ------------------------------------------------------------------------------------------- config
def _categories(value: Any, key: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BadInput(f"{key}={value!r} is not a list of category names: pass e.g. {key}=[en,code]")
    return list(value)


def validate(cfg: DictConfig) -> dict[str, Any]:
    """The run's settings, refusing unusable values with one-line fixes."""
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
    return {"input": c.get("input"), "tokenizers": names, "extras": [e.strip() for e in extras if e.strip()],
            "vocab_size": vocab_size, "train_categories": _categories(train.get("categories"), "train.categories"),
            "numerator": num, "denominator": den,
            "fertility": _categories(c.get("fertility_categories"), "fertility_categories") or [],
            "digit_run_max": run_max, "show": show}


# ------------------------------------------------------------------------------------------------ run
def load_adapters(names: list[str], extras: list[str], train_texts: list[str], vocab_size: int,
                  rec: Recorder) -> list[lab.Adapter]:
    adapters = []
    for name in names + [e for e in extras if e not in names]:
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


def run(cfg: DictConfig, rec: Recorder) -> None:
    s = validate(cfg)
    samples, source, skipped = read_samples(s["input"])
    rec.note(f"input: {source}: {len(samples)} samples" + (f", {skipped} empty lines skipped" if skipped else ""))
    categories = list(dict.fromkeys(x.category for x in samples))
    train_cats = s["train_categories"]
    if train_cats is not None:
        unknown = [c for c in train_cats if c not in categories]
        if unknown:
            raise BadInput(f"train.categories names {unknown[0]!r}, which the input lacks (it has "
                           f"{', '.join(categories)}): pick among those")
    train_texts = [x.text for x in samples if train_cats is None or x.category in train_cats]
    rec.note(f"trained tokenizers learn from {len(train_texts)} samples of "
             f"{', '.join(train_cats) if train_cats else 'every category'} (and are measured on the same input)")

    adapters = load_adapters(s["tokenizers"], s["extras"], train_texts, s["vocab_size"], rec)
    texts = [x.text for x in samples]
    encoded: list[Encoded] = []
    for adapter in rec.progress(adapters, total=len(adapters), description="encoding"):
        ids = adapter.encode_batch(texts)
        rec.time("encode", lambda a=adapter: a.encode_batch(texts), repeats=3, warmup=0, tokenizer=adapter.name)
        encoded.append(Encoded(adapter, ids))

    record_samples(rec, samples, encoded)
    totals = record_aggregates(rec, samples, encoded, categories, s["fertility"])
    check_counts(rec, samples, encoded)
    check_round_trips(rec, samples, encoded)
    check_reference_bpe(rec, samples, encoded)
    digit_rows = record_digits(rec, encoded, s["digit_run_max"])
    premiums = record_premium(rec, samples, encoded, totals, s["numerator"], s["denominator"])

    rec.print(results_table(encoded, categories, totals, premiums))
    rec.plot("tokens_by_category", bar_chart(encoded, categories, totals))
    rec.plot("digit_runs", digit_chart(digit_rows))
    rec.summary(summary_markdown(samples, encoded, categories, totals, premiums, s))


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
                      fertility_cats: list[str]) -> dict[str, dict[str, int]]:
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


def utf8_length(text: str) -> int:
    """UTF-8 bytes of ``text`` from the code points, by the encoding's ranges (RFC 3629), not by an encoder."""
    return sum(1 if cp < 0x80 else 2 if cp < 0x800 else 3 if cp < 0x10000 else 4 for cp in map(ord, text))


def code_point_count(text: str) -> int:
    """Code points of ``text`` counted on its UTF-8 bytes: every byte that is not a continuation byte (10xxxxxx)
    starts one character (independent of Python's own str length)."""
    return sum(1 for b in text.encode("utf-8", errors="surrogatepass") if b & 0xC0 != 0x80)


def reference_count(adapter: lab.Adapter, text: str) -> tuple[int, str]:
    """The count ``adapter``'s batch path must give for ``text`` and where it comes from. Library tokenizers: the
    library's own single-text call. bytes / chars (no library): computed here from first principles, never with
    the adapter's own expression (a bug there would otherwise be compared with itself)."""
    if isinstance(adapter, lab.BytesAdapter):
        return utf8_length(text), "UTF-8 lengths of the code points (RFC 3629 ranges)"
    if isinstance(adapter, lab.CharsAdapter):
        return code_point_count(text), "UTF-8 lead bytes (one per code point)"
    return adapter.direct_count(text), "the library's own encode() counts"


def check_counts(rec: Recorder, samples: list[Sample], encoded: list[Encoded]) -> None:
    """The recorded counts (from the batch path) equal an independent count, sample by sample: the library's own
    single-text call, or for bytes / chars a first-principles count."""
    for e in encoded:
        direct = [reference_count(e.adapter, x.text) for x in samples]
        bad = [(x.line, len(ids), d) for x, ids, (d, _) in zip(samples, e.ids, direct, strict=True) if len(ids) != d]
        source = direct[0][1] if direct else "the reference"
        detail = f"{len(samples)} samples: batch counts == {source}"
        if bad:
            detail = "first mismatch: line {} recorded {}, reference {}".format(*bad[0]) + f" ({source})"
        rec.check(f"counts_match_library[{e.adapter.name}]", not bad, len(bad), 0, detail)


def check_round_trips(rec: Recorder, samples: list[Sample], encoded: list[Encoded]) -> None:
    """decode(encode(x)) == x for every sample, for each tokenizer that promises to be lossless."""
    import torch

    for e in encoded:
        if not e.adapter.lossless:
            continue
        bad = [(x, ids) for x, ids in zip(samples, e.ids, strict=True) if e.adapter.decode(ids) != x.text]
        detail = f"{len(samples)} samples decode back exactly"
        evidence = None
        if bad:
            x, ids = bad[0]
            detail = f"line {x.line}: {x.text[:40]!r} -> {e.adapter.decode(ids)[:40]!r}"
            evidence = {"ids": torch.tensor(ids, dtype=torch.long)}
        rec.check(f"round_trip[{e.adapter.name}]", not bad, len(bad), 0, detail, evidence)


def check_reference_bpe(rec: Recorder, samples: list[Sample], encoded: list[Encoded]) -> None:
    """cl100k/o200k ids equal an independent pre-tokenizer + plain-Python BPE over the same ranks."""
    import torch

    for e in encoded:
        if e.adapter.name not in lab.OPENAI_NAMES:
            continue
        bad = [(x, ids) for x, ids in zip(samples, e.ids, strict=True)
               if lab.reference_openai_encode(e.adapter.name, x.text) != ids]
        detail = f"{len(samples)} samples: ids identical to the reference BPE"
        evidence = None
        if bad:
            x, ids = bad[0]
            ref = lab.reference_openai_encode(e.adapter.name, x.text)
            detail = f"line {x.line}: {len(ids)} ids vs reference {len(ref)}"
            evidence = {"ids": torch.tensor(ids, dtype=torch.long), "reference": torch.tensor(ref, dtype=torch.long)}
        rec.check(f"matches_reference_bpe[{e.adapter.name}]", not bad, len(bad), 0, detail, evidence)


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


# ------------------------------------------------------------------------------------------- output
def results_table(encoded: list[Encoded], categories: list[str], totals: dict[str, dict[str, int]],
                  premiums: dict[str, float]) -> Table:
    table = Table(title="tokens per category (lower = cheaper)", padding=(0, 1), collapse_padding=True)
    table.add_column("tokenizer", no_wrap=True)
    table.add_column("vocab", justify="right", no_wrap=True)
    for cat in categories + [ALL]:
        table.add_column(cat, justify="right", no_wrap=True, min_width=len(cat))
    table.add_column("premium", justify="right", no_wrap=True, min_width=7)
    for e in encoded:
        name = e.adapter.name
        cells = [name, f"{e.adapter.vocab_size}"] + [str(totals[name][c]) for c in categories + [ALL]]
        cells.append(f"{premiums[name]:.2f}" if name in premiums else "-")
        table.add_row(*cells)
    return table


def bar_chart(encoded: list[Encoded], categories: list[str], totals: dict[str, dict[str, int]]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 1.3 * len(categories) + 2), 4.2))
    ax = fig.subplots()
    width = 0.8 / max(1, len(encoded))
    for k, e in enumerate(encoded):
        xs = [i + (k - (len(encoded) - 1) / 2) * width for i in range(len(categories))]
        ax.bar(xs, [totals[e.adapter.name][c] for c in categories], width, label=e.adapter.name)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("tokens (total over the category)")
    ax.set_title("Tokens per category and tokenizer")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def digit_chart(rows: dict[str, list[int]]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    styles = ["-", "--", "-.", ":"]
    for k, (name, counts) in enumerate(rows.items()):  # wide-to-thin lines keep coinciding ones visible
        ax.plot(range(1, len(counts) + 1), counts, ls=styles[k % len(styles)], lw=max(1.0, 4.0 - 0.45 * k),
                marker=".", label=name)
    ax.set_xlabel("digits in the run (prefixes of pi)")
    ax.set_ylabel("tokens")
    ax.set_title("How digit runs are split")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "\\n")


def _md_piece(piece: str) -> str:
    """A piece for a markdown table: spaces shown as '␣' so leading spaces stay visible."""
    return _md_cell(piece).replace(" ", "␣")


def summary_markdown(samples: list[Sample], encoded: list[Encoded], categories: list[str],
                     totals: dict[str, dict[str, int]], premiums: dict[str, float], s: dict[str, Any]) -> str:
    cols = categories + [ALL]
    lines = ["## Tokens per category", "", "| tokenizer | vocab | " + " | ".join(cols) + " | premium |",
             "|---|---:|" + "---:|" * len(cols) + "---:|"]
    for e in encoded:
        name = e.adapter.name
        p = f"{premiums[name]:.2f}" if name in premiums else "-"
        lines.append(f"| {name} | {e.adapter.vocab_size:,} | " + " | ".join(str(totals[name][c]) for c in cols)
                     + f" | {p} |")
    if premiums:
        lines += ["", f"Premium = total tokens of `{s['numerator']}` / total tokens of `{s['denominator']}` on the "
                  "parallel samples (a ratio of totals, Petrov et al. 2023)."]
    shown = [x for cat in categories for x in [y for y in samples if y.category == cat][: s["show"]]]
    if shown:
        lines += ["", "## Why: the pieces", ""]
        for x in shown:
            lines += [f"**line {x.line} ({x.category})**: `{_md_cell(x.text)}`", "",
                      "| tokenizer | n | pieces |", "|---|---:|---|"]
            i = samples.index(x)
            for e in encoded:
                pieces = " ".join(f"`{_md_piece(p)}`" for p in e.adapter.pieces(e.ids[i]))
                lines.append(f"| {e.adapter.name} | {len(e.ids[i])} | {pieces} |")
            lines.append("")
    lines += ["Pieces are shown in backticks, ␣ = a space, \\xNN = a byte that is only part of a UTF-8 character.",
              "All samples' ids and pieces: metrics.parquet, rows `name == 'tokens'`, columns `ids`, `pieces`."]
    return "\n".join(lines)


def sweep_plots(df) -> dict[str, Any]:
    """After a multirun: the premium of each tokenizer against the first override key that varies."""
    import pandas as pd
    from matplotlib.figure import Figure

    known = {"name", "value", "step", "tokenizer", "category", "sample", "ids", "pieces", "numerator",
             "denominator", "job", "run_id", "status"}
    prem = df[df["name"] == "premium"] if "name" in df.columns else df.iloc[0:0]
    keys = [c for c in df.columns if c not in known and prem[c].astype(str).nunique() > 1]
    if not keys or prem.empty:
        return {}
    key = keys[0]
    numeric = pd.to_numeric(prem[key], errors="coerce")
    x = numeric if numeric.notna().all() else prem[key].astype(str)
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for name, part in prem.assign(_x=x).groupby("tokenizer"):
        part = part.sort_values("_x")
        ax.plot(part["_x"], part["value"], marker="o", label=str(name))
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel(key)
    if {"numerator", "denominator"} <= set(prem.columns):
        ax.set_ylabel(f"premium ({prem['numerator'].iloc[0]} tokens / {prem['denominator'].iloc[0]} tokens)")
    else:
        ax.set_ylabel("premium")
    ax.set_title(f"Tokenization premium vs {key}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return {"premium_sweep": fig}


__all__ = ["run", "read_samples", "premium_ratio", "validate", "digit_violations", "sweep_plots", "Sample"]
