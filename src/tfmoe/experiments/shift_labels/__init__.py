"""tfmoe shift-labels — course §2.5: inputs = sequence[:-1], labels = sequence[1:], padding ignored.

Question: after shifting and padding, does every label name the next token, does no padded position
contribute to the loss, and is each sequence's loss the same alone as inside a padded batch?

This module is the recipe (Settings, settings(cfg), run); the parts it orchestrates:
:mod:`~tfmoe.experiments.shift_labels.batch` (sequences -> the shifted, padded batch; texts through a tokenizer)
and :mod:`~tfmoe.experiments.shift_labels.checks` (the checks).
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from tfmoe.components.lm import TinyCausalLM
from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.contract.tables import Rows
from tfmoe.experiments import lm_battery
from tfmoe.experiments.lm_battery import lm_settings
from tfmoe.experiments.shift_labels import batch as batching
from tfmoe.experiments.shift_labels.batch import PAD_SIDES, ShiftedBatch, encode_sequences, encode_texts
from tfmoe.experiments.shift_labels.checks import (
    ce_mismatch,
    check_labels_are_next_tokens,
    check_no_label_on_padding,
    invariance_tolerance,
    label_count,
    padding_invariance,
)
from tfmoe.experiments.shift_labels.settings import Settings
from tfmoe.rules import finite, memory
from tfmoe.rules.memory import (
    DTYPE_BYTES,
    Knob,
    available_memory_bytes,
    block_activation_elements,
    block_params,
)
from tfmoe.rules.validate import require_int

FINITE_QUANTITIES = ("loss", "loss_manual_fp64", "sequence_loss", "padding_invariance_max_abs",
                     "padding_invariance_logits_max_abs", "left_right_max_abs")


def settings(cfg: DictConfig) -> Settings:
    """The run's settings from the composed config; BadInput names the problem and the fix.

    With ``texts`` the sentences are tokenized here (on the CPU, by a local tokenizer: pad_token and
    ignore_index are judged against the vocabulary that produces); no device is touched.
    """
    texts = OmegaConf.to_container(cfg.texts) if cfg.get("texts") is not None else None
    enc = encode_texts(texts, cfg.get("tokenizer"), str(cfg.pad_token)) if texts is not None else None
    vocab = enc.vocab if enc is not None else [str(v) for v in OmegaConf.to_container(cfg.vocab)]
    if str(cfg.pad_token) not in vocab:
        raise BadInput(f"pad_token={cfg.pad_token!r} is not in vocab: add it to vocab")
    if cfg.pad_side not in PAD_SIDES:
        raise BadInput(f"pad_side={cfg.pad_side!r} is unknown: use pad_side=right or pad_side=left")
    if not isinstance(cfg.ignore_index, int) or 0 <= cfg.ignore_index < len(vocab):
        raise BadInput(f"ignore_index={cfg.ignore_index!r} collides with a vocabulary id: use a negative "
                       "integer such as -100")
    m = cfg.model
    for key in ("model.d_model", "model.n_heads", "model.n_layers"):  # n_layers=-1 made a model of no layers, "ok"
        require_int(cfg, key, 1)
    if m.d_model % m.n_heads != 0:
        raise BadInput(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}: "
                       "choose d_model as a multiple of n_heads")
    seqs = enc.sequences if enc is not None else encode_sequences(OmegaConf.to_container(cfg.sequences), vocab)
    s = Settings(
        sequences=tuple(tuple(q) for q in seqs), vocab=tuple(vocab), pad_token=str(cfg.pad_token),
        pad_id=vocab.index(str(cfg.pad_token)), pad_side=str(cfg.pad_side), ignore_index=int(cfg.ignore_index),
        d_model=int(m.d_model), n_heads=int(m.n_heads), n_layers=int(m.n_layers),
        texts=None if texts is None else tuple(texts), tokenizer=None if enc is None else str(cfg.tokenizer),
        tokenizer_source=None if enc is None else enc.source,
        tokenizer_ids=() if enc is None else tuple(tuple(i) for i in enc.tokenizer_ids), lm=lm_settings(cfg))
    if str(cfg.get("device")) == "cpu":  # the host's RAM is the device's: refused before anything is allocated
        refuse_oversized(s, str(cfg.get("dtype")), memory.host_available_bytes(), "the host's")
    return s


def estimated_bytes(z: dict[str, int], dtype: str, s: Settings) -> int:
    """Peak bytes of a shift-labels run with sizes ``z``: the tiny LM (embeddings, blocks, head) and a forward of
    the padded batch, of each sequence alone and of the other padding side (no gradients)."""
    e = DTYPE_BYTES.get(dtype, 4)
    d, n_layers, v = z["model.d_model"], z["model.n_layers"], len(s.vocab)
    t = max(len(q) for q in s.sequences)
    params = 2 * v * d + t * d + n_layers * block_params(d)
    tokens = 3 * len(s.sequences) * t
    return params * e + (2 * block_activation_elements(tokens, d, s.n_heads, t) + 2 * tokens * v) * max(e, 4)


def refuse_oversized(s: Settings, dtype: str, available: int, where: str) -> None:
    """BadInput (exit 2) naming the size that dominates the estimate and a value of it that fits."""
    knobs = {"model.d_model": Knob(s.d_model, s.n_heads, s.n_heads), "model.n_layers": Knob(s.n_layers)}
    memory.refuse_oversized(lambda z: estimated_bytes(z, dtype, s), knobs, available, where, "shift-labels")


def run(s: Settings, rec: Recorder) -> None:
    seqs, vocab, pad_id = [list(q) for q in s.sequences], list(s.vocab), s.pad_id
    if s.texts is not None:
        rec.note(f"texts tokenized by {s.tokenizer} ({s.tokenizer_source}); compact vocabulary of {len(vocab)} "
                 "entries (PAD, BOS, EOS + the pieces used); the tokenizer's own ids are in tensor tokenizer_ids")
        for n, (text, ids) in enumerate(zip(s.texts, s.tokenizer_ids, strict=True)):
            rec.metric("tokens_per_text", len(ids), text=n)
            rec.note(f"text {n} {text!r} -> {len(ids)} token(s) {list(ids)}: "
                     f"{' | '.join(vocab[j] for j in seqs[n][1:-1])}")
        rec.tensor("tokenizer_ids", torch.tensor([i for ids in s.tokenizer_ids for i in ids]))
    if rec.device.type != "cpu":  # a CUDA run's memory is not the host's
        refuse_oversized(s, {torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
            rec.dtype, "fp32"), available_memory_bytes(rec.device), f"{rec.device}'s")
    ignore = s.ignore_index
    batch = batching.shift_and_pad(seqs, pad_id, s.pad_side, ignore)

    # the per-position table
    table = Rows(f"shift-labels ({s.pad_side} padding, ignore_index={ignore})",
                 ("seq", "pos", "input", "label", "attention_mask", "label_mask"))
    for i in range(batch.inputs.shape[0]):
        for t in range(batch.inputs.shape[1]):
            lab = int(batch.labels[i, t])
            table.add(i, t, vocab[int(batch.inputs[i, t])], "−100 (ignored)" if lab == ignore else vocab[lab],
                      int(batch.attention_mask[i, t]), int(batch.label_mask[i, t]))
    table.print_to(rec.console)
    rec.summary("## Per-position table\n\n" + table.markdown())

    # checks on the labels themselves
    side = s.pad_side
    n_wrong = check_labels_are_next_tokens(batch, seqs, ignore, side)
    rec.check("labels_are_next_tokens", n_wrong == 0, n_wrong, 0,
              "every kept (input, label) pair equals (s[t], s[t+1]) of the original sequence at its position")
    n_bad = check_no_label_on_padding(batch, ignore, seqs, side)
    rec.check("no_label_on_padding", n_bad == 0, n_bad, 0,
              "labels where input or target is padding (from the sequences' lengths and the padding side)")
    n_labels = label_count(batch, ignore)
    expected = sum(len(q) - 1 for q in seqs)
    rec.check("label_count", n_labels == expected, n_labels, expected,
              "kept labels == Σ(len(s) − 1)" + ("" if n_labels >= expected else
                                                 f": {expected - n_labels} (token, next token) pairs lost a label"))

    if s.lm is not None:  # impl=...: the user's whole causal LM on these sequences
        battery = lm_battery.run_shift_labels(s.lm, rec, seqs, vocab, pad_id)
        lm_battery.learner_view(rec, battery, batch, vocab, s.pad_side, ignore)
        for name in ("sequences", "inputs", "labels", "attention_mask", "label_mask"):
            rec.tensor(name, getattr(batch, name))
        return
    model = TinyCausalLM(len(vocab), s.d_model, s.n_heads, s.n_layers,
                         max_len=max(len(q) for q in seqs)).to(rec.device, rec.dtype).eval()

    # loss: torch's ignore_index vs a manual mean over valid positions
    with torch.no_grad():
        batch_dev = ShiftedBatch(*(t.to(rec.device) for t in vars(batch).values()))
        logits, tok_loss = batching.token_losses(model, batch_dev, ignore)
        ce_diff, torch_ce, manual = ce_mismatch(logits, batch_dev, ignore, seqs, side)
        ce_tol = 8 * torch.finfo(torch.float32).eps * max(1.0, abs(manual))  # CE itself runs in fp32
        rec.check_le("ce_ignore_index_matches_manual", ce_diff, ce_tol,
                     "F.cross_entropy(ignore_index) vs fp64 mean of -log p(next token) over the positions that have "
                     "a target")
        rec.metric("loss", torch_ce)
        rec.metric("loss_manual_fp64", manual)
        rec.metric("valid_labels", n_labels)

        # padding invariance: alone vs in the batch, and left vs right
        tol = invariance_tolerance(rec.dtype)
        d_loss, d_logits, d_side, scale = padding_invariance(model, seqs, pad_id, s.pad_side, ignore)
        other = "left" if s.pad_side == "right" else "right"
        rec.check_le("padding_invariance_loss", d_loss, tol * scale,
                     "max |token loss alone − token loss in the padded batch|")
        rec.check_le("padding_invariance_logits", d_logits, tol * scale,
                     "max |logits alone − logits in the padded batch| at valid positions")
        rec.check_le("left_right_same_token_loss", d_side, tol * scale,
                     f"max |token loss with {s.pad_side} padding − with {other} padding|")
        rec.metric("padding_invariance_max_abs", d_loss)
        rec.metric("padding_invariance_logits_max_abs", d_logits)
        rec.metric("left_right_max_abs", d_side)
        valid = batch.label_mask.bool()
        for i in range(len(seqs)):
            rec.metric("sequence_loss", tok_loss[i][valid[i].to(tok_loss.device)].double().mean(), sequence=i)

    finite.check_finite(rec, "finite", FINITE_QUANTITIES, what="the losses and the padding-invariance gaps")

    rec.tensor("sequences", batch.sequences)
    rec.tensor("inputs", batch.inputs)
    rec.tensor("labels", batch.labels)
    rec.tensor("attention_mask", batch.attention_mask)
    rec.tensor("label_mask", batch.label_mask)
    rec.tensor("token_loss", tok_loss.cpu())
    line = (f"loss (mean over {n_labels} valid labels) = {torch_ce:.6f}; padding invariance, alone vs in the "
            f"padded batch: per-token losses max |Δ| = {d_loss:.3g}, logits max |Δ| = {d_logits:.3g} (tolerance "
            f"{tol * scale:.3g}); {s.pad_side} vs {other} padding: per-token losses max |Δ| = {d_side:.3g}")
    rec.print(line)
    rec.summary(line)
