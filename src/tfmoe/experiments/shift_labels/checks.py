"""shift-labels' checks: labels against the original sequences, padding, the ignore_index loss against a manual
fp64 mean, and padding invariance (alone vs in a padded batch, left vs right padding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tfmoe.components.lm import TinyCausalLM
from tfmoe.experiments.shift_labels import batch as batching
from tfmoe.experiments.shift_labels.batch import ShiftedBatch


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
    batch = batching.shift_and_pad(seqs, pad_id, pad_side, ignore_index)
    logits, loss = batching.token_losses(model, batch, ignore_index, positions_from_mask)
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
