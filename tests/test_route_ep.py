"""route-sim ep_size=W: expert parallelism across processes started by torch.distributed.run (gloo, CPU).

One launch at route-sim's defaults (ep_size=2) runs the package's layer and every planted bug of tests/buggy_ep.py
in the same process group; each bug must fail its check, and exactly the checks listed (the others a bug
disturbs for real: a wrong placement also sends other bytes, a global capacity's all_gather writes bytes too).
The end-to-end CLI runs (ep_size=2 and 4) and the faults (a SIGKILLed rank, SIGTERM, a stuck rank) start a
launcher each and are marked slow: ``pytest tests/test_route_ep.py -m slow``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.api.testing import compose, make_recorder, run_cli
from tfmoe.contract.errors import BadInput
from tfmoe.experiments import route_sim
from tfmoe.experiments.route_sim import ep_launch
from tfmoe.experiments.route_sim import expert_parallel as ep

TESTS = Path(__file__).resolve().parent
CHECKS = {"output", "grad_input", "grad_router", "grad_experts", "a2a_bytes", "loads", "drops", "step_time"}
CLAIM = {"rows_per_token", "a2a_bytes_per_token"}  # the chapter's claim, judged on dropless runs
GRADS = {"grad_input", "grad_router", "grad_experts"}
# bug -> (the check it plants against, every check it fails at route-sim's defaults with ep_size=2)
PLANTED = {
    "RoundRobin": ("loads", {"output", *GRADS, "a2a_bytes", "loads"}),
    "EqualSplits": ("a2a_bytes", {"a2a_bytes"}),
    "NoWeights": ("output", {"output", *GRADS}),
    "NoAutograd": ("grad_experts", {"grad_input", "grad_experts", "a2a_bytes"}),
    "GlobalCapacity": ("drops", {"output", *GRADS, "a2a_bytes", "loads", "drops"}),
    "UntimedStall": ("step_time", {"step_time"}),
}


# each rank's own noise routes other tokens: every check that follows the routing fails, not step_time
NOISY_OWN_RNG_FAILS = {"output", *GRADS, "a2a_bytes", "loads", "drops"}


def failed(rec) -> set[str]:
    return {c.check.removeprefix("ep.") for c in rec.checks_rows if not c.passed}


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """One torch.distributed.run launch at the defaults + ep_size=2: the package's layer and every planted bug,
    each judged into its own recorder."""
    cfg = compose("route-sim", ["ep_size=2"])
    s = route_sim.settings(cfg)
    impls = ["own", *(f"buggy_ep:{name}" for name in PLANTED), "buggy_ep:RaisesInForward", "buggy_ep:OddExperts"]
    spec = ep.spec_for(s, 0, "fp32", impls, dropless=("own", "buggy_ep:EveryExpert"),
                       noisy=("own", "buggy_ep:NoisyOwnRng"))
    result, recs = _launch_and_judge(cfg, spec)
    recs["__launch__"] = (cfg, spec, result)
    return recs


def test_package_layer_passes_every_check(judged):
    rec = judged["own"]
    assert {c.check.removeprefix("ep.") for c in rec.checks_rows} == CHECKS | CLAIM
    assert {c.check.removeprefix("ep.") for c in rec.checks_rows if not c.applicable} == CLAIM  # capacity 1.0
    assert failed(rec) == set(), [(c.check, c.observed, c.threshold) for c in rec.checks_rows if not c.passed]
    rows = pd.DataFrame(rec.metrics_rows)
    sent = rows[rows.name == "ep.rows_sent"]
    assert set(sent["rank"]) == {0, 1} and set(sent["peer"]) == {0, 1} and set(sent["step"]) == {0, 1, 2}
    # what one rank sends a peer, the peer receives
    recv = rows[rows.name == "ep.rows_received"].set_index(["step", "rank", "peer"])["value"]
    for (step, rank, peer), value in sent.set_index(["step", "rank", "peer"])["value"].items():
        assert recv[(step, peer, rank)] == value
    wire = rows[rows.name == "ep.wire_bytes"]
    assert (wire["value"] > 0).all()  # bytes really crossed the wire between the two processes


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_ep_bug_fails_its_check(judged, bug):
    target, expected = PLANTED[bug]
    got = failed(judged[f"buggy_ep:{bug}"])
    assert target in got
    assert got == expected


def test_claim_holds_dropless_and_dense_dispatch_falsifies_it(judged):
    """Expert rows per token stay k and the All-to-All bytes per token follow 2*k*(W-1)/W*D*itemsize for the
    package's layer; sending every token to every expert breaks both (and the loads and bytes checks)."""
    own = judged["own@dropless"]
    assert failed(own) == set() and all(c.applicable for c in own.checks_rows)
    assert failed(judged["buggy_ep:EveryExpert@dropless"]) == CLAIM | {"loads", "a2a_bytes"}


def test_noisy_topk_under_ep_passes_every_check_and_the_noise_is_real(judged):
    """Noisy top-k at W=2: the noise is a function of (seed, step, global token), so the float64 reference adds the
    same noise and every check passes; judged as if there were no noise, the same records fail the output check
    (the noise really moved the routing)."""
    rec = judged["own@noisy"]
    assert {c.check.removeprefix("ep.") for c in rec.checks_rows} == CHECKS | CLAIM
    assert failed(rec) == set(), [(c.check, c.observed, c.threshold) for c in rec.checks_rows if not c.passed]
    cfg, spec, result = judged["__launch__"]
    deaf = make_recorder(cfg)
    ep.judge([r["own@noisy"] for r in result["ranks"]], result["world"], spec, deaf, spec["layers"][0]["capacity_factor"])
    assert "output" in failed(deaf)


def test_noise_from_each_ranks_own_rng_fails_the_output_check(judged):
    """Each rank drawing its noise from its own (identically seeded) RNG: rank 1's tokens get rank 0's noise, so the
    routing is not the reference's."""
    got = failed(judged["buggy_ep:NoisyOwnRng@noisy"])
    assert "output" in got
    assert got == NOISY_OWN_RNG_FAILS


def test_routing_noise_is_a_function_of_seed_step_and_global_token():
    import torch

    from tfmoe.experiments.route_sim.ep_worker import routing_noise

    a = routing_noise(0, 1, 64, 8)
    assert a.shape == (64, 8) and a.dtype == torch.float64 and a.std() > 0.5
    assert torch.equal(a, routing_noise(0, 1, 64, 8))  # no RNG state enters
    assert not torch.equal(a, routing_noise(0, 2, 64, 8)) and not torch.equal(a, routing_noise(1, 1, 64, 8))
    assert not torch.equal(a[:32], a[32:])  # two ranks' shards get different noise


def test_users_exception_fails_every_check_naming_it(judged):
    rec = judged["buggy_ep:RaisesInForward"]
    assert failed(rec) == CHECKS | CLAIM
    assert all(c.detail.startswith("rank 0 raised RuntimeError: planted: my dispatcher is not written yet")
               for c in rec.checks_rows)


def test_experts_outside_the_interface_fail_every_check_naming_the_layout(judged):
    rec = judged["buggy_ep:OddExperts"]
    assert failed(rec) == CHECKS | CLAIM
    assert all("not the course's nn.Sequential(nn.Linear, nn.GELU, nn.Linear)" in c.detail for c in rec.checks_rows)


@pytest.mark.parametrize("overrides, needle", [
    (["ep_size=3"], "ep_size=3 does not divide n_experts=8: pass ep_size as one of 1, 2, 4"),  # 8: tokens=100
    (["ep_size=8", "tokens=100"], "tokens=100 is not divisible by ep_size=8: pass tokens=96"),
    (["ep_size=0"], "ep_size"),
    (["ep_size=2", "impl=buggy_moe:Correct"], "with ep_size=2 pass the expert-parallel layer as ep_impl="),
    (["ep_size=2", "dtype=bf16"], "pass dtype=fp32 or dtype=fp64"),
    (["ep_size=2", "device=cuda"], "pass device=cpu"),
    (["ep_size=2", "ep_impl=nocolon"], "is not 'python.module:Class'"),
    (["ep_size=4096", "n_experts=4096", "tokens=4096", "steps=0"], "more worker processes than this machine can start"),
    (["ep_size=4", "train_tokens=250"], "train_tokens=250 is not divisible by ep_size=4: pass train_tokens=248"),
])
def test_bad_ep_settings_refused_before_anything_starts(overrides, needle):
    with pytest.raises(BadInput) as err:
        route_sim.settings(compose("route-sim", overrides))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_ep_size_is_exit_2_in_one_line(tmp_path):
    res = run_cli(["route-sim", "ep_size=3"], tmp_path)
    assert res.exit_code == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert lines == ["error: ep_size=3 does not divide n_experts=8: pass ep_size as one of 1, 2, 4"]


@pytest.mark.parametrize("overrides", [
    ["ep_size=3"], ["ep_size=16"], ["ep_size=6", "n_experts=12"], ["ep_size=7", "n_experts=14"],
    ["ep_size=3", "n_experts=6", "tokens=7"], ["ep_size=5", "n_experts=10", "train_tokens=7"],
    ["ep_size=8", "tokens=100"], ["ep_size=4", "train_tokens=250", "tokens=90"],
])
def test_every_ep_size_suggestion_is_itself_accepted(overrides):
    """Each value a refusal suggests (every one of an 'as one of' list; all the keys of a 'pass k=v k=v' fix) is
    accepted as it stands: a suggestion never leads to the next refusal."""
    import re

    with pytest.raises(BadInput) as err:
        route_sim.settings(compose("route-sim", overrides))
    said = str(err.value)
    tries = []
    listed = re.search(r"ep_size as one of ([\d, ]+)", said)
    if listed:
        tries += [[*overrides, f"ep_size={w}"] for w in listed.group(1).replace(" ", "").split(",")]
    fix = re.search(r": pass ((?:\w+=\d+ ?)+)", said)
    if fix:
        tries.append([*overrides, *fix.group(1).split()])
    assert tries, said
    for args in tries:
        keys = {a.split("=")[0]: a for a in args}  # the last value of each key
        route_sim.settings(compose("route-sim", list(keys.values())))


def test_failure_line_names_the_rank():
    stderr = ("...\nRoot Cause (first observed failure):\n[0]:\n  time      : x\n  host      : h\n"
              "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 12)\n")
    assert ep_launch.failure_line(stderr, 1, 2) == "expert-parallel worker rank 1 of 2 failed (killed by SIGKILL)"
    assert "a rank of 4" in ep_launch.failure_line("", 1, 4)


def test_capacity_rule_is_exact():
    assert ep.capacity(50, 2, 8, 1.0) == 13  # ceil(12.5)
    assert ep.capacity(25, 1, 5, 1.2) == 6  # 6.000..04 in floats would give 7
    assert ep.capacity(50, 2, 8, None) is None


# ------------------------------------------------------------------------------------ slow: whole runs
def _run(tmp_path: Path, *args: str):
    res = run_cli(["route-sim", *args], tmp_path)
    run = pd.read_parquet(res.run_dir / "run.parquet").iloc[0]
    return res, run


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_cli_ep_run_end_to_end(tmp_path, world):
    res, run = _run(tmp_path, f"ep_size={world}")
    assert res.exit_code == 0, res.stderr
    checks = pd.read_parquet(res.run_dir / "checks.parquet")
    assert set(checks["check"]) == {f"ep.{c}" for c in CHECKS | CLAIM} | {f"ep.noisy.{c}" for c in CHECKS | CLAIM} | {
        "ep.train.router_replicated", "ep.train.assignments_add_up"}
    assert checks["passed"].all()
    metrics = pd.read_parquet(res.run_dir / "metrics.parquet")
    assert set(metrics[metrics.name == "ep.expert_load"]["rank"].dropna()) == set(range(world))
    assert set(metrics[metrics.name == "ep.sim.tokens_per_s_per_rank"]["world"]) == {world, 8, 16, 32, 64, 128, 256,
                                                                                      512, 1024}
    assert (res.run_dir / "ep_scaling.png").stat().st_size > 0 and (res.run_dir / "ep_training.png").exists()
    rows = metrics[metrics.name == "ep.train.rank_rows"]
    assert set(rows["strategy"]) == {"none", "aux_loss", "z_loss", "noisy_topk", "aux_free"} and set(rows["rank"]) == set(range(world))
    assert "Expert parallelism" in (res.run_dir / "summary.md").read_text()


@pytest.mark.slow
def test_killed_rank_ends_the_run_crashed_naming_it(tmp_path):
    (tmp_path / "buggy_ep.py").write_text((TESTS / "buggy_ep.py").read_text())
    t0 = time.monotonic()
    res, run = _run(tmp_path, "ep_size=2", "ep_impl=buggy_ep:DiesOnRank1")
    assert res.exit_code == 3 and run["status"] == "crashed"
    assert "rank 1 of 2 failed (killed by SIGKILL)" in run["error"]
    assert time.monotonic() - t0 < 120


@pytest.mark.slow
def test_stuck_rank_times_out(tmp_path):
    """Rank 1 never returns: rank 0's collective times out after ep_timeout_s, and the run ends crashed."""
    (tmp_path / "buggy_ep.py").write_text((TESTS / "buggy_ep.py").read_text())
    t0 = time.monotonic()
    res, run = _run(tmp_path, "ep_size=2", "ep_impl=buggy_ep:Sleeps", "ep_timeout_s=5")
    assert res.exit_code == 3 and run["status"] == "crashed"
    assert "expert-parallel worker rank" in run["error"]
    assert time.monotonic() - t0 < 120


@pytest.mark.slow
def test_sigterm_interrupts_every_rank(tmp_path):
    import psutil

    (tmp_path / "buggy_ep.py").write_text((TESTS / "buggy_ep.py").read_text())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "tfmoe.cli", "route-sim", "ep_size=2", "ep_impl=buggy_ep:Sleeps"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: list = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(workers) < 2:
        time.sleep(0.5)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "ep_worker" in " ".join(p.cmdline()) and "torch.distributed.run" not in " ".join(p.cmdline())]
    assert len(workers) == 2, "the two workers never started"
    time.sleep(3)  # they are inside the step now (rank 1 sleeping, rank 0 waiting in the All-to-All)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert time.monotonic() - t0 < 30
    _gone, alive = psutil.wait_procs(workers, timeout=5)
    assert alive == []
    run_dir = next((tmp_path / "runs" / "route-sim").iterdir())
    assert pd.read_parquet(run_dir / "run.parquet").iloc[0]["status"] == "interrupted"


# ------------------------------------------------------------------------------------ the scaling model
def _measured(popularity, world=2, ms_per_row=0.01):
    import numpy as np

    from tfmoe.experiments.route_sim.ep_scaling import Measured

    return Measured(world, 256, 2, 16, 4, 2, np.asarray(popularity, dtype=float), ms_per_row, None)


def test_scaling_model_bytes_law_and_balanced_straggler():
    from tfmoe.experiments.route_sim.ep_scaling import simulate

    points = simulate(_measured([0.25] * 4), (8, 64, 1024), 100.0, 10.0, seed=0)
    for p in points:
        assert p.bytes_per_token == pytest.approx(2 * 2 * (p.world - 1) / p.world * 16 * 4)
        assert p.experts == 2 * p.world
        assert 1.0 <= p.straggler < 1.5  # uniform popularity: multinomial noise only
        assert p.step_ms == pytest.approx(p.compute_ms + p.a2a_ms)
    assert points[0].tokens_per_s_per_rank > points[-1].tokens_per_s_per_rank  # latency * (W-1) grows
    assert simulate(_measured([0.25] * 4), (8, 64), 100.0, 10.0, seed=0) == simulate(
        _measured([0.25] * 4), (8, 64), 100.0, 10.0, seed=0)  # seeded


def test_scaling_model_skewed_popularity_makes_a_straggler():
    from tfmoe.experiments.route_sim.ep_scaling import simulate

    even = simulate(_measured([0.25] * 4), (64,), 100.0, 10.0, seed=0)[0]
    skewed = simulate(_measured([0.85, 0.05, 0.05, 0.05]), (64,), 100.0, 10.0, seed=0)[0]
    assert skewed.straggler > 2 * even.straggler and skewed.compute_ms > even.compute_ms


@pytest.mark.parametrize("value", ["[1]", "[8,x]", "7"])
def test_bad_sim_ranks_refused(value):
    with pytest.raises(BadInput, match="ep_sim_ranks"):
        route_sim.settings(compose("route-sim", ["ep_size=2", f"ep_sim_ranks={value}"]))


# ------------------------------------------------------------------------------------ shipped adapters
def test_lib_fairscale_refused_in_one_line_where_it_cannot_run():
    from tfmoe.adapters.moe_ep_libs import check_lib

    with pytest.raises(BadInput, match="is not a shipped adapter"):
        check_lib("lib:nosuch", 64, 8, 2, 1.0)
    try:
        import fairscale  # noqa: F401
    except ImportError:
        with pytest.raises(BadInput, match=r"needs fairscale 0.4.13, not installed here: pip install"):
            check_lib("lib:fairscale", 64, 8, 2, 1.0)
        return
    for args, needle in [((64, 8, 1, 1.0), "pass top_k=2"), ((64, 8, 2, None), "pass capacity_factor=1.0"),
                         ((50, 8, 2, 1.0), "multiple of n_experts=8")]:
        with pytest.raises(BadInput, match=needle):
            check_lib("lib:fairscale", *args)


def _launch_and_judge(cfg, spec: dict) -> tuple[dict, dict]:
    """Run ``spec`` at W = 2 from tests/ (buggy_ep importable by the workers, as a user's module beside them); each
    layer's records judged by its own recorder (with noise where the spec asked for it)."""
    old = os.getcwd()
    os.chdir(TESTS)
    try:
        result = ep.launch(spec, 2)
    finally:
        os.chdir(old)
    recs = {}
    for layer in spec["layers"]:
        rec = make_recorder(cfg)
        ep.judge([r[layer["label"]] for r in result["ranks"]], result["world"], spec, rec, layer["capacity_factor"],
                 noisy=layer.get("noisy", False))
        recs[layer["label"]] = rec
    return result, recs


def test_lib_fairscale_passes_and_its_gumbel_noise_fails_the_output_check():
    """fairscale 0.4.13's MOELayer at W=2 against its own documented semantics (capacity 2T/E per rank, weights
    renormalised over the kept, capacity-padded All-to-Alls); with its gate's Gumbel noise left on it fails.
    Runs where fairscale is installed (scripts/test-ep-libs.sh); skipped in the main venv."""
    pytest.importorskip("fairscale.nn.moe", reason="fairscale is not installed (scripts/test-ep-libs.sh)")
    cfg = compose("route-sim", ["ep_size=2", "tokens=128", "steps=0"])
    s = route_sim.settings(cfg)
    spec = ep.spec_for(s, 0, "fp32", ["lib:fairscale", "buggy_ep:FairscaleGumbel"])
    result, recs = _launch_and_judge(cfg, spec)
    own = recs["lib:fairscale"]
    assert failed(own) == set(), [(c.check, c.observed, c.threshold) for c in own.checks_rows if not c.passed]
    assert {c.check.removeprefix("ep.") for c in own.checks_rows if c.applicable} == {
        "output", "grad_input", "grad_router", "grad_experts", "a2a_bytes"}
    assert "output" in failed(recs["buggy_ep:FairscaleGumbel"])


@pytest.mark.parametrize("lib", ["lib:fairscale", "lib:deepspeed"])
def test_lib_adapters_refuse_fp64_before_anything_starts(lib):
    """Both libraries' gates compute in float32: at fp64 fairscale raised on mixed dtypes (every check failed as if
    the user's code had) and deepspeed's float32 combine weights failed a correct layer by 1e7 tolerances
    (failures.md F-203); refused in one line, installed or not."""
    from tfmoe.adapters.moe_ep_libs import check_lib

    with pytest.raises(BadInput, match="pass dtype=fp32") as err:
        check_lib(lib, 64, 8, 2, 1.0, "fp64")
    assert "\n" not in str(err.value)


def test_lib_deepspeed_refused_in_one_line_where_it_cannot_run():
    from importlib import metadata

    from tfmoe.adapters.moe_ep_libs import check_lib

    try:
        metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        with pytest.raises(BadInput, match=r"needs deepspeed 0.19.8, not installed here: pip install"):
            check_lib("lib:deepspeed", 64, 8, 2, 1.0)
        return
    with pytest.raises(BadInput, match="pass top_k=2"):
        check_lib("lib:deepspeed", 64, 8, 1, 1.0)
    check_lib("lib:deepspeed", 64, 8, 2, None)  # dropless is its drop_tokens=False
    check_lib("lib:deepspeed", 50, 8, 2, 1.2)  # any T and capacity factor


def test_deepspeed_capacity_is_its_float32_rule():
    from tfmoe.adapters.moe_ep_libs import deepspeed_capacity

    assert deepspeed_capacity(64, 8, 1.0) == 16
    assert deepspeed_capacity(50, 8, 1.0) == 13  # ceil(6.25 * 2)
    assert deepspeed_capacity(50, 8, 1.2) == 16  # float32(6.25) * float32(2.4) = 15.000000...6 -> 16 (exact: 15)
    assert ep.capacity(50, 2, 8, 1.2) == 15


def test_lib_deepspeed_passes_and_its_2nd_expert_sampling_fails_the_output_check():
    """deepspeed 0.19.8's MoE at W=2 against its documented semantics: capacity-padded (capacity ceil(2cT/E) in
    float32, weights renormalised over the kept) and dropless (drop_tokens=False: padded to the largest load on any
    rank, agreed by one all_reduce), both to the byte on the wire; with its second-expert sampling left on it
    fails the output check. Runs where deepspeed is installed (scripts/test-ep-libs.sh); skipped in the main venv."""
    pytest.importorskip("deepspeed.moe.layer", reason="deepspeed is not installed (scripts/test-ep-libs.sh)")
    cfg = compose("route-sim", ["ep_size=2", "tokens=100", "capacity_factor=1.2", "steps=0"])
    s = route_sim.settings(cfg)
    spec = ep.spec_for(s, 0, "fp32", ["lib:deepspeed", "buggy_ep:DeepspeedSampling"], dropless=("lib:deepspeed",))
    result, recs = _launch_and_judge(cfg, spec)
    judged = {"output", "grad_input", "grad_router", "grad_experts", "a2a_bytes"}
    for label in ("lib:deepspeed", "lib:deepspeed@dropless"):
        rec = recs[label]
        assert failed(rec) == set(), (label, [(c.check, c.observed, c.threshold) for c in rec.checks_rows
                                              if not c.passed])
        assert {c.check.removeprefix("ep.") for c in rec.checks_rows if c.applicable} == judged, label
    rows = pd.DataFrame(recs["lib:deepspeed"].metrics_rows)
    wire = rows[rows.name == "ep.wire_bytes_expected"]
    assert (wire["value"] > 0).all()
    assert "output" in failed(recs["buggy_ep:DeepspeedSampling"])
    # its capacity is float32's: judged by the exact rule (C = 15 where it keeps 16), the correct layer would fail
    exact = [dict(r["lib:deepspeed"], semantics={"renormalize_kept": True}) for r in result["ranks"]]
    rec = make_recorder(cfg)
    ep.judge(exact, result["world"], spec, rec, 1.2)
    assert "output" in failed(rec)


@pytest.mark.slow  # two expert-parallel runs (the run and its replay), ~1 min
def test_every_notebook_command_on_an_ep_run(tmp_path) -> None:
    """An ep_size=2 run (per-rank rows, ep.noisy.* checks) through show (every format), diff, sql (every view),
    export mlflow, failures add, conclude and replay: the cross-product of tests/test_notebook_cross_product.py
    builds single-process route-sim runs only."""
    from tfmoe.harness.method.conclusions import CONCLUSIONS_FILE
    from tfmoe.harness.reading.sql import FILE_VIEWS
    from tfmoe.harness.store.notebook import load_run

    r = run_cli(["route-sim", "ep_size=2", "steps=2"], tmp_path)
    assert r.exit_code == 0 and r.run_dir is not None, r.stdout[-2000:] + r.stderr[-2000:]
    run, run_id = str(r.run_dir), str(load_run(r.run_dir).run["run_id"])
    for fmt in ("table", "md", "json"):
        shown = run_cli(["show", run, "--format", fmt], tmp_path)
        assert shown.exit_code == 0 and run_id in shown.stdout, (fmt, shown.stdout[:500], shown.stderr[-500:])
    assert run_cli(["diff", run, run], tmp_path).exit_code == 0
    for view in FILE_VIEWS:
        q = run_cli(["sql", f"SELECT run_id, count(*) AS n FROM {view} GROUP BY run_id", "--format", "csv"], tmp_path)
        assert q.exit_code == 0 and run_id in q.stdout, (view, q.stdout[:500], q.stderr[-500:])
    sent = run_cli(["sql", "SELECT count(*) AS n FROM metrics WHERE name = 'ep.rows_sent'", "--format", "csv"],
                   tmp_path)  # the per-rank, per-peer rows reach SQL
    assert sent.exit_code == 0 and int(sent.stdout.split()[-1]) > 0, (sent.stdout[-500:], sent.stderr[-500:])
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exported = run_cli(["export", "mlflow", "--tracking-uri", store], tmp_path)
    assert exported.exit_code == 0 and "exported 1 run(s)" in exported.stdout, exported.stdout[-1000:]
    log = tmp_path / "failures.md"
    logged = run_cli(["failures", "add", run, "--file", str(log), "--hypothesis", "planted"], tmp_path)
    assert logged.exit_code in (0, 2) and (logged.exit_code == 2) == (not log.exists()), logged.stderr[-500:]
    concluded = run_cli(["conclude", run, "--proven", "it ran on 2 ranks"], tmp_path)
    assert concluded.exit_code == 0 and (r.run_dir / CONCLUSIONS_FILE).exists(), concluded.stdout[-1000:]
    replay = run_cli(["replay", run], tmp_path)
    assert replay.exit_code == 0 and "reproduced" in replay.stdout and "NOT reproduced" not in replay.stdout, \
        replay.stdout[-2000:]
