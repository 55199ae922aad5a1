"""`tfmoe export mlflow`: copy finished runs into an MLflow tracking store (default ``sqlite:///mlflow.db``).

One MLflow experiment per tfmoe experiment; each run becomes an MLflow run with params (the flattened Hydra config),
metrics (metrics.parquet; tag columns folded into the name as ``name/tag:value``, steps kept), tags (``tfmoe.run_id``,
status, git commit, versions, device) and artifacts (the whole run directory: parquet files, PNGs, summary.md,
``.hydra/``). A sweep becomes a parent run (sweep.parquet and sweep plots as artifacts) with its jobs as child runs.
Runs are keyed by the ``tfmoe.run_id`` tag, so exporting again adds nothing; runs still ``running`` are left for a
later export. Everything goes through MLflow's own client.

A run is written in one order: params and metrics, then artifacts (with ``tfmoe/metric_names.json``, each metric
name's tfmoe name and tags), then the tag ``tfmoe.export_complete=true``, then its FINISHED/FAILED/KILLED status. Only
a run with that tag counts as "already there": one an export left half-written (killed, a failing artifact) is found
by the next export and completed in place, so each tfmoe run has exactly one MLflow run. Exports into one store are
serialised by a file lock beside it (``<db>.tfmoe-export.lock`` for sqlite, ``.tfmoe-export.lock`` in a file
store's folder): two at once would otherwise both create the store's schema or both export every run. A new sqlite
store is created whole or not at all (its schema made in a file beside it, then renamed); an empty store whose
schema creation was cut short is made again, while a store with runs in it is never touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import posixpath
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from tfmoe.contract.errors import BadInput
from tfmoe.contract.status import Status
from tfmoe.harness.store.notebook import effective_status, load_run, present, resolve_run
from tfmoe.harness.store.rundir import RUN_FILE, read_parquet

DEFAULT_URI = "sqlite:///mlflow.db"
# MLflow's run status for each finished tfmoe status (unexpected: every check passed, a prediction missed);
# a running run is not exported yet
MLFLOW_STATUS = {Status.OK: "FINISHED", Status.UNEXPECTED: "FINISHED", Status.FAILED: "FAILED", Status.ERROR: "FAILED",
                 Status.CRASHED: "FAILED", Status.LOST: "FAILED", Status.UNREADABLE: "FAILED",
                 Status.INTERRUPTED: "KILLED"}
ENV_TAGS = ["git_commit", "git_dirty", "python", "torch", "cuda", "cudnn", "numpy", "pandas", "pyarrow", "hydra",
            "device", "device_name", "dtype", "hostname", "platform"]
NOT_A_TAG = {"name", "value", "step", "measured"}
# MLflow's rules for a metric/param name (mlflow/utils/validation.py: validate_param_and_metric_name,
# path_not_unique, MAX_ENTITY_KEY_LENGTH): these characters only, at most 250 of them, and a name that
# posixpath.normpath leaves as it is (no leading '/', no '//', no '.' or '..' segment, no trailing '/')
_BAD_NAME_CHARS = re.compile(r"[^\w./\- :]")
MAX_KEY = 250
BATCH = 900  # MLflow takes at most 1000 metrics (and 100 params, 100 tags) per log_batch call
COMPLETE_TAG = "tfmoe.export_complete"
NAMES_ARTIFACT = "tfmoe/metric_names.json"
LOCK_NAME = ".tfmoe-export.lock"


def _mlflow() -> Any:
    try:
        import mlflow
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise BadInput("tfmoe export mlflow needs the optional extra `mlflow`: pip install -e '.[mlflow]'") from None
    for name in ("alembic", "mlflow"):  # the store's migration chatter
        logging.getLogger(name).setLevel(logging.WARNING)
    return mlflow, MlflowClient


@dataclass
class Exported:
    exported: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)  # half-written by an earlier export, completed now
    still_running: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)  # "run_id: why"
    sweeps: list[str] = field(default_factory=list)
    experiments: dict[str, str] = field(default_factory=dict)  # experiment name -> MLflow experiment id


def _fits(key: str) -> str:
    """``key`` made to pass MLflow's name checks: bad characters -> ``_``, empty/``.``/``..`` segments -> ``_``."""
    key = _BAD_NAME_CHARS.sub("_", key)
    return "/".join("_" * max(1, len(seg)) if seg in ("", ".", "..") else seg for seg in key.split("/"))


def metric_key(name: str, tags: dict[str, Any]) -> str:
    """``loss`` with tags {variant: a, layer: 3} -> ``loss/variant:a/layer:3``, made to fit MLflow's rules (see
    _BAD_NAME_CHARS); a name over 250 characters is cut and ends in a hash of the whole, so it stays distinct."""
    key = _fits(str(name) + "".join(f"/{k}:{v}" for k, v in tags.items()))
    if len(key) > MAX_KEY:
        key = _fits(key[:MAX_KEY - 9].rstrip("/") + "-" + _digest(key))
    return key


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:8]


def valid_name(key: str) -> bool:
    """MLflow's own test of a metric name (mlflow.utils.validation), for the tests and a last check here."""
    norm = posixpath.normpath(key)
    return (bool(re.fullmatch(r"[/\w.\- :]*", key)) and len(key) <= MAX_KEY and norm == key and norm != "."
            and not norm.startswith("..") and not norm.startswith("/"))


class MetricNames:
    """Each exported metric name -> the tfmoe metric and tags it stands for; names kept distinct after fitting."""

    def __init__(self) -> None:
        self.names: dict[str, dict[str, Any]] = {}
        self._keys: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}

    def key(self, name: str, tags: dict[str, Any]) -> str:
        ident = (str(name), tuple((str(k), str(v)) for k, v in tags.items()))
        if ident not in self._keys:
            key = metric_key(name, tags)
            if key in self.names:  # two tfmoe names fitted to one MLflow name: tell them apart by a hash
                key = _fits(key[:MAX_KEY - 9].rstrip("/") + "-" + _digest(repr(ident)))
            self.names[key] = {"metric": str(name), "tags": {k: v for k, v in ident[1]}}
            self._keys[ident] = key
        return self._keys[ident]

    def renamed(self) -> int:
        return sum(k != str(v["metric"]) + "".join(f"/{a}:{b}" for a, b in v["tags"].items())
                   for k, v in self.names.items())


def flatten(d: Any) -> dict[str, str]:
    """The config as MLflow params: dotted keys, lists as JSON."""
    from tfmoe.harness.reading.reports import flatten_keys

    return {k: json.dumps(v) if isinstance(v, (list, tuple)) else str(v) for k, v in flatten_keys(d).items()}


def _ms(ts: Any) -> int | None:
    return int(pd.Timestamp(ts).timestamp() * 1000) if present(ts) and ts is not pd.NaT else None


def _tracking_store(tracking_uri: str) -> str | None:
    """Artifacts of a sqlite store live beside the database file (``mlartifacts/``), like `mlflow ui`'s default."""
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri.removeprefix("sqlite:///"))
        return (db.resolve().parent / "mlartifacts").as_uri()
    return None










def lock_path(tracking_uri: str) -> Path | None:
    """The file lock that serialises exports into this store: beside a sqlite database, inside a file store's
    folder; None for a tracking server (it owns its database)."""
    from urllib.parse import urlparse

    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri.removeprefix("sqlite:///"))
        return db.parent / f"{db.name}{LOCK_NAME}"
    parsed = urlparse(tracking_uri)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else tracking_uri) / LOCK_NAME
    return None


@contextlib.contextmanager
def store_lock(tracking_uri: str, wait_s: float = 3600) -> Iterator[None]:
    """Hold the store's export lock (one line on stderr when another export holds it; BadInput after wait_s)."""
    from filelock import FileLock, Timeout

    path = lock_path(tracking_uri)
    if path is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path))
        try:
            lock.acquire(timeout=0.5)
        except Timeout:
            print(f"waiting for another tfmoe export into {tracking_uri} (lock {path})", file=sys.stderr)
            lock.acquire(timeout=wait_s)
    except Timeout:
        raise BadInput(f"another export has held {path} for {wait_s:.0f} s: wait for it, or remove the lock file "
                       "if no export is running") from None
    except OSError as exc:
        raise BadInput(f"cannot lock the MLflow store {tracking_uri!r} ({path}): {exc.strerror or exc}") from None
    try:
        yield
    finally:
        lock.release()


def open_client(client_cls: Any, tracking_uri: str) -> Any:
    """MLflow's client on the store. A new sqlite store is created whole or not at all: its schema is made in a
    file beside it, then renamed into place, so an export killed or refused a write while creating it leaves no
    half-made store. One such store left by an earlier export (an MLflow migration's leftovers, no version, or
    empty), holding no run, is moved aside (said on stderr) and created again."""
    import os

    db = Path(tracking_uri.removeprefix("sqlite:///")) if tracking_uri.startswith("sqlite:///") else None
    if db is not None and db.name and db.parent.is_dir():
        if db.is_file() and half_created(db):
            _move_aside(db)
        if not db.exists():
            import uuid

            for left in db.parent.glob(f".{db.name}.tfmoe-creating-*"):  # an earlier attempt's (the store is locked)
                left.unlink(missing_ok=True)
            making = db.with_name(f".{db.name}.tfmoe-creating-{uuid.uuid4().hex[:8]}")  # new: MLflow caches by URI
            client_cls(tracking_uri=f"sqlite:///{making}")  # MLflow creates its schema
            os.replace(making, db)
    return client_cls(tracking_uri=tracking_uri)


def _verified_client(client_cls: Any, tracking_uri: str) -> Any:
    client = open_client(client_cls, tracking_uri)
    client.search_experiments(max_results=1)  # MLflow opens a store lazily: verify its schema now
    return client


def _forget_engine(uri: str) -> None:
    """Close and drop the SQLAlchemy engine MLflow's sqlite store keeps for ``uri`` (one per URI, per process): its
    pool would keep the moved file open."""
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    except ImportError:
        return
    engine = getattr(SqlAlchemyStore, "_engine_map", {}).pop(uri, None)
    if engine is not None:
        engine.dispose()


def _move_aside(db: Path) -> None:
    import os

    from tfmoe.harness.store.rundir import utcnow

    aside = db.with_name(f"{db.name}.half-created-{utcnow():%Y%m%dT%H%M%SZ}")
    _forget_engine(f"sqlite:///{db}")
    os.replace(db, aside)
    print(f"{db} was left half-created by an earlier export and holds no run: moved to {aside}, created again",
          file=sys.stderr)


def half_created(db: Path, migrated_or_not: bool = False) -> bool:
    """Whether a sqlite file is an MLflow store whose creation stopped part-way (no schema version, a migration's
    temporary table, or nothing at all) and holds no run; with ``migrated_or_not`` (a store MLflow refused to
    open), any store that holds no run and no experiment but the default one."""
    import sqlite3

    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "runs" in tables and conn.execute("SELECT count(*) FROM runs").fetchone()[0]:
                return False
            if migrated_or_not:
                return not ("experiments" in tables and conn.execute(
                    "SELECT count(*) FROM experiments WHERE experiment_id != 0").fetchone()[0])
            versioned = "alembic_version" in tables and conn.execute(
                "SELECT count(*) FROM alembic_version").fetchone()[0] > 0
        finally:
            conn.close()
    except sqlite3.Error:
        return False  # not a database: MLflow says so
    return not versioned or any(t.startswith("_alembic_tmp_") for t in tables)


def one_line(exc: BaseException, where: str | None = None) -> str:
    """An MLflow or SQLAlchemy error in one line: a refused write as :func:`tfmoe.contract.errors.disk_problem` says it, else
    the message without SQLAlchemy's statement dump and link."""
    from tfmoe.contract.errors import disk_problem

    said = disk_problem(exc, where)
    if said is not None:  # the store, not a run directory, is where the space or device is wanting
        return said.replace("pass run_root=DIR", "pass --tracking-uri")
    text = str(getattr(exc, "message", exc)).split("\n[SQL:")[0].split("(Background on this error")[0]
    return " ".join(text.split())[:400]


class Exporter:
    def __init__(self, tracking_uri: str) -> None:
        mlflow, client_cls = _mlflow()
        self.mlflow = mlflow
        try:
            self.client = _verified_client(client_cls, tracking_uri)
        except Exception as exc:  # its schema not created (a refused write, a store of another version): one line
            db = Path(tracking_uri.removeprefix("sqlite:///")) if tracking_uri.startswith("sqlite:///") else None
            if db is None or not db.is_file() or not half_created(db, migrated_or_not=True):
                raise BadInput(f"cannot open MLflow tracking store {tracking_uri!r}: {one_line(exc, tracking_uri)}; a store "
                               "an export left half-created is completed by the next `tfmoe export mlflow`") from None
            _move_aside(db)  # a store MLflow refuses (a migration cut short) that holds nothing: made again
            self.client = _verified_client(client_cls, tracking_uri)
        self.artifact_root = _tracking_store(tracking_uri)
        self.experiments: dict[str, str] = {}
        self.known: dict[str, dict[str, str]] = {}  # experiment id -> tfmoe.run_id -> MLflow run id
        self.incomplete: dict[str, dict[str, str]] = {}  # the same, for runs an earlier export left half-written

    def experiment_id(self, name: str) -> str:
        if name not in self.experiments:
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                location = f"{self.artifact_root}/{name}" if self.artifact_root else None
                exp_id = self.client.create_experiment(name, artifact_location=location,
                                                       tags={"tfmoe.experiment": name})
            else:
                exp_id = exp.experiment_id
            self.experiments[name] = exp_id
            self.known[exp_id], self.incomplete[exp_id] = self._exported_runs(exp_id)
        return self.experiments[name]

    def _exported_runs(self, exp_id: str) -> tuple[dict[str, str], dict[str, str]]:
        """(complete, half-written) MLflow runs of this experiment, by tfmoe run id."""
        from mlflow.entities import ViewType

        done, half, token = {}, {}, None
        while True:
            page = self.client.search_runs([exp_id], run_view_type=ViewType.ALL, max_results=5000, page_token=token)
            for r in page:
                rid = r.data.tags.get("tfmoe.run_id")
                if rid and (r.data.tags.get(COMPLETE_TAG) == "true" or r.info.lifecycle_stage == "deleted"):
                    done[rid] = r.info.run_id  # a run the user deleted in MLflow is not brought back
                elif rid:
                    half[rid] = r.info.run_id
            token = page.token
            if not token:
                return done, half

    def _open_run(self, exp_id: str, rid: str, tags: dict[str, str], start: int | None) -> tuple[str, set[Any]]:
        """(MLflow run id, the metrics it already holds): a new run, or the half-written one an earlier export
        left (reopened, its tags set again) so that it is completed in place."""
        mid = self.incomplete[exp_id].pop(rid, None)
        if mid is None:
            name = tags.get("mlflow.runName", rid)
            return self.client.create_run(exp_id, start_time=start, tags=tags, run_name=name).info.run_id, set()
        run = self.client.get_run(mid)
        if run.info.status != "RUNNING":
            self.client.update_run(mid, status="RUNNING")  # MLflow logs only into an active run
        self._log(mid, tags=[_tag(k, v) for k, v in tags.items() if k != "mlflow.parentRunId"])
        have = {(m.key, m.step, m.timestamp, m.value) for key in run.data.metrics
                for m in self.client.get_metric_history(mid, key)}  # a key cut between two batches: keep the rest
        return mid, have

    def _log(self, run_id: str, metrics: list[Any] = (), params: list[Any] = (), tags: list[Any] = ()) -> None:
        params, tags, metrics = list(params), list(tags), list(metrics)
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i:i + 100])
        for i in range(0, len(tags), 100):
            self.client.log_batch(run_id, tags=tags[i:i + 100])
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(run_id, metrics=metrics[i:i + BATCH])

    def export_run(self, run_dir: Path, parent: str | None, done: Exported) -> str | None:
        from mlflow.entities import Metric, Param

        try:
            data = load_run(run_dir)
        except BadInput as exc:  # an unreadable run: said, and the others exported
            done.unreadable.append(f"{run_dir.name}: {exc}")
            return None
        run = data.run
        rid, status = str(run["run_id"]), effective_status(run)  # a dead `running` run is `lost`
        if status == Status.RUNNING:
            done.still_running.append(rid)
            return None
        exp_id = self.experiment_id(str(run["experiment"]))
        if rid in self.known[exp_id]:
            done.already.append(rid)
            return self.known[exp_id][rid]
        completing = rid in self.incomplete[exp_id]
        checks = data.checks
        tags = {"tfmoe.run_id": rid, "tfmoe.status": status, "tfmoe.experiment": str(run["experiment"]),
                "tfmoe.path": str(run_dir.resolve()), "tfmoe.seed": str(run["seed"]),
                "tfmoe.overrides": " ".join(run["overrides"]) or "(none)", "mlflow.runName": rid,
                "tfmoe.checks": f"{int(checks['passed'].sum()) if not checks.empty else 0}/{len(checks)}"}
        tags.update({f"tfmoe.{k}": str(run[k]) for k in ENV_TAGS if present(run.get(k))})
        if present(run.get("git_commit")):
            tags["mlflow.source.git.commit"] = str(run["git_commit"])
        if present(run.get("error")):
            tags["tfmoe.error"] = str(run["error"])[:5000]
        if parent:
            tags["mlflow.parentRunId"] = parent
        mid, have = self._open_run(exp_id, rid, tags, _ms(run.get("started_at")))
        params = [Param(_fits(k)[:MAX_KEY], v[:6000]) for k, v in flatten(_config(data)).items()]
        if completing:
            logged = self.client.get_run(mid).data.params
            params = [p for p in params if p.key not in logged]
        stamp = _ms(run.get("finished_at")) or _ms(run.get("started_at")) or 0
        metrics, names = [], MetricNames()
        m = data.metrics
        tag_cols = [c for c in m.columns if c not in NOT_A_TAG]
        for row in m.to_dict("records"):
            if not present(row.get("value")):
                continue
            key = names.key(row["name"], {c: row[c] for c in tag_cols if present(row.get(c)) and row[c] != ""})
            step = int(row["step"]) if present(row.get("step")) else 0
            metric = Metric(key, float(row["value"]), stamp, step)
            if (metric.key, metric.step, metric.timestamp, metric.value) not in have:
                metrics.append(metric)
        # 1. params and metrics, 2. artifacts, 3. the complete tag, 4. the run's status: a run cut short anywhere
        # lacks the tag, and the next export completes it
        self._log(mid, metrics=metrics, params=params)
        self.client.log_artifacts(mid, str(run_dir))
        self.client.log_dict(mid, names.names, NAMES_ARTIFACT)
        self._log(mid, tags=[_tag("tfmoe.metric_names", f"{NAMES_ARTIFACT}: {len(names.names)} metric names, "
                                  f"{names.renamed()} changed to fit MLflow's rules"), _tag(COMPLETE_TAG, "true")])
        self.client.set_terminated(mid, MLFLOW_STATUS.get(status, "FAILED"), end_time=_ms(run.get("finished_at")))
        self.known[exp_id][rid] = mid
        (done.completed if completing else done.exported).append(rid)
        return mid

    def export_sweep(self, sweep_dir: Path, jobs: list[Path], done: Exported) -> None:
        from mlflow.entities import Param

        runs = [read_parquet(j / RUN_FILE).iloc[0] for j in jobs]
        experiment = str(runs[0]["experiment"])
        exp_id = self.experiment_id(experiment)
        sid = sweep_dir.name.removeprefix("multirun-")
        parent = self.known[exp_id].get(sid)
        statuses = {effective_status(r) for r in runs}
        if parent is None:  # new, or half-written (reopened): its params and artifacts, then its jobs
            starts = [t for t in (_ms(r["started_at"]) for r in runs) if t is not None]
            tags = {"tfmoe.run_id": sid, "tfmoe.sweep": "true", "tfmoe.experiment": experiment,
                    "tfmoe.path": str(sweep_dir.resolve()), "mlflow.runName": sweep_dir.name,
                    "tfmoe.status": Status.OK.value if statuses == {Status.OK} else ",".join(sorted(statuses))}
            completing = sid in self.incomplete[exp_id]
            parent, _ = self._open_run(exp_id, sid, tags, min(starts) if starts else None)
            if "sweep.jobs" not in (self.client.get_run(parent).data.params if completing else {}):
                self._log(parent, params=[Param("sweep.jobs", str(len(jobs)))])
            for f in sorted(sweep_dir.iterdir()):
                if f.is_file() and (f.name == "sweep.parquet" or f.suffix == ".png" or f.name == "multirun.yaml"):
                    self.client.log_artifact(parent, str(f))
            done.sweeps.append(sid)
            for job in jobs:
                self.export_run(job, parent, done)
            if Status.RUNNING in statuses:
                return  # its jobs still running: completed (tag, status) by a later export
            ends = [t for t in (_ms(r["finished_at"]) for r in runs) if t is not None]
            worst = MLFLOW_STATUS[Status.OK] if statuses == {Status.OK} else MLFLOW_STATUS[Status.FAILED]
            self._log(parent, tags=[_tag(COMPLETE_TAG, "true")])
            self.client.set_terminated(parent, worst, end_time=max(ends) if ends else None)
            self.known[exp_id][sid] = parent
            return
        for job in jobs:
            self.export_run(job, parent, done)


def _tag(key: str, value: str) -> Any:
    from mlflow.entities import RunTag

    return RunTag(key, value[:8000])


def _config(data: Any) -> dict[str, Any]:
    import yaml

    try:
        return yaml.safe_load(data.config) or {}
    except yaml.YAMLError:
        return {}


def _sweep_of(run_dir: Path) -> Path | None:
    parent = run_dir.parent
    return parent if parent.name.startswith("multirun-") else None


def export(refs: list[str], runs_root: Path, tracking_uri: str = DEFAULT_URI) -> Exported:
    """Export RUN refs (ids, prefixes, paths, `latest`, or sweep directories) — all runs when none are given."""
    from tfmoe.harness.store.notebook import run_index

    _mlflow()  # without the extra, say so before anything else
    dirs: list[Path] = []
    for ref in refs:
        p = Path(ref)
        if p.is_dir() and not (p / RUN_FILE).exists() and any(p.glob(f"*/{RUN_FILE}")):
            dirs += sorted(j.parent for j in p.glob(f"*/{RUN_FILE}"))  # a sweep directory: all its jobs
        else:
            dirs.append(resolve_run(ref, runs_root))
    if not refs:
        index = run_index(runs_root)
        if index.empty:
            raise BadInput(f"no runs under {runs_root}: run an experiment first, or pass --runs-root")
        dirs = [Path(p) for p in index["path"]]
    done = Exported()
    singles, sweeps = [], {}
    for d in dict.fromkeys(dirs):
        sweep = _sweep_of(d)
        if sweep is None:
            singles.append(d)
        else:
            sweeps.setdefault(sweep, []).append(d)
    with store_lock(tracking_uri), _mlflow_logs_quiet():  # one export at a time per store, from its schema on
        exporter = Exporter(tracking_uri)
        try:
            for d in singles:
                exporter.export_run(d, None, done)
            for sweep, jobs in sweeps.items():
                exporter.export_sweep(sweep, sorted(jobs, key=lambda j: (len(j.name), j.name)), done)
        except (OSError, exporter.mlflow.exceptions.MlflowException) as exc:  # an artifact that cannot be read or
            # written, a store that refuses a write: the run being written is left for the next export to complete
            message = one_line(exc, tracking_uri)
            raise BadInput(f"export stopped: {message}; {len(done.exported)} run(s) exported before it, the run it "
                           "was writing is completed by the next `tfmoe export mlflow`") from None
        done.experiments = dict(exporter.experiments)
    return done


@contextlib.contextmanager
def _mlflow_logs_quiet() -> Iterator[None]:
    """MLflow logs a refused database write with its traceback before raising it; the export says it in one line."""
    store = logging.getLogger("mlflow.store")
    before = store.level
    store.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        store.setLevel(before)


def report(done: Exported, tracking_uri: str) -> int:
    """Print what was exported; the exit code: 1 when a run was skipped as unreadable (one stderr line each: the
    export is incomplete, and a script should notice), else 0 (a run still running is said, not an error: export
    again once it ends)."""
    print(f"exported {len(done.exported)} run(s) ({len(done.sweeps)} sweep parent run(s)) to {tracking_uri}; "
          f"{len(done.already)} already there")
    if done.completed:
        print(f"completed {len(done.completed)} run(s) an earlier export had left half-written: "
              f"{', '.join(done.completed)}")
    if done.still_running:
        print(f"not exported, still running: {', '.join(done.still_running)}")
    for line in done.unreadable:
        print(f"not exported, unreadable: {line}", file=sys.stderr)
    if tracking_uri.startswith("sqlite:///"):
        print(f"browse: mlflow ui --backend-store-uri {tracking_uri}, then open "
              + ", ".join(f"http://127.0.0.1:5000/#/experiments/{i}/runs ({n})" for n, i in done.experiments.items()))
    return 1 if done.unreadable else 0

