"""shift-labels on your own sentences: raw texts through tokenize's real tokenizers (the hand vocabulary stays
the worked example)."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.api.testing import check_passed, run_cli, run_recorded
from tfmoe.experiments.shift_labels.batch import encode_texts


def test_cl100k_splits_cat_into_three_byte_tokens_o200k_keeps_it_whole() -> None:
    cl = encode_texts(["我爱猫", "猫"], "cl100k_base", "PAD")
    assert cl.tokenizer_ids[1] == [163, 234, 104]  # 猫 = e7 8c ab: no merge in cl100k, one token per byte
    assert cl.vocab[:3] == ["PAD", "BOS", "EOS"] and cl.sequences[1] == [1, 6, 7, 8, 2]
    o2 = encode_texts(["我爱猫", "猫"], "o200k_base", "PAD")
    assert o2.vocab == ["PAD", "BOS", "EOS", "我", "爱", "猫"] and o2.sequences == [[1, 3, 4, 5, 2], [1, 5, 2]]


def test_every_check_passes_on_real_tokenizer_input() -> None:
    rec = run_recorded("shift-labels", ['texts=["我爱猫","猫"]', "tokenizer=cl100k_base", "pad_side=left"])
    assert all(c.passed for c in rec.checks_rows), [(c.check, c.detail) for c in rec.checks_rows if not c.passed]
    assert check_passed(rec, "labels_are_next_tokens")
    valid = next(r for r in rec.metrics_rows if r["name"] == "valid_labels")["value"]
    assert valid == (6 + 1) + (3 + 1)  # [BOS] + n tokens + [EOS]: n + 1 labels per text
    per_text = {r["text"]: r["value"] for r in rec.metrics_rows if r["name"] == "tokens_per_text"}
    assert per_text == {0: 6, 1: 3} and rec.tensors_saved["tokenizer_ids"].tolist()[-3:] == [163, 234, 104]


def test_boundary_one_character_one_token() -> None:
    enc = encode_texts(["猫"], "chars", "PAD")
    assert enc.sequences == [[1, 3, 2]]  # the shortest text still has 2 labels (猫, EOS)


@pytest.mark.parametrize(("args", "needle"), [
    (['texts=["我爱猫"]'], "needs tokenizer=NAME"),
    (['texts=["猫"]', "tokenizer=nosuch"], "unknown tokenizer 'nosuch'"),
])
def test_bad_texts_exit_2_with_the_fix(workdir: Path, args: list[str], needle: str) -> None:
    r = run_cli(["shift-labels", *args], workdir)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.stderr


@pytest.mark.parametrize(("texts", "needle"), [
    (["我爱猫", ""], "texts[1] is empty"), ([], "non-empty list of strings"), ("我爱猫", "non-empty list"),
    (["猫", 3], "non-empty list of strings"),
])
def test_malformed_texts_are_refused(texts, needle: str) -> None:
    from tfmoe.contract.errors import BadInput

    with pytest.raises(BadInput, match=re.escape(needle)):
        encode_texts(texts, "chars", "PAD")


def test_cli_run_keeps_the_tokenizer_notes(workdir: Path) -> None:
    r = run_cli(["shift-labels", 'texts=["我爱猫","猫"]', "tokenizer=o200k_base", "--expect",
                 "tokens_per_text[text=1] == 1"], workdir)
    assert r.exit_code == 0, r.stderr
    notes = list(pd.read_parquet(r.run_dir / "run.parquet").iloc[0]["notes"])
    assert any("texts tokenized by o200k_base" in n for n in notes) and any("'猫' -> 1 token(s)" in n for n in notes)
