"""Each term of the backward's rounding floor (kernel_judging.accumulation_atols) beside FlashAttention's rounding
term, per case of bench_kernel_sensitivity's matrix, for SDPA: which term keeps tfmoe's limit above FA's.

    nice -n 10 .venv/bin/python benchmarks/kernel_floor_terms.py --dtype bf16 [--seed 0]

Per case and tensor (dq, dk, dv): SDPA's error, the plain implementation's, FlashAttention's rounding term
2·|(r + 0.3 - 0.3) - r| and its own plain implementation's error, tfmoe's rounding term (the larger of that, the cast rounding and the floor) and the floor's
terms (each before the floor's doubling). Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from tfmoe.api.testing import compose
from tfmoe.components.comparison import cast_rounding, max_abs_err, rounding_atol
from tfmoe.components.reference_attention import plain_attention, reference_attention
from tfmoe.contract.registry import EXPERIMENTS
from tfmoe.experiments.attn_check.kernel_cases import make_inputs
from tfmoe.experiments.attn_check.kernel_judging import accumulation_atols, backward_rounds_to_run_dtype
from tfmoe.experiments.attn_check.kernels import load_kernel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_kernel_sensitivity import DTYPES, MATRIX, fa_attention, sdpa  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--without-group-term", action="store_true",
                    help="print only, per case with grouped kv heads, SDPA's dk/dv err / the limit without the group "
                         "term (each query head's dk/dv rounded before the group sum) and with it")
    ap.add_argument("--row-factor", action="store_true",
                    help="instead: SDPA's fp32 dq on the default matrix's (127, 128, 80) scale case (F-176's): per "
                         "query row the common factor c_i (dq_i = (1 + c_i)·dq_ref_i, least squares), in eps32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    if args.row_factor:
        return row_factor(args.seed)
    rounds, note = backward_rounds_to_run_dtype(load_kernel("torch:sdpa", None, torch.device("cpu")), dtype,
                                                torch.device("cpu"), args.seed)
    print(note)
    s = EXPERIMENTS["attn-check"].load().settings(compose("attn-check", ["kernel=torch:sdpa", *MATRIX])).battery
    for i, case in enumerate(s.cases):
        if case.family == "dropout":
            continue
        inp = make_inputs(case, s.B, s.Hq, "top_left", args.seed, i, torch.device("cpu"), dtype)
        leaves = {n: [t.detach().to(c).requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
                  for n, c in (("ref", torch.float64), ("plain", dtype), ("kernel", dtype), ("fa", dtype))}
        ref, w = reference_attention(*leaves["ref"], inp.visible, inp.bias, case.scale, return_weights=True)
        plain = plain_attention(*leaves["plain"], inp.visible, inp.bias, case.scale)
        out = sdpa(*leaves["kernel"], **inp.kwargs)
        fa_plain = fa_attention(*leaves["fa"], inp.visible, inp.bias, case.scale, dtype)
        g = {n: torch.autograd.grad(o, leaves[n], inp.grad_out.to(o.dtype)) for n, o in
             (("ref", ref), ("plain", plain), ("kernel", out),
                                                                      ("fa", fa_plain))}
        parts: dict = {}
        scale = 1.0 / math.sqrt(case.D) if case.scale is None else case.scale
        floors = accumulation_atols(inp, ref, w, scale, dtype, out.detach().masked_fill(~inp.seen[..., None], 0.0),
                                    parts, rounds)
        if not args.without_group_term:
            print(case.label(), flush=True)
        for j, name in enumerate(("dq", "dk", "dv")):
            rows = inp.seen if name == "dq" else None
            r = g["ref"][j].detach()
            err, perr = max_abs_err(g["kernel"][j], r, rows), max_abs_err(g["plain"][j], r, rows)
            fa, fa_perr = rounding_atol(r, dtype, rows), max_abs_err(g["fa"][j], r, rows)
            ours = max(rounding_atol(r, dtype, rows), cast_rounding(r, dtype, rows), floors[name])
            terms = " ".join(f"{k}={2 * v:.2g}" for k, v in parts[name].items() if v)
            gmax = float(r[rows].abs().max()) if rows is not None else float(r.abs().max())
            if args.without_group_term:
                if name != "dq" and case.Hkv < s.Hq:
                    rest = 2.0 * math.hypot(*(v for k, v in parts[name].items() if k != "group"))
                    without = 2 * perr + max(rounding_atol(r, dtype, rows), cast_rounding(r, dtype, rows), rest)
                    print(f"seed {args.seed} {case.label()} {name}: err/limit {err / without:.2f} without the group "
                          f"term, {err / (2 * perr + ours):.2f} with it", flush=True)
                continue
            print(f"  {name}: err {err:.3g} plain {perr:.3g} FA plain {fa_perr:.3g} |g| {gmax:.3g}  FA atol {fa:.3g}  tfmoe atol {ours:.3g}"
                  f"  (2x terms: {terms})", flush=True)
    return 0


def row_factor(seed: int) -> int:
    """How much of SDPA's fp32 dq error is a factor common to its row (what a uniform gradient scale looks like)."""
    s = EXPERIMENTS["attn-check"].load().settings(compose("attn-check", ["kernel=torch:sdpa"])).battery
    i, case = next((i, c) for i, c in enumerate(s.cases) if (c.family, c.Tq, c.Tk, c.D, c.scale) == (
        "scale", 127, 128, 80, None))
    inp = make_inputs(case, s.B, s.Hq, "top_left", seed, i, torch.device("cpu"), torch.float32)
    leaves = {n: [t.detach().to(c).requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
              for n, c in (("ref", torch.float64), ("kernel", torch.float32))}
    ref = reference_attention(*leaves["ref"], inp.visible, inp.bias, case.scale)
    out = sdpa(*leaves["kernel"], **inp.kwargs)
    dq_ref = torch.autograd.grad(ref, leaves["ref"][0], inp.grad_out.double())[0]
    dq = torch.autograd.grad(out, leaves["kernel"][0], inp.grad_out)[0].double()
    c = ((dq - dq_ref) * dq_ref).sum(-1) / dq_ref.pow(2).sum(-1)  # (B,Hq,Tq)
    resid = (dq - (1 + c[..., None]) * dq_ref).abs().max()
    eps = torch.finfo(torch.float32).eps
    print(f"seed {seed} {case.label()}: max|dq - ref| {float((dq - dq_ref).abs().max()):.3g}; row factor c_i: max "
          f"|c_i| {float(c.abs().max()) / eps:.1f} eps32, mean {float(c.mean()) / eps:.1f} eps32; max|dq - (1 + c)·ref| "
          f"{float(resid):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
