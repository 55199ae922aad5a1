"""route-sim ``ep_size=W`` under SLURM: the W ranks are the W tasks of one srun step.

Two ways to start them, both ending in one run directory written by task 0:
  srun -n W tfmoe route-sim ep_size=W ...                      inside an allocation (salloc -n W, sbatch -n W)
  tfmoe route-sim -m ep_size=W hydra/launcher=submitit_slurm hydra.launcher.tasks_per_node=W ...
                                                               a sweep: each job is one srun step of W tasks
Every task runs tfmoe. Task 0 (``SLURM_PROCID`` 0) runs the recipe as any run does and writes the run directory;
every other task serves as its rank (:func:`serve_peer`) and writes nothing. Each task starts one worker process
(:func:`main` of this module, the same rank code as under torch.distributed.run:
``ep_worker.run_rank``) that joins torch's ``env://`` rendezvous with RANK = SLURM_PROCID, WORLD_SIZE =
SLURM_STEP_NUM_TASKS, MASTER_ADDR = the step's first node (where task 0 runs) and MASTER_PORT derived from the job
and step ids ($MASTER_ADDR / $MASTER_PORT, when set, win, as for torch and submitit). Rank 0's worker hosts the
rendezvous store and broadcasts the spec, so every rank runs exactly task 0's configuration.

Faults: collectives time out after ``ep_timeout_s``, the rendezvous after STARTUP_S. A worker that fails leaves a
line in the store (``tfmoe-ep/failed/<rank>``); a task whose worker is killed leaves "killed by SIGKILL" there.
Rank 0, when its worker fails, names the first rank whose failure was its own (not the loss of a peer), else a rank
that said nothing (killed with its task, or hung). A peer task whose rank 0 has gone (its store closed) stops its
worker after PEER_GRACE_S, so a dead or finished rank 0 never leaves the step hanging.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# the worker: this module's main() (not `-m`: the package imports this module first)
WORKER_CMD = [sys.executable, "-c",
              "import sys; from tfmoe.experiments.route_sim.ep_slurm import main; sys.exit(main())"]
TIMEOUT_ENV = "TFMOE_EP_TIMEOUT_S"  # a peer's collective timeout (its own config: the same command as task 0)
FAILED_MARK = "TFMOE-EP-FAILED "  # rank 0's worker: the failure it names, one line on stderr
KEY = "tfmoe-ep/failed/"  # + rank: what ended that rank's worker
REPORT_GRACE_S = 5.0  # rank 0, after its own failure, waits this long for the other ranks' reports
PEER_GRACE_S = 10.0  # a peer keeps its worker this long after rank 0's store has gone, then stops it
# what a rank sees when another rank fails: not a failure of its own
PEER_LOSS = re.compile(r"Connection closed|closed by peer|Connection reset|Connection refused|Broken pipe|"
                       r"[Tt]imed out|Socket Timeout|Application timeout|pair closure|Failed to recv|"
                       r"DistNetworkError")


@dataclass(frozen=True)
class SlurmStep:
    """The SLURM step this process is one task of, as torch's env:// rendezvous needs it."""

    rank: int  # SLURM_PROCID
    world: int  # SLURM_STEP_NUM_TASKS
    local_rank: int  # SLURM_LOCALID
    master_addr: str  # the step's first node: task 0 runs there
    master_port: int
    job_id: str
    step_id: str

    def env(self) -> dict[str, str]:
        """The variables of torch's env:// initialisation."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist ('node[03-05,9],gpu1' -> 'node03'; 'rack[1-2]-n[7,8]' -> 'rack1-n7')."""
    first, depth = "", 0
    for ch in nodelist:  # the first top-level group
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        first += ch
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", first).strip()


def port_for(job_id: str, step_id: str) -> int:
    """A port in 20000..59999 from the job and step ids: the same on every task, different for concurrent steps
    (a sweep's array jobs have their own job ids)."""
    return 20000 + zlib.crc32(f"{job_id}.{step_id}".encode()) % 40000


def slurm_step(env: Mapping[str, str] | None = None) -> SlurmStep | None:
    """This process's task in an srun step of two or more tasks; None elsewhere (no SLURM, a batch script's own
    step, which has no SLURM_STEP_ID, or a one-task step: torch.distributed.run starts the ranks then)."""
    env = os.environ if env is None else env
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    if world < 2:
        return None
    job, step = env.get("SLURM_JOB_ID", "0"), env["SLURM_STEP_ID"]
    addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                                or "localhost")
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else port_for(job, step)
    return SlurmStep(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID") or 0), addr, port, job, step)


def check_world(ep_size: int, n_experts: int, tokens: int, step: SlurmStep | None = None) -> bool:
    """Whether the ranks are this SLURM step's tasks; BadInput (one line, a fix that is accepted) when the step's
    task count differs from ep_size."""
    from tfmoe.contract.errors import BadInput

    step = slurm_step() if step is None else step
    if step is None:
        return False
    if step.world != ep_size:
        w = step.world
        fixes = [f"pass ep_size={w}"] if n_experts % w == 0 and tokens % w == 0 else []
        fixes.append(f"start {ep_size} tasks (srun -n {ep_size}, or hydra.launcher.tasks_per_node={ep_size})"
                     if ep_size > 1 else "run it outside srun (or with srun -n 1)")
        raise BadInput(f"ep_size={ep_size} but this SLURM step runs {w} tasks (SLURM_NTASKS={w}), one rank each: "
                       + ", or ".join(fixes))
    return True


def check_tasks(s: Any, tasks: int) -> None:
    """A sweep's job under ``hydra/launcher=submitit_slurm`` with ``tasks`` tasks (tasks_per_node x nodes), checked
    before anything is submitted: its ep_size must be that count (each task is one rank)."""
    from tfmoe.contract.errors import BadInput

    if s.ep.size != tasks:
        fixes = [f"pass ep_size={tasks}"] if s.n_experts % tasks == 0 and s.tokens % tasks == 0 else []
        fixes.append(f"hydra.launcher.tasks_per_node={s.ep.size} (with nodes=1)")
        raise BadInput(f"ep_size={s.ep.size} but each job runs as {tasks} SLURM tasks (hydra.launcher."
                       f"tasks_per_node x nodes), one rank each: {', or '.join(fixes)}")


def worker_env(step: SlurmStep, timeout_s: float) -> dict[str, str]:
    """The worker's environment: this process's, the rendezvous variables, one thread, tfmoe importable."""
    env = dict(os.environ)
    env.update(step.env())
    env[TIMEOUT_ENV] = repr(float(timeout_s))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
    return env


# ------------------------------------------------------------------------------------------ task 0: the recipe
def launch(spec: dict[str, Any], step: SlurmStep) -> dict[str, Any]:
    """Task 0: run rank 0's worker (the other ranks are the step's other tasks); its gathered records."""
    from tfmoe.experiments.route_sim.ep_launch import launch as run_workers

    return run_workers(spec, step.world, worker_cmd=WORKER_CMD,
                       worker_env=worker_env(step, spec["timeout_s"]),
                       explain=lambda err, code, world: failure_line(err, code, world, step))


def failure_line(stderr: str, code: int, world: int, step: SlurmStep) -> str:
    """One line: what rank 0's worker named (FAILED_MARK), else how it ended and its last error."""
    from tfmoe.experiments.route_sim.ep_launch import how_ended

    named = [ln[len(FAILED_MARK):].strip() for ln in stderr.splitlines() if ln.startswith(FAILED_MARK)]
    where = f"SLURM job {step.job_id} step {step.step_id}"
    if named:
        return f"expert-parallel {named[-1][:400]} ({where})"
    what = how_ended(code)
    errors = [ln.strip() for ln in stderr.splitlines() if re.match(r"\s*[\w.]+(Error|Exception)\b.*:", ln)]
    last = f"; last error: {errors[-1][:240]}" if errors else ""
    return f"expert-parallel worker rank 0 of {world} failed ({what}){last} ({where})"


# ------------------------------------------------------------------------------------------ tasks 1..W-1
def serve_peer(cfg: Any, settings_of: Callable[[Any], Any]) -> int | None:
    """In a non-zero task of a multi-task SLURM step running route-sim: serve as this task's rank of task 0's run
    and return the exit code (no run directory: task 0 writes it). None in every other process. ``settings_of``
    is the recipe's own ``settings`` (a part never imports its recipe)."""
    from tfmoe.contract.errors import BadInput, Terminated
    from tfmoe.contract.status import Status, signal_exit_code

    step = slurm_step()
    if step is None or step.rank == 0:
        return None
    try:
        s = settings_of(cfg)  # the same validation as task 0 (ep_size = the step's tasks: check_world)
        if s.ep.size == 1:
            return None
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return Status.ERROR.exit_code
    from tfmoe.experiments.route_sim.ep_launch import STARTUP_S, how_ended, stop

    bound = STARTUP_S + s.ep.timeout_s * (s.ep.steps + 4)  # as task 0 bounds its worker (one layer)
    from tfmoe.contract import lifetime

    env = {**worker_env(step, s.ep.timeout_s), lifetime.OWNER_ENV: lifetime.owner_token()}
    proc = subprocess.Popen(WORKER_CMD, env=env, start_new_session=True, preexec_fn=lifetime.tied_preexec())
    try:
        code = watch(proc, step, bound)
    except (KeyboardInterrupt, Terminated) as exc:
        stop(proc)
        return signal_exit_code(getattr(exc, "signum", signal.SIGINT))
    if code < 0:
        report_death(step, how_ended(code))
        return signal_exit_code(-code)
    return 0 if code == 0 else Status.CRASHED.exit_code


def watch(proc: subprocess.Popen, step: SlurmStep, bound: float) -> int:
    """Wait for this task's worker: its exit code; 1 when this stopped it (SIGTERM, then SIGKILL) because rank 0's
    store, once up, had refused connections for PEER_GRACE_S (rank 0 ended: nothing will answer this rank), or
    because it ran past ``bound`` seconds."""
    import socket

    from tfmoe.experiments.route_sim.ep_launch import stop

    start, seen, gone = time.monotonic(), False, None
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - start > bound:
            print(f"rank {step.rank}: its worker ran past {bound:.0f} s: stopped", file=sys.stderr)
            stop(proc)
            return 1  # stopped here: a failure of the run, not a signal from outside
        try:  # a bare connect: the store's server says nothing of it
            with socket.create_connection((step.master_addr, step.master_port), timeout=2.0):
                seen, gone = True, None
        except OSError:
            gone = now if seen and gone is None else gone
        if gone is not None and now - gone > PEER_GRACE_S:
            print(f"rank {step.rank}: rank 0 ended (its store closed) {PEER_GRACE_S:g} s ago and this rank's worker "
                  "still runs: stopped", file=sys.stderr)
            stop(proc)
            return 1


def report_death(step: SlurmStep, what: str) -> None:
    """Best effort: tell rank 0's store how this task's worker ended (a signal leaves the worker no word)."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(step.master_addr, step.master_port, None, False, datetime.timedelta(seconds=2),
                              wait_for_workers=False)
        store.set(KEY + str(step.rank), what)
    except Exception:  # rank 0 has gone too: nothing to tell
        pass


# ------------------------------------------------------------------------------------------ the worker
def first_failure(store: Any, world: int, mine: str, grace_s: float = REPORT_GRACE_S) -> str:
    """Rank 0, after its worker failed with ``mine``: the rank whose failure was its own (not the loss of a peer),
    else one that left no word within ``grace_s`` (killed with its task, or hung), else rank 0 itself."""
    if not PEER_LOSS.search(mine):
        return f"worker rank 0 of {world} failed: {mine[:300]}"
    deadline = time.monotonic() + grace_s
    reports: dict[int, str] = {}
    while True:
        for r in range(1, world):
            if r not in reports and store.check([KEY + str(r)]):
                reports[r] = store.get(KEY + str(r)).decode(errors="replace")
        own = [r for r, said in sorted(reports.items()) if not PEER_LOSS.search(said)]
        if own:
            return f"worker rank {own[0]} of {world} failed ({reports[own[0]][:300]})"
        if len(reports) == world - 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    silent = [r for r in range(1, world) if r not in reports]
    if silent:
        return (f"worker rank {silent[0]} of {world} failed (no word from it within {grace_s:g} s of rank 0's "
                f"error: killed with its task, or hung outside a collective); rank 0: {mine[:200]}")
    return f"worker rank 0 of {world} failed: {mine[:300]}"


def main() -> int:
    """One rank: env:// rendezvous, the spec from rank 0, ep_worker.run_rank; rank 0 prints the records."""
    from tfmoe.contract import lifetime

    lifetime.die_with_parent()  # the task's tfmoe starts it: it ends with that process
    lifetime.watch_owner()
    import torch
    import torch.distributed as dist

    from tfmoe.experiments.route_sim.ep_launch import STARTUP_S
    from tfmoe.experiments.route_sim.ep_worker import SPEC_ENV, emit, run_rank

    torch.set_num_threads(1)
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=STARTUP_S)))
    timeout = datetime.timedelta(seconds=float(os.environ[TIMEOUT_ENV]))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        box = [json.loads(os.environ[SPEC_ENV]) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        gathered = run_rank(box[0], rank, world)
        if gathered is not None:
            emit(world, gathered)
        dist.barrier()
    except Exception as exc:
        mine = " ".join(f"{type(exc).__name__}: {exc}".split())
        try:
            store.set(KEY + str(rank), mine)
            if rank == 0:
                print(FAILED_MARK + first_failure(store, world, mine), file=sys.stderr, flush=True)
        except Exception:  # the store is gone (rank 0 ended): the failure is said on stderr below
            pass
        raise
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
