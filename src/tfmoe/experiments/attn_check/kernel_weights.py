"""The ``weights`` probe: every case's attention weights read exactly, through a one-hot v, in the run's dtype.

With v = the one-hot rows of keys c..c+n-1 (n <= D; every other row 0), output column d of a query is
Σ_j P_ij·v_jd = P_i,c+d: one nonzero product, so the kernel's output *is* its weights, rounded once to the dtype
(ceil(Tk / D) calls read a whole row). Two rules, on the rows that see a key:

- *exact*: a hidden key (mask, padding, causal) has weight exactly 0, and a visible key whose fp64 weight is a
  normal number of the dtype has a weight > 0. No tolerance: a key wrongly hidden or shown is caught in any
  dtype and any row length (a bf16 output moves by ~1/255 when one of 255 keys is hidden, inside the output rule's
  limit; its weight reads 0 here);
- *relative*: each such weight within ``2·plain + 2·(8·eps_acc) + 2·eps_dtype`` of the fp64 weight, relative:
  ``plain`` the plain same-dtype softmax's largest relative error (in either order of the scale, as the output's
  yardstick), ``8·eps_acc`` a fast exp's error per weight (as the output's floor, kernel_judging.fast_exp_atol),
  ``eps_dtype`` the output's rounding and one more (FlashAttention rounds P to the dtype before P·V)."""

from __future__ import annotations

import math

import torch

from tfmoe.components.reference_attention import plain_attention, reference_attention
from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.attn_check.kernel_cases import Case, CaseInputs
from tfmoe.experiments.attn_check.kernel_judging import (
    Outcome,
    accumulation_dtype,
    call_kernel,
    raised_outcome,
)
from tfmoe.experiments.attn_check.kernels import Kernel


def one_hot_chunks(B: int, Hkv: int, Tk: int, D: int, device: torch.device, dtype: torch.dtype):
    """Yield (c, n, v): v (B,Hkv,Tk,D) in ``dtype`` whose rows c..c+n-1 are the first n unit vectors, 0 elsewhere."""
    for c in range(0, Tk, D):
        n = min(D, Tk - c)
        v = torch.zeros(B, Hkv, Tk, D, device=device, dtype=dtype)
        v[:, :, c:c + n, :n] = torch.eye(n, device=device, dtype=dtype)
        yield c, n, v


def read_weights(fn, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, float]:
    """(B,Hq,Tq,Tk) float64 weights read through ``fn(q, k, v)`` with one-hot v, and the largest |output| outside
    the one-hot columns on ``rows`` (B,Hq,Tq) (0 for a kernel that computes P·V)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    got = torch.empty(B, Hq, Tq, Tk, dtype=torch.float64, device=q.device)
    tail = 0.0
    for c, n, v in one_hot_chunks(B, Hkv, Tk, D, q.device, q.dtype):
        out = fn(q, k, v).detach().double()
        got[..., c:c + n] = out[..., :n]
        if n < D and rows is not None:
            rest = out[..., n:].abs()[rows]
            tail = max(tail, float(rest.nan_to_num(nan=math.inf).max()) if rest.numel() else 0.0)
    return got, tail


def run_weights_probe(kernel: Kernel, case: Case, inp: CaseInputs, dtype: torch.dtype, rec: Recorder
                      ) -> tuple[Outcome, torch.Tensor | None]:
    """Read the case's weights exactly (module docstring) and judge them on the rows that see a key. Returns the
    outcome and, when it passed, the weights read (B,Hq,Tq,Tk) float64: the output's and the gradients' floors
    are then measured on them (kernel_judging.measured_weights_atol, accumulation_atols)."""
    B, Hq, Tq, D = inp.q.shape
    Tk = inp.k.shape[2]
    evidence = {"q": inp.q, "k": inp.k, **{n: t for n, t in inp.kwargs.items() if isinstance(t, torch.Tensor)}}
    try:
        with torch.no_grad():
            got, tail = read_weights(lambda q, k, v: call_kernel(kernel, inp, q, k, v), inp.q, inp.k,
                                     inp.seen)
    except NotImplementedError as exc:
        from tfmoe.rules.capabilities import not_implemented_detail

        return Outcome(case, "n/a", f"{case.label()}: weights probe: {not_implemented_detail(exc)}"), None
    except Exception as exc:  # the user's kernel raised: this case fails; tfmoe's error crashes the run
        return raised_outcome(kernel, case, exc, "forward with a one-hot v (weights probe)", evidence), None
    s = 1.0 / math.sqrt(D) if case.scale is None else case.scale
    with torch.no_grad():
        _, ref = reference_attention(inp.q, inp.k, inp.v, inp.visible, inp.bias, case.scale, return_weights=True)
        plain_rel = 0.0
        for qs, ks, sc in ((inp.q, inp.k, case.scale), (inp.q * math.sqrt(s), inp.k * math.sqrt(s), 1.0)):
            plain, _ = read_weights(lambda q, k, v, sc=sc: plain_attention(q, k, v, inp.visible, inp.bias, sc), qs, ks)
            plain_rel = max(plain_rel, _rel_err(plain, ref, inp, dtype))
    eps = torch.finfo(dtype).eps
    tol = 2.0 * plain_rel + 16.0 * torch.finfo(accumulation_dtype(dtype)).eps + 2.0 * eps
    seen = inp.seen[..., None].expand(B, Hq, Tq, Tk)
    visible = (torch.ones_like(seen) if inp.visible is None else inp.visible.expand(B, Hq, Tq, Tk)) & seen
    hidden = seen & ~visible
    normal = visible & (ref >= torch.finfo(dtype).tiny)
    leaked = hidden & (got != 0)  # NaN != 0: a NaN weight of a hidden key leaks too
    lost = normal & ~(got > 0)
    rel = _rel_err(got, ref, inp, dtype)
    rec.metric("weights_rel_err", rel, limit=tol, plain_rel_err=plain_rel, **case.tags())
    problems = []
    if bool(leaked.any()):
        w = got[leaked]
        problems.append(f"{int(leaked.sum())} hidden (query, key) pairs get weight (max {float(w.abs().max()):.3g}; "
                        "a hidden key's weight is exactly 0 in any dtype)")
    if bool(lost.any()):
        n_keys = visible.sum(dim=-1)[lost.any(dim=-1)]
        problems.append(f"{int(lost.sum())} visible keys read weight 0 (or NaN) in rows that see "
                        f"{int(n_keys.min())}-{int(n_keys.max())} keys (fp64 weight up to {float(ref[lost].max()):.3g})")
    if tail > 0:
        problems.append(f"output columns beyond the one-hot v's read up to {tail:.3g} (P·V gives 0 there)")
    if not problems and not rel <= tol:
        problems.append(f"max relative weight error {rel:.3g} vs limit {tol:.3g} (2×plain {plain_rel:.3g} + "
                        f"16·eps_acc + 2·eps)")
    ratio = math.inf if leaked.any() or lost.any() or tail > 0 else (rel / tol if tol > 0 else 0.0)
    if problems:
        return Outcome(case, "fail", f"{case.label()}: weights read through a one-hot v: " + "; ".join(problems),
                       ratio, evidence={**evidence, "weights_kernel": got, "weights_ref": ref}), None
    return Outcome(case, "pass", f"{case.label()}: weights exact (hidden keys 0, visible keys > 0); max relative "
                   f"error {rel:.3g} vs limit {tol:.3g}", ratio), got


def _rel_err(got: torch.Tensor, ref: torch.Tensor, inp: CaseInputs, dtype: torch.dtype) -> float:
    """max |got/ref - 1| over the visible keys of rows that see a key whose fp64 weight is a normal number of
    ``dtype`` (NaN -> inf)."""
    B, Hq, Tq, Tk = ref.shape
    mask = inp.seen[..., None].expand(B, Hq, Tq, Tk) & (ref >= torch.finfo(dtype).tiny)
    if inp.visible is not None:
        mask = mask & inp.visible.expand(B, Hq, Tq, Tk)
    if not bool(mask.any()):
        return 0.0
    r = (got[mask] / ref[mask] - 1.0).abs()
    return math.inf if not bool(torch.isfinite(r).all()) else float(r.max())
