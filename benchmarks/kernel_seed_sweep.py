"""attn-check kernel mode across seeds: false alarms on correct kernels, catches of the planted bugs.

The kernel battery's rules were calibrated on one seed per kernel; this runs the battery (in-process, exactly as
`tfmoe attn-check kernel=...` composes it) on every built-in CPU kernel, the correct test kernels and each planted
bug of tests/buggy_kernels.py, for seeds 0..N-1, and prints one table: kernel x seeds -> runs that passed / failed,
which families failed (a correct kernel failing any family is a false alarm), and for a planted bug whether its
family caught it and whether any other family failed too.

    nice -n 10 .venv/bin/python benchmarks/kernel_seed_sweep.py                   # seeds 0..9, the tests' matrix
    nice -n 10 .venv/bin/python benchmarks/kernel_seed_sweep.py --seeds 20 --dtype bf16
    nice -n 10 .venv/bin/python benchmarks/kernel_seed_sweep.py --default-matrix --seeds 3 --only correct

Exits 1 if any correct kernel failed or any planted bug was missed on some seed (the per-seed failures are printed
with their details, so a seed to regress on can be read off; a planted bug failing a second family is counted apart:
read its detail, it is often the bug itself showing there). Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from tfmoe.api.testing import run_recorded

TESTS = Path(__file__).resolve().parents[1] / "tests"
SMALL = "cases.shapes=[[5,7,12],[7,5,8],[1,6,16]]"  # tests/test_attn_kernels.py's reduced matrix
ATTEND_POLICY = "kernel_checks.fully_masked_expect={bool:zeros,additive:nan,causal:uniform}"

# (spec, extra overrides): correct kernels, never to fail a family
CORRECT = [("torch:sdpa", ()), ("torch:sdpa-math", ()), ("torch:sdpa-flash", ()), ("torch:flex", ()),
           ("tfmoe:chunked", ()), ("buggy_kernels:plain_kernel", ()),
           ("buggy_kernels:kernel_declares_bottom_right", ()), ("buggy_kernels:kernel_like_attend", (ATTEND_POLICY,)),
           ("buggy_kernels:kernel_normalises_last", ())]
# (spec, the families that must fail): tests/test_attn_kernels.py's PLANTED
PLANTED = [("kernel_ignores_scale", "kernel_scale"), ("kernel_bottom_right", "kernel_causal"),
           ("kernel_gqa_modulo", "kernel_gqa"), ("kernel_ignores_bool_mask", "kernel_padding_bool"),
           ("kernel_ignores_float_mask", "kernel_padding_additive"), ("kernel_nan_rows", "kernel_fully_masked"),
           ("kernel_wrong_grad", "kernel_backward"), ("kernel_nan_to_num_rows", "kernel_backward"),
           ("kernel_first_query_row_of_mask", "kernel_mask_bool"), ("kernel_first_head_of_mask", "kernel_per_head"),
           ("kernel_uniform_causal_empty", "kernel_causal"), ("kernel_ignores_dropout", "kernel_dropout"),
           ("kernel_dropout_no_rescale", "kernel_dropout"), ("kernel_dropout_own_generator", "kernel_dropout"),
           ("kernel_dropout_redraws_in_backward", "kernel_backward"),
           ("kernel_hides_a_key_in_long_rows", "kernel_long_rows"), ("kernel_fp16_online_softmax", "kernel_long_rows")]
# where the bug is dtype-bound: the family that catches it in fp32 (the fp16 accumulator fails every family there,
# the first one, kernel_scale, blocking the rest)
FP32_FAMILY = {"kernel_fp16_online_softmax": "kernel_scale"}


def margins(rows: list[dict]) -> dict[str, float]:
    """The worst err / limit per rule over one run: forward (per family), backward (dq, dk, dv), dropout."""
    worst: dict[str, float] = {}

    def put(key: str, ratio: float) -> None:
        if math.isfinite(ratio):
            worst[key] = max(worst.get(key, 0.0), ratio)

    for r in rows:
        if r["name"] == "err" and r.get("limit"):
            put("backward" if r.get("tensor") != "out" else r["family"], r["value"] / r["limit"])
        elif r["name"] == "dropout_keep_rate":
            put("dropout", abs(r["value"] - (1.0 - r["p"])) / r["bound"])
        elif r["name"] == "dropout_rescale_err" and r.get("limit"):
            put("dropout", r["value"] / r["limit"])
        elif r["name"] == "weights_rel_err" and r.get("limit"):
            put("weights", r["value"] / r["limit"])
    return worst


def failed_families(spec: str, seed: int, dtype: str, matrix: list[str], extra: tuple[str, ...],
                    closest: dict[str, tuple[float, int]] | None = None) -> dict[str, str]:
    """The families that failed, with their details; ``closest`` collects the worst err/limit per rule (and seed)."""
    with contextlib.redirect_stdout(io.StringIO()):  # the battery's own table, once per run
        rec = run_recorded("attn-check", [f"kernel={spec}", f"seed={seed}", f"dtype={dtype}", *matrix, *extra])
    if closest is not None:
        for key, ratio in margins(rec.metrics_rows).items():
            if ratio > closest.get(key, (-1.0, 0))[0]:
                closest[key] = (ratio, seed)
    return {c.check: c.detail for c in rec.checks_rows if not c.passed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default 10)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--default-matrix", action="store_true", help="the default case matrix instead of the tests'")
    ap.add_argument("--only", choices=("correct", "planted", "all"), default="all")
    ap.add_argument("--kernels", nargs="*", default=[], help="only these correct kernels (default: all)")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides, e.g. kernel_checks.backward=false")
    args = ap.parse_args()
    sys.path.insert(0, str(TESTS))  # buggy_kernels.py, as the tests import it
    matrix = ([] if args.default_matrix else [SMALL]) + list(args.overrides)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, cpu, {args.dtype}, seeds {seeds.start}..{seeds.stop - 1}, "
          f"{'default matrix' if args.default_matrix else SMALL}")
    alarms_total = misses_total = elsewhere_total = 0
    if args.only in ("correct", "all"):
        print(f"\n{'correct kernel':48} {'pass':>5} {'fail':>5}  false alarms (family: seeds); closest to a limit "
              "over the seeds: worst err/limit (seed), forward | backward | dropout | weights")
        for spec, extra in CORRECT:
            if spec not in args.kernels and args.kernels:
                continue
            alarms: dict[str, list[int]] = {}
            details: list[str] = []
            closest: dict[str, tuple[float, int]] = {}
            for seed in seeds:
                for family, detail in failed_families(spec, seed, args.dtype, matrix, extra, closest).items():
                    alarms.setdefault(family, []).append(seed)
                    details.append(f"    seed={seed} {family}: {detail[:300]}")
            n_fail = len({s for v in alarms.values() for s in v})
            text = "; ".join(f"{f}: {v}" for f, v in alarms.items()) or "none"
            fwd = max(((r, s, f) for f, (r, s) in closest.items() if f not in ("backward", "dropout", "weights")),
                      default=None)
            near = " | ".join("-" if x is None else f"{x[0]:.2f} ({x[2] + ', ' if len(x) > 2 else ''}seed {x[1]})"
                              for x in (fwd, closest.get("backward"), closest.get("dropout"), closest.get("weights")))
            print(f"{spec:48} {len(seeds) - n_fail:5d} {n_fail:5d}  {text}; {near}", flush=True)
            print("\n".join(details)) if details else None
            alarms_total += n_fail
    if args.only in ("planted", "all"):
        print(f"\n{'planted bug':48} {'caught':>6} {'missed':>6}  other families failed (family: seeds); weakest "
              "catch: the family's worst err/limit, least over the seeds")
        caught_per_seed: Counter[int] = Counter()
        for bug, family in PLANTED:
            family = FP32_FAMILY.get(bug, family) if args.dtype == "fp32" else family
            missed, others, details = [], {}, []
            weakest: tuple[float, int] | None = None
            for seed in seeds:
                closest: dict[str, tuple[float, int]] = {}
                failed = failed_families(f"buggy_kernels:{bug}", seed, args.dtype, matrix, (), closest)
                ratio = closest.get(family.removeprefix("kernel_"), (0.0, seed))[0]
                if weakest is None or ratio < weakest[0]:
                    weakest = (ratio, seed)
                if family in failed:
                    caught_per_seed[seed] += 1
                else:
                    missed.append(seed)
                for f, detail in failed.items():
                    if f != family:
                        others.setdefault(f, []).append(seed)
                        details.append(f"    seed={seed} {f}: {detail[:300]}")
            text = "; ".join(f"{f}: {v}" for f, v in others.items()) or "none"
            if weakest is not None:
                text += (f"; {weakest[0]:.3g}x (seed {weakest[1]})" if weakest[0] > 1
                         else "; no ratio (a policy, NaN or the seed test caught it)")
            print(f"{bug:48} {len(seeds) - len(missed):6d} {len(missed):6d}  {text}"
                  + (f"  (missed on seeds {missed})" if missed else ""), flush=True)
            print("\n".join(details)) if details else None
            misses_total += len(missed)
            elsewhere_total += len({s for v in others.values() for s in v})
        by_count: dict[int, list[int]] = {}
        for seed in seeds:
            by_count.setdefault(caught_per_seed[seed], []).append(seed)
        print("bugs caught per seed: " + "; ".join(
            f"{n}/{len(PLANTED)} on " + ("every seed" if len(v) == len(seeds) else f"seeds {v}")
            for n, v in sorted(by_count.items(), reverse=True)))
    print(f"\n{time.perf_counter() - t0:.0f} s; false alarms (runs of a correct kernel with a failed family): "
          f"{alarms_total}; planted bugs missed: {misses_total}; runs where a planted bug also failed another "
          f"family (its details above: the bug showing there too, or a false alarm): {elsewhere_total}")
    return 1 if alarms_total or misses_total else 0


if __name__ == "__main__":
    sys.exit(main())
