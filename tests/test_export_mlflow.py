"""`tfmoe export mlflow`: a real export into a sqlite MLflow store, read back with MLflow's own client."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tfmoe.errors import BadInput
from tfmoe.harness.launching import launch
from tfmoe.harness.reading import export_mlflow
from tfmoe.testing import launched, run_cli


def test_metric_names_fold_tags_into_allowed_characters() -> None:
    assert export_mlflow.metric_key("loss", {"variant": "a", "layer": 3}) == "loss/variant:a/layer:3"
    assert export_mlflow.metric_key("cv", {"router": "top[2]=x"}) == "cv/router:top_2__x"
    assert export_mlflow.metric_key("x", {}) == "x"


def test_without_the_extra_the_command_exits_2_naming_it(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError, as when it is not installed
    r = run_cli(["export", "mlflow"], workdir)
    assert r.exit_code == 2 and "optional extra `mlflow`" in r.stderr and r.stderr.count("\n") == 1


def test_export_reads_back_with_mlflows_client_and_is_idempotent(fake_experiment) -> None:
    mlflow = pytest.importorskip("mlflow")
    from mlflow.entities import ViewType

    made = {}
    for label, args, multirun in (("ok", ["seed=3"], False), ("failed", ["mode=fail_check"], False),
                                  ("sweep", ["seed=1,2"], True)):
        made[label] = launched(fake_experiment, args, multirun)[1]
    made["interrupted"] = []
    with pytest.raises(KeyboardInterrupt):
        launch.run_experiment(fake_experiment, ["mode=interrupt"], quiet=True, made=made["interrupted"])
    uri = f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    r = run_cli(["export", "mlflow", "--tracking-uri", uri], Path.cwd())
    assert r.exit_code == 0, r.stderr
    assert "exported 5 run(s) (1 sweep parent run(s))" in r.stdout

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("fake")
    runs = {x.data.tags["tfmoe.run_id"]: x for x in client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL)}
    assert len(runs) == 6  # ok, failed, interrupted, the 2 sweep jobs, and the sweep parent
    ok = runs[made["ok"][0].name]
    assert ok.info.status == "FINISHED" and ok.data.params["seed"] == "3" and ok.data.params["steps"] == "5"
    assert ok.data.tags["tfmoe.status"] == "ok" and ok.data.tags["tfmoe.torch"].startswith("2.")
    assert ok.data.tags["tfmoe.device"] == "cpu" and ok.data.tags["tfmoe.checks"] == "1/1"
    history = client.get_metric_history(ok.info.run_id, "loss/variant:a")
    assert sorted(m.step for m in history) == [0, 1, 2, 3, 4] and all(m.value > 0 for m in history)
    artifacts = {a.path for a in client.list_artifacts(ok.info.run_id)}
    assert {"run.parquet", "metrics.parquet", "checks.parquet", "tensors.parquet", "summary.md", ".hydra"} <= artifacts
    assert {a.path for a in client.list_artifacts(ok.info.run_id, ".hydra")} >= {".hydra/config.yaml"}
    assert runs[made["failed"][0].name].info.status == "FAILED"
    assert runs[made["interrupted"][0].name].info.status == "KILLED"
    sweep_dir = made["sweep"][0].parent
    parent = runs[sweep_dir.name.removeprefix("multirun-")]
    assert parent.data.tags["tfmoe.sweep"] == "true"
    assert "sweep.parquet" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    children = [x for x in runs.values() if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(c.data.params["seed"] for c in children) == ["1", "2"]

    again = run_cli(["export", "mlflow", "--tracking-uri", uri], Path.cwd())
    assert again.exit_code == 0 and "exported 0 run(s)" in again.stdout
    assert len(client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL)) == 6


def test_bad_refs_and_empty_roots_are_bad_input(workdir: Path) -> None:
    pytest.importorskip("mlflow")
    with pytest.raises(BadInput, match="no runs"):
        export_mlflow.export([], workdir / "runs", f"sqlite:///{workdir / 'm.db'}")
    r = run_cli(["export", "mlflow", "nosuchrun"], workdir)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_mlflow_ui_shows_an_exported_runs_metrics_in_headless_chromium(fake_experiment) -> None:
    """`mlflow ui --backend-store-uri sqlite:///mlflow.db` (docs/notebook-at-scale.md) on localhost, the run's page read by Debian's
    chromium (installed by scripts/chromium-up.sh) with the page's JavaScript run."""
    import subprocess
    import time
    import urllib.request

    mlflow = pytest.importorskip("mlflow")
    repo = Path(__file__).resolve().parents[1]
    browser = subprocess.run(["bash", str(repo / "scripts" / "chromium-up.sh")], capture_output=True, text=True)
    assert browser.returncode == 0, f"scripts/chromium-up.sh could not provide chromium: {browser.stderr[-800:]}"
    chromium = browser.stdout.strip().splitlines()[-1]

    run_dir = launched(fake_experiment, ["seed=5"])[1][-1]
    assert run_cli(["export", "mlflow"], Path.cwd()).exit_code == 0  # the default: ./mlflow.db
    client = mlflow.tracking.MlflowClient(tracking_uri="sqlite:///mlflow.db")
    exp = client.get_experiment_by_name("fake")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`tfmoe.run_id` = '{run_dir.name}'")
    port = _free_port()
    ui = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "ui", "--backend-store-uri",
                           "sqlite:///mlflow.db", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(180):
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=2).read() == b"OK":
                    break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("mlflow ui did not answer /health within 3 minutes")
        page = f"{base}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}"
        dom = ""
        for _ in range(3):  # the first load of a cold UI can time out on a loaded machine
            dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                  "--virtual-time-budget=30000", "--dump-dom", page],
                                 capture_output=True, text=True, timeout=240).stdout
            if "loss/variant:a" in dom:
                break
        assert run_dir.name in dom  # the run's name on its page
        assert "loss/variant:a" in dom and "sums_per_call" in dom  # its metrics, rendered by the UI
    finally:
        import os
        import signal

        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=30)
