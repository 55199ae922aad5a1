"""masks: the returned weights sum to 1 per query row; future and padded keys get exactly 0."""

from __future__ import annotations

import math

import torch

from tfmoe.adapters import ContractError
from tfmoe.components.comparison import COARSER, hidden_weight_max, row_sum_deviation
from tfmoe.experiments.attn_check.layer import LayerUnderTest


def check_rows_and_masks(layer: LayerUnderTest) -> None:
    """2. every row sums to 1; 3. future and padded keys get exactly 0 weight."""
    attn, s = layer.attn, layer.s
    if attn is None or tuple(attn.shape) != (s.B, s.n_heads, s.T, s.T):
        raise ContractError(f"attn_weights shape {None if attn is None else tuple(attn.shape)} "
                                  f"is not (B,H,T,T) = {(s.B, s.n_heads, s.T, s.T)}")
    eps = torch.finfo(attn.dtype).eps if attn.is_floating_point() else 0.0
    dev = row_sum_deviation(attn, layer.valid)
    tol = 4 * eps * (1 + math.log2(s.T))
    layer.rec.metric("row_sum_max_dev", dev, dtype=str(attn.dtype).removeprefix("torch."))
    cause = ""
    if math.isfinite(dev) and dev > tol:
        for coarse in COARSER.get(attn.dtype, ()):
            if dev <= 4 * torch.finfo(coarse).eps * (1 + math.log2(s.T)):
                cause = (f"; CAUSE: the weights sum to 1 only to {str(coarse).removeprefix('torch.')} precision: the "
                         f"module computes its softmax in {str(coarse).removeprefix('torch.')} (see sdpa_match)")
                break
    layer.rec.check_le("row_sums", dev, tol, f"max |Σ_k w - 1| over {int(layer.valid.sum())} query rows x {s.n_heads} heads "
                     f"(rows without a visible key{'' if s.padded_query_policy == 'attend' else ' and padded queries'} excluded); "
                     "tolerance 4·eps·(1+log2 T)" + cause,
                     evidence=layer.evidence(attn=attn))
    if s.causal and s.T < 2:  # one key per row: a causal mask hides nothing, a pass would be vacuous
        layer.rec.not_applicable("causal_zero", "not judged: with T=1 each query sees its one key, so a causal mask "
                                 "hides nothing (vacuous); set T >= 2 to judge it")
    elif s.causal:
        future = ~torch.ones(s.T, s.T, dtype=torch.bool).tril()  # (T,T) key j > query i
        leak = hidden_weight_max(attn, future[None, None], layer.valid)
        layer.rec.metric("future_weight_max", leak)
        layer.rec.check_le("causal_zero", leak, 0.0, "max |w| on future keys (j > i) must be exactly 0",
                         evidence=layer.evidence(attn=attn))
    if not bool(layer.padding_mask.all()):
        padded_keys = (~layer.padding_mask)[:, None, None, :]  # (B,1,1,T)
        leak = hidden_weight_max(attn, padded_keys, layer.valid)
        layer.rec.metric("padded_key_weight_max", leak)
        layer.rec.check_le("padding_zero", leak, 0.0, "max |w| on padded keys must be exactly 0 "
                         "(padding hides keys; padded queries still attend)", evidence=layer.evidence(attn=attn))

