"""Bad input at the edges of a single run: a typo, a device the machine lacks, bytes that are not UTF-8, a size that
cannot fit in memory. Each exits 2 with one line, before anything is written (issue 24, item 6)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tfmoe.api.testing import run_cli


def _nothing_written(cwd: Path) -> None:
    assert not (cwd / "runs").exists() or not any((cwd / "runs").rglob("*")), list((cwd / "runs").rglob("*"))


TYPOS = [
    (["shift-labels", "pad_side=middle"], "pad_side='middle' is unknown"),
    (["complexity", "T=0"], "T=0"),
    (["route-sim", "tokens=-5"], "tokens=-5 is below 1"),
    (["route-sim", "top_k=9"], "top_k=9 is outside 1..n_experts=8"),
    (["route-sim", "--seed", "-1"], "seed=-1"),
    (["route-sim", "threads=0"], "threads=0"),
]


@pytest.mark.parametrize(("args", "said"), TYPOS, ids=[" ".join(a) for a, _ in TYPOS])
def test_a_typo_in_a_single_run_writes_nothing(workdir: Path, args: list[str], said: str) -> None:
    r = run_cli(args, workdir)
    assert r.exit_code == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "Traceback" not in r.stderr, r.stderr
    _nothing_written(workdir)
    listing = run_cli(["runs", "--format", "json"], workdir)
    assert "no runs" in listing.stdout, listing.stdout  # no `error` row either


def test_cuda_on_a_machine_without_it_is_refused_before_the_run(workdir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    r = run_cli(["shift-labels", "--device", "cuda"], workdir)
    assert r.exit_code == 2 and "sees no CUDA device" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    _nothing_written(workdir)


def test_a_valid_single_run_still_runs(workdir: Path) -> None:
    """The validation refuses only what is wrong: the default config runs and writes its run directory."""
    r = run_cli(["shift-labels"], workdir)
    assert r.exit_code == 0 and r.run_dir is not None and (r.run_dir / "run.parquet").exists(), r.stderr


def test_a_non_utf8_override_exits_2_in_one_line_with_nothing_written(tmp_path: Path) -> None:
    """Bytes argv from a real process (Python keeps the undecodable byte as a surrogate)."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    p = subprocess.run([os.fsencode(sys.executable), b"-m", b"tfmoe.cli", b"shift-labels", b"pad_side=\xff"],
                       cwd=tmp_path, env=env, capture_output=True, timeout=120)
    err = p.stderr.decode("utf-8", "replace")
    assert p.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and "not UTF-8" in err and "pad_side=\\xff" in err, err
    _nothing_written(tmp_path)


def test_route_sim_refuses_a_course_case_that_cannot_fit_in_memory(workdir: Path) -> None:
    import psutil

    r = run_cli(["route-sim", "tokens=2000000000"], workdir)
    assert r.exit_code == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "tokens=2000000000 needs about" in line
    assert "GiB available" in line and "lower tokens (at most about tokens=" in line
    avail = psutil.virtual_memory().available / 2**30
    assert f"{avail:,.0f}" in line or f"{avail:,.1f}"[:-2] in line  # the host's available memory, in GiB
    _nothing_written(workdir)


def test_route_sim_guard_boundary_and_the_device_check() -> None:
    """The guard refuses above MEMORY_FRACTION of what is available and passes at it; run() checks the run's own
    device the same way (a CUDA run's memory is not the host's)."""
    from tfmoe.api.testing import compose
    from tfmoe.contract.errors import BadInput
    from tfmoe.experiments import route_sim

    s = route_sim.settings(compose("route-sim", ["tokens=100000"]))
    need = route_sim.estimated_course_bytes(s, "fp32")
    assert need > 0 and route_sim.estimated_course_bytes(s, "fp64") > need
    route_sim.refuse_oversized(s, "fp32", int(need / route_sim.MEMORY_FRACTION) + 1, "the host's")  # fits
    with pytest.raises(BadInput, match=r"tokens=100000 needs about .* lower tokens \(at most about tokens=\d+\)"):
        route_sim.refuse_oversized(s, "fp32", int(need / route_sim.MEMORY_FRACTION) - 1024, "cuda:0's")


@pytest.mark.parametrize("extra", [[], ["d_model=64"], ["d_hidden=128", "n_experts=16", "top_k=4"]],
                         ids=["default", "wide", "many-experts"])
def test_route_sim_estimate_against_the_measured_peak(extra: list[str], one_torch_thread) -> None:
    """The estimate is 1.0-1.5x of the course case's real peak (torch.profiler's allocation events) at 20,000
    tokens: never under what a run allocates, never so far over that a run that fits is refused."""
    from tfmoe.api.testing import compose, make_recorder
    from tfmoe.experiments import route_sim
    from tfmoe.experiments.route_sim import course
    from tfmoe.rules.memory import peak_memory_bytes

    cfg = compose("route-sim", ["tokens=20000", "steps=0", *extra])
    s = route_sim.settings(cfg)
    rec = make_recorder(cfg)
    rec.console.file = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):
        measured = peak_memory_bytes(lambda: course.course_case(s, rec), rec.device)
    ratio = route_sim.estimated_course_bytes(s, "fp32") / measured
    assert 1.0 <= ratio <= 1.5, (measured, ratio)


# ---------------------------------------------------------------- issue 29, item 4: every bad input, one line,
# refused before any run directory; every fix a message suggests is itself accepted
EDGES = [
    (["shift-labels", "seed=9223372036854775808"], "seed=9223372036854775808 is above"),  # 2**63
    (["shift-labels", "--seed", "18446744073709551615"], "is above"),  # 2**64-1
    (["shift-labels", "seed=1180591620717411303424"], "is above"),  # 2**70
    (["shift-labels", "seed=-1"], "seed=-1"),
    (["shift-labels", "+foo=1"], "unknown config key 'foo'"),
    (["shift-labels", "++foo=1"], "unknown config key 'foo'"),
    (["shift-labels", "+model.nosuch=1"], "unknown config key 'model.nosuch'"),
    (["shift-labels", "tensor_max_numel=-1"], "tensor_max_numel=-1"),
    (["shift-labels", "flush_every_s=-0.5"], "flush_every_s=-0.5"),
    (["shift-labels", "flush_every_s=0"], "flush_every_s=0"),
    (["shift-labels", "threads=-2"], "threads=-2"),
    (["shift-labels", "--dtype", "fp8"], "'fp8' is not one of"),
    (["shift-labels", "--seed", "x"], "--seed"),
    (["shift-labels", "--no-such-flag"], "--no-such-flag"),
    (["shift-labels", "sequences=[]"], "sequences is empty"),
    (["shift-labels", "sequences=[[BOS,我]]"], "needs non-ASCII text quoted"),
    (["route-sim", "tokens=-5"], "tokens=-5"),
    (["shift-labels", "model.n_layers=-1"], "model.n_layers=-1"),  # was a model of no layers, judged ok
    (["shift-labels", "model.n_heads=-1"], "model.n_heads=-1"),
    (["complexity", "T=0"], "T=0"),
]


def _suggestion(line: str) -> list[str] | None:
    """The fix a one-line refusal suggests, as command-line arguments: a quoted override ('k=v'), or what
    follows "pass"/"e.g."/"use" (k=v or --flag value); None when the line suggests no value."""
    import re

    quoted = re.search(r"(?:pass|e\.g\.|use)\s+'([\w.+]+=[^']+)'", line)
    if quoted:
        return [quoted.group(1)]
    m = re.search(r"(?:pass|e\.g\.|use)\s+(--[\w-]+ [\w.:-]+|[\w.]+=[^\s,;)]+)", line)
    if m is None:
        return None
    return m.group(1).split(" ") if m.group(1).startswith("--") else [m.group(1)]


@pytest.mark.parametrize(("args", "said"), EDGES, ids=[" ".join(a) for a, _ in EDGES])
def test_each_bad_input_is_one_line_and_its_suggested_fix_is_accepted(workdir: Path, args: list[str], said: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    r = run_cli(args, workdir)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and said in lines[0] and "Traceback" not in r.stderr, r.stderr
    _nothing_written(workdir)
    fix = _suggestion(lines[0])
    if fix is None:  # a line that suggests no value (`--cfg job lists the keys`, "give both T and D")
        return
    monkeypatch.setenv("TFMOE_VALIDATE_ONLY", "1")
    again = run_cli([args[0], *fix], workdir)  # the fix in place of the one bad argument
    assert again.exit_code == 0 and "valid:" in again.stdout, (fix, again.stdout + again.stderr)


def test_seed_bounds_are_those_a_run_can_record(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tfmoe.contract.runtime import MAX_SEED

    monkeypatch.setenv("TFMOE_VALIDATE_ONLY", "1")
    assert run_cli(["shift-labels", f"seed={MAX_SEED}"], workdir).exit_code == 0
    assert run_cli(["shift-labels", f"seed={MAX_SEED + 1}"], workdir).exit_code == 2
    assert run_cli(["shift-labels", "-m", f"seed=0,{MAX_SEED + 1}"], workdir).exit_code == 2  # a sweep's job too
    assert run_cli(["shift-labels", "tensor_max_numel=0"], workdir).exit_code == 0  # 0: summaries only


def test_hydra_flags_and_a_known_plus_key_still_work(workdir: Path) -> None:
    r = run_cli(["shift-labels", "--info", "config"], workdir)
    assert r.exit_code == 0 and "Config" in r.stdout, r.stdout + r.stderr
    r = run_cli(["shift-labels", "--cfg", "job", "++seed=4"], workdir)
    assert r.exit_code == 0 and "seed: 4" in r.stdout, r.stdout + r.stderr
    r = run_cli(["shift-labels", "--cfg", "job", "+expect.loss='< 100'"], workdir)
    assert r.exit_code == 0, r.stdout + r.stderr
