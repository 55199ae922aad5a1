"""`tfmoe export mlflow`: copy finished runs into an MLflow tracking store (default ``sqlite:///mlflow.db``).

One MLflow experiment per tfmoe experiment; each run becomes an MLflow run with params (the flattened Hydra config),
metrics (metrics.parquet; tag columns folded into the name as ``name/tag:value``, steps kept), tags (``tfmoe.run_id``,
status, git commit, versions, device) and artifacts (the whole run directory: parquet files, PNGs, summary.md,
``.hydra/``). A sweep becomes a parent run (sweep.parquet and sweep plots as artifacts) with its jobs as child runs.
Runs are keyed by the ``tfmoe.run_id`` tag, so exporting again adds nothing; runs still ``running`` are left for a
later export. Everything goes through MLflow's own client, from this one process.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from tfmoe.errors import BadInput
from tfmoe.harness.store.notebook import effective_status, load_run, present, resolve_run
from tfmoe.harness.store.rundir import RUN_FILE, read_parquet
from tfmoe.status import Status

DEFAULT_URI = "sqlite:///mlflow.db"
# MLflow's run status for each finished tfmoe status (unexpected: every check passed, a prediction missed);
# a running run is not exported yet
MLFLOW_STATUS = {Status.OK: "FINISHED", Status.UNEXPECTED: "FINISHED", Status.FAILED: "FAILED", Status.ERROR: "FAILED",
                 Status.CRASHED: "FAILED", Status.LOST: "FAILED", Status.UNREADABLE: "FAILED",
                 Status.INTERRUPTED: "KILLED"}
ENV_TAGS = ["git_commit", "git_dirty", "python", "torch", "cuda", "cudnn", "numpy", "pandas", "pyarrow", "hydra",
            "device", "device_name", "dtype", "hostname", "platform"]
NOT_A_TAG = {"name", "value", "step", "measured"}
_BAD_NAME_CHARS = re.compile(r"[^\w./\- :]")
BATCH = 900  # MLflow takes at most 1000 metrics (and 100 params, 100 tags) per log_batch call


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
    still_running: list[str] = field(default_factory=list)
    sweeps: list[str] = field(default_factory=list)


def metric_key(name: str, tags: dict[str, Any]) -> str:
    """``loss`` with tags {variant: a, layer: 3} -> ``loss/variant:a/layer:3`` (MLflow's allowed characters only)."""
    key = str(name) + "".join(f"/{k}:{v}" for k, v in tags.items())
    return _BAD_NAME_CHARS.sub("_", key)[:250]


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


class Exporter:
    def __init__(self, tracking_uri: str) -> None:
        mlflow, client_cls = _mlflow()
        self.mlflow = mlflow
        try:
            self.client = client_cls(tracking_uri=tracking_uri)
        except Exception as exc:
            raise BadInput(f"cannot open MLflow tracking store {tracking_uri!r}: {exc}") from None
        self.artifact_root = _tracking_store(tracking_uri)
        self.experiments: dict[str, str] = {}
        self.known: dict[str, dict[str, str]] = {}  # experiment id -> tfmoe.run_id -> MLflow run id

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
            self.known[exp_id] = self._exported_runs(exp_id)
        return self.experiments[name]

    def _exported_runs(self, exp_id: str) -> dict[str, str]:
        from mlflow.entities import ViewType

        found, token = {}, None
        while True:
            page = self.client.search_runs([exp_id], run_view_type=ViewType.ALL, max_results=5000, page_token=token)
            for r in page:
                rid = r.data.tags.get("tfmoe.run_id")
                if rid:
                    found[rid] = r.info.run_id
            token = page.token
            if not token:
                return found

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

        data = load_run(run_dir)
        run = data.run
        rid, status = str(run["run_id"]), effective_status(run)  # a dead `running` run is `lost`
        if status == Status.RUNNING:
            done.still_running.append(rid)
            return None
        exp_id = self.experiment_id(str(run["experiment"]))
        if rid in self.known[exp_id]:
            done.already.append(rid)
            return self.known[exp_id][rid]
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
        created = self.client.create_run(exp_id, start_time=_ms(run.get("started_at")), tags=tags, run_name=rid)
        mid = created.info.run_id
        params = [Param(k[:250], v[:6000]) for k, v in flatten(_config(data)).items()]
        stamp = _ms(run.get("finished_at")) or _ms(run.get("started_at")) or 0
        metrics = []
        m = data.metrics
        tag_cols = [c for c in m.columns if c not in NOT_A_TAG]
        for row in m.to_dict("records"):
            if not present(row.get("value")):
                continue
            key = metric_key(row["name"], {c: row[c] for c in tag_cols if present(row.get(c)) and row[c] != ""})
            step = int(row["step"]) if present(row.get("step")) else 0
            metrics.append(Metric(key, float(row["value"]), stamp, step))
        self._log(mid, metrics=metrics, params=params)
        self.client.log_artifacts(mid, str(run_dir))
        self.client.set_terminated(mid, MLFLOW_STATUS.get(status, "FAILED"), end_time=_ms(run.get("finished_at")))
        self.known[exp_id][rid] = mid
        done.exported.append(rid)
        return mid

    def export_sweep(self, sweep_dir: Path, jobs: list[Path], done: Exported) -> None:
        from mlflow.entities import Param

        runs = [read_parquet(j / RUN_FILE).iloc[0] for j in jobs]
        experiment = str(runs[0]["experiment"])
        exp_id = self.experiment_id(experiment)
        sid = sweep_dir.name.removeprefix("multirun-")
        parent = self.known[exp_id].get(sid)
        if parent is None:
            statuses = {effective_status(r) for r in runs}
            starts = [t for t in (_ms(r["started_at"]) for r in runs) if t is not None]
            tags = {"tfmoe.run_id": sid, "tfmoe.sweep": "true", "tfmoe.experiment": experiment,
                    "tfmoe.path": str(sweep_dir.resolve()), "mlflow.runName": sweep_dir.name,
                    "tfmoe.status": Status.OK.value if statuses == {Status.OK} else ",".join(sorted(statuses))}
            created = self.client.create_run(exp_id, start_time=min(starts) if starts else None, tags=tags,
                                             run_name=sweep_dir.name)
            parent = created.info.run_id
            self._log(parent, params=[Param("sweep.jobs", str(len(jobs)))])
            for f in sorted(sweep_dir.iterdir()):
                if f.is_file() and (f.name == "sweep.parquet" or f.suffix == ".png" or f.name == "multirun.yaml"):
                    self.client.log_artifact(parent, str(f))
            self.known[exp_id][sid] = parent
            done.sweeps.append(sid)
        for job in jobs:
            self.export_run(job, parent, done)
        ends = [t for t in (_ms(r["finished_at"]) for r in runs) if t is not None]
        statuses = {effective_status(r) for r in runs}
        if Status.RUNNING not in statuses:
            worst = MLFLOW_STATUS[Status.OK] if statuses == {Status.OK} else MLFLOW_STATUS[Status.FAILED]
            self.client.set_terminated(parent, worst, end_time=max(ends) if ends else None)


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
    exporter = Exporter(tracking_uri)
    done = Exported()
    singles, sweeps = [], {}
    for d in dict.fromkeys(dirs):
        sweep = _sweep_of(d)
        if sweep is None:
            singles.append(d)
        else:
            sweeps.setdefault(sweep, []).append(d)
    for d in singles:
        exporter.export_run(d, None, done)
    for sweep, jobs in sweeps.items():
        exporter.export_sweep(sweep, sorted(jobs, key=lambda j: (len(j.name), j.name)), done)
    return done


def report(done: Exported, tracking_uri: str) -> None:
    print(f"exported {len(done.exported)} run(s) ({len(done.sweeps)} sweep parent run(s)) to {tracking_uri}; "
          f"{len(done.already)} already there")
    if done.still_running:
        print(f"not exported, still running: {', '.join(done.still_running)}")
    if tracking_uri.startswith("sqlite:///"):
        print(f"browse: mlflow ui --backend-store-uri {tracking_uri}")

