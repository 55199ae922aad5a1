"""Judging an attention output against a reference: FlashAttention's dtype rule, and what masked rows hold.

The rule (FlashAttention's tests): err(implementation vs a higher-precision reference) <= factor · err(a plain
implementation in the same dtype vs the same reference) + a rounding term at the reference's scale. Errors are
max |a - b| over the rows that are judged; a NaN or inf anywhere there makes the error inf (never a pass).

Plain PyTorch, imports nothing it judges: used by both of attn-check's batteries (layers and kernels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# dtypes coarser than the run's, in the order a layer that silently computes in lower precision would show
COARSER = {torch.float64: (torch.float32, torch.bfloat16, torch.float16),
           torch.float32: (torch.float16, torch.bfloat16), torch.float16: (torch.bfloat16,)}


def max_abs_err(out: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """max |out - ref| over the valid positions (valid selects out's leading dims, e.g. (B,T) query rows);
    NaN/inf -> inf."""
    diff = (out.detach().double() - ref.detach().double()).abs()
    if valid is not None:
        diff = diff[valid.to(diff.device)]
    if diff.numel() == 0:
        return 0.0
    if not torch.isfinite(diff).all():
        return math.inf
    return float(diff.max())


def rounding_atol(ref: torch.Tensor, dtype: torch.dtype, valid: torch.Tensor | None = None) -> float:
    """FlashAttention's absolute term: 2·max|(r + 0.3 - 0.3) - r| with r = ref rounded to ``dtype``."""
    r = ref.detach().to(dtype)
    if valid is not None:
        r = r[valid.to(r.device)]
    if r.numel() == 0:
        return 0.0
    return 2.0 * float(((r + 0.3 - 0.3) - r).abs().max().double())


def cast_rounding(ref: torch.Tensor, dtype: torch.dtype, rows: torch.Tensor | None = None) -> float:
    """2·max|fl_dtype(ref) - ref|: what a perfect kernel loses by returning its result in ``dtype``.
    FlashAttention's 2·|(r + 0.3 - 0.3) - r| is that rounding at the scale of 0.3, which for |r| >> 1 (a dv that
    sums 1434 rows reaches ~90) is far below one ulp of r."""
    return 2.0 * max_abs_err(ref.detach().to(dtype), ref, rows)


@dataclass(frozen=True)
class Comparison:
    """implementation vs reference, next to a plain same-dtype implementation vs the same reference."""

    err: float
    plain_err: float
    atol: float
    ref_scale: float = 0.0  # max |ref| over the judged rows (for the relative error; 0 = not measured)
    factor: float = 2.0  # FlashAttention's multiple of the plain implementation's error

    @property
    def threshold(self) -> float:
        return self.factor * self.plain_err + self.atol

    @property
    def rel_err(self) -> float:
        return self.err / self.ref_scale if self.ref_scale > 0 else self.err

    @property
    def passed(self) -> bool:
        return math.isfinite(self.err) and self.err <= self.threshold

    @property
    def ratio(self) -> float:
        return self.err / self.threshold if self.threshold > 0 else (0.0 if self.err == 0 else math.inf)

    def text(self, what: str) -> str:
        err = f"{self.err:.3g}" if math.isfinite(self.err) else "inf (NaN or inf values)"
        return (f"max|{what} - ref| {err} vs limit {self.threshold:.3g} "
                f"({self.factor:g}×plain {self.plain_err:.3g} + rounding {self.atol:.3g})")


def compare(out: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor, dtype: torch.dtype,
            valid: torch.Tensor | None = None, factor: float = 2.0) -> Comparison:
    """FlashAttention's rule: err(out) <= factor·err(plain) + rounding_atol, errors vs ``ref`` on valid rows."""
    ref_valid = ref.detach().double()
    if valid is not None:
        ref_valid = ref_valid[valid.to(ref_valid.device)]
    scale = float(ref_valid.abs().max()) if ref_valid.numel() else 0.0
    return Comparison(max_abs_err(out, ref, valid), max_abs_err(plain, ref, valid),
                      rounding_atol(ref, dtype, valid), scale, factor)


def judge(out: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor, dtype: torch.dtype, factor: float,
          rows: torch.Tensor | None = None) -> Comparison:
    """The kernel battery's form of the rule on the selected rows (None = all): the rounding term is the larger
    of FlashAttention's and the reference's own rounding to ``dtype`` (kernels return values of any scale)."""
    atol = max(rounding_atol(ref, dtype, rows), cast_rounding(ref, dtype, rows))
    return Comparison(max_abs_err(out, ref, rows), max_abs_err(plain, ref, rows), atol, 0.0, factor)


# ====================================================================================== attention weights
def row_sum_deviation(weights: torch.Tensor, valid: torch.Tensor) -> float:
    """max |Σ_keys w - 1| over query rows that see at least one key; weights (B,H,T,Tk), valid (B,T)."""
    sums = weights.detach().double().sum(dim=-1)  # (B,H,T)
    dev = (sums - 1.0).abs().permute(0, 2, 1)[valid.to(sums.device)]  # (n_valid, H)
    if dev.numel() == 0:
        return 0.0
    return math.inf if not torch.isfinite(dev).all() else float(dev.max())


def hidden_weight_max(weights: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor) -> float:
    """max |w| over hidden (query, key) pairs of valid query rows; hidden broadcastable to weights."""
    w = weights.detach().double()
    sel = hidden.to(w.device).expand_as(w) & valid.to(w.device)[:, None, :, None]
    picked = w[sel]
    if picked.numel() == 0:
        return 0.0
    return math.inf if not torch.isfinite(picked).all() else float(picked.abs().max())


def classify_rows(rows: torch.Tensor, mean_v_rows: torch.Tensor, dtype: torch.dtype,
                  zero_rows: torch.Tensor | None = None) -> str:
    """How a set of fully masked query outputs behaves: nan | zeros | mean_of_v | other. ``zero_rows``: what a
    zero context gives after the output projection (its bias; 0 when None)."""
    if rows.numel() == 0:
        return "none"
    rows, mean_v_rows = rows.detach().double(), mean_v_rows.detach().double()
    zero = torch.zeros_like(rows) if zero_rows is None else zero_rows.detach().double()
    if not torch.isfinite(rows).all():
        return "nan"
    tol = 8 * torch.finfo(dtype).eps * max(1.0, float(mean_v_rows.abs().max()))
    if float((rows - zero).abs().max()) <= tol:
        return "zeros"
    if float((rows - mean_v_rows).abs().max()) <= tol:
        return "mean_of_v"
    return "other"
