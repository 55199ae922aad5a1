"""tfmoe shift-labels — course §2.5: inputs = sequence[:-1], labels = sequence[1:], padding ignored.

Question: after shifting and padding, does every label name the next token, does no padded position
contribute to the loss, and is each sequence's loss the same alone as inside a padded batch?
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from tfmoe.components.lm import TinyCausalLM
from tfmoe.components.positions import position_ids_from_mask
from tfmoe.errors import BadInput
from tfmoe.recorder import Recorder
from tfmoe.tables import Rows

PAD_SIDES = ("right", "left")


@dataclass
class ShiftedBatch:
    sequences: torch.Tensor  # (B, L) padded full sequences
    mask: torch.Tensor  # (B, L) 1 = real token
    inputs: torch.Tensor  # (B, L-1) = sequences[:, :-1]
    labels: torch.Tensor  # (B, L-1) = sequences[:, 1:], ignore_index where no target
    attention_mask: torch.Tensor  # (B, L-1) 1 = real input token
    label_mask: torch.Tensor  # (B, L-1) 1 = this position has a label


def encode_sequences(sequences: Any, vocab: list[str]) -> list[list[int]]:
    """Token strings or ids -> ids, refusing what next-token training cannot use."""
    if not isinstance(sequences, list) or not sequences:
        raise BadInput("sequences is empty: give at least one sequence, e.g. sequences=[[BOS,我,EOS]]")
    index = {tok: i for i, tok in enumerate(vocab)}
    out = []
    for n, seq in enumerate(sequences):
        if not isinstance(seq, list) or len(seq) == 0:
            raise BadInput(f"sequence {n} is empty: every sequence needs at least 2 tokens")
        if len(seq) == 1:
            raise BadInput(f"sequence {n} has 1 token: next-token training needs at least 2 (an input and its "
                           "successor); add a token or drop the sequence")
        ids = []
        for tok in seq:
            if isinstance(tok, bool):
                raise BadInput(f"sequence {n}: token {tok!r} is not a token string or id")
            if isinstance(tok, int):
                if not 0 <= tok < len(vocab):
                    raise BadInput(f"sequence {n}: id {tok} is outside the vocabulary (0..{len(vocab) - 1}): "
                                   "use an id in range or add the token to vocab")
                ids.append(tok)
            elif str(tok) in index:
                ids.append(index[str(tok)])
            else:
                raise BadInput(f"sequence {n}: token {tok!r} is not in the vocabulary: add it to vocab or fix it")
        out.append(ids)
    return out


def shift_and_pad(seqs: list[list[int]], pad_id: int, pad_side: str, ignore_index: int = -100) -> ShiftedBatch:
    """The padded batch, masks, inputs and labels (labels = next token, ignore_index where no target)."""
    if pad_side not in PAD_SIDES:
        raise BadInput(f"pad_side={pad_side!r} is unknown: use right or left")
    B, L = len(seqs), max(len(s) for s in seqs)
    sequences = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if pad_side == "right" else slice(L - len(s), L)
        sequences[i, sl] = torch.tensor(s)
        mask[i, sl] = 1
    inputs, labels = sequences[:, :-1], sequences[:, 1:].clone()  # (B, L-1)
    label_mask = mask[:, :-1] * mask[:, 1:]  # a target exists only if input and next token are both real
    labels[label_mask == 0] = ignore_index
    return ShiftedBatch(sequences, mask, inputs.clone(), labels, mask[:, :-1].clone(), label_mask)


def token_losses(model: TinyCausalLM, batch: ShiftedBatch, ignore_index: int = -100,
                 positions_from_mask: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B,L-1,V) fp32, per-token loss (B,L-1) fp32 with 0 where ignored)."""
    pos = position_ids_from_mask(batch.attention_mask) if positions_from_mask else None
    logits = model(batch.inputs, padding_mask=batch.attention_mask.bool(), position_ids=pos).float()
    loss = F.cross_entropy(logits.transpose(1, 2), batch.labels, ignore_index=ignore_index, reduction="none")
    return logits, loss  # cross_entropy puts 0 at ignored positions


# ------------------------------------------------------------------------------------------- checks
# The checks judge the batch against the original sequences and the padding side, never against the batch's own
# masks (a bug in shift_and_pad that made its masks and labels wrong together would otherwise be invisible).
def expected_label_positions(seqs: list[list[int]], width: int, pad_side: str) -> list[list[int]]:
    """Per sequence, the input positions (0..width-1 of inputs = sequences[:, :-1]) that must carry a label:
    its first len(s)-1 positions with right padding, its last len(s)-1 with left padding."""
    L = width + 1
    return [list(range(len(s) - 1)) if pad_side == "right" else list(range(L - len(s), L - 1)) for s in seqs]


def check_labels_are_next_tokens(batch: ShiftedBatch, seqs: list[list[int]], ignore_index: int,
                                 pad_side: str = "right") -> int:
    """Kept labels whose (input, label) pair is not (s[t], s[t+1]) at that position of the original sequence.
    Judges only the labels present where a label belongs; a missing label is ``label_count``'s, a label on
    padding ``no_label_on_padding``'s."""
    bad = 0
    for i, (s, positions) in enumerate(zip(seqs, expected_label_positions(seqs, batch.inputs.shape[1], pad_side),
                                           strict=True)):
        for t, pos in enumerate(positions):
            label = int(batch.labels[i, pos])
            if label != ignore_index and (int(batch.inputs[i, pos]), label) != (s[t], s[t + 1]):
                bad += 1
    return bad


def check_no_label_on_padding(batch: ShiftedBatch, ignore_index: int, seqs: list[list[int]] | None = None,
                              pad_side: str = "right") -> int:
    """Labels present at a position where no label belongs (its input or target is padding), from the original
    sequences' lengths and the padding side (``seqs=None``: from the batch's own padding mask)."""
    has_label = batch.labels != ignore_index
    if seqs is None:
        padded = (batch.mask[:, :-1] == 0) | (batch.mask[:, 1:] == 0)
    else:
        padded = torch.ones_like(has_label)
        for i, positions in enumerate(expected_label_positions(seqs, batch.inputs.shape[1], pad_side)):
            padded[i, positions] = False
    return int((has_label & padded).sum())


def label_count(batch: ShiftedBatch, ignore_index: int) -> int:
    """Labels the batch keeps (must be Σ(len(s) − 1): one per (token, next token) pair)."""
    return int((batch.labels != ignore_index).sum())


def manual_mean_ce(logits: torch.Tensor, batch: ShiftedBatch, seqs: list[list[int]] | None = None,
                   pad_side: str = "right") -> torch.Tensor:
    """Mean of -log p(next token) over the positions that have a target, in fp64: those of the original
    sequences and padding side (``seqs=None``: the batch's label_mask), targets from the sequences themselves."""
    logp = torch.log_softmax(logits.double(), dim=-1)  # (B,L-1,V)
    if seqs is None:
        valid = batch.label_mask.bool()
        targets = batch.sequences[:, 1:]  # the true next tokens, independent of the ignore_index labels
    else:
        valid = torch.zeros(batch.inputs.shape, dtype=torch.bool, device=logits.device)
        targets = torch.zeros(batch.inputs.shape, dtype=torch.long, device=logits.device)
        for i, (s, positions) in enumerate(zip(seqs, expected_label_positions(seqs, batch.inputs.shape[1], pad_side),
                                               strict=True)):
            valid[i, positions] = True
            targets[i, positions] = torch.tensor(s[1:], device=logits.device)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B,L-1)
    return -(picked[valid]).mean()


def per_sequence_losses(model: TinyCausalLM, seqs: list[list[int]], pad_id: int, pad_side: str,
                        ignore_index: int, positions_from_mask: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sequence's per-token losses and logits at the positions that have a target, from a padded batch."""
    batch = shift_and_pad(seqs, pad_id, pad_side, ignore_index)
    logits, loss = token_losses(model, batch, ignore_index, positions_from_mask)
    positions = expected_label_positions(seqs, batch.inputs.shape[1], pad_side)  # from the sequences, not the batch
    return [loss[i][p] for i, p in enumerate(positions)], [logits[i][p] for i, p in enumerate(positions)]


def ce_mismatch(logits: torch.Tensor, batch: ShiftedBatch, ignore_index: int, seqs: list[list[int]] | None = None,
                pad_side: str = "right") -> tuple[float, float, float]:
    """(|torch CE with ignore_index − manual fp64 mean over the positions with a target|, torch CE, manual CE)."""
    torch_ce = F.cross_entropy(logits.float().transpose(1, 2), batch.labels, ignore_index=ignore_index)
    manual = manual_mean_ce(logits, batch, seqs, pad_side)
    return abs(torch_ce.double().item() - manual.item()), torch_ce.item(), manual.item()


def padding_invariance(model: Any, seqs: list[list[int]], pad_id: int, pad_side: str, ignore_index: int,
                       positions_from_mask: bool = True) -> tuple[float, float, float, float]:
    """(max |Δ token loss| alone vs batch, max |Δ logits| alone vs batch, max |Δ token loss| this side vs the
    other padding side, logit scale) — all at valid positions only."""
    alone_loss, alone_logits = [], []
    for s in seqs:
        lo, lg = per_sequence_losses(model, [s], pad_id, pad_side, ignore_index, positions_from_mask)
        alone_loss += lo
        alone_logits += lg
    batch_loss, batch_logits = per_sequence_losses(model, seqs, pad_id, pad_side, ignore_index, positions_from_mask)
    other = "left" if pad_side == "right" else "right"
    other_loss, _ = per_sequence_losses(model, seqs, pad_id, other, ignore_index, positions_from_mask)
    scale = max(1.0, max(x.abs().max().item() for x in alone_logits))
    return (max_abs_diff(alone_loss, batch_loss), max_abs_diff(alone_logits, batch_logits),
            max_abs_diff(batch_loss, other_loss), scale)


def invariance_tolerance(dtype: torch.dtype) -> float:
    """Batch-vs-alone differences come only from reduction order: 8 ulps of the compute dtype (times the logit scale)."""
    return 8 * torch.finfo(dtype).eps


def max_abs_diff(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(xs, ys, strict=True))


# ----------------------------------------------------------------------------- your own sentences
@dataclass
class TextEncoding:
    sequences: list[list[int]]  # [BOS] + tokens + [EOS] in the compact vocabulary
    vocab: list[str]  # PAD, BOS, EOS, then each distinct token piece in order of appearance
    tokenizer_ids: list[list[int]]  # the tokenizer's own ids per text
    source: str  # where the tokenizer's vocabulary comes from


def encode_texts(texts: Any, tokenizer: Any, pad_token: str) -> TextEncoding:
    """Raw sentences through one of tokenize's real tokenizers, onto a compact vocabulary of the pieces they use
    (the tiny LM needs no 100k-row embedding): each text becomes [BOS] + its tokens + [EOS]."""
    from tfmoe.tokenizers_lab import BUILTIN_NAMES, load_tokenizer

    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise BadInput(f"texts={texts!r} must be a non-empty list of strings, e.g. texts=[\"我爱猫\",\"猫\"]")
    for n, t in enumerate(texts):
        if not t.strip():
            raise BadInput(f"texts[{n}] is empty: give every text at least one character")
    if not isinstance(tokenizer, str) or not tokenizer.strip():
        raise BadInput(f"texts= needs tokenizer=NAME: one of {', '.join(BUILTIN_NAMES)} or file:PATH/tokenizer.json")
    adapter = load_tokenizer(tokenizer, texts, 1000)
    ids = adapter.encode_batch(texts)
    vocab, index = [pad_token, "BOS", "EOS"], {}
    for seq in ids:
        for i in seq:
            if i not in index:
                label = adapter.pieces([i])[0]
                if label in vocab or not label.strip():
                    label = f"{label!r}#{i}"  # keep labels unique and visible (spaces, byte fragments)
                index[i] = len(vocab)
                vocab.append(label)
    seqs = [[1, *(index[i] for i in seq), 2] for seq in ids]
    return TextEncoding(seqs, vocab, ids, adapter.source)


# --------------------------------------------------------------------------------------------- run
@dataclass(frozen=True)
class Settings:
    """Every value a shift-labels run reads, validated by :func:`settings`; the sequences already encoded."""

    sequences: tuple[tuple[int, ...], ...]  # token ids, lengths may differ
    vocab: tuple[str, ...]  # id = index
    pad_token: str
    pad_id: int
    pad_side: str  # right | left
    ignore_index: int  # negative: never a vocabulary id
    d_model: int
    n_heads: int
    n_layers: int
    texts: tuple[str, ...] | None  # the user's sentences (None: `sequences` came from the config)
    tokenizer: str | None
    tokenizer_source: str | None  # where the tokenizer's vocabulary comes from
    tokenizer_ids: tuple[tuple[int, ...], ...]  # the tokenizer's own ids per text (empty without texts)


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
    if m.d_model % m.n_heads != 0:
        raise BadInput(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}: "
                       "choose d_model as a multiple of n_heads")
    seqs = enc.sequences if enc is not None else encode_sequences(OmegaConf.to_container(cfg.sequences), vocab)
    return Settings(
        sequences=tuple(tuple(q) for q in seqs), vocab=tuple(vocab), pad_token=str(cfg.pad_token),
        pad_id=vocab.index(str(cfg.pad_token)), pad_side=str(cfg.pad_side), ignore_index=int(cfg.ignore_index),
        d_model=int(m.d_model), n_heads=int(m.n_heads), n_layers=int(m.n_layers),
        texts=None if texts is None else tuple(texts), tokenizer=None if enc is None else str(cfg.tokenizer),
        tokenizer_source=None if enc is None else enc.source,
        tokenizer_ids=() if enc is None else tuple(tuple(i) for i in enc.tokenizer_ids))


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
    ignore = s.ignore_index
    batch = shift_and_pad(seqs, pad_id, s.pad_side, ignore)
    model = TinyCausalLM(len(vocab), s.d_model, s.n_heads, s.n_layers,
                         max_len=max(len(q) for q in seqs)).to(rec.device, rec.dtype).eval()

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

    # loss: torch's ignore_index vs a manual mean over valid positions
    with torch.no_grad():
        batch_dev = ShiftedBatch(*(t.to(rec.device) for t in vars(batch).values()))
        logits, tok_loss = token_losses(model, batch_dev, ignore)
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
