"""shift-labels' subject: sequences -> the padded batch of inputs and next-token labels, and its per-token losses.

Sequences come from the config (token strings or ids) or from your own sentences through one of tokenize's real
tokenizers, onto a compact vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tfmoe.components.lm import TinyCausalLM
from tfmoe.components.positions import position_ids_from_mask
from tfmoe.contract.errors import BadInput

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
        raise BadInput("sequences is empty: give at least one sequence, e.g. 'sequences=[[BOS,\"我\",EOS]]'")
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
    device = next(model.parameters()).device  # the batch is built on the host (F-210: a CUDA run crashed here)
    inputs, attention_mask, labels = (t.to(device) for t in (batch.inputs, batch.attention_mask, batch.labels))
    pos = position_ids_from_mask(attention_mask) if positions_from_mask else None
    logits = model(inputs, padding_mask=attention_mask.bool(), position_ids=pos).float()
    loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=ignore_index, reduction="none")
    return logits, loss  # cross_entropy puts 0 at ignored positions


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
    from tfmoe.experiments.tokenize.tokenizers_lab import BUILTIN_NAMES, load_tokenizer

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
