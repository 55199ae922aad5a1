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
  and FlashAttention's own rule on the same read: each output within 2 × the plain same-dtype softmax's error
  (with that call's mask) + rounding of (P∘m/(1-p)), the fp64 weights with the kernel's mask;
- ``seed``: the same torch seed gives a bit-identical output, and different seeds different masks;
- the backward (:func:`run_dropout_backward`, judged in kernel_backward): dq, dk, dv against the fp64 reference's
  with the forward's own mask.
"""

from __future__ import annotations

import math
from dataclasses import replace
from statistics import NormalDist

import torch

from tfmoe.components.comparison import judge
from tfmoe.components.reference_attention import kv_head_index, reference_attention
from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.attn_check.kernel_cases import Case, CaseInputs
from tfmoe.experiments.attn_check.kernel_judging import (
    Outcome,
    accumulation_atols,
    call_kernel,
    enter_backward,
    raised_outcome,
)
from tfmoe.experiments.attn_check.kernels import Kernel
from tfmoe.rules.capabilities import not_implemented_detail

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
    q, k, v = dropout_probe(inp, case, dtype)  # (B,Hq,Tq,D), (B,Hkv,Tk,D): smaller scores, one-hot rows of v
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
        return Outcome(case, "n/a", f"{case.label()}: {not_implemented_detail(exc, 'dropout')}")
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
    # FlashAttention's rule on the same read: each output against the fp64 weights with that call's own mask,
    # beside the plain same-dtype softmax with that mask (catches a rescale off by less than the relative limit)
    masked = [judge(o[..., :Tk], ref * (r_n > 0.5) / (1.0 - p), (plain * (r_n > 0.5).to(dtype) / (1.0 - p)), dtype,
                    2.0) for o, r_n in zip(outs, r, strict=True)] if finite else []
    worst_masked = max(masked, key=lambda j: j.ratio) if masked else None
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
    if worst_masked is not None and not worst_masked.passed and not problems:
        problems.append("the output against the weights with its own mask, (P∘mask/(1-p))·v: "
                        + worst_masked.text("out") + f" (kept weights come out rescaled by "
                        f"{_digits(float(r[kept].median()) / (1 - p), 1 / (1 - p))}, not 1/(1-p) = "
                        f"{_digits(1 / (1 - p), float(r[kept].median()) / (1 - p))})")
    if not same:
        problems.append("the same torch seed gave a different output (the mask does not follow torch's RNG)")
    if not varies:
        problems.append(f"{seeds} different torch seeds gave the same dropout mask")
    detail = (f"{case.label()}: keep rate {rate:.4f} (1-p = {1 - p:g} ± {bound:.4f}, {n:,} weights, {seeds} seeds); "
              f"rescale err {rescale:.3g} (limit {tol:.3g}); same seed bit-identical: {'yes' if same else 'NO'}")
    if problems:
        detail = f"{case.label()}: " + "; ".join(problems)
    ratio = max(abs(rate - (1.0 - p)) / bound, rescale / tol if tol > 0 else 0.0, 0.0 if same and varies else math.inf,
                worst_masked.ratio if worst_masked is not None else 0.0)
    return Outcome(case, "fail" if problems else "pass", detail, ratio,
                   evidence={**evidence, "out": outs[0], "weights_ref": ref} if problems else {})


def dropout_probe(inp: CaseInputs, case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The probe's q (scores halved: no weight near 0), k and one-hot v (B,Hkv,Tk,D)."""
    k = inp.k
    v = torch.eye(case.Tk, case.D, device=k.device, dtype=dtype).expand(k.shape[0], k.shape[1], case.Tk, case.D)
    return inp.q * 0.5, k, v.contiguous()


def run_dropout_backward(kernel: Kernel, case: Case, inp: CaseInputs, dtype: torch.dtype, seed: int,
                         factor: float, rec: Recorder, run_dtype_intermediates: bool = True,
                         row_max: bool = False, query_chunk: int = 0) -> Outcome:
    """The dropout case's dq, dk, dv, judged against the fp64 reference *with the kernel's own mask*.

    One call under torch seed ``seed`` with autograd on; its output on the one-hot probe reads that call's mask
    exactly (out·(1-p)/P is 0 or 1 per weight, as the forward check showed); the reference's gradients are those
    of (P∘mask/(1-p))·v, the plain same-dtype implementation's likewise, and FlashAttention's rule (``factor``,
    the accumulation floors) judges the kernel's. A backward that draws a fresh mask, or none, differs by O(1).
    ``run_dtype_intermediates``: the backward rounds dP and δ to the run dtype (the battery's one-key probe)."""
    p, Tk = case.dropout_p, case.Tk
    q0, k0, v0 = dropout_probe(inp, case, dtype)
    probe = replace(inp, q=q0, k=k0, v=v0)
    mine = [t.detach().clone().requires_grad_(True) for t in (q0, k0, v0)]
    evidence = {"q": q0, "k": k0, "v": v0, "grad_out": inp.grad_out}
    try:
        devices = [q0.device] if q0.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = call_kernel(kernel, probe, *mine)
            got = enter_backward(out, mine, inp.grad_out)
    except NotImplementedError as exc:
        return Outcome(case, "n/a", f"{case.label()}: backward with dropout_p: {not_implemented_detail(exc)}")
    except Exception as exc:
        return raised_outcome(kernel, case, exc, "backward with dropout_p", evidence)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q0, k0, v0)]
    plain_leaves = [t.detach().clone().requires_grad_(True) for t in (q0, k0, v0)]
    heads = kv_head_index(q0.shape[1], k0.shape[1], q0.device)
    ones = torch.eye(Tk, dtype=torch.float64, device=q0.device).expand(k0.shape[0], k0.shape[1], Tk, Tk)
    with torch.no_grad():
        weights = reference_attention(q0, k0, ones)  # (B,Hq,Tq,Tk) fp64
    keep = (out.detach()[..., :Tk].double() * (1.0 - p) / weights) > 0.5  # this call's mask, read exactly
    scale = 1.0 / math.sqrt(case.D)
    rq, rk, rv = ref_leaves
    _, w = reference_attention(rq, rk, rv, return_weights=True)
    ref = (w * keep / (1.0 - p)) @ rv[:, heads]
    pq, pk, pv = plain_leaves
    pw = torch.softmax((pq @ pk[:, heads].transpose(-2, -1)) * scale, dim=-1)
    plain = (pw * keep.to(dtype) / (1.0 - p)) @ pv[:, heads]
    ref_g = torch.autograd.grad(ref, ref_leaves, inp.grad_out.double())
    plain_g = torch.autograd.grad(plain, plain_leaves, inp.grad_out)
    floors = accumulation_atols(probe, ref.detach(), (w * keep / (1.0 - p)).detach(), scale, dtype,
                                run_dtype_intermediates=run_dtype_intermediates, row_max=row_max,
                                query_chunk=query_chunk)
    bad, worst = [], (0.0, "")
    for i, name in enumerate(("dq", "dk", "dv")):
        j = judge(got[i], ref_g[i], plain_g[i], dtype, factor)
        j = replace(j, atol=max(j.atol, floors[name]))
        rec.metric("err", j.err, tensor=name, plain_err=j.plain_err, limit=j.threshold, **case.tags())
        if not j.passed:
            bad.append(j.text(name))
        worst = max(worst, (j.ratio, j.text(name)))
        evidence[f"{name}_kernel"], evidence[f"{name}_ref"] = got[i], ref_g[i]
    what = "the gradients of the forward's own dropout mask (read through the one-hot v)"
    if bad:
        return Outcome(case, "fail", f"{case.label()}: backward with dropout_p vs {what}: " + "; ".join(bad)
                       + " (a backward that draws its own mask, or none, is off by O(1))", worst[0], evidence=evidence)
    return Outcome(case, "pass", f"{case.label()}: backward with dropout_p vs {what}: {worst[1]}", worst[0])
