"""dropout: eval mode is exact, train mode drops a fraction p and scales the rest by 1/(1-p), seeded."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from tfmoe.adapters import AttentionAdapter
from tfmoe.components.comparison import max_abs_err
from tfmoe.components.references import Projections
from tfmoe.experiments.attn_check.layer import LayerUnderTest, projection_tensors

if TYPE_CHECKING:
    from tfmoe.experiments.attn_check.settings import ModuleSettings


@dataclass
class DropoutReadout:
    """A train-mode forward whose output reveals each attention weight after dropout (see dropout_readout)."""

    values: torch.Tensor  # (n,) train-mode readout at every entry the no-dropout readout makes non-zero
    expected_kept: torch.Tensor  # (n,) no-dropout readout / (1-p): what a kept weight must read
    n_expected: int  # visible (query, key) pairs the readout should show (B · #visible pairs per row)
    evidence: dict[str, torch.Tensor]  # what reproduces the measurement (x, weights, both outputs, kept mask)
    resolution: float = 0.0  # relative rounding of the no-dropout weights vs the exact 1/n: the module's precision


def _readout_projections(d_model: int, device: torch.device, dtype: torch.dtype) -> Projections:
    zeros = torch.zeros(d_model, d_model, device=device, dtype=dtype)
    eye = torch.eye(d_model, device=device, dtype=dtype)
    return Projections(zeros, zeros, eye, eye, 1, 1)  # biases None -> written as 0


def dropout_readout(module: nn.Module, no_dropout: nn.Module, p: float, causal: bool, d_model: int, samples: int,
                    device: torch.device, dtype: torch.dtype, adapter: AttentionAdapter | None = None) -> DropoutReadout:
    """Make the module's output spell out its dropout mask: W_q = W_k = 0 (every visible key gets the same
    weight; RoPE of 0 is 0), W_v = W_out = I, biases 0, and token j = one-hot e_j, so every output entry carries
    exactly one attention weight (query i, key j) times its dropout factor (0 or 1/(1-p)).

    The expected value of each entry is read from ``no_dropout`` (the same class built with dropout=0, eval mode,
    same readout weights), not from the formula: a bug elsewhere in the module (a wrong merge of heads that
    permutes entries, a wrong scale, an off-by-one mask) moves entries around the same way in both forwards,
    so train/no-dropout at the non-zero entries measures dropout alone."""
    if adapter is None:
        from tfmoe.adapters.course import CourseInterface

        adapter = CourseInterface(type(module), type(module).__name__)
    T = min(d_model, 64)
    readout_p = _readout_projections(d_model, device, dtype)
    adapter.set_projections(module, readout_p)
    adapter.set_projections(no_dropout, readout_p)
    visible = torch.ones(T, T, dtype=torch.bool).tril() if causal else torch.ones(T, T, dtype=torch.bool)
    per_row = int(visible.sum())
    B = max(1, math.ceil(samples / per_row))
    x = torch.zeros(B, T, d_model, device=device, dtype=dtype)
    x[:, torch.arange(T), torch.arange(T)] = 1.0  # token j = e_j
    module.train()
    try:
        with torch.no_grad():
            out_train, _ = adapter.forward(module, x, None, causal=causal)  # (B,T,D)
            out_ref, _ = adapter.forward(no_dropout.eval(), x, None, causal=causal)  # (B,T,D)
    finally:
        module.eval()
    train, ref = out_train.detach().double().cpu(), out_ref.detach().double().cpu()
    carries = torch.isfinite(ref) & (ref != 0)  # entries that carry one attention weight
    values = train[carries]
    expected = ref[carries] / (1 - p)
    evidence = {"x": x, "padding_mask": torch.ones(B, T, dtype=torch.bool),  # the readout passes None
                **projection_tensors(readout_p), "out_train": out_train, "out_no_dropout": out_ref,
                "kept_mask": carries & (train != 0)}  # (B,T,D) True = a weight-carrying entry dropout kept
    # every readout weight is 1/n (n visible keys): how far the no-dropout values sit from the nearest 1/n is
    # the precision the module computes in (an fp64 run of a module that computes in fp32 shows fp32 rounding)
    n = torch.arange(1, T + 2, dtype=torch.float64)
    resolution = float((ref[carries][:, None] * n[None, :] - 1).abs().min(dim=1).values.max()) if bool(
        carries.any()) else 0.0
    return DropoutReadout(values, expected, B * per_row, evidence, resolution)


def _readout_prerequisite(r: DropoutReadout) -> str:
    """'' if the no-dropout readout shows every visible (query, key) pair once, else what went wrong."""
    n = r.expected_kept.numel()
    if n == r.n_expected:
        return ""
    return (f"; PREREQUISITE: the no-dropout readout shows {n} non-zero entries where {r.n_expected} visible "
            "(query, key) pairs were expected, so a bug outside dropout (masking / projection) also enters this "
            "measurement: fix the module's other failed checks first")


def check_dropout(layer: LayerUnderTest) -> None:
    """10. attention dropout: eval = no dropout exactly; train drops a fraction p (±0.01), scales kept by
    1/(1-p); the same seed gives the same mask, the next call a new one."""
    s, rec = layer.s, layer.rec
    p = s.dropout
    no_drop = layer.build(dropout=0.0, state=layer.state())
    with torch.no_grad():
        out_p, _ = layer.call(layer.module, layer.x, layer.pm_arg)  # layer.module has dropout p, eval mode
        out_0, _ = layer.call(no_drop, layer.x, layer.pm_arg)
    diff = max_abs_err(out_p, out_0, layer.valid)
    rec.check_le("dropout_eval_identity", diff, 0.0, f"eval-mode output with dropout={p} vs dropout=0: max diff "
                 f"{diff:.3g} (must be exactly 0)", evidence=layer.evidence(out_dropout=out_p, out_no_dropout=out_0))

    probe = layer.build(dropout=p)
    probe_ref = layer.build(dropout=0.0)

    def readout() -> DropoutReadout:
        return dropout_readout(probe, probe_ref, p, s.causal, s.d_model, s.dropout_samples, layer.device, layer.dtype,
                               layer.adapter)

    torch.manual_seed(s.dropout_samples + 7)
    r1 = readout()
    prereq = _readout_prerequisite(r1)
    if prereq:
        rec.note("dropout checks" + prereq.removeprefix(";"))
    dropped = r1.values == 0
    rate = float(dropped.double().mean()) if r1.values.numel() else math.nan
    rec.metric("dropout_rate", rate, p=p)
    rec.check_le("dropout_rate", abs(rate - p), 0.01,
                 f"dropped fraction {rate:.4f} of {r1.values.numel()} attention weights vs p={p} (|diff| <= 0.01)"
                 + prereq, evidence=r1.evidence)
    kept = ~dropped
    if bool(kept.any()):
        scale_err = float(((r1.values[kept] - r1.expected_kept[kept]).abs() / r1.expected_kept[kept]).max())
    else:
        scale_err = math.inf
    eps = torch.finfo(layer.dtype).eps
    limit = 4 * eps + 4 * r1.resolution  # the scaling is judged at the precision the module computes in
    rec.metric("dropout_kept_scale_rel_err", scale_err)
    mean_ratio = float((r1.values / (r1.expected_kept * (1 - p))).mean()) if r1.values.numel() else math.nan
    rec.metric("dropout_mean_weight_ratio", mean_ratio)  # E[w_dropped]/w: 1 if unbiased
    rec.check_le("dropout_scale", scale_err, limit,
                 f"kept weights vs w/(1-p) (w read from the same readout with dropout=0): max rel deviation "
                 f"{scale_err:.3g} (limit 4·eps + 4·the readout's own rounding {r1.resolution:.2g} = {limit:.3g}); mean of the dropped-out weights / w = {mean_ratio:.4f} "
                 "(1 = expectation preserved)" + prereq, evidence=r1.evidence)
    torch.manual_seed(rec.seed + 1)
    r_seed = readout()
    r_next = readout()
    torch.manual_seed(rec.seed + 1)
    r_again = readout()
    m1, m_next, m2 = r_seed.values == 0, r_next.values == 0, r_again.values == 0
    differ_same_seed = float((m1 != m2).double().mean()) if m1.numel() else math.nan
    differ_next_call = float((m1 != m_next).double().mean()) if m1.numel() else math.nan
    rec.metric("dropout_mask_diff_same_seed", differ_same_seed)
    rec.metric("dropout_mask_diff_next_call", differ_next_call)
    rec.check("dropout_seed", differ_same_seed == 0.0 and differ_next_call > 0.0, differ_same_seed, 0.0,
              f"torch.manual_seed({rec.seed + 1}) twice -> masks differ in {differ_same_seed:.4f} of entries "
              f"(must be 0); the next call without reseeding differs in {differ_next_call:.4f} (must be > 0)" + prereq,
              evidence={**{k: v for k, v in r_seed.evidence.items() if k not in ("out_train", "kept_mask")},
                        "kept_mask_seeded": r_seed.evidence["kept_mask"],
                        "kept_mask_reseeded": r_again.evidence["kept_mask"],
                        "seed": torch.tensor(rec.seed + 1)})


def dropout_not_applicable(s: ModuleSettings, adapter: AttentionAdapter) -> str:
    """'' when the dropout checks can run, else why not."""
    if s.dropout == 0:
        return "dropout=0"
    if not adapter.takes_dropout:
        return f"{adapter.name} takes no `dropout`"
    if not adapter.can_set_projections:
        return f"{adapter.name}'s adapter cannot write the readout weights (no set_projections)"
    if s.n_kv_heads != s.n_heads:
        return f"the readout needs W_v = I, impossible with n_kv_heads={s.n_kv_heads} < n_heads"
    return ""

