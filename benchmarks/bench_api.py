"""The Python API in a test suite (issue 31): wall time of `tfmoe.check_attention(..., profile="quick")` on a small
layer (tfmoe's own MultiHeadSelfAttention at d_model=64, n_heads=4, T=16), each in a fresh interpreter, as a
multiple of `import torch` timed in the same run; and the CLI (`tfmoe attn-check`, Hydra, a run directory) on the
same case (the quick profile's keys as overrides). Samples are paired (each command right after an `import torch`),
so machine load hits both alike; medians are printed with the load average before and after. Also printed: a second
check in the same process (a test suite's later tests, imports already paid), and the same figures for a kernel
(`check_kernel(torch:sdpa)`, quick) and an MoE layer (`check_moe` on the course's ToyMoE listing, tests/buggy_moe.py:Correct).

Usage: python benchmarks/bench_api.py [REPEATS]   (default 3)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = SRC.parent / "tests"  # buggy_moe.Correct: the course's ToyMoE listing, unchanged
LAYER = "tfmoe.components.attention:MultiHeadSelfAttention"
SIZES = {"d_model": 64, "n_heads": 4, "T": 16}
CASES = {  # label -> (API call text, CLI arguments) for one case
    "attention": (f"tfmoe.check_attention({LAYER!r}, profile='quick', **{SIZES!r})", "attention"),
    "kernel": ("tfmoe.check_kernel('torch:sdpa', profile='quick')", "kernel"),
    "moe": ("tfmoe.check_moe('buggy_moe:Correct', profile='quick')", "moe"),
}


def cli_args(kind: str) -> list[str]:
    """The CLI's arguments for the API's quick case (the profile's keys and the sizes as overrides)."""
    sys.path.insert(0, str(SRC))
    from tfmoe.api import checking as checks

    settings = {"attention": SIZES, "kernel": {}, "moe": {}}[kind]
    spec = {"attention": LAYER, "kernel": "torch:sdpa", "moe": "buggy_moe:Correct"}[kind]
    overrides = checks._overrides(kind, spec, "quick", settings)
    return [checks.KINDS[kind], *(checks._override_text(k, v) for k, v in overrides.items())]


def wall(code: str, cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    elapsed = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        raise SystemExit(f"{code[:80]}... exited {r.returncode}: {r.stderr[-2000:]}")
    return elapsed


def api_code(call: str, twice: bool = False) -> str:
    second = (f"\nimport time; t = time.perf_counter(); v = {call}; "
              "print(json.dumps({'second': time.perf_counter() - t}))") if twice else ""
    return f"import json, tfmoe\nv = {call}\nassert v.passed, v.table(){second}"


def second_call(call: str, cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", api_code(call, twice=True)], cwd=cwd, capture_output=True, text=True,
                       env=env, timeout=900, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])["second"]


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def main(repeats: int = 3) -> None:
    print(f"python {sys.version.split()[0]}; {load()}")
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        for label, (call, kind) in CASES.items():
            cli = f"from tfmoe.cli import main; import sys; sys.argv = ['tfmoe', *{cli_args(kind)!r}]; main()"
            torch_s, api_s, cli_s = [], [], []
            for _ in range(repeats):
                torch_s.append(wall("import torch", cwd))
                api_s.append(wall(api_code(call), cwd))
                torch_s.append(wall("import torch", cwd))
                cli_s.append(wall(cli, cwd))
            t, a, c = statistics.median(torch_s), statistics.median(api_s), statistics.median(cli_s)
            again = second_call(call, cwd)
            print(f"{label:<10} import torch {t:6.2f} s | API quick {a:6.2f} s = {a / t:4.2f}x "
                  f"(+{a - t:5.2f} s beyond torch) | CLI same case {c:6.2f} s = {c / t:4.2f}x | "
                  f"API again in-process {again:5.2f} s")
    print(load())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
