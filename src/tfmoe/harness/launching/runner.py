"""Runs one experiment inside a Hydra job and hands its records to the notebook layer.

``execute(cfg)`` is the Hydra task function (every launcher calls it, in-process or in a worker).
It never raises for bad input or failed checks: the outcome is the run's status and exit code in
run.parquet, which the CLI turns into the process's exit code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from tfmoe.contract.errors import BadInput, Terminated, disk_problem
from tfmoe.contract.registry import EXPERIMENTS
from tfmoe.contract.runtime import (
    MAX_SEED,
    check_seed,
    check_tensor_max_numel,
    check_threads,
    resolve_device,
    resolve_dtype,
    seed_everything,
    torch_threads,
)
from tfmoe.contract.status import Status

log = logging.getLogger("tfmoe")


# The process that launched the sweep (set by launch.run_experiment). A job interrupted there stops the whole
# sweep (the interrupt is re-raised); a job in a worker (joblib, submitit, SLURM, Ray) returns its exit code.
LAUNCHER_PID: int | None = None
# Run directories of this process whose records the file system refused (full disk, read-only): their final
# run.parquet (their status on disk is still `running`, readers say `lost` once the process ends), or a sweep job's
# .hydra/ files before it started (JobNotStarted); launch exits 2 for them.
UNRECORDED: set[Path] = set()
# The launching process's pid, in the environment its worker processes (joblib's loky workers) inherit.
LAUNCHER_ENV = "TFMOE_LAUNCHER_PID"
STOP_WAIT_S = 60.0  # how long the launcher waits, on SIGTERM, for its workers' jobs to record `interrupted`


class JobNotStarted(BaseException):  # noqa: N818 (a stop, like SystemExit: Hydra's job runner must not report it)
    """The file system refused a sweep job's ``.hydra/`` records before the job could start (a disk that filled
    during the sweep). Not an ``Exception``: Hydra would print it with a traceback; launch says ``said`` in one
    line, and the sweep stops there (its later jobs would meet the same disk)."""

    def __init__(self, said: str, job_dir: Path) -> None:
        super().__init__(said)
        self.said, self.job_dir = said, job_dir


def _worker_children() -> list[Any]:
    """This process's child processes that run jobs (not multiprocessing's resource trackers, which ignore SIGTERM
    and end when their launcher does)."""
    import psutil

    kids = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if not any("resource_tracker" in part for part in child.cmdline()):
                kids.append(child)
    return kids


@contextlib.contextmanager
def stop_reaches_workers(jobs_under: Path) -> Iterator[None]:
    """While a launch runs: SIGTERM reaches the launcher's worker processes first, and the launcher waits until none
    of their jobs under ``jobs_under`` is still ``running`` (each records ``interrupted``; a worker then takes no
    next job), then stops as before. Without it joblib, on the launcher's interrupt, kills its workers at once and
    their jobs are ``lost``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def forward(signum: int, frame: Any) -> None:
        import psutil

        from tfmoe.harness.store.rundir import RUN_FILE, read_parquet

        kids = _worker_children()
        for child in kids:
            with contextlib.suppress(psutil.Error):
                child.send_signal(signum)
        pids = {c.pid for c in kids}

        def busy() -> bool:
            for f in Path(jobs_under).glob(f"*/{RUN_FILE}"):
                with contextlib.suppress(Exception):
                    row = read_parquet(f).iloc[0]
                    if row["status"] == Status.RUNNING and int(row["pid"]) in pids and psutil.pid_exists(int(row["pid"])):
                        return True
            return False

        deadline = time.monotonic() + STOP_WAIT_S
        while pids and busy() and time.monotonic() < deadline:
            time.sleep(0.1)
        if callable(previous):
            previous(signum, frame)
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def in_loky_worker() -> bool:
    """Whether this process is a worker of a joblib (loky) launcher started by tfmoe."""
    import multiprocessing

    launcher = os.environ.get(LAUNCHER_ENV)
    return (launcher is not None and os.getpid() != int(launcher)
            and type(multiprocessing.current_process()).__name__ == "LokyProcess")


_WATCHING: list[threading.Thread] = []
_JOB_RUNNING = threading.Event()  # a joblib worker is inside a job
_STOPPED: list[int] = []  # a joblib worker was told to stop: it takes no next job


def watch_the_launcher() -> None:
    """In a joblib worker (once): SIGTERM between jobs marks the worker stopped (it takes no next job) instead of
    killing it (loky would then kill its sibling workers mid-job); when the launching process dies (SIGKILL, a lost
    machine) the worker SIGTERMs itself, so its job records ``interrupted``, and then exits instead of running on
    (loky's workers outlive a killed parent)."""
    if _WATCHING or not in_loky_worker() or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: _STOPPED.append(signal_exit(signum)))
    parent = os.getppid()

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        while _JOB_RUNNING.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(signal_exit(signal.SIGTERM))

    thread = threading.Thread(target=loop, name="tfmoe-launcher-watch", daemon=True)
    thread.start()
    _WATCHING.append(thread)


def signal_exit(signum: int) -> int:
    from tfmoe.contract.status import signal_exit_code

    return signal_exit_code(signum)




def _run_name() -> str:
    from tfmoe.harness.store.rundir import utcnow

    return f"{utcnow():%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"


def register_resolvers() -> None:
    """``${tfmoe_run_name:}`` -> '<UTC timestamp>-<8 hex>': cached per config, so a sweep's jobs share it."""
    if not OmegaConf.has_resolver("tfmoe_run_name"):
        OmegaConf.register_new_resolver("tfmoe_run_name", _run_name, use_cache=True)


register_resolvers()


def check_flush_every(cfg: DictConfig) -> float | None:
    every = cfg.get("flush_every_s", 2.0)
    if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or not every > 0):
        raise BadInput(f"flush_every_s={every!r} must be a positive number of seconds (or null: write only at "
                       "the end): pass flush_every_s=2")
    return None if every is None else float(every)


def stop_signals() -> tuple[int, ...]:
    """SIGTERM always; inside a submitit job (local or SLURM) also SIGUSR2, submitit's warning that the time limit
    is ``hydra.launcher.signal_delay_s`` away (its own handler would raise inside the experiment)."""
    return (signal.SIGTERM, signal.SIGUSR2) if os.environ.get("SUBMITIT_EXECUTOR") else (signal.SIGTERM,)


SIGNAL_CAUSES = {"SIGTERM": "SLURM sends it at a job's time limit; `kill` sends it by default",
                 "SIGUSR2": "submitit's warning that the job's time limit (hydra.launcher.timeout_min) is "
                            "hydra.launcher.signal_delay_s away"}


@contextlib.contextmanager
def terminate_on(signums: tuple[int, ...] | None = None) -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so the run records what it has. A second signal while that happens is logged, not raised
    (the records are being written). Previous handlers are restored afterwards. SIGKILL cannot be caught: the
    heartbeat's periodic writes are what survive it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = []

    def handler(signum: int, frame: Any) -> None:
        if raised:
            log.warning("%s again while the records are written: ignored", signal.Signals(signum).name)
            return
        raised.append(signum)
        raise Terminated(signum)

    previous = {s: signal.signal(s, handler) for s in (signums or stop_signals())}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# Test-only hooks (tests/test_faults_signals.py): $TFMOE_TEST_STAGES names a directory where the runner touches a
# file per stage it enters (start, experiment, records, status, summary, plots); at the stage(s) named in
# $TFMOE_TEST_HOLD (comma-separated) it waits, up to 30 s, until a signal arrives, so a test signals *inside* that
# stage instead of at guessed seconds.
STAGES_ENV, HOLD_ENV = "TFMOE_TEST_STAGES", "TFMOE_TEST_HOLD"
_SIGNALS_SEEN: list[int] = []  # every stop signal this process's handlers met (the hold waits on it)


def stage(name: str) -> None:
    where = os.environ.get(STAGES_ENV)
    if not where:
        return
    Path(where).mkdir(parents=True, exist_ok=True)
    Path(where, name).touch()
    if name in os.environ.get(HOLD_ENV, "").split(","):
        seen, deadline = len(_SIGNALS_SEEN), time.monotonic() + 30
        while len(_SIGNALS_SEEN) == seen and time.monotonic() < deadline:
            time.sleep(0.02)  # SIGINT's default handler raises KeyboardInterrupt here, and it ends the wait


class StopExtras(BaseException):  # noqa: N818 (a stop, like KeyboardInterrupt)
    """A signal during the best-effort parts of the final write (summary, plots): stop drawing."""


class FinalWrite:
    """The run's final write (its tables, then run.parquet with how it ended, then summary and plots): Ctrl-C,
    SIGTERM (and submitit's SIGUSR2) are recorded instead of raised, so no signal can leave the run ``running``;
    during the best-effort parts (:meth:`abortable`) a signal stops them. A run that was not already interrupted
    is then rewritten as ``interrupted`` (:meth:`interrupted`), with one line for stderr (``said``) and the stop
    to re-raise in the launching process (``stop``)."""

    def __init__(self, stop: BaseException | None) -> None:
        self.stop, self.got, self.said = stop, [], None
        self._abortable, self._previous = False, {}

    def _handler(self, signum: int, frame: Any) -> None:
        _SIGNALS_SEEN.append(signum)
        self.got.append(signum)
        if len(self.got) > 1:
            log.warning("%s again while the records are written: recorded", signal.Signals(signum).name)
        if self._abortable and len(self.got) == 1:
            raise StopExtras

    def __enter__(self) -> FinalWrite:
        if threading.current_thread() is threading.main_thread():
            ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # a worker whose launcher takes Ctrl-C
            for s in {*([] if ignored else [signal.SIGINT]), *stop_signals()}:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    @contextlib.contextmanager
    def abortable(self) -> Iterator[None]:
        self._abortable = not self.got
        try:
            yield
        finally:
            self._abortable = False

    def interrupted(self, writer: Any, status: Status, code: int, error: str | None,
                    rec: Any = None) -> tuple[Status, int, str | None]:
        """After a signal during the final write: run.parquet (and, with ``rec``, summary.md) say ``interrupted``."""
        if not self.got or status == Status.INTERRUPTED:
            return status, code, error
        signum = self.got[0]
        if signum == signal.SIGINT:
            stop: BaseException = KeyboardInterrupt()
            code, what = Status.INTERRUPTED.exit_code, "interrupted by the user (Ctrl-C)"
        else:
            stop = Terminated(signum)
            code = stop.exit_code  # type: ignore[attr-defined]
            what = f"{stop} ({SIGNAL_CAUSES.get(signal.Signals(signum).name, 'a signal that ends the process')})"
        was = f" (it had ended {status})" if status != Status.RUNNING else ""
        error = f"{what} while its records were written{was}" + (f"; {error}" if error else "")
        self.said, self.stop = f"interrupted while its records were written{was}", self.stop or stop
        writer.end_as(Status.INTERRUPTED, code, error)
        if rec is not None:
            with contextlib.suppress(Exception):  # best effort, like the summary it replaces
                writer.write_summary(rec)
        return Status.INTERRUPTED, code, error


class Heartbeat:
    """A background thread that, every ``every_s`` seconds, writes the run's records so far and a heartbeat
    (:meth:`RunWriter.checkpoint`), so a SIGKILL loses at most the last interval."""

    def __init__(self, writer: Any, every_s: float | None) -> None:
        self.writer, self.every_s, self.rec = writer, every_s, None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        if self.every_s is not None:
            self._thread = threading.Thread(target=self._loop, name="tfmoe-heartbeat", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        warned = False
        while not self._stop.wait(self.every_s):
            try:
                self.writer.checkpoint(self.rec)
            except Exception as exc:  # a failed periodic write must not stop the run; the final write decides
                if disk_problem(exc) is not None:
                    continue  # a full disk / read-only file system: the final write says so, in one line
                if not warned:  # once: a failure would repeat every interval
                    log.warning("periodic write of the records failed (not retried in the log): %s",
                                disk_problem(exc, self.writer.run_dir) or f"{type(exc).__name__}: {exc}")
                    warned = True

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb * (1 if sys.platform == "darwin" else 1024))


def _run_id(run_dir: Path, sweep_dir: str | None) -> str:
    if sweep_dir:
        return f"{Path(sweep_dir).name.removeprefix('multirun-')}-{run_dir.name}"
    return run_dir.name


def start_expectations(cfg: DictConfig, exp: Any, writer: Any) -> list:
    """Parse and validate ``cfg.expect`` and write expectations.parquet before the experiment runs."""
    from tfmoe.harness.method import expectations as ex
    from tfmoe.harness.method.declared_metrics import declared_for
    from tfmoe.harness.store.rundir import utcnow

    parsed = ex.parse(cfg.get("expect"))
    if parsed:
        ex.validate(parsed, declared_for(exp.name), exp.name)
        writer.write_expectations(ex.frame(parsed, utcnow()))
    return parsed


def keep_code(cfg: DictConfig, writer: Any) -> None:
    """Copy the user-supplied modules and input files the config names into the run directory (code.parquet)."""
    from tfmoe.harness.store.code_capture import capture

    try:
        writer.write_code(capture(OmegaConf.to_container(cfg, resolve=True), writer.run_dir))
    except Exception as exc:  # the run goes on; its log says what could not be kept
        if disk_problem(exc, writer.run_dir) is not None:  # the disk refused the run's records: not ok, say so
            raise
        log.warning("could not keep the code this run used: %s: %s", type(exc).__name__, exc)


def explain_failures(experiment: str, rec: Any, cfg: DictConfig, writer: Any) -> tuple[str | None, list]:
    """The one exception every check raised (if so) and the planted-bug catalogue's likely causes for the failed
    checks, from measured checks only (inferences; both kept for summary.md)."""
    from tfmoe.harness.method.diagnosis import checks_mapping, common_exception, diagnose, markdown

    try:
        checks = checks_mapping(rec.checks_rows)
        same = common_exception(checks)
        found = diagnose(experiment, checks, rec.metrics_rows, OmegaConf.to_container(cfg, resolve=True))
    except Exception as exc:  # an explanation must never cost the run its records
        log.warning("could not match the failure pattern: %s: %s", type(exc).__name__, exc)
        return None, []
    writer.inference_lines = markdown(found, same)
    return same, found


def finish_expectations(parsed: list, rec: Any, writer: Any) -> list[str]:
    """Judge each expectation on the recorded metrics, complete expectations.parquet; the misses, described."""
    from tfmoe.harness.method import expectations as ex
    from tfmoe.harness.store.rundir import utcnow

    if not parsed or rec is None:
        return []
    judged = [ex.judge(e, rec.metrics_rows) for e in parsed]
    written_at = writer.expectations["written_at"].iloc[0]
    writer.write_expectations(ex.frame(parsed, written_at, judged, utcnow()))
    return [ex.describe_miss(e, j) for e, j in zip(parsed, judged, strict=True) if not j.held]


def run_module(exp: Any, cfg: DictConfig, rec: Any) -> None:
    """The experiment's contract (registry.ExperimentModule): settings built once from cfg, then run."""
    module = exp.load()
    module.run(module.settings(cfg), rec)


def serve_as_peer(exp: Any, cfg: DictConfig) -> int | None:
    """In a task other than the first of a multi-task SLURM step (``srun -n W``; submitit's
    ``hydra.launcher.tasks_per_node=W``) whose experiment spans the step's tasks (its module's ``serve_peer(cfg)``:
    route-sim ``ep_size=W``): serve task 0's run, write no run of its own, and return the exit code. None in every
    other process, which runs as usual."""
    if os.environ.get("SLURM_PROCID", "0") == "0" or "SLURM_STEP_ID" not in os.environ:
        return None
    hook = getattr(exp.load(), "serve_peer", None)
    if hook is None:
        return None
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(cfg):
        cfg.pop("hydra", None)
    with terminate_on():  # SIGTERM (scancel, the time limit) stops this task's worker too
        return hook(cfg)


def execute(cfg: DictConfig) -> int:
    """Hydra task function: run ``cfg.experiment`` and record everything. Returns the exit code."""
    from hydra.core.hydra_config import HydraConfig
    from rich.console import Console

    from tfmoe.harness.store.notebook import RunWriter

    peer = serve_as_peer(EXPERIMENTS[cfg.experiment], cfg)  # a SLURM task serving task 0's run: no run dir here
    if peer is not None:
        return peer
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sweep_dir = str(hc.sweep.dir) if hc.mode.name == "MULTIRUN" else None
    exp = EXPERIMENTS[cfg.experiment]
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    writer = RunWriter(
        run_dir=run_dir, run_id=_run_id(run_dir, sweep_dir), experiment=exp.name,
        seed=cfg.seed if _recordable_seed(cfg.get("seed")) else -1, argv=list(sys.argv),
        overrides=list(hc.overrides.task), device=str(cfg.get("device")), dtype=str(cfg.get("dtype")),
        sweep_dir=sweep_dir,
    )
    raise_before, logging.raiseExceptions = logging.raiseExceptions, False  # a log file on a full disk: no
    watch_the_launcher()
    if _STOPPED:  # a joblib worker told to stop: this job never starts (the sweep lists it not_started)
        logging.raiseExceptions = raise_before
        return _STOPPED[0]
    _JOB_RUNNING.set()
    try:  # '--- Logging error ---' traceback per line (the run says what it could not write, once)
        with terminate_on():
            code = _execute(cfg, exp, writer, err, run_dir)
    finally:
        _JOB_RUNNING.clear()
        logging.raiseExceptions = raise_before
    if code >= 128 and in_loky_worker():  # stopped by a signal, records written: take no next job
        _STOPPED.append(code)
    return code


def _tensor_limit(cfg: DictConfig) -> int:
    """The tensor size limit for the final write (a refused value was already said: the default then)."""
    try:
        return check_tensor_max_numel(cfg)
    except BadInput:
        return 1_000_000


def _recordable_seed(seed: Any) -> bool:
    return isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= MAX_SEED


def _execute(cfg: DictConfig, exp: Any, writer: Any, err: Any, run_dir: Path) -> int:
    from rich.markup import escape

    from tfmoe.contract.recorder import Recorder, device_peak, forget_device_peak
    from tfmoe.harness.store.notebook import device_name, environment

    rec = None
    status, code, error = Status.OK, Status.OK.exit_code, None
    told = False  # a full disk / read-only file system already said on stderr
    device = None
    expectations: list = []
    stop: BaseException | None = None
    heartbeat = Heartbeat(writer, None)
    try:
        writer.env = environment()
        writer.start()
        stage("start")
        heartbeat = Heartbeat(writer, check_flush_every(cfg)).__enter__()
        expectations = start_expectations(cfg, exp, writer)
        keep_code(cfg, writer)
        seed = check_seed(cfg)
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        writer.device = str(device)
        writer.env["device_name"] = device_name(device)  # the rest of the environment is already known
        seed_everything(seed)
        forget_device_peak()
        if device.type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(device)
        threads = check_threads(cfg)
        check_tensor_max_numel(cfg)
        rec = Recorder(cfg=cfg, device=device, dtype=dtype, seed=seed)
        heartbeat.rec = rec
        with torch_threads(threads):
            if device.type == "cpu":
                import torch

                rec.note(f"{torch.get_num_threads()} torch intra-op thread(s) (config threads={threads})")
            stage("experiment")
            run_module(exp, cfg, rec)
        if not rec.all_passed:
            status, code = Status.FAILED, Status.FAILED.exit_code
            failed = [c.check for c in rec.checks_rows if not c.passed]
            same, inferences = explain_failures(exp.name, rec, cfg, writer)
            if same:
                from tfmoe.harness.method.diagnosis import same_exception_line

                err.print(f"{exp.name}: {same_exception_line(same)}", markup=False)
            err.print(f"[red]{exp.name}: {len(failed)} check(s) failed:[/] ", escape(", ".join(failed)), sep="")
            for inference in inferences:
                err.print(inference.line(), markup=False)
        missed = finish_expectations(expectations, rec, writer)
        if missed:
            err.print(f"[yellow]{exp.name}: {len(missed)} expectation(s) did not hold:[/] ", escape("; ".join(missed)),
                      sep="")
            if status == Status.OK:
                status, code = Status.UNEXPECTED, Status.UNEXPECTED.exit_code
    except BadInput as exc:
        status, code, error = Status.ERROR, Status.ERROR.exit_code, str(exc)
        err.print(f"error: {exc}", markup=False, emoji=False)  # hf:llama: is not an emoji
    except KeyboardInterrupt as exc:
        status, code, error, stop = Status.INTERRUPTED, Status.INTERRUPTED.exit_code, "interrupted by the user (Ctrl-C)", exc
        err.print(f"{exp.name}: interrupted; the records so far are in {run_dir}", markup=False)
    except Terminated as exc:
        status, code, stop = Status.INTERRUPTED, exc.exit_code, exc
        error = f"{exc} ({SIGNAL_CAUSES.get(exc.signal_name, 'a signal that ends the process')})"
        err.print(f"{exp.name}: {exc}; the records so far are in {run_dir}", markup=False)
    except Exception as exc:  # a bug: keep the records, point at the log
        disk = disk_problem(exc, run_dir)
        if disk is not None:  # the file system refused a write (full disk, read-only): not a bug of tfmoe
            status, code, error, told = Status.ERROR, Status.ERROR.exit_code, disk, True
            err.print(f"error: {disk}", markup=False, emoji=False)
        else:
            status, code = Status.CRASHED, Status.CRASHED.exit_code
            error = f"{type(exc).__name__}: {exc}"
            log.error("run crashed:\n%s", traceback.format_exc())
            err.print(f"{exp.name} crashed ({error}); traceback in {run_dir}/{exp.name}.log", markup=False)
    except BaseException as exc:  # SystemExit from a library, GeneratorExit...: never recorded as ok
        status, code, error = Status.CRASHED, Status.CRASHED.exit_code, f"{type(exc).__name__}: {exc}"
        log.error("run stopped by %s:\n%s", type(exc).__name__, traceback.format_exc())
        raise
    finally:
        with FinalWrite(stop) as final:  # a signal from here on is recorded, and never loses the records
            heartbeat.__exit__()
            stage("records")
            if rec is not None and expectations and writer.expectations is not None \
                    and writer.expectations["held"].isna().all():  # crashed or interrupted: judge what was recorded
                with contextlib.suppress(Exception):
                    finish_expectations(expectations, rec, writer)
            peak_dev = device_peak(device) if device is not None else None
            ended = False
            try:
                status, code, error = writer.finish(rec, status, code, error, peak_dev, _peak_rss_bytes(),
                                                    _tensor_limit(cfg), extras=False)
                ended = True
            except OSError as exc:  # run.parquet itself refused: the run cannot record how it ended
                disk = disk_problem(exc, run_dir)
                if disk is None:
                    raise
                UNRECORDED.add(run_dir.resolve())
                status, code, error = Status.ERROR, Status.ERROR.exit_code, f"{disk} (the run's end is not recorded)"
            if ended:
                stage("status")
                status, code, error = final.interrupted(writer, status, code, error, rec)
                if not final.got:
                    try:
                        with final.abortable():  # a signal stops the plots: the run ends interrupted all the same
                            status, code, error = writer.finish_extras(rec, stage)
                    except StopExtras:
                        pass
                    status, code, error = final.interrupted(writer, status, code, error, rec)
                    if writer.unwritten:  # best-effort parts the disk refused: one line, the status kept
                        err.print(f"warning: {exp.name}: {'; '.join(writer.unwritten)} ({run_dir})", markup=False,
                                  emoji=False, soft_wrap=True)
                else:  # a signal during the tables or run.parquet: the summary, no plots
                    with contextlib.suppress(Exception):
                        writer.write_summary(rec)
            if final.said is not None:
                err.print(f"{exp.name}: {final.said}; the records so far are in {run_dir}", markup=False)
            stop = final.stop
        if not told and status == Status.ERROR and "cannot write " in (error or ""):  # one line, the first refusal
            err.print(f"error: {error[error.index('cannot write '):].split('; ')[0]}", markup=False, emoji=False)
        log.info("run %s: %s (exit %d) in %s", writer.run_id, status, code, run_dir)
    if stop is not None and os.getpid() == LAUNCHER_PID:
        raise stop  # stop the whole in-process sweep too; the CLI exits 130 (Ctrl-C) or 143 (SIGTERM)
    return code
