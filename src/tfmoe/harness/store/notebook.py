"""The notebook layer: the only code that reads and writes run directories.

A run directory (see README, "Run directory contract") holds run.parquet, metrics.parquet, checks.parquet,
tensors.parquet, timings.parquet, PNG plots, summary.md, Hydra's .hydra/ and the run's log. Every file is
written atomically (temp file + rename), so a crash or Ctrl-C leaves readable parquet. Reading a run never
unpickles anything and never instantiates classes named in it.

pandas and pyarrow are imported by the functions that use them: listing the catalog (`tfmoe runs`) needs neither.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfmoe.contract.errors import BadInput, disk_problem
from tfmoe.contract.paths import CODE_PATHSPECS, PACKAGE_ROOT
from tfmoe.contract.status import Status
from tfmoe.contract.tables import Rows
from tfmoe.harness.store import rundir
from tfmoe.harness.store.rundir import (
    EXPECTATIONS_FILE,
    RUN_FILE,
    TABLE_FILES,
    UnreadableFile,
    atomic_replace,
    metrics_frame,
    read_parquet,
    read_table,
    records,
    timings_frame,
    utcnow,
    write_parquet,
    write_text,
)

if TYPE_CHECKING:
    import pandas as pd


def tensor_row(name: str, t: Any, max_numel: int) -> dict[str, Any]:
    """One tensors.parquet row. Values are the tensor flattened in C order as float64 (exact for
    fp16/bf16/fp32/fp64, bool and integers up to 2**53); tensors above ``max_numel`` keep only stats."""
    import torch

    flat = t.detach().reshape(-1).to("cpu")
    as64 = flat.to(torch.float64)
    numel = flat.numel()
    finite = as64[torch.isfinite(as64)]
    stats = (
        (finite.min().item(), finite.max().item(), finite.mean().item(),
         finite.std().item() if finite.numel() > 1 else 0.0)
        if finite.numel() else (None, None, None, None)
    )
    summarised = numel > max_numel
    return {
        "name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
        "values": None if summarised else as64.tolist(), "numel": numel, "summarised": summarised,
        "min": stats[0], "max": stats[1], "mean": stats[2], "std": stats[3],
    }


@functools.lru_cache(maxsize=8)
def git_state(start: Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git checkout holding ``start``, or (None, None) outside one; dirty: tracked code or
    configs (``CODE_PATHSPECS``) differ from HEAD, never the notebook's own files."""
    try:
        commit = subprocess.run(["git", "-C", str(start), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=5)
        if commit.returncode != 0:
            return None, None
        dirty = subprocess.run(["git", "-C", str(start), "status", "--porcelain", "--untracked-files=no", "--",
                                *CODE_PATHSPECS], capture_output=True, text=True, timeout=5)
        return commit.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def device_name(device: Any = None) -> str:
    """The GPU's name for a CUDA device, else the host processor."""
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def environment(device: Any = None) -> dict[str, Any]:
    """Versions and machine facts recorded in run.parquet."""
    import hydra
    import numpy
    import pandas as pd
    import pyarrow as pa
    import torch

    commit, dirty = git_state(PACKAGE_ROOT)
    cuda_ok = torch.cuda.is_available()
    return {
        "git_commit": commit, "git_dirty": dirty, "hostname": socket.gethostname(),
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda_ok else None,
        "cudnn": str(torch.backends.cudnn.version()) if cuda_ok and torch.backends.cudnn.is_available() else None,
        "numpy": numpy.__version__, "pandas": pd.__version__, "pyarrow": pa.__version__,
        "hydra": hydra.__version__, "device_name": device_name(device),
    }


@dataclass
class RunWriter:
    """Writes one run directory: ``start()`` marks it running, ``finish()`` writes every record."""

    run_dir: Path
    run_id: str
    experiment: str
    seed: int
    argv: list[str]
    overrides: list[str]
    device: str
    dtype: str
    sweep_dir: str | None = None
    started_at: dt.datetime = field(default_factory=utcnow)
    env: dict[str, Any] = field(default_factory=dict)
    expectations: pd.DataFrame | None = None  # rows of EXPECTATIONS_SCHEMA (see tfmoe.harness.method.expectations)
    inference_lines: list[str] = field(default_factory=list)  # likely causes of failed checks (tfmoe.harness.method.diagnosis)
    process: dict[str, Any] = field(default_factory=lambda: process_identity())
    _checkpointed: tuple[int, int, int] = (0, 0, 0)  # metrics/checks/timings rows at the last checkpoint
    _end: dict[str, Any] = field(default_factory=dict)  # run.parquet's final fields other than the status (finish)
    ended: tuple[Status, int, str | None] | None = None  # how run.parquet says the run ended (finish, end_as)
    unwritten: list[str] = field(default_factory=list)  # best-effort parts the disk refused (finish_extras)

    def _row(self, status: Status, **extra: Any) -> dict[str, Any]:
        row = {name: None for name in rundir.RUN_SCHEMA.names}
        row.update(self.env)
        row.update(self.process)
        row.update(run_id=self.run_id, experiment=self.experiment, status=Status(status).value, started_at=self.started_at,
                   seed=self.seed, argv=self.argv, overrides=self.overrides, device=self.device,
                   dtype=self.dtype, sweep_dir=self.sweep_dir, notes=[], heartbeat_at=utcnow())
        row.update(extra)
        return row

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.write_run(self._row(Status.RUNNING))

    def write_expectations(self, df: pd.DataFrame) -> None:
        """expectations.parquet: written before the experiment runs (observed/held empty), completed at the end."""
        self.expectations = df
        write_parquet(df.reindex(columns=rundir.EXPECTATIONS_SCHEMA.names), self.run_dir / EXPECTATIONS_FILE,
                      schema=rundir.EXPECTATIONS_SCHEMA)

    def write_code(self, df: pd.DataFrame) -> None:
        """code.parquet: the user-supplied files this run imported or read (copies under code/, see code_capture)."""
        from tfmoe.harness.store.code_capture import CODE_FILE, SCHEMA

        if len(df):
            write_parquet(df, self.run_dir / CODE_FILE, schema=SCHEMA)

    def checkpoint(self, rec: Any) -> None:
        """While the run runs: metrics, checks and timings so far, and a heartbeat in run.parquet (status
        still ``running``). Each file is replaced atomically, so a SIGKILL loses only what came after. A table
        that has not grown since the last checkpoint is not rewritten (a timing loop is disturbed as little as
        possible); run.parquet always is (the heartbeat)."""
        if rec is not None:
            sizes = (len(rec.metrics_rows), len(rec.checks_rows), len(rec.timings_rows))
            written = self._checkpointed
            if sizes[0] != written[0]:
                write_parquet(metrics_frame(list(rec.metrics_rows)), self.run_dir / TABLE_FILES["metrics"])
            if sizes[1] != written[1]:
                self._write_checks(rec)
            if sizes[2] != written[2]:
                write_parquet(timings_frame(list(rec.timings_rows)), self.run_dir / TABLE_FILES["timings"])
            self._checkpointed = sizes
        self.write_run(self._row(Status.RUNNING, notes=list(rec.notes) if rec is not None else []))

    def write_run(self, row: dict[str, Any]) -> None:
        # straight to arrow (one row, a fixed schema): no pandas frame per write, which a sweep pays per job
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist([row], schema=rundir.RUN_SCHEMA)
        atomic_replace(self.run_dir / RUN_FILE, lambda tmp: pq.write_table(table, tmp))

    def finish(self, rec: Any, status: Status, exit_code: int, error: str | None,
               peak_device_mem_bytes: int | None, peak_rss_bytes: int | None,
               tensor_max_numel: int, extras: bool = True) -> tuple[Status, int, str | None]:
        """Write every table the recorder holds (whatever state the run ended in), then run.parquet with how the
        run ended, then (``extras``) the best-effort parts: summary.md and the plots (:meth:`finish_extras`; the
        runner calls it itself, so that an interrupt while plots are drawn cannot leave the run ``running``).
        Returns the (status, exit code, error) written. A record the file system refuses (full disk, read-only:
        errors.disk_problem) makes an ok run ``error`` (exit 2), another one ``crashed``; an OSError writing
        run.parquet itself propagates (the run cannot record its end: readers then see it ``lost``)."""
        notes: list[str] = []
        problems: list[str] = []
        disk: str | None = None
        if rec is not None:
            notes = list(rec.notes)
            for what, fn in [
                ("metrics", lambda: write_parquet(metrics_frame(rec.metrics_rows), self.run_dir / TABLE_FILES["metrics"])),
                ("checks", lambda: self._write_checks(rec)),
                ("timings", lambda: write_parquet(timings_frame(rec.timings_rows), self.run_dir / TABLE_FILES["timings"])),
                ("tensors", lambda: notes.extend(self._write_tensors(rec, tensor_max_numel))),
            ]:
                try:
                    fn()
                except Exception as exc:  # keep going: one bad record must not lose the others
                    said = disk_problem(exc, self.run_dir)
                    disk = disk or said
                    problems.append(f"could not write {what}: {said or f'{type(exc).__name__}: {exc}'}")
        if problems:
            error = "; ".join(([error] if error else []) + problems)
            if status == Status.OK:
                status = Status.ERROR if disk else Status.CRASHED
                exit_code = status.exit_code
        finished = utcnow()
        self._end = dict(finished_at=finished, wall_s=(finished - self.started_at).total_seconds(),
                         peak_device_mem_bytes=peak_device_mem_bytes, peak_rss_bytes=peak_rss_bytes, notes=notes)
        self.end_as(status, exit_code, error)
        if extras:
            return self.finish_extras(rec)
        return status, exit_code, error

    def end_as(self, status: Status, exit_code: int, error: str | None) -> None:
        """(Re)write run.parquet's final row: how the run ended (after :meth:`finish` wrote the tables)."""
        self.ended = (Status(status), exit_code, error)
        self.write_run(self._row(status, error=error, exit_code=exit_code, **self._end))

    def finish_extras(self, rec: Any, stage: Any = None) -> tuple[Status, int, str | None]:
        """The best-effort parts, after run.parquet holds how the run ended: summary.md (text, quick) and then the
        plots (matplotlib, slow). Plots the file system refuses (a full disk, read-only) are best-effort: the run's
        status stays, its notes say which were not written (when run.parquet can still take them), and
        ``unwritten`` says so for the runner's warning line. A summary.md the file system refuses, or a plot that
        fails to draw (tfmoe's error), is added to the run's error (an ok run becomes ``error`` or ``crashed``) and
        run.parquet is rewritten; if that rewrite is refused too, run.parquet keeps how it ended and the status
        returned is that one (``unwritten`` says why). ``stage(name)`` is called before each part (the runner's
        test hook)."""
        status, exit_code, error = self.ended
        for what, fn in [("summary.md", lambda: self.write_summary(rec)), ("plots", lambda: self._write_plots(rec))]:
            if stage is not None:
                stage(what.removesuffix(".md"))
            if rec is None and what == "plots":
                continue
            try:
                fn()
            except Exception as exc:
                said = disk_problem(exc, self.run_dir)
                if said is None and isinstance(exc, OSError) and what == "summary.md":
                    raise
                problem = f"could not write {what}: {said or f'{type(exc).__name__}: {exc}'}"
                if what == "plots" and said is not None:
                    self.unwritten.append(f"{problem} (plots are best-effort: the records are complete)")
                    self._end["notes"] = [*self._end.get("notes", []), self.unwritten[-1]]
                    self._record_quietly(status, exit_code, error)
                    continue
                new_error = "; ".join(([error] if error else []) + [problem])
                new_status, new_code = status, exit_code
                if status == Status.OK:
                    new_status = Status.ERROR if said else Status.CRASHED
                    new_code = new_status.exit_code
                if self._record_quietly(new_status, new_code, new_error):
                    status, exit_code, error = new_status, new_code, new_error
                else:
                    self.unwritten.append(problem)
        return status, exit_code, error

    def _record_quietly(self, status: Status, exit_code: int, error: str | None) -> bool:
        """end_as, unless the file system refuses run.parquet (then it keeps what it said, and False)."""
        kept = self.ended
        try:
            self.end_as(status, exit_code, error)
            return True
        except OSError as exc:
            if disk_problem(exc, self.run_dir) is None:
                raise
            self.ended = kept
            return False

    def write_summary(self, rec: Any) -> None:
        """summary.md for the run as run.parquet says it ended."""
        status, _, error = self.ended
        write_text(self.run_dir / "summary.md", self._summary(rec, status, error, list(self._end["notes"])))

    def _write_checks(self, rec: Any) -> None:
        rows = [vars(c) for c in list(rec.checks_rows)]
        import pandas as pd

        df = pd.DataFrame(rows, columns=rundir.CHECKS_SCHEMA.names)
        write_parquet(df, self.run_dir / TABLE_FILES["checks"], schema=rundir.CHECKS_SCHEMA)

    def _write_tensors(self, rec: Any, max_numel: int) -> list[str]:
        rows = [tensor_row(name, t, max_numel) for name, t in rec.tensors_saved.items()]
        import pandas as pd

        df = pd.DataFrame(rows, columns=rundir.TENSORS_SCHEMA.names)
        write_parquet(df, self.run_dir / TABLE_FILES["tensors"], schema=rundir.TENSORS_SCHEMA)
        return [f"tensor {r['name']} ({r['numel']} elements > tensor_max_numel={max_numel}) saved as a summary only"
                for r in rows if r["summarised"]]

    def _write_plots(self, rec: Any) -> None:
        for name, fig in rec.figures.items():
            atomic_replace(self.run_dir / f"{name}.png", lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=110))

    def _summary(self, rec: Any, status: Status, error: str | None, notes: list[str]) -> str:
        lines = [f"# {self.experiment} — {self.run_id}", "",
                 f"status: **{status}**  ", f"device: {self.device}, dtype: {self.dtype}, seed: {self.seed}  ",
                 f"overrides: {' '.join(self.overrides) or '(none)'}", ""]
        if error:
            lines += [f"error: {error}", ""]
        if rec is not None and rec.checks_rows:
            lines += [checks_table(rec.checks_rows).markdown(), ""]
        lines += self.inference_lines
        if self.expectations is not None and len(self.expectations):
            lines += [expectations_table(self.expectations).markdown(), ""]
        lines += [f"- {n}" for n in notes]
        if rec is not None:
            lines += ["", *rec.summary_parts]
        return "\n".join(lines).rstrip() + "\n"


def write_run_config(run_dir: Path, config_yaml: str, overrides: list[str]) -> None:
    """.hydra/config.yaml and .hydra/overrides.yaml of a run made without Hydra's launcher (tfmoe.api.checking' record=),
    as Hydra writes them, so load_run, show and rerun_advice read it like any run."""
    import yaml

    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    write_text(run_dir / ".hydra" / "config.yaml", config_yaml)
    write_text(run_dir / ".hydra" / "overrides.yaml", yaml.safe_dump(list(overrides), default_flow_style=False))


def _fmt(x: float | None) -> str:
    return "" if x is None or x != x else f"{x:.4g}"


def checks_table(checks: Any) -> Rows:
    """The checks table of summary.md: each check (recorder CheckRows), passed, observed, threshold."""
    table = Rows("checks", ["check", "passed", "observed", "threshold"])
    for c in checks:
        table.add(c.check, rundir.check_mark(vars(c), no="**NO**"), _fmt(c.observed), _fmt(c.threshold))
    return table


def expectations_table(df: pd.DataFrame) -> Rows:
    """The expectations table of summary.md (beside the checks): prediction, observation, held, when written."""
    import pandas as pd

    table = Rows("expectations", ["expectation", "expected", "observed", "held", "written at"])
    for r in df.to_dict("records"):
        held = r.get("held")
        mark = "" if held is None or held != held else ("yes" if held else "**NO**")
        when = "" if r.get("written_at") is None else pd.Timestamp(r["written_at"]).strftime("%Y-%m-%d %H:%M:%S")
        table.add(r["selector"], r["expected"], _fmt(r.get("observed")), mark, when)
    return table



# --------------------------------------------------------------------------------------------- status


def process_identity() -> dict[str, Any]:
    """What identifies this process across machines and pid reuse: host, pid and the process's start time."""
    import psutil

    started = dt.datetime.fromtimestamp(psutil.Process().create_time(), dt.timezone.utc)
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "process_started_at": started}


def present(v: Any) -> bool:
    """Not None, NaN, pandas' NaT or NA."""
    pd = sys.modules.get("pandas")  # a pandas value can only be here once pandas is loaded
    return v is not None and not (isinstance(v, float) and v != v) and not (
        pd is not None and (v is pd.NaT or v is pd.NA))


def process_alive(pid: int, started_at: Any) -> bool:
    """Is the process ``pid`` that started at ``started_at`` still alive on this host? (a reused pid is not it)"""
    import psutil

    try:
        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        created = proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, OverflowError):
        return False
    if not present(started_at):
        return True
    return abs(created - _epoch(started_at)) < 1.0


def _epoch(t: Any) -> float:
    """A recorded time (a datetime, pandas' Timestamp, or ISO text) in seconds since the epoch; naive means UTC."""
    if not isinstance(t, dt.datetime):
        t = dt.datetime.fromisoformat(str(t))
    return (t.replace(tzinfo=dt.timezone.utc) if t.tzinfo is None else t).timestamp()


def effective_status(run: Any) -> str:
    """THE status every reader shows (runs, show, sweeps, exit codes, catalogs): the recorded one, except that a
    ``running`` run whose process is gone from this host is ``lost`` (killed by SIGKILL, the OOM killer, a node
    loss...). A run owned by another host stays ``running`` (it is running there; see :func:`where_running`).
    A ``running`` run recorded before pids were recorded cannot be checked and stays ``running``."""
    status = str(run.get("status"))
    if status != Status.RUNNING:
        return status
    host, pid = run.get("hostname"), run.get("pid")
    if not present(host) or not present(pid) or str(host) != socket.gethostname():
        return Status.RUNNING.value
    alive = process_alive(int(pid), run.get("process_started_at"))
    return (Status.RUNNING if alive else Status.LOST).value


def is_lost(run: Any) -> bool:
    return effective_status(run) == Status.LOST


def where_running(run: Any) -> str:
    """'' unless the run is running: then 'on HOST (pid N)', with '(this host)' or '(another host: not checked)'."""
    if effective_status(run) != Status.RUNNING:
        return ""
    host, pid = run.get("hostname"), run.get("pid")
    here = present(host) and str(host) == socket.gethostname()
    where = f"on {host if present(host) else 'an unknown host'}" + (f" (pid {int(pid)})" if present(pid) else "")
    return where + (" — this host" if here else " — another host: not checked from here")


def read_run_row(run_dir: Path) -> dict[str, Any]:
    """run.parquet of ``run_dir`` as a dict whose ``status`` is :func:`effective_status` (the file's own value
    is kept as ``recorded_status``). Every reader of run.parquet goes through here."""
    path = Path(run_dir) / RUN_FILE
    try:
        rows = records(read_table(path))  # pandas' values (NaN for a missing float or text), read without pandas
    except UnreadableFile as exc:
        raise UnreadableFile(path, f"{exc}; {rerun_advice(run_dir)}") from None
    if not rows:
        raise BadInput(f"{path} holds no row: the run is unreadable; {rerun_advice(run_dir)}")
    row = rows[0]
    row["recorded_status"] = row.get("status")
    row["status"] = effective_status(row)
    return row


STATE_COLUMNS = ("run_id", "experiment", "status", "exit_code", "wall_s", "error", "hostname", "pid",
                 "process_started_at")


def read_run_state(run_dir: Path) -> dict[str, Any]:
    """Only run.parquet's state columns (:data:`STATE_COLUMNS`, those the file has), read with pyarrow, with
    ``status`` made :func:`effective_status` like :func:`read_run_row`: about 3x faster, for the readers that
    touch every job of a big sweep (its exit code, its outcome summary)."""
    path = Path(run_dir) / RUN_FILE
    try:
        rows = read_table(path, STATE_COLUMNS).to_pylist()
    except UnreadableFile as exc:
        raise UnreadableFile(path, f"{exc}; {rerun_advice(run_dir)}") from None
    if not rows:
        raise BadInput(f"{path} holds no row: the run is unreadable; {rerun_advice(run_dir)}")
    row = rows[0]
    row["recorded_status"] = row.get("status")
    row["status"] = effective_status(row)
    return row


def rerun_advice(run_dir: Path) -> str:
    """The command that makes an unreadable run again, one that works: ``tfmoe replay RUN_ID`` while run.parquet
    (the recorded config, seed and code) is readable, else the command line recorded by Hydra in .hydra/."""
    import shlex

    run_dir = Path(run_dir)
    try:
        rows = read_table(run_dir / RUN_FILE, ("run_id",)).to_pylist()
    except BadInput:
        rows = []
    if rows and rows[0].get("run_id"):
        return f"`tfmoe replay {rows[0]['run_id']}` runs it again from its recorded config and seed"
    import yaml

    try:
        overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text(encoding="utf-8")) or []
        config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return "its recorded command line is lost too (.hydra/ unreadable): run the experiment again"
    experiment = config.get("experiment") or run_dir.parent.name
    if not any(str(o).split("=", 1)[0].lstrip("+~") == "seed" for o in overrides) and "seed" in config:
        overrides = [*overrides, f"seed={config['seed']}"]
    command = " ".join(["tfmoe", shlex.quote(str(experiment)), *(shlex.quote(str(o)) for o in overrides)])
    return f"`{command}` runs it again (its command line, recorded in .hydra/)"


def with_effective_status(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` (one row per run with ``status`` and ``path``, e.g. from the catalog) with the status of each row
    recorded as ``running`` derived by :func:`effective_status` from its run.parquet, read now (a cache may be
    older than the run's last heartbeat). Finished runs are left as they are."""
    if df.empty or "status" not in df or "path" not in df:
        return df
    df = df.copy()
    for i in df.index[df["status"] == Status.RUNNING]:
        df.at[i, "status"] = status_now(Status.RUNNING.value, Path(df.at[i, "path"]))
    return df


def status_now(status: str, run_dir: Path) -> str:
    """A cached ``status`` of ``run_dir`` made :func:`effective_status`, read from its run.parquet now when it is
    ``running`` (state columns only: pyarrow, no pandas); kept as it is when the file is unreadable."""
    if status != Status.RUNNING:
        return status
    try:
        return str(read_run_state(run_dir)["status"])
    except BadInput:
        return status


# --------------------------------------------------------------------------------------------- reading


RUN_TABLE_FILES = {**TABLE_FILES, "expectations": EXPECTATIONS_FILE}  # the tables of a run directory RunData holds


def _frame_property(key: str) -> Any:
    """RunData's ``key`` table as a pandas DataFrame (empty when absent), made on first use."""
    return property(lambda self: self.frame(key), doc=f"the run's {key} table as a DataFrame (empty when absent)")


@dataclass
class RunData:
    """One run directory, read back (no pickles, no classes instantiated): run.parquet's row, the config text, and
    each table as arrow (None: the run has no such file). ``rows(key)`` gives a table's rows with pandas' values
    without importing pandas (what `tfmoe show` prints); ``metrics``, ``checks``, ``timings``, ``tensor_table`` and
    ``expectations`` are the same tables as pandas DataFrames (empty when absent), made on first use."""

    path: Path
    run: dict[str, Any]
    tables: dict[str, Any]  # key of RUN_TABLE_FILES -> pyarrow.Table or None
    config: str  # .hydra/config.yaml text ("" when it is missing: see config_missing)
    config_missing: bool = False  # .hydra/config.yaml is not in the run directory (deleted, never written)
    _frames: dict[str, Any] = field(default_factory=dict, repr=False)

    def rows(self, key: str) -> list[dict[str, Any]]:
        return records(self.tables.get(key))

    def frame(self, key: str) -> pd.DataFrame:
        if key not in self._frames:
            table = self.tables.get(key)
            self._frames[key] = _pd().DataFrame() if table is None else table.to_pandas()
        return self._frames[key]

    metrics = _frame_property("metrics")
    checks = _frame_property("checks")
    timings = _frame_property("timings")
    tensor_table = _frame_property("tensors")
    expectations = _frame_property("expectations")

    @property
    def tensors(self) -> dict[str, Any]:
        return tensors_from_frame(self.tensor_table)

    @property
    def plots(self) -> list[Path]:
        return sorted(self.path.glob("*.png"))


def _pd() -> Any:
    import pandas as pd

    return pd


def _refuse_missing_run_file(path: Path) -> None:
    """A run directory (it holds a run's other files) whose run.parquet is missing: say so, and how to re-make it."""
    from tfmoe.harness.store.catalog import RUN_MARKS

    if path.is_dir() and any((path / m).exists() for m in RUN_MARKS):
        raise UnreadableFile(path / RUN_FILE, f"{path / RUN_FILE} is missing: the run is unreadable (its other files "
                                              f"are kept); {rerun_advice(path)}")


def load_run(path: str | Path) -> RunData:
    """Read a run directory (pass a path; use :func:`resolve_run` for ids and prefixes)."""
    path = Path(path)
    if not (path / RUN_FILE).exists():
        _refuse_missing_run_file(path)
        raise BadInput(f"{path} is not a run directory (no {RUN_FILE}): pass a path under runs/, a run id or `latest`")
    run = read_run_row(path)
    try:
        tables = {key: read_table(path / name) if (path / name).exists() else None
                  for key, name in RUN_TABLE_FILES.items()}
        tables["checks"] = rundir.with_applicable(tables.get("checks"))  # a run older than the column: applicable
    except UnreadableFile as exc:
        raise UnreadableFile(exc.path, f"{exc}; {rerun_advice(path)}") from None
    cfg_file = path / ".hydra" / "config.yaml"
    config = cfg_file.read_text(encoding="utf-8") if cfg_file.exists() else ""
    return RunData(path, run, tables, config, config_missing=not cfg_file.exists())


def tensors_from_frame(df: pd.DataFrame) -> dict[str, Any]:
    """Rebuild every fully saved tensor (bit-identical to what was saved); summarised ones are skipped."""
    import torch

    out: dict[str, Any] = {}
    for row in df.itertuples(index=False):
        if row.summarised:
            continue
        dtype = getattr(torch, row.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise BadInput(f"tensor {row.name!r} has unknown dtype {row.dtype!r}: the run is corrupt")
        values = torch.tensor(list(row.values), dtype=torch.float64)
        out[row.name] = values.to(dtype).reshape([int(s) for s in row.shape])
    return out


def load_tensors(path: str | Path) -> dict[str, Any]:
    """All tensors of a run directory as torch tensors."""
    return tensors_from_frame(read_parquet(Path(path) / TABLE_FILES["tensors"]))


def load_tensor(path: str | Path, name: str) -> Any:
    """One tensor of a run directory, identical (dtype, shape, bits) to what the run saved."""
    df = read_parquet(Path(path) / TABLE_FILES["tensors"])
    sel = df[df["name"] == name]
    if sel.empty:
        raise BadInput(f"run {path} saved no tensor named {name!r}: saved are {', '.join(df['name'])}")
    if bool(sel.iloc[0]["summarised"]):
        raise BadInput(f"tensor {name!r} was saved as a summary only (above tensor_max_numel): re-run with "
                       "a larger tensor_max_numel=N")
    return tensors_from_frame(sel)[name]


def find_runs(runs_root: Path) -> list[Path]:
    """Every run directory under ``runs_root`` (single runs and sweep jobs)."""
    if not runs_root.exists():
        return []
    return sorted(p.parent for p in runs_root.rglob(RUN_FILE) if ".hydra" not in p.parts)


def run_index(runs_root: Path) -> pd.DataFrame:
    """One row per run (run.parquet's columns, ``path``, ``checks_passed``/``checks_total``) from the catalog,
    synced with the directories first (see catalog.py); unreadable runs are listed as such."""
    import pandas as pd

    from tfmoe.harness.store import catalog

    if not Path(runs_root).is_dir():
        return pd.DataFrame()
    conn = catalog.open_catalog(Path(runs_root))
    try:
        return with_effective_status(catalog.frame(conn, Path(runs_root)))
    finally:
        conn.close()


def resolve_run(ref: str, runs_root: Path) -> Path:
    """A run directory from a path, a run id, a unique prefix of one, or ``latest`` (looked up in the catalog)."""
    from tfmoe.harness.store import catalog

    path = Path(ref)
    if (path / RUN_FILE).exists():
        return path
    if path.exists() and path.is_dir():
        _refuse_missing_run_file(path)
        raise BadInput(f"{ref} is not a run directory (no {RUN_FILE}): pass a run path, id or `latest`")
    if not Path(runs_root).is_dir():
        raise BadInput(f"no runs under {runs_root}: run an experiment first, or pass --runs-root")
    conn = catalog.open_catalog(Path(runs_root))
    try:
        if catalog.count(conn) == 0:
            raise BadInput(f"no runs under {runs_root}: run an experiment first, or pass --runs-root")
        matches = catalog.lookup(conn, Path(runs_root), ref)
    finally:
        conn.close()
    if ref == "latest" and not matches:
        raise BadInput(f"no readable runs under {runs_root}")
    if not matches:
        raise BadInput(f"run {ref!r} not found under {runs_root}: `tfmoe runs` lists the run ids")
    if len(matches) > 1:
        ids = ", ".join(run_id for run_id, _ in matches[:5])
        raise BadInput(f"run prefix {ref!r} is ambiguous ({len(matches) if len(matches) < 6 else '6 or more'} runs: {ids}…): give more characters")
    return matches[0][1]
