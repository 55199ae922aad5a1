"""route-sim's layer battery: wall time of one battery per implementation (target <= 30 s each on this CPU),
measured in-process with the default sizes (2x12 tokens, d_model 16, 8 experts, top-2). The first HF battery
includes importing transformers' modeling code; a fresh `tfmoe route-sim impl=...` process also pays Python,
torch and Hydra start-up (measured separately, end to end). Prints seconds and the ratio to the target."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tfmoe.api.testing import compose, make_recorder
from tfmoe.contract.runtime import check_threads, torch_threads
from tfmoe.experiments import route_sim
from tfmoe.experiments.route_sim import layer as route_layer

TARGET_S = 30.0
COURSE = Path(__file__).resolve().parents[1].parent / "shared" / "course"
IMPLS = ["null", "toy_moe:ToyMoE", "hf:mixtral", "hf:qwen2_moe", "hf:deepseek_v3"]


def battery_seconds(impl: str) -> float:
    cfg = compose("route-sim", [f"impl={impl}", "steps=0"])
    rec = make_recorder(cfg)
    with torch_threads(check_threads(cfg)):  # conf's threads: 1, as the runner applies it
        t0 = time.perf_counter()
        route_layer.run_battery(route_sim.settings(cfg).layer, rec)
        elapsed = time.perf_counter() - t0
    assert rec.all_passed, [c for c in rec.checks_rows if not c.passed]
    return elapsed


def cli_seconds(impl: str) -> float:
    tfmoe = str(Path(sys.executable).with_name("tfmoe"))
    with tempfile.TemporaryDirectory() as work:
        t0 = time.perf_counter()
        subprocess.run([tfmoe, "route-sim", f"impl={impl}", "steps=0"], cwd=work, check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(COURSE)})
        return time.perf_counter() - t0


def main() -> None:
    sys.path.insert(0, str(COURSE))  # the course's listing, importable as toy_moe
    impls = [i for i in IMPLS if i != "toy_moe:ToyMoE" or (COURSE / "toy_moe.py").exists()]
    print(f"layer battery, in-process (target <= {TARGET_S:g} s each)")
    for impl in impls:
        s = battery_seconds(impl)
        print(f"  {impl:18s} {s:6.2f} s   ratio to target {s / TARGET_S:.3f}")
    print("end to end, a fresh `tfmoe route-sim impl=... steps=0` process (start-up + battery; impl=null adds the "
          "course case)")
    for impl in ("null", "hf:deepseek_v3"):
        s = cli_seconds(impl)
        print(f"  {impl:18s} {s:6.2f} s   ratio to target {s / TARGET_S:.3f}")


if __name__ == "__main__":
    main()
