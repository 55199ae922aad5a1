"""Exact probes: inputs on which a correct kernel's output (each forward family's exact-output probe) and dq, dk, dv
(``kernel_backward``'s exact-gradient probe) are exact in fp16 and bf16, so an error of half an ulp shows.

q and k live in disjoint halves of the head dimension (q ⟂ k), so every score is exactly 0 and each weight is
exactly 1/Tk (Tk = 4, D = 16, scale 1/4: powers of two). q, k, v and dO are small integers, drawn until every
value a kernel forms (O, dP = dO·vᵀ, δ = Σ dO∘O or Σ P∘dP, dS = P∘(dP - δ), dq, dk, dv) has terms whose absolute
sum is at most 2^8 units of its grid: then every partial sum, in any order and any split into blocks, is exact in
bf16 (8 significant bits) and so in fp16, fp32 and fp64. One column of dO, whose v column is 0 (so dP and δ do not
see it), sums to 2^p - 1 units (p the dtype's significant bits, at most 11): a dv of full mantissa, on which a
gradient off by half an ulp of the dtype shows.

The rule, per dtype:

- fp16 / bf16: exact. A kernel that rounds once per operation, or keeps any intermediate in fp32 or the run
  dtype, returns the exact values: its only inexact steps are exp and log (a recomputed weight off by u = 8·eps32
  at most, relative, common to every weight here since every score is equal), and u times the largest absolute
  term sum (2^8 units) is at most 2^-12 of a unit: below half an ulp of any nonzero value here in fp16 (2^-11 of a
  unit, relative) and bf16, so it rounds away. Any difference is a wrong gradient by more than the dtype's
  rounding: no tolerance.
- fp32 / fp64: the weights' exp is not exact, so each tensor is judged within 2·(u·max|g| + eps_acc·Σ|terms|),
  the a-priori fast-exp allowance of the rest of the battery (kernel_judging.accumulation_atols).

The exact-output probe of a forward family (:func:`output_probe_inputs`) is the same construction for the
output alone, with the family's kind of mask: each row sees 1, 2 or 4 of 4 keys (weights 1, 1/2, 1/4), additive
masks as 0 / -inf, and v's full-mantissa column 2^p - 1 at key 0 (rows that see 3 keys or none are left to the
family's other cases).

The exact-gradient probe is a case of ``kernel_backward`` (plain attention, Hkv = Hq, no mask); it runs when the
``scale`` family passed. Its sensitivity to a gradient scaled by (1 + ε) is the dtype's half ulp, relative: the most any
rule can reach, since a smaller ε rounds away in the kernel's own output.
"""

from __future__ import annotations

import math

import torch

from tfmoe.components.reference_attention import kv_head_index, reference_attention
from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.attn_check.kernel_cases import Case, CaseInputs
from tfmoe.experiments.attn_check.kernel_judging import (
    Outcome,
    _raised,
    accumulation_dtype,
    call_kernel,
    enter_backward,
    forward_or_outcome,
    raised_outcome,
)
from tfmoe.experiments.attn_check.kernels import Kernel

TQ, TK, D = 8, 4, 16  # P = 1/4 and scale = 1/√16 = 1/4: powers of two
CAP = 2 ** 8  # bf16's significant bits: an absolute term sum of at most 2^8 grid units is exact in any order
FULL = D - 1  # the dO column that sums to 2^p - 1 (its v column is 0)
PROBE_CASE = Case("backward", TQ, TK, D, 0, "none")  # Hkv set per run (= Hq)


def significant_bits(dtype: torch.dtype) -> int:
    """8 for bf16, 11 for fp16, 24 for fp32, 53 for fp64 (eps = 2^(1 - p))."""
    return round(1 - math.log2(torch.finfo(dtype).eps))


def term_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_o: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per element, the absolute sum of the terms each intermediate adds up, in units of its grid (fp64)."""
    P, scale = 1.0 / TK, D ** -0.5
    o_abs = P * v.abs().sum(dim=2, keepdim=True)  # (B,H,1,D): O = P·Σ_j v_j, grid P
    dp = d_o.abs() @ v.abs().transpose(-2, -1)  # (B,H,Tq,Tk), grid 1
    delta = torch.maximum((d_o.abs() * o_abs).sum(dim=-1, keepdim=True), P * dp.sum(dim=-1, keepdim=True))
    ds = P * (dp + delta)  # grid P²
    return {"O": o_abs / P, "dP": dp, "delta": delta / P, "dS": ds / P ** 2,
            "dq": scale * ds @ k.abs() / (scale * P ** 2), "dk": scale * ds.transpose(-2, -1) @ q.abs()
            / (scale * P ** 2), "dv": P * d_o.abs().sum(dim=2) / P}


def probe_inputs(B: int, H: int, dtype: torch.dtype, seed: int, device: torch.device) -> CaseInputs:
    """The probe's q ⟂ k, v, dO (module docstring), drawn from (seed) until every term sum is within 2^8 units."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 424_243)
    half = D // 2

    def ints(*shape: int) -> torch.Tensor:  # -1, 0, 1 with probabilities 1/4, 1/2, 1/4
        return (torch.randint(0, 2, shape, generator=g) * (torch.randint(0, 2, shape, generator=g) * 2 - 1)).double()

    q = torch.zeros(B, H, TQ, D, dtype=torch.float64)
    k = torch.zeros(B, H, TK, D, dtype=torch.float64)
    v = torch.zeros(B, H, TK, D, dtype=torch.float64)
    d_o = torch.zeros(B, H, TQ, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):  # each (batch row, head) drawn until its term sums are within the bound
            for _ in range(1000):  # about 1 in 2 draws is (seeds 0-99)
                qs = torch.zeros(1, 1, TQ, D, dtype=torch.float64)
                ks = torch.zeros(1, 1, TK, D, dtype=torch.float64)
                qs[..., :half], ks[..., half:] = ints(1, 1, TQ, half), ints(1, 1, TK, D - half)
                vs, dos = ints(1, 1, TK, D), ints(1, 1, TQ, D)
                vs[..., FULL] = 0.0
                sums = term_sums(qs, ks, vs, dos)
                sums["dv"] = sums["dv"][..., :FULL]
                if all(float(t.max()) <= CAP for t in sums.values()):
                    break
            else:
                raise RuntimeError("the exact-gradient probe found no draw within its term bound")
            q[b, h], k[b, h], v[b, h], d_o[b, h] = qs[0, 0], ks[0, 0], vs[0, 0], dos[0, 0]
    p = min(significant_bits(dtype), 11)
    part = 2 ** (p - 3)  # Tq = 8 rows: 7·2^(p-3) + 2^(p-3) - 1 = 2^p - 1, each part representable
    d_o[0, 0, :, FULL] = torch.tensor([part] * (TQ - 1) + [part - 1], dtype=torch.float64)
    q, k, v, d_o = (t.to(device=device, dtype=dtype) for t in (q, k, v, d_o))
    return CaseInputs(q, k, v, d_o, {}, None, None, torch.ones(B, H, TQ, dtype=torch.bool, device=device))


def run_exact_grad_probe(kernel: Kernel, B: int, H: int, dtype: torch.dtype, seed: int, rec: Recorder) -> Outcome:
    """Run the probe (module docstring) and judge the output and dq, dk, dv: exact in fp16/bf16, within the
    fast-exp allowance in fp32/fp64."""
    case = Case("backward", TQ, TK, D, H, "none")
    inp = probe_inputs(B, H, dtype, seed, rec.device)
    label = f"exact-gradient probe {case.label()[:-1]}, q ⟂ k: every weight 1/{TK})"
    evidence = {"q": inp.q, "k": inp.k, "v": inp.v, "grad_out": inp.grad_out}
    try:
        mine = [t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
        out = call_kernel(kernel, inp, *mine)
        got = [out.detach(), *enter_backward(out, mine, inp.grad_out)]
    except NotImplementedError as exc:
        return Outcome(case, "n/a", f"{label}: {_raised(exc)}")
    except Exception as exc:
        return raised_outcome(kernel, case, exc, "exact-gradient probe", evidence)
    leaves = [t.detach().double().requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
    ref = reference_attention(*leaves, None, None, None)
    exact = [ref.detach(), *torch.autograd.grad(ref, leaves, inp.grad_out.double())]
    low = torch.finfo(dtype).bits <= 16
    eps = torch.finfo(accumulation_dtype(dtype)).eps
    sums = term_sums(*(t.double() for t in (inp.q, inp.k, inp.v, inp.grad_out)))
    grid = {"out": 1.0 / TK, "dq": D ** -0.5 / TK ** 2, "dk": D ** -0.5 / TK ** 2, "dv": 1.0 / TK}
    terms = {"out": sums["O"], "dq": sums["dq"], "dk": sums["dk"], "dv": sums["dv"]}
    texts, worst, bad = [], 0.0, []
    for name, g_, e in zip(("out", "dq", "dk", "dv"), got, exact, strict=True):
        diff = (g_.double() - e).abs()
        err = math.inf if not bool(torch.isfinite(diff).all()) else float(diff.max())
        limit = 0.0 if low else 2.0 * (8.0 * eps * float(e.abs().max())
                                       + eps * float(terms[name].max()) * grid[name])
        rec.metric("err", err, tensor=name, plain_err=0.0, limit=limit, probe="exact_grads", **case.tags())
        ratio = err / limit if limit > 0 else (0.0 if err == 0 else math.inf)
        worst = max(worst, ratio)
        if not err <= limit:
            n = int((diff > limit).sum()) if math.isfinite(err) else int((~torch.isfinite(diff)).sum())
            bad.append(f"max|{name} - exact| {err:.3g} on {n} elements vs limit {limit:.3g}"
                       + (" (exact in this dtype: every value and partial sum is representable)" if low else ""))
        texts.append(f"{name} {err:.3g}")
        evidence[f"{name}_kernel"], evidence[f"{name}_ref"] = g_, e
    if bad:
        return Outcome(case, "fail", f"{label}: " + "; ".join(bad), worst, evidence=evidence)
    rule = "exact" if low else "within 2·(8·eps·max|g| + eps·Σ|terms|)"
    return Outcome(case, "pass", f"{label}: {rule}: " + ", ".join(texts), worst)


# ------------------------------------------------------------------------------ the exact-output probe of a family
OUT_TQ = 8  # queries; TK = 4 keys, D = 16 as above: every visible count 1, 2 or 4 (a power of two)
EXACT_OUTPUT_MASKS = {"scale": "none", "gqa": "none", "causal": "causal", "padding_bool": "pad_bool",
                      "padding_additive": "pad_additive", "fully_masked": "fully_masked", "mask_bool": "bool_random",
                      "mask_additive": "additive_random", "per_head": "per_head_bool"}


def _subsets(g: torch.Generator, rows: int) -> torch.Tensor:
    """(rows, TK) bool: row r sees a random 1, 2 or 4 of the TK keys (r % 3 picks which count)."""
    vis = torch.zeros(rows, TK, dtype=torch.bool)
    for r in range(rows):
        n = (1, 2, 4)[r % 3]
        vis[r, torch.randperm(TK, generator=g)[:n]] = True
    return vis


def output_probe_inputs(family: str, B: int, Hq: int, Hkv: int, align: str, dtype: torch.dtype, seed: int,
                        device: torch.device) -> tuple[Case, CaseInputs]:
    """The exact-output probe of a forward family: q ⟂ k (every score 0), the family's kind of mask with each
    row seeing 1, 2 or 4 of 4 keys (the additive kinds as 0 / -inf), v small integers but for one column that
    is 2^p - 1 at key 0 and 0 elsewhere (a full mantissa in every row that sees key 0)."""
    mask = EXACT_OUTPUT_MASKS[family]
    case = Case(family, OUT_TQ, TK, D, Hkv, mask)
    g = torch.Generator().manual_seed(seed * 1_000_003 + 524_287 + len(family))
    half = D // 2

    def ints(*shape: int) -> torch.Tensor:
        return (torch.randint(0, 2, shape, generator=g) * (torch.randint(0, 2, shape, generator=g) * 2 - 1)).double()

    q = torch.zeros(B, Hq, OUT_TQ, D, dtype=torch.float64)
    k = torch.zeros(B, Hkv, TK, D, dtype=torch.float64)
    q[..., :half], k[..., half:] = ints(B, Hq, OUT_TQ, half), ints(B, Hkv, TK, D - half)
    v = ints(B, Hkv, TK, D)
    v[..., FULL] = 0.0
    v[:, :, 0, FULL] = 2.0 ** min(significant_bits(dtype), 11) - 1
    kwargs: dict = {}
    visible = None
    if mask == "causal":
        from tfmoe.components.reference_attention import causal_visibility

        kwargs["is_causal"] = True
        visible = causal_visibility(OUT_TQ, TK, align)[None, None]
    elif mask in ("pad_bool", "pad_additive", "fully_masked"):
        lengths = [(4, 2, 1)[b % 3] for b in range(B)]
        if mask == "fully_masked":
            lengths[-1] = 0
        visible = (torch.arange(TK)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]  # (B,1,1,TK)
    elif mask in ("bool_random", "additive_random"):
        visible = _subsets(g, B * OUT_TQ).reshape(B, 1, OUT_TQ, TK)
    elif mask == "per_head_bool":
        visible = _subsets(g, B * Hq * OUT_TQ).reshape(B, Hq, OUT_TQ, TK)
    if visible is not None and mask != "causal":
        kwargs["attn_mask"] = (visible.clone() if mask in ("pad_bool", "fully_masked", "bool_random", "per_head_bool")
                               else torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, -math.inf)
                               .to(device))
        kwargs["attn_mask"] = kwargs["attn_mask"].to(device)
    if Hkv != Hq:
        kwargs["enable_gqa"] = True
    visible = None if visible is None else visible.to(device)
    seen = (torch.ones(B, Hq, OUT_TQ, dtype=torch.bool, device=device) if visible is None
            else visible.expand(B, Hq, OUT_TQ, TK).any(dim=-1))
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    return case, CaseInputs(q, k, v, torch.zeros_like(q), kwargs, visible, None, seen)


def run_exact_output_probe(kernel: Kernel, case: Case, inp: CaseInputs, dtype: torch.dtype, rec: Recorder
                           ) -> Outcome:
    """Judge the kernel's output on an exact-output probe (:func:`output_probe_inputs`) on the rows that see a
    power-of-two count of keys (rows that see none or 3 are the family's other cases' to judge): exact in
    fp16/bf16, within 2·(8·eps·max|O| + eps·Σ|terms|) in fp32/fp64."""
    label = f"exact-output probe {case.label()[:-1]}, q ⟂ k: each row sees 1, 2 or 4 keys)"
    evidence = {"q": inp.q, "k": inp.k, "v": inp.v, **{n: t for n, t in inp.kwargs.items()
                                                        if isinstance(t, torch.Tensor)}}
    out = forward_or_outcome(kernel, case, inp, label, "exact-output probe", evidence)
    if isinstance(out, Outcome):
        return out
    B, Hq, Tq, _ = inp.q.shape
    visible = (torch.ones(1, 1, Tq, TK, dtype=torch.bool, device=inp.q.device) if inp.visible is None
               else inp.visible)
    counts = visible.expand(B, Hq, Tq, TK).sum(dim=-1)  # (B,Hq,Tq)
    rows = (counts > 0) & ((counts & (counts - 1)) == 0)
    ref = reference_attention(inp.q, inp.k, inp.v, inp.visible, None, None)
    diff = (out.detach().double() - ref).abs()[rows]
    err = math.inf if not bool(torch.isfinite(diff).all()) else (float(diff.max()) if diff.numel() else 0.0)
    low = torch.finfo(dtype).bits <= 16
    eps = torch.finfo(accumulation_dtype(dtype)).eps
    terms = (visible.expand(B, Hq, Tq, TK).double() / counts.clamp_min(1)[..., None]) @ \
        inp.v.double().abs()[:, kv_head_index(Hq, inp.k.shape[1], inp.q.device)]  # Σ_j P_ij·|v_j|
    limit = 0.0 if low else 2.0 * (8.0 * eps * float(ref[rows].abs().max()) + eps * float(terms[rows].max()))
    rec.metric("err", err, tensor="out", plain_err=0.0, limit=limit, probe="exact_output", **case.tags())
    ratio = err / limit if limit > 0 else (0.0 if err == 0 else math.inf)
    if not err <= limit:
        n = int((diff > limit).sum()) if math.isfinite(err) else int((~torch.isfinite(diff)).sum())
        return Outcome(case, "fail", f"{label}: max|out - exact| {err:.3g} on {n} elements of {int(rows.sum())} "
                       f"judged rows vs limit {limit:.3g}" + (" (exact in this dtype: every weight is 1, 1/2 or "
                                                            "1/4 and every sum representable)" if low else ""),
                       ratio, evidence={**evidence, "out": out, "ref": ref})
    return Outcome(case, "pass", f"{label}: {'exact' if low else 'within the fast-exp allowance'}: max|out - exact| "
                   f"{err:.3g} on {int(rows.sum())} rows", ratio)
