"""The kernel battery's dropout family: the kernel's own ``dropout_p``, read back weight by weight.

FlashAttention's tests recover the dropout mask from the kernel's debug output (the kept/dropped sign of S_dmask)
and check the keep rate, that the output equals the reference with that mask and the 1/(1-p) rescale, and that
the same seed gives the same output. A black-box kernel with SDPA's signature returns no mask, so the probe
makes the mask visible in the output: v is one-hot (v[j] = e_j, Tk <= D), so out[b,h,i,j] = P_ij·m_ij/(1-p)
exactly (one nonzero term per sum), P the fp64 reference's softmax weights. From r = out·(1-p)/P:

- ``keep rate``: m = (r > 1/2); over N weights (``seeds`` calls of B·Hq·Tq·Tk each) the kept fraction must lie
  within z·sqrt(p(1-p)/N) of 1-p, z for a two-sided false-alarm probability of ``FALSE_ALARM`` (normal
  approximation to the binomial; N >= 10^4 in the default probe, so the approximation is good to far below it);
- ``rescale``: every weight is either dropped (r = 0) or kept and rescaled (r = 1), within the dtype's rounding
  (2 × the plain same-dtype softmax's relative error + 8 eps); out[..., Tk:] is 0;
- ``seed``: the same torch seed gives a bit-identical output, and different seeds different masks.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

from tfmoe.components.reference_attention import reference_attention
from tfmoe.experiments.attn_check.kernel_cases import Case, CaseInputs
from tfmoe.experiments.attn_check.kernel_judging import Outcome, _raised, call_kernel, raised_outcome
from tfmoe.experiments.attn_check.kernels import Kernel
from tfmoe.recorder import Recorder

FALSE_ALARM = 1e-6  # probability that a correct kernel fails the keep-rate test in one run


def keep_rate_bound(p: float, n: int, alpha: float = FALSE_ALARM) -> float:
    """Half-width of the two-sided acceptance interval of the kept fraction of n Bernoulli(1-p) draws."""
    z = NormalDist().inv_cdf(1.0 - alpha / 2.0)
    return z * math.sqrt(p * (1.0 - p) / n)


def _digits(x: float, other: float) -> str:
    """x with enough significant digits to differ from ``other`` in print (3 at least, 17 at most)."""
    for n in range(3, 18):
        if f"{x:.{n}g}" != f"{other:.{n}g}":
            return f"{x:.{n}g}"
    return f"{x:.17g}"


def run_dropout_case(kernel: Kernel, case: Case, inp: CaseInputs, dtype: torch.dtype, seed: int, seeds: int,
                     rec: Recorder) -> Outcome:
    """Call the kernel with ``dropout_p`` on the one-hot probe under ``seeds`` torch seeds (and the first seed
    twice); judge the keep rate, the rescale and the seed (module docstring)."""
    p, Tk, D = case.dropout_p, case.Tk, case.D
    q, k = inp.q * 0.5, inp.k  # (B,Hq,Tq,D), (B,Hkv,Tk,D): smaller scores, no weight near 0
    v = torch.eye(Tk, D, device=q.device, dtype=dtype).expand(k.shape[0], k.shape[1], Tk, D)  # one-hot rows
    ones = torch.eye(Tk, dtype=torch.float64, device=q.device).expand(k.shape[0], k.shape[1], Tk, Tk)
    ref = reference_attention(q, k, ones).detach()  # (B,Hq,Tq,Tk) = the fp64 weights P
    plain = torch.softmax((q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-2, -1))
                          * (1.0 / math.sqrt(D)), dim=-1)  # the dtype's own weights (yardstick)
    tol = 2.0 * float(((plain.double() - ref) / ref).abs().max()) + 8.0 * torch.finfo(dtype).eps
    evidence = {"q": q, "k": k, "v": v}
    outs = []
    try:
        devices = [q.device] if q.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for n in range(seeds):
                torch.manual_seed(seed + n)
                outs.append(call_kernel(kernel, inp, q, k, v))
            torch.manual_seed(seed)
            again = call_kernel(kernel, inp, q, k, v)
    except NotImplementedError as exc:
        return Outcome(case, "n/a", f"{case.label()}: {_raised(exc)}")
    except Exception as exc:  # the user's kernel raised: this case fails; tfmoe's error crashes the run
        return raised_outcome(kernel, case, exc, "forward with dropout_p", evidence)
    out = torch.stack(outs).double()  # (seeds,B,Hq,Tq,D)
    r = out[..., :Tk] * (1.0 - p) / ref  # 0 (dropped) or 1 (kept) per weight
    kept = r > 0.5
    n = kept.numel()
    rate = float(kept.double().mean())
    bound = keep_rate_bound(p, n)
    finite = bool(torch.isfinite(out).all())
    rescale = float(torch.where(kept, (r - 1.0).abs(), r.abs()).max()) if finite else math.inf
    tail = float(out[..., Tk:].abs().max()) if D > Tk and finite else 0.0
    same = torch.equal(again, outs[0])
    varies = seeds < 2 or any(not torch.equal(kept[0], kept[i]) for i in range(1, seeds))
    rec.metric("dropout_keep_rate", rate, p=p, n=n, bound=bound, **case.tags())
    rec.metric("dropout_rescale_err", rescale, p=p, limit=tol, **case.tags())
    problems = []
    if abs(rate - (1.0 - p)) > bound:
        problems.append(f"kept {rate:.4f} of {n:,} weights, expected 1-p = {1 - p:g} ± {bound:.4f} (two-sided, "
                        f"false-alarm probability {FALSE_ALARM:g})" + (": dropout_p is ignored" if rate == 1.0 else ""))
    if rescale > tol or tail > tol:
        problems.append(f"weights are neither dropped nor kept and rescaled by 1/(1-p): max |out·(1-p)/P - "
                        f"{{0, 1}}| = {rescale:.3g} vs limit {tol:.3g}" + (f", out[..., Tk:] up to {tail:.3g}"
                                                                              if tail > tol else "")
                        + (f" (kept weights come out rescaled by {_digits(float(r[kept].median()) / (1 - p), 1 / (1 - p))}"
                           f", not 1/(1-p) = {_digits(1 / (1 - p), float(r[kept].median()) / (1 - p))})"
                           if finite and bool(kept.any()) and rescale > tol else ""))
    if not same:
        problems.append("the same torch seed gave a different output (the mask does not follow torch's RNG)")
    if not varies:
        problems.append(f"{seeds} different torch seeds gave the same dropout mask")
    detail = (f"{case.label()}: keep rate {rate:.4f} (1-p = {1 - p:g} ± {bound:.4f}, {n:,} weights, {seeds} seeds); "
              f"rescale err {rescale:.3g} (limit {tol:.3g}); same seed bit-identical: {'yes' if same else 'NO'}")
    if problems:
        detail = f"{case.label()}: " + "; ".join(problems)
    ratio = max(abs(rate - (1.0 - p)) / bound, rescale / tol if tol > 0 else 0.0, 0.0 if same and varies else math.inf)
    return Outcome(case, "fail" if problems else "pass", detail, ratio,
                   evidence={**evidence, "out": outs[0], "weights_ref": ref} if problems else {})
