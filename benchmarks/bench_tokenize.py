"""Throughput of each tokenizer on ~1 MB of text, and the wall time of the default `tfmoe tokenize` run.

    .venv/bin/python benchmarks/bench_tokenize.py [--mb 1.0] [--repeats 3]

The 1 MB text is the shipped corpus (zh/en/code/numbers/mixed lines) repeated, encoded line by line
through each adapter's batch path (the path the experiment uses). The trained tokenizers learn from the
corpus first (not timed). Prints tokens/s, MB/s and each tokenizer's speed as a ratio to cl100k_base, and
the same text encoded as 8 long chunks (lines joined by newlines), which shows the per-call overhead.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tfmoe.experiments.tokenize import samples as tokenize_input
from tfmoe.experiments.tokenize import tokenizers_lab as lab

NAMES = ["cl100k_base", "o200k_base", "bpe", "wordpiece", "unigram", "bytes", "chars"]


def one_mb_of_lines(mb: float) -> list[str]:
    samples, _, _ = tokenize_input.read_samples(None)
    base = [x.text for x in samples]
    lines: list[str] = []
    size = 0
    while size < mb * 1e6:
        for t in base:
            lines.append(t)
            size += len(t.encode("utf-8")) + 1
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    lines = one_mb_of_lines(args.mb)
    n_bytes = sum(len(t.encode("utf-8")) for t in lines)
    train = [x.text for x in tokenize_input.read_samples(None)[0]]
    names = NAMES + (["bert_uncased"] if lab.bert_tokenizer_path() else [])
    print(f"text: {len(lines)} lines, {n_bytes / 1e6:.2f} MB (shipped corpus repeated); median of {args.repeats}")
    blob = "\n".join(lines)
    step = len(blob) // 8 + 1
    chunks = [blob[i:i + step] for i in range(0, len(blob), step)]
    print(f"{'tokenizer':<14}{'tokens':>10}{'seconds':>10}{'Mtok/s':>10}{'MB/s':>9}{'vs cl100k':>11}"
          f"{'8 chunks MB/s':>15}")
    rates: dict[str, float] = {}
    for name in names:
        adapter = lab.load_tokenizer(name, train, 1000)
        adapter.encode_batch(lines[:100])  # warm-up
        walls, n_tok = [], 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ids = adapter.encode_batch(lines)
            walls.append(time.perf_counter() - t0)
            n_tok = sum(map(len, ids))
        wall = statistics.median(walls)
        rates[name] = n_bytes / wall
        ratio = rates[name] / rates["cl100k_base"]
        t0 = time.perf_counter()
        adapter.encode_batch(chunks)
        chunk_rate = len(blob.encode("utf-8")) / (time.perf_counter() - t0) / 1e6
        print(f"{name:<14}{n_tok:>10}{wall:>10.3f}{n_tok / wall / 1e6:>10.2f}{n_bytes / wall / 1e6:>9.2f}{ratio:>10.2f}x"
              f"{chunk_rate:>15.2f}")

    from tfmoe.api.testing import run_recorded

    t0 = time.perf_counter()
    rec = run_recorded("tokenize")
    print(f"default `tfmoe tokenize` run (in-process, no files): {time.perf_counter() - t0:.2f} s, "
          f"{sum(c.passed for c in rec.checks_rows)}/{len(rec.checks_rows)} checks passed")


if __name__ == "__main__":
    main()
