"""attn-check kernel mode on a CUDA device, in one process: every SDPA backend and FlexAttention, in fp32, fp16 and
bf16, on the default case matrix; then planted bugs that only the exact probes or the long row catch.

For `benchmarks/cuda_check.sh` (a GPU loan is short: one process spares an interpreter start and a CUDA context
per run). One line per run: passed / failed / refused, the failed families with their details, the worst
err/limit per rule (forward | backward | dropout | weights) and, for the exact probes, their worst error and
limit (0 = exact: fp16/bf16). Writes the same as JSON lines to ``--out``.

    python benchmarks/cuda_kernel_battery.py --out cuda-check/kernels.jsonl
    python benchmarks/cuda_kernel_battery.py --specs torch:sdpa-flash --dtypes bf16 --deadline 120

Exits 1 if a correct kernel failed a family or a planted bug passed (the families that caught it are printed beside
the one it is aimed at). Asserts
nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # buggy_kernels, as the tests import it
from kernel_seed_sweep import margins  # noqa: E402

from tfmoe.api.testing import run_recorded  # noqa: E402
from tfmoe.contract.errors import BadInput  # noqa: E402

SPECS = ["torch:sdpa", "torch:sdpa-flash", "torch:sdpa-efficient", "torch:sdpa-cudnn", "torch:sdpa-math",
         "torch:flex"]
# (planted bug, dtype, the family that must fail): the blind spots issue 28 closed, on a GPU's own SDPA
PLANTED = [("buggy_kernels:kernel_output_quarter_percent_large", "bf16", "kernel_scale"),
           ("buggy_kernels:kernel_grads_quarter_percent_large", "bf16", "kernel_backward"),
           ("buggy_kernels:kernel_hides_a_key_in_long_rows", "bf16", "kernel_long_rows"),
           ("buggy_kernels:kernel_fp16_online_softmax", "fp16", "kernel_long_rows"),
           ("buggy_kernels:kernel_dropout_redraws_in_backward", "bf16", "kernel_backward")]


def probe_errors(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """The worst (err, limit) of each exact probe (by err/limit; limit 0 means exact)."""
    worst: dict[str, tuple[float, float]] = {}
    for r in rows:
        if r["name"] == "err" and r.get("probe"):
            err, limit = float(r["value"]), float(r.get("limit") or 0.0)
            ratio = err / limit if limit > 0 else (0.0 if err == 0 else math.inf)
            old = worst.get(r["probe"])
            if old is None or ratio > (old[0] / old[1] if old[1] > 0 else (0.0 if old[0] == 0 else math.inf)):
                worst[r["probe"]] = (err, limit)
    return worst


def run_one(spec: str, dtype: str, seed: int, extra: list[str], device: str = "cuda") -> dict:
    """One battery run on ``device``; a refusal (exit 2) or a crash is reported, not raised."""
    t0 = time.perf_counter()
    out: dict = {"spec": spec, "dtype": dtype, "seed": seed}
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rec = run_recorded("attn-check", [f"kernel={spec}", f"device={device}", f"dtype={dtype}", f"seed={seed}",
                                              *extra])
    except (SystemExit, BadInput) as exc:  # a refused setting: its one-line message
        out.update(result="refused", detail=str(exc)[:400])
    except Exception as exc:  # noqa: BLE001 - reported, the next run goes on
        out.update(result="crashed", detail="".join(traceback.format_exception_only(exc)).strip()[:600],
                   where=traceback.format_exc()[-1200:])
    else:
        failed = {c.check: c.detail for c in rec.checks_rows if c.outcome == "failed"}
        out.update(result="failed" if failed else "passed", failed=failed,
                   families={c.check: c.outcome for c in rec.checks_rows},
                   margins=margins(rec.metrics_rows), probes=probe_errors(rec.metrics_rows))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def line(r: dict) -> str:
    text = f"{r['spec']:52} {r['dtype']:5} {r['result']:8} {r['wall_s']:6.1f}s"
    if r["result"] in ("refused", "crashed"):
        return text + "  " + r["detail"].replace("\n", " ")[:300]
    m = r["margins"]
    fwd = max((v for k, v in m.items() if k not in ("backward", "dropout", "weights")), default=float("nan"))
    text += "  fwd {:.2f} | bwd {} | dropout {} | weights {}".format(
        fwd, *(f"{m[k]:.2f}" if k in m else "-" for k in ("backward", "dropout", "weights")))
    text += "  probes " + ", ".join(f"{p} {e:.3g}/{lim:.3g}" for p, (e, lim) in sorted(r["probes"].items()))
    na = [f for f, s in r["families"].items() if s == "n/a"]
    if na:
        text += f"  not judged: {na}"
    for f, d in r["failed"].items():
        text += f"\n    {f}: {d[:400]}"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", nargs="*", default=SPECS)
    ap.add_argument("--dtypes", nargs="*", default=["bf16", "fp32", "fp16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-planted", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: try this script here (with a small matrix)")
    ap.add_argument("--deadline", type=float, default=math.inf, help="start no run after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines, one per run")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides (after --)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to run", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {where}, seed {args.seed}", flush=True)
    t0 = time.perf_counter()
    # eager FlexAttention last (about a minute per run on an H200, where every SDPA backend takes 1-5 s; the
    # first run also pays CUDA's start, ~45 s): the planted bugs before it
    slow = [s for s in args.specs if s == "torch:flex"]
    plan = [(s, d, None) for d in args.dtypes for s in args.specs if s not in slow]
    plan += [] if args.no_planted else [(s, d, fam) for s, d, fam in PLANTED]
    plan += [(s, d, None) for d in args.dtypes for s in slow]
    alarms = misses = 0
    sink = args.out.open("a") if args.out else None
    for spec, dtype, family in plan:
        if time.perf_counter() - t0 > args.deadline:
            print(f"deadline: {spec} {dtype} not run", flush=True)
            continue
        r = run_one(spec, dtype, args.seed, list(args.overrides), args.device)
        r["planted_family"] = family
        if family is None:
            alarms += r["result"] == "failed"
        else:
            caught = bool(r.get("failed"))  # the run fails; the line names which families
            r["caught"] = caught
            misses += not caught
        print(line(r) + ("" if family is None else f"  -> {'caught' if r['caught'] else 'MISSED'} (aimed at {family})"),
              flush=True)
        if sink:
            sink.write(json.dumps(r, default=str) + "\n")
            sink.flush()
    print(f"{time.perf_counter() - t0:.0f} s; correct-kernel runs failed: {alarms}; planted bugs missed: {misses}")
    return 1 if alarms or misses else 0


if __name__ == "__main__":
    sys.exit(main())
