"""Sensitivity of the kernel battery beside FlashAttention's rule: per family and dtype, the smallest ε caught.

A correct kernel (SDPA) is made wrong by a factor (1 + ε), computed in fp64 and rounded to the dtype:

- ``out``: its output, on every case of a forward family (tfmoe: the family's check and the weights probe of its
  cases, read through a one-hot v, as the battery judges them) and on the family's exact-output probe (both
  rules; "rule-judged cases alone" gives tfmoe's figure without it);
- ``grad``: its dq, dk, dv (tfmoe: kernel_backward on the same cases and its exact-gradient probe, forward
  unchanged; FlashAttention's rule judges the probe too, and the line "rule-judged cases alone" gives tfmoe's
  figure without it);
- ``dropout``: its output with dropout_p (tfmoe: the dropout family's rescale check; FlashAttention's rule: the
  output against the reference with the kernel's own mask, read through the one-hot v).

tfmoe's ε is found by bisection in log scale over the battery's own judging functions (run_case,
run_weights_probe, run_dropout_case), per case (the family's ε is its cases' least), as FlashAttention's: the same
bisection path for both, since a perturbation below half an ulp of the dtype rounds away and detection is not
monotone in ε there. FlashAttention's rule is
written here independently of tfmoe's judging (its own fp64 reference and plain same-dtype implementation, its
own head mapping): err <= 2·err(plain) + 2·max|(r + 0.3 - 0.3) - r|, r the reference in the dtype, for the output
and for each of dq, dk, dv, over the rows that see a key. A case where FlashAttention's rule fails the unperturbed
kernel (its false alarm: e.g. Tk = 1, where dq = 0 exactly) is left out of its column and counted in ``FA n/a``.

    nice -n 10 .venv/bin/python benchmarks/bench_kernel_sensitivity.py              # fp32, fp16, bf16 (minutes)
    nice -n 10 .venv/bin/python benchmarks/bench_kernel_sensitivity.py --dtypes fp32 --seed 3
    nice -n 10 .venv/bin/python benchmarks/bench_kernel_sensitivity.py --dtypes bf16 --families backward --per-case

Prints one table: family, dtype, tfmoe's ε, FlashAttention's ε, their ratio (tfmoe / FA: <= 1 is at
FlashAttention's rule or better). Exits 1 if any ratio exceeds 1.05 (the bisection's resolution), or tfmoe fails
the unperturbed kernel. Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from tfmoe.api.testing import compose, cpu_recorder
from tfmoe.contract.registry import EXPERIMENTS
from tfmoe.experiments.attn_check.kernel_cases import make_inputs
from tfmoe.experiments.attn_check.kernel_dropout import dropout_probe, run_dropout_case
from tfmoe.experiments.attn_check.kernel_exact import (
    EXACT_OUTPUT_MASKS,
    PROBE_CASE,
    output_probe_inputs,
    probe_inputs,
    run_exact_grad_probe,
    run_exact_output_probe,
)
from tfmoe.experiments.attn_check.kernel_judging import backward_rounds_to_run_dtype, run_case
from tfmoe.experiments.attn_check.kernel_weights import run_weights_probe
from tfmoe.experiments.attn_check.kernels import Kernel

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# The tests' reduced matrix, a shape whose rows see >= 128 keys, and the default long_rows case.
MATRIX = ["cases.shapes=[[5,7,12],[7,5,8],[1,6,16],[9,130,32]]", "kernel_checks.long_row=[2,2048,32]"]
EPS_LO, EPS_HI, STEPS = 1e-9, 1.0, 12  # log-scale bisection: resolution (1e9)^(1/2^12) ~ 1.005


def perturb(t: torch.Tensor, eps: float) -> torch.Tensor:
    return (t.double() * (1.0 + eps)).to(t.dtype)


class _ScaleGrads(torch.autograd.Function):
    """Identity forward; dq, dk, dv come back multiplied by (1 + ε) (in fp64, rounded to their dtype)."""

    @staticmethod
    def forward(ctx, eps, q, k, v):
        ctx.eps = eps
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        return None, perturb(gq, ctx.eps), perturb(gk, ctx.eps), perturb(gv, ctx.eps)


def sdpa(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def perturbed_kernel(what: str, eps: float) -> Kernel:
    def wrong(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        kw = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if what == "grad":
            return sdpa(*_ScaleGrads.apply(eps, q, k, v), **kw)
        return perturb(sdpa(q, k, v, **kw), eps)

    return Kernel(f"sdpa x (1+{eps:g}) on {what}", wrong, None, "top_left")


# ------------------------------------------------------------------ FlashAttention's rule, written independently
def fa_attention(q, k, v, visible, bias, scale, dtype):
    """softmax(q kᵀ·scale + bias over visible keys) v with every op in ``dtype``; rows without a key -> 0."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        s = s + bias.to(dtype)
    if visible is not None:
        vis = visible.expand_as(s)
        empty = ~vis.any(dim=-1, keepdim=True)
        s = s.masked_fill(~vis, float("-inf")).masked_fill(empty, 0.0)
        w = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    else:
        w = torch.softmax(s, dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", w, v)


def fa_passes(got: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor, rows: torch.Tensor | None) -> bool:
    def err(x):
        d = (x.double() - ref).abs()
        d = d[rows] if rows is not None else d
        return float(d.max()) if d.numel() else 0.0

    r = ref.to(got.dtype)
    atol = 2.0 * float(((r + 0.3 - 0.3) - r).abs().max())
    return err(got) <= 2.0 * err(plain) + atol


def fa_tensors(case, inp, dtype, backward: bool = True):
    """(out, dq, dk, dv) of SDPA, the fp64 reference and the plain same-dtype implementation (out alone when
    not ``backward``)."""
    out = {}
    for name, cast in (("kernel", None), ("ref", torch.float64), ("plain", dtype)):
        leaves = [t.detach().clone().requires_grad_(backward) for t in (inp.q, inp.k, inp.v)]
        o = (sdpa(*leaves, **inp.kwargs) if cast is None
             else fa_attention(*leaves, inp.visible, inp.bias, case.scale, cast))
        grads = torch.autograd.grad(o, leaves, inp.grad_out.to(o.dtype)) if backward else ()
        out[name] = [o.detach(), *grads]
    return out


def fa_eps(tensors, rows, which: list[int]) -> float | None:
    """The smallest ε at which FlashAttention's rule fails the perturbed SDPA on tensors ``which`` (None: it fails
    the unperturbed kernel: not applicable)."""
    k, ref, plain = tensors["kernel"], [t.double() for t in tensors["ref"]], tensors["plain"]

    def caught(eps: float) -> bool:
        return any(not fa_passes(perturb(k[i], eps), ref[i], plain[i], rows if i < 2 else None) for i in which)

    return None if caught(0.0) else bisect(caught)


def fa_dropout_eps(case, inp, dtype, seed) -> float | None:
    """FlashAttention's rule on the dropout probe: the output against (P∘mask/(1-p))·v with the kernel's mask."""
    q, k, v = dropout_probe(inp, case, dtype)
    p, Tk = case.dropout_p, case.Tk
    torch.manual_seed(seed)
    out = sdpa(q, k, v, dropout_p=p)
    w = fa_attention(q, k, torch.eye(Tk, dtype=torch.float64).expand_as(k.double()), None, None, None, torch.float64)
    keep = out[..., :Tk].double() * (1 - p) / w > 0.5
    ref = (w * keep / (1 - p)) @ v.double()
    wp = fa_attention(q, k, torch.eye(Tk, dtype=dtype).expand_as(k), None, None, None, dtype)
    plain = (wp * keep.to(dtype) / (1 - p)) @ v

    def caught(eps: float) -> bool:
        return not fa_passes(perturb(out, eps), ref, plain, None)

    return None if caught(0.0) else bisect(caught)


# ------------------------------------------------------------------------------------------------------ tfmoe
def tfmoe_caught(s, case, inp, dtype, what: str, eps: float, seed: int, i: int) -> bool:
    kernel, rec = perturbed_kernel(what, eps), cpu_recorder(seed, dtype)
    if case.family == "dropout":
        return run_dropout_case(kernel, case, inp, dtype, seed * 1_000_003 + i, s.dropout_seeds, rec).status == "fail"
    probe, read = run_weights_probe(kernel, case, inp, dtype, rec)  # as the battery: the weights first
    fwd, bwd = run_case(kernel, case, inp, dtype, s.fully_masked_expect, what == "grad", s.grad_factor, rec, read,
                        ROUNDS[dtype])
    if what == "grad":
        return bwd is not None and bwd.status == "fail"
    return fwd.status == "fail" or probe.status == "fail"


ROUNDS: dict[torch.dtype, bool] = {}  # SDPA's backward rounds dP and δ to the dtype: measured as the battery does


def bisect(caught: Callable[[float], bool]) -> float:
    """The smallest ε in [EPS_LO, EPS_HI] (log scale) with caught(ε), assuming monotone; inf if none."""
    lo, hi = math.log(EPS_LO), math.log(EPS_HI)
    if not caught(EPS_HI):
        return math.inf
    if caught(EPS_LO):
        return EPS_LO
    for _ in range(STEPS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if caught(math.exp(mid)) else (mid, hi)
    return math.exp(hi)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", nargs="*", default=[], help="only these families (e.g. backward; default: all)")
    ap.add_argument("--per-case", action="store_true", help="also print each case's ε under both rules")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    s = EXPERIMENTS["attn-check"].load().settings(compose("attn-check", ["kernel=torch:sdpa", *MATRIX])).battery
    print(f"torch {torch.__version__}, cpu, seed {args.seed}, {' '.join(MATRIX)}, grad_factor {s.grad_factor:g}")
    print(f"{'family':18} {'dtype':5} {'cases':>5} {'tfmoe eps':>10} {'FA eps':>10} {'tfmoe/FA':>8} {'FA n/a':>6}")
    worst, bad = 0.0, []
    families = list(dict.fromkeys(c.family for c in s.cases)) + ["backward"]
    families = [f for f in families if not args.families or f in args.families]
    for name in args.dtypes:
        dtype = DTYPES[name]
        ROUNDS[dtype], note = backward_rounds_to_run_dtype(perturbed_kernel("grad", 0.0), dtype, torch.device("cpu"),
                                                           args.seed)
        print(f"{name}: {note}")
        for family in families:
            what = "grad" if family == "backward" else "out"
            idx = [i for i, c in enumerate(s.cases) if (c.family == family or (what == "grad" and c.family not in (
                "dropout",)))]
            inputs = {i: make_inputs(s.cases[i], s.B, s.Hq, "top_left", args.seed, i, torch.device("cpu"), dtype)
                      for i in idx}
            ours_each, theirs, na = [], [], 0
            for i in idx:  # each case bisected on its own, for both rules: the same path through the dtype's grid
                if tfmoe_caught(s, s.cases[i], inputs[i], dtype, what, 0.0, args.seed, i):
                    bad.append(f"{family} {name}: tfmoe fails the unperturbed SDPA at {s.cases[i].label()}")
                    continue
                ours_each.append(bisect(lambda e, i=i, dtype=dtype, what=what, inputs=inputs: tfmoe_caught(
                    s, s.cases[i], inputs[i], dtype, what, e, args.seed, i)))
                case, inp = s.cases[i], inputs[i]
                if case.family == "dropout":
                    e = fa_dropout_eps(case, inp, dtype, args.seed * 1_000_003 + i)
                else:
                    e = fa_eps(fa_tensors(case, inp, dtype), inp.seen, [1, 2, 3] if what == "grad" else [0])
                na += e is None
                if args.per_case:
                    print(f"    {case.label()}: tfmoe {ours_each[-1]:.3g}, FA {'n/a' if e is None else f'{e:.3g}'}",
                          flush=True)
                theirs += [] if e is None else [e]
            fa_alone = min(theirs, default=math.inf)  # FlashAttention's figure over the rule-judged cases

            probes = []  # (name, tfmoe catches at e?, FlashAttention's ε on it): the family's exact probe
            if what == "grad":  # the exact-gradient probe, a case of kernel_backward: both rules judge it too
                case = replace(PROBE_CASE, Hkv=s.Hq)
                inp = probe_inputs(s.B, s.Hq, dtype, args.seed, torch.device("cpu"))

                def probe_caught(e: float, dtype=dtype) -> bool:
                    kernel, rec = perturbed_kernel("grad", e), cpu_recorder(args.seed, dtype)
                    return run_exact_grad_probe(kernel, s.B, s.Hq, dtype, args.seed, rec).status == "fail"

                probes.append(("exact-gradient", probe_caught, lambda case=case, inp=inp, dtype=dtype: fa_eps(
                    fa_tensors(case, inp, dtype), inp.seen, [1, 2, 3])))
            if what == "out" and family in EXACT_OUTPUT_MASKS:  # the family's exact-output probe, both rules
                hkv = min(s.cases[i].Hkv for i in idx)
                case, inp = output_probe_inputs(family, s.B, s.Hq, hkv, "top_left", dtype, args.seed,
                                                torch.device("cpu"))

                def out_probe_caught(e: float, dtype=dtype, case=case, inp=inp) -> bool:
                    return run_exact_output_probe(perturbed_kernel("out", e), case, inp, dtype,
                                                  cpu_recorder(args.seed, dtype)).status == "fail"

                def fa_on_output_probe(case=case, inp=inp, dtype=dtype) -> float | None:
                    counts = (inp.visible.expand(s.B, s.Hq, case.Tq, case.Tk).sum(-1) if inp.visible is not None
                              else None)
                    rows = inp.seen if counts is None else inp.seen & ((counts & (counts - 1)) == 0)
                    return fa_eps(fa_tensors(case, inp, dtype, backward=False), rows, [0])

                probes.append(("exact-output", out_probe_caught, fa_on_output_probe))
            for probe, caught, fa_figure in probes:
                if caught(0.0):
                    bad.append(f"{family} {name}: tfmoe fails the unperturbed SDPA on the {probe} probe")
                    continue
                ours_each.append(bisect(caught))
                e = fa_figure()
                na += e is None
                theirs += [] if e is None else [e]
                if args.per_case:
                    print(f"    {probe} probe: tfmoe {ours_each[-1]:.3g}, FA {'n/a' if e is None else f'{e:.3g}'}",
                          flush=True)
                print(f"    {family} {name}: rule-judged cases alone: tfmoe "
                      f"{min(ours_each[:-1], default=math.inf):.3g}, FA {fa_alone:.3g}", flush=True)
            ours, fa = min(ours_each, default=math.inf), min(theirs, default=math.inf)
            ratio = ours / fa if math.isfinite(fa) else (0.0 if math.isfinite(ours) else math.nan)
            worst = max(worst, ratio) if ratio == ratio else worst
            n_cases = len(idx) + (what == "grad" or family in EXACT_OUTPUT_MASKS)  # + the family's exact probe
            print(f"{family:18} {name:5} {n_cases:5d} {ours:10.3g} {fa:10.3g} {ratio:8.2f} {na:6d}", flush=True)
            if ratio > 1.05:
                bad.append(f"{family} {name}: tfmoe catches at {ours:.3g}, FlashAttention's rule at {fa:.3g}")
    print(f"\nworst tfmoe/FA {worst:.2f}; {time.perf_counter() - t0:.0f} s")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
