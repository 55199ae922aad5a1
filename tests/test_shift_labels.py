"""shift-labels: each check has a planted bug that makes it fail; boundaries and bad input."""

from __future__ import annotations

import pytest
import torch

from tfmoe.api.testing import run_recorded
from tfmoe.components.lm import TinyCausalLM
from tfmoe.contract.errors import BadInput
from tfmoe.experiments import shift_labels as sl
from tfmoe.experiments.shift_labels import batch as slb
from tfmoe.experiments.shift_labels import checks as slc

SEQS = [[1, 3, 4, 5, 2], [1, 5, 7, 2], [1, 6, 2]]  # BOS 我 爱 猫 EOS / BOS 猫 睡 EOS / BOS 狗 EOS
PAD, IGN = 0, -100


def model(seed: int = 0) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM(12, 32, 4, 2, max_len=8).eval()


@pytest.mark.parametrize("side", ["right", "left"])
def test_shift_and_pad_normal(side: str) -> None:
    b = slb.shift_and_pad(SEQS, PAD, side, IGN)
    assert b.sequences.shape == (3, 5) and b.inputs.shape == b.labels.shape == (3, 4)
    assert slc.check_labels_are_next_tokens(b, SEQS, IGN, side) == 0
    assert slc.check_no_label_on_padding(b, IGN) == 0 == slc.check_no_label_on_padding(b, IGN, SEQS, side)
    assert slc.label_count(b, IGN) == sum(len(s) - 1 for s in SEQS)
    # the shortest sequence: right padding puts its pads last, left padding first
    assert b.attention_mask[2].tolist() == ([1, 1, 1, 0] if side == "right" else [0, 0, 1, 1])


def test_boundary_equal_lengths_and_two_token_sequences() -> None:
    b = slb.shift_and_pad([[1, 2], [3, 4]], PAD, "right", IGN)
    assert b.labels.tolist() == [[2], [4]] and b.label_mask.tolist() == [[1], [1]]


def test_planted_unshifted_labels_fail_next_token_check() -> None:
    b = slb.shift_and_pad(SEQS, PAD, "right", IGN)
    b.labels = torch.where(b.labels == IGN, b.labels, b.inputs)  # bug: labels = inputs, no shift
    assert slc.check_labels_are_next_tokens(b, SEQS, IGN) > 0


def test_planted_unmasked_padding_fails_padding_check() -> None:
    b = slb.shift_and_pad(SEQS, PAD, "right", IGN)
    b.labels = b.sequences[:, 1:].clone()  # bug: pads keep their PAD label
    assert slc.check_no_label_on_padding(b, IGN) > 0


def test_planted_pad_id_labels_fail_cross_entropy_check() -> None:
    m = model()
    b = slb.shift_and_pad(SEQS, PAD, "right", IGN)
    logits, _ = slb.token_losses(m, b, IGN)
    ok, _, _ = slc.ce_mismatch(logits, b, IGN)
    assert ok < 1e-6
    b.labels = b.sequences[:, 1:].clone()  # bug: padding labelled with the PAD id instead of ignore_index
    bad, _, _ = slc.ce_mismatch(logits, b, IGN)
    assert bad > 1e-3


def _failed(monkeypatch, batch_bug, side: str = "right") -> set[str]:
    """The checks a run fails when shift_and_pad's batch is changed by ``batch_bug`` (a planted bug)."""
    real = slb.shift_and_pad

    def buggy(seqs, pad_id, pad_side, ignore_index=-100):
        return batch_bug(real(seqs, pad_id, pad_side, ignore_index), ignore_index)

    monkeypatch.setattr(slb, "shift_and_pad", buggy)
    rec = run_recorded("shift-labels", [f"pad_side={side}", "model.n_layers=1"])
    monkeypatch.setattr(slb, "shift_and_pad", real)
    return {c.check for c in rec.checks_rows if not c.passed}


def test_planted_lost_last_label_fails_label_count_only(monkeypatch) -> None:
    """label_count had no planted-bug test (issue 11 item 2); blame stays with it (item 9): the kept labels are
    right, no label sits on padding."""
    def drop_last_label(b, ign):  # bug: the last target of every sequence (… -> EOS) is ignored
        last = b.label_mask.cumsum(1) == b.label_mask.sum(1, keepdim=True)
        b.labels[last & (b.label_mask == 1)] = ign
        return b

    # the loss then averages over 3 targets fewer, so the CE check (vs every target of the sequences) fails too
    assert _failed(monkeypatch, drop_last_label) == {"label_count", "ce_ignore_index_matches_manual"}


def test_planted_mask_bug_is_judged_against_the_sequences_not_the_batch_mask(monkeypatch) -> None:
    """Regression (issue 11 item 2): no_label_on_padding read the batch's own mask, so a shift_and_pad whose mask
    and labels were wrong together passed. Here the mask claims one pad after each shorter sequence is real."""
    def one_pad_too_many(b, ign):
        L = b.sequences.shape[1]
        for i in range(b.sequences.shape[0]):
            n = int(b.mask[i].sum())
            if n < L:
                b.mask[i, n] = 1
                b.label_mask[i, n - 1] = 1
                b.labels[i, n - 1] = b.sequences[i, n]  # EOS -> PAD becomes a "pair"
        return b

    failed = _failed(monkeypatch, one_pad_too_many)
    assert {"no_label_on_padding", "label_count"} <= failed and "labels_are_next_tokens" not in failed
    b = one_pad_too_many(slb.shift_and_pad(SEQS, PAD, "right", IGN), IGN)
    assert slc.check_no_label_on_padding(b, IGN) == 0  # the batch's own mask cannot see it
    assert slc.check_no_label_on_padding(b, IGN, SEQS, "right") == 2


def test_expected_label_positions_by_hand() -> None:
    assert slc.expected_label_positions(SEQS, 4, "right") == [[0, 1, 2, 3], [0, 1, 2], [0, 1]]
    assert slc.expected_label_positions(SEQS, 4, "left") == [[0, 1, 2, 3], [1, 2, 3], [2, 3]]
    for side in ("right", "left"):
        b = slb.shift_and_pad(SEQS, PAD, side, IGN)
        assert slc.check_labels_are_next_tokens(b, SEQS, IGN, side) == 0
        assert slc.check_no_label_on_padding(b, IGN, SEQS, side) == 0


class NoPaddingMaskLM(torch.nn.Module):
    """Planted bug: forgets to pass the padding mask to attention."""

    def __init__(self, inner: TinyCausalLM) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx, padding_mask=None, position_ids=None, caches=None):
        return self.inner(idx, None, position_ids)


def test_padding_invariance_holds_for_the_real_model_both_sides() -> None:
    for side in ("right", "left"):
        d_loss, d_logits, d_side, scale = slc.padding_invariance(model(), SEQS, PAD, side, IGN)
        tol = slc.invariance_tolerance(torch.float32) * scale
        assert d_loss <= tol and d_logits <= tol and d_side <= tol


def test_planted_missing_padding_mask_fails_invariance_with_left_padding() -> None:
    buggy = NoPaddingMaskLM(model())
    d_loss, d_logits, d_side, scale = slc.padding_invariance(buggy, SEQS, PAD, "left", IGN)
    assert d_loss > 1e-3 and d_logits > 1e-3 and d_side > 1e-3
    # with right padding the causal mask alone already hides the pads (a finding, not a bug)
    d_loss_r, *_ = slc.padding_invariance(buggy, SEQS, PAD, "right", IGN)
    assert d_loss_r <= slc.invariance_tolerance(torch.float32) * scale


def test_planted_absolute_positions_fail_invariance_with_left_padding() -> None:
    d_loss, d_logits, _, _ = slc.padding_invariance(model(), SEQS, PAD, "left", IGN, positions_from_mask=False)
    assert d_loss > 1e-3 and d_logits > 1e-3


@pytest.mark.parametrize(("seqs", "needle"), [
    ([], "sequences is empty"), ([[]], "is empty"), ([["BOS"]], "has 1 token"),
    ([["BOS", 99]], "outside the vocabulary"), ([["BOS", "zebra"]], "not in the vocabulary"),
    ([["BOS", True]], "not a token"),
])
def test_encode_sequences_bad_input(seqs, needle: str) -> None:
    with pytest.raises(BadInput, match=needle):
        slb.encode_sequences(seqs, ["PAD", "BOS", "EOS"])


def test_unknown_pad_side_is_bad_input() -> None:
    with pytest.raises(BadInput, match="pad_side"):
        slb.shift_and_pad(SEQS, PAD, "middle", IGN)


def test_run_records_the_named_tensors_and_is_bit_identical() -> None:
    a, b = run_recorded("shift-labels"), run_recorded("shift-labels")
    assert a.all_passed and {c.check for c in a.checks_rows} >= {
        "labels_are_next_tokens", "no_label_on_padding", "ce_ignore_index_matches_manual",
        "padding_invariance_loss", "padding_invariance_logits", "left_right_same_token_loss"}
    names = {"sequences", "inputs", "labels", "attention_mask", "token_loss"}
    assert names <= set(a.tensors_saved)
    assert a.tensors_saved["labels"].shape == a.tensors_saved["inputs"].shape == (3, 4)
    tl, lab = a.tensors_saved["token_loss"], a.tensors_saved["labels"]
    assert (tl[lab == -100] == 0).all() and (tl[lab != -100] > 0).all()
    for n in names:
        assert torch.equal(a.tensors_saved[n], b.tensors_saved[n])
    loss = [r["value"] for r in a.metrics_rows if r["name"] == "loss"]
    assert loss == [r["value"] for r in b.metrics_rows if r["name"] == "loss"] and loss[0] > 0


def test_summary_names_losses_and_logits() -> None:
    """Regression (issue 11 item 10): the summary said "padding invariance max |Δ| = 2.38e-07" without saying it was
    the per-token losses (the README said Δ = 0); both quantities are named now, in the terminal and summary.md."""
    from rich.console import Console

    from tfmoe.api.testing import compose, make_recorder

    cfg = compose("shift-labels", ["model.n_layers=1"])
    rec = make_recorder(cfg)
    rec.console = Console(record=True, width=400)
    sl.run(sl.settings(cfg), rec)
    m = {r["name"]: r["value"] for r in rec.metrics_rows if "sequence" not in r}
    want = (f"alone vs in the padded batch: per-token losses max |Δ| = {m['padding_invariance_max_abs']:.3g}, "
            f"logits max |Δ| = {m['padding_invariance_logits_max_abs']:.3g}")
    assert want in rec.summary_parts[-1] and want in rec.console.export_text()
    assert f"right vs left padding: per-token losses max |Δ| = {m['left_right_max_abs']:.3g}" in rec.summary_parts[-1]


def test_settings_touch_no_device() -> None:
    """settings() runs for every job of a sweep before any starts: a device this machine lacks is no error there;
    the sequences are encoded once, there."""
    from tfmoe.api.testing import compose

    s = sl.settings(compose("shift-labels", ["device=cuda:7", "dtype=bf16"]))
    assert s.vocab[s.pad_id] == "PAD" and s.sequences[2] == (1, 6, 2) and s.texts is None and s.tokenizer_ids == ()


def test_per_position_table_is_whole_when_redirected_at_80_columns() -> None:
    """Issue 12 item 8: with output redirected (rich assumes 80 columns) the table is one tables.Rows printed at
    its natural width: no cell cut to '…', the same rows as summary.md's table."""
    import io

    from rich.console import Console

    from tfmoe.api.testing import compose, make_recorder

    cfg = compose("shift-labels", ["model.n_layers=1"])
    rec = make_recorder(cfg)
    rec.console = Console(file=io.StringIO(), width=80)
    sl.run(sl.settings(cfg), rec)
    text = rec.console.file.getvalue()
    assert "…" not in text and "−100 (ignored)" in text and "attention_mask" in text and "label_mask" in text
    summary = "\n".join(rec.summary_parts)
    assert "| 2 | 3 | PAD | −100 (ignored) | 0 | 0 |" in summary  # [BOS, 狗, EOS] right-padded: no label on PAD


def test_low_precision_run_passes_with_dtype_tolerances() -> None:
    rec = run_recorded("shift-labels", ["dtype=bf16", "model.n_layers=1"])
    assert rec.all_passed, [(c.check, c.observed, c.threshold) for c in rec.checks_rows if not c.passed]


def test_token_losses_moves_the_host_batch_to_the_models_device():
    """F-210: the first CUDA run (H200) crashed in padding_invariance: the batch is built on the host and
    token_losses fed it to a model on cuda:0. A model on the meta device records where its inputs arrive."""

    class WhereInputsArrive(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3, device="meta"))
            self.seen: list[torch.device] = []

        def forward(self, idx, padding_mask=None, position_ids=None):
            self.seen += [t.device for t in (idx, padding_mask, position_ids)]
            return torch.zeros(*idx.shape, 7, device=idx.device)

    m = WhereInputsArrive()
    b = slb.shift_and_pad([[1, 2, 3, 4], [1, 5, 4]], pad_id=0, pad_side="right", ignore_index=IGN)
    _, loss = slb.token_losses(m, b, IGN)
    assert m.seen and {d.type for d in m.seen} == {"meta"} and loss.device.type == "meta"
