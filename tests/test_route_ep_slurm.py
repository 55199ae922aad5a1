"""route-sim ep_size=W under SLURM (route_sim/ep_slurm.py), without a cluster: the SLURM environment -> rank
mapping, the task-count mismatch (exit 2, one line, with a fix that is accepted), and how rank 0 names the rank
that failed. The real runs (srun, submitit) are in tests/test_cluster.py (`make test-cluster`)."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from tfmoe.api.testing import compose, run_cli
from tfmoe.contract.errors import BadInput
from tfmoe.experiments import route_sim
from tfmoe.experiments.route_sim import ep_slurm

# what srun sets in each task of `srun -n 2` (read on scripts/slurm-up.sh's node), task 1
TASK1 = {"SLURM_JOB_ID": "21", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": "1",
         "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "vm",
         "SLURM_JOB_NODELIST": "vm"}


def test_a_task_of_an_srun_step_is_the_rank_of_its_procid() -> None:
    step = ep_slurm.slurm_step(TASK1)
    assert step is not None
    assert (step.rank, step.world, step.local_rank, step.master_addr) == (1, 2, 1, "vm")
    assert 20000 <= step.master_port < 60000
    task0 = ep_slurm.slurm_step({**TASK1, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    assert task0 is not None and (task0.rank, task0.master_port) == (0, step.master_port)  # one rendezvous
    assert step.env() == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "vm",
                          "MASTER_PORT": str(step.master_port)}


def test_concurrent_steps_and_jobs_get_other_ports_and_the_user_can_set_them() -> None:
    ports = {ep_slurm.slurm_step({**TASK1, "SLURM_JOB_ID": job, "SLURM_STEP_ID": st}).master_port
             for job in ("21", "22", "1234567") for st in ("0", "1", "2")}
    assert len(ports) == 9
    mine = ep_slurm.slurm_step({**TASK1, "MASTER_PORT": "29500", "MASTER_ADDR": "10.0.0.7"})
    assert (mine.master_addr, mine.master_port) == ("10.0.0.7", 29500)


def test_the_first_node_of_the_step_hosts_the_rendezvous() -> None:
    many = {**TASK1, "SLURM_STEP_NODELIST": "gpu[003-005,9],cpu1", "SLURM_JOB_NODELIST": "gpu[001-009],cpu1"}
    assert ep_slurm.slurm_step(many).master_addr == "gpu003"  # the step's, not the job's, first node
    assert ep_slurm.first_host("rack[1-2]-n[07,8]") == "rack1-n07"
    assert ep_slurm.first_host("node7,node[1-3]") == "node7"
    assert ep_slurm.first_host("a-b.example.org") == "a-b.example.org"


@pytest.mark.parametrize("env", [
    {},  # no SLURM
    {k: v for k, v in TASK1.items() if not k.startswith(("SLURM_STEP", "SLURM_STEPID"))},  # sbatch's own script
    {**TASK1, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"},  # srun -n 1
])
def test_outside_a_multi_task_step_torch_distributed_run_starts_the_ranks(env: dict[str, str]) -> None:
    assert ep_slurm.slurm_step(env) is None


def test_a_task_count_other_than_ep_size_is_refused_with_a_fix_that_is_accepted() -> None:
    step = ep_slurm.slurm_step(TASK1)
    assert ep_slurm.check_world(2, 8, 100, step) is True
    with pytest.raises(BadInput, match=r"ep_size=4 but this SLURM step runs 2 tasks \(SLURM_NTASKS=2\).*"
                                       r"pass ep_size=2, or start 4 tasks \(srun -n 4, or hydra.launcher.tasks_per_node=4\)"):
        ep_slurm.check_world(4, 8, 100, step)
    with pytest.raises(BadInput, match=r"ep_size=1 .*: pass ep_size=2, or run it outside srun \(or with srun -n 1\)$"):
        ep_slurm.check_world(1, 8, 100, step)
    three = ep_slurm.slurm_step({**TASK1, "SLURM_STEP_NUM_TASKS": "3"})
    with pytest.raises(BadInput, match=r"runs 3 tasks .*one rank each: start 2 tasks") as exc:  # 3 does not divide 8 experts
        ep_slurm.check_world(2, 8, 100, three)
    assert "ep_size=3" not in str(exc.value)


@pytest.mark.parametrize("task", ["0", "1"])
def test_the_mismatch_is_exit_2_in_one_line_on_every_task_and_writes_nothing(tmp_path: Path, task: str,
                                                                             monkeypatch) -> None:
    for key, value in {**TASK1, "SLURM_PROCID": task, "SLURM_LOCALID": task}.items():
        monkeypatch.setenv(key, value)
    r = run_cli(["route-sim", "ep_size=4", "steps=0"], tmp_path)
    assert r.exit_code == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ep_size=4 but this SLURM step runs 2 tasks"), r.stderr
    assert "Traceback" not in r.stdout + r.stderr and not (tmp_path / "runs").exists()
    s = route_sim.settings(compose("route-sim", ["ep_size=2", "steps=0"]))  # the fix it names is accepted
    assert s.ep.size == 2


def test_outside_slurm_a_task_serves_nothing(monkeypatch) -> None:
    for key in TASK1:
        monkeypatch.delenv(key, raising=False)
    assert route_sim.serve_peer(compose("route-sim", ["ep_size=2"])) is None
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    assert route_sim.serve_peer(compose("route-sim", ["ep_size=2"])) is None  # task 0 runs the recipe itself


@pytest.fixture
def store():
    return dist.HashStore()


LOST = ("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:17081. This is "
        "typically caused by a remote worker crashing.")


def test_rank_0_names_itself_when_its_own_error_is_not_a_lost_peer(store) -> None:
    said = ep_slurm.first_failure(store, 2, "ValueError: experts[0] is Linear", grace_s=0.1)
    assert said == "worker rank 0 of 2 failed: ValueError: experts[0] is Linear"


def test_rank_0_names_the_rank_its_task_reported_killed(store) -> None:
    store.set(ep_slurm.KEY + "1", "killed by SIGKILL")  # serve_peer's report_death
    assert ep_slurm.first_failure(store, 2, LOST, grace_s=0.1) == "worker rank 1 of 2 failed (killed by SIGKILL)"


def test_rank_0_names_the_rank_that_failed_on_its_own_not_those_that_lost_it(store) -> None:
    store.set(ep_slurm.KEY + "1", LOST)
    store.set(ep_slurm.KEY + "3", LOST)
    store.set(ep_slurm.KEY + "2", "RuntimeError: planted: my dispatcher is not written yet")
    said = ep_slurm.first_failure(store, 4, LOST, grace_s=0.1)
    assert said == "worker rank 2 of 4 failed (RuntimeError: planted: my dispatcher is not written yet)"


@pytest.mark.parametrize("mine", [
    "DistBackendError: [c10d] Socket Timeout",
    "RuntimeError: Application timeout caused pair closure",  # gloo's collective timeout (a rank that sleeps)
])
def test_a_rank_that_says_nothing_is_named_after_the_grace(store, mine: str) -> None:
    store.set(ep_slurm.KEY + "1", LOST)
    said = ep_slurm.first_failure(store, 3, mine, grace_s=0.3)
    assert said.startswith("worker rank 2 of 3 failed (no word from it within 0.3 s of rank 0's error: killed")


def test_task_0s_failure_line_says_what_its_worker_named_or_how_it_ended() -> None:
    step = ep_slurm.slurm_step({**TASK1, "SLURM_PROCID": "0"})
    named = "noise\nTFMOE-EP-FAILED worker rank 1 of 2 failed (killed by SIGKILL)\nRuntimeError: Connection closed\n"
    assert ep_slurm.failure_line(named, 1, 2, step) == \
        "expert-parallel worker rank 1 of 2 failed (killed by SIGKILL) (SLURM job 21 step 0)"
    assert ep_slurm.failure_line("torch.distributed.DistStoreError: Timed out after 121 seconds waiting for "
                                 "clients. 1/2 clients joined.", 1, 2, step) == \
        ("expert-parallel worker rank 0 of 2 failed (exit 1); last error: torch.distributed.DistStoreError: Timed "
         "out after 121 seconds waiting for clients. 1/2 clients joined. (SLURM job 21 step 0)")
    assert "failed (killed by SIGKILL)" in ep_slurm.failure_line("", -9, 2, step)


def test_the_rendezvous_variables_reach_torch_env_init(monkeypatch) -> None:
    """What the worker does with them: torch's own env:// rendezvous (one rank here), then the gloo group."""
    step = ep_slurm.slurm_step({**TASK1, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "MASTER_ADDR":
                                "127.0.0.1"})
    env = {**step.env(), "WORLD_SIZE": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=10)))
    assert (rank, world) == (0, 1)
    store.set("probe", "1")
    assert store.get("probe") == b"1"
    del store
    assert os.environ["MASTER_PORT"] == str(step.master_port)


SUBMITIT = ["hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=2"]


def test_a_submitit_sweep_whose_tasks_per_job_are_not_ep_size_is_refused_before_submitting(tmp_path: Path) -> None:
    r = run_cli(["route-sim", "-m", "ep_size=2,4", "steps=0", *SUBMITIT], tmp_path)
    assert r.exit_code == 2, r.stdout + r.stderr
    assert r.stderr.strip() == ("error: sweep job 1 (ep_size=4 steps=0): ep_size=4 but each job runs as 2 SLURM tasks "
                                "(hydra.launcher.tasks_per_node x nodes), one rank each: pass ep_size=2, or "
                                "hydra.launcher.tasks_per_node=4 (with nodes=1) (1 of 2 jobs refused); nothing was run")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, refused", [
    (["route-sim", "-m", "ep_size=2", "steps=0", *SUBMITIT], None),  # the fix: accepted
    (["route-sim", "-m", "ep_size=2", "steps=0", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2"],
     "hydra.launcher.tasks_per_node=2 x nodes=1 runs each route-sim job 2 times into one run directory"),
    (["shift-labels", "-m", "seed=0,1", *SUBMITIT],
     "runs each shift-labels job 2 times into one run directory (only route-sim ep_size=W under "
     "hydra/launcher=submitit_slurm spans a job's tasks): pass hydra.launcher.tasks_per_node=1"),
    (["route-sim", "-m", "ep_size=1", "steps=0", "hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2"],
     "ep_size=1 but each job runs as 2 SLURM tasks"),
])
def test_only_route_sim_ep_under_submitit_slurm_takes_several_tasks_per_job(tmp_path: Path, monkeypatch, args,
                                                                           refused) -> None:
    monkeypatch.setenv("TFMOE_VALIDATE_ONLY", "1")
    r = run_cli(args, tmp_path)
    if refused is None:
        assert r.exit_code == 0 and r.stdout.startswith("valid: tfmoe route-sim, 1 job(s)"), r.stdout + r.stderr
    else:
        assert r.exit_code == 2 and refused in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
