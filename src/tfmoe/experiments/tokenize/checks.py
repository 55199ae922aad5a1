"""tokenize's checks: the recorded counts against an independent count (the library's own single-text call, or for
bytes / chars a count from first principles), lossless round trips, and cl100k/o200k ids against the independent
plain-Python BPE of :func:`tfmoe.experiments.tokenize.tokenizers_lab.reference_openai_encode`."""

from __future__ import annotations

from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.tokenize import tokenizers_lab as lab
from tfmoe.experiments.tokenize.measures import Encoded
from tfmoe.experiments.tokenize.samples import Sample


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
