"""The notebook commands one step off the well-trodden runs (issue 24): diff with values missing on either side,
replay's verdict without machine measurements, show/diff/runs printing user text literally, failures add's
refusals. Real runs, real parquet, a real read-only mount."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.api.testing import run_cli
from tfmoe.harness.store import rundir

QUICK = ["n_heads=2", "min_run_time=0.002", "warmup=0", "peak_matmul_n=64", "n_layers=2", "vocab=100"]


@pytest.fixture(scope="module")
def complexity_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Two tiny complexity runs with different T (the card's "sweep over T and D, diff two runs"), in one root."""
    root = tmp_path_factory.mktemp("cx")
    a = run_cli(["complexity", "T=16", "D=16", *QUICK], root)
    b = run_cli(["complexity", "T=32", "D=16", *QUICK], root)
    assert a.exit_code == 0 and b.exit_code == 0, a.stderr + b.stderr
    return root, a.run_dir, b.run_dir


# ------------------------------------------------------------------------------------------------ diff
def test_diff_of_two_complexity_runs_exits_1_with_a_summary(complexity_runs) -> None:
    """Rows only one run has (its T is a tag) left rel_delta None: `abs()` of it was a traceback, exit 1."""
    root, a, b = complexity_runs
    r = run_cli(["diff", str(a), str(b)], root)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "config: 1 key(s) differ (T: 16 -> 32)" in r.stdout and "(only in A)" in r.stdout
    assert "differ: config, metrics, checks" in r.stdout and "Traceback" not in r.stdout + r.stderr
    body = json.loads(run_cli(["diff", str(a), str(b), "--format", "json"], root).stdout)
    assert body["differs"] and body["summary"]["metrics_differ"] > 0
    assert {m["name"] for m in body["metrics"]} >= {"flops_forward_block", "crossover_T"}
    assert run_cli(["diff", str(b), str(a), "--top", "3"], root).exit_code == 1  # the other way round
    same = run_cli(["diff", str(a), str(a)], root)
    assert same.exit_code == 0 and "no differences beyond tolerance" in same.stdout


def _plant(src: Path, dst: Path) -> Path:
    """A copy of ``src`` with a value missing (None/NaN) or absent in every column kind diff compares."""
    shutil.copytree(src, dst)
    m = pd.read_parquet(dst / "metrics.parquet")
    m.loc[m.index[0], "value"] = float("nan")  # a metric left empty
    rundir.write_parquet(m.drop(index=m.index[-1]), dst / "metrics.parquet")  # and one row absent
    c = pd.read_parquet(dst / "checks.parquet")
    c["passed"] = c["passed"].astype(object)
    c.loc[c.index[0], "passed"] = None  # a check not decided
    rundir.write_parquet(c.iloc[:-1], dst / "checks.parquet")  # and one check absent
    t = pd.read_parquet(dst / "tensors.parquet")
    rundir.write_parquet(t.iloc[1:], dst / "tensors.parquet", schema=rundir.TENSORS_SCHEMA)  # a tensor absent
    cfg = (dst / ".hydra" / "config.yaml").read_text()
    (dst / ".hydra" / "config.yaml").write_text(cfg.replace("seed:", "planted_key: null\nseed:"))
    return dst


def test_diff_handles_missing_values_on_either_side_of_every_column_kind(workdir: Path) -> None:
    a = run_cli(["shift-labels", "--expect", "loss < 100", "--expect", "loss_manual_fp64 > 0"], workdir).run_dir
    b = _plant(a, workdir / "planted")
    e = pd.read_parquet(b / rundir.EXPECTATIONS_FILE)
    e["held"] = e["held"].astype("boolean")
    e.loc[0, ["held", "observed"]] = [pd.NA, float("nan")]  # an expectation that could not be judged
    rundir.write_parquet(e.iloc[:1], b / rundir.EXPECTATIONS_FILE)  # and one absent
    for x, y in ((a, b), (b, a)):
        r = run_cli(["diff", str(x), str(y), "--format", "json"], workdir)
        assert r.exit_code == 1, r.stdout + r.stderr
        body = json.loads(r.stdout)
        assert [k["key"] for k in body["config"]] == ["planted_key"]
        assert len(body["metrics"]) == 2 and len(body["checks"]) == 2 and len(body["expectations"]) == 2
        assert [t["note"] for t in body["tensors"]] == ["only in " + ("A" if x == a else "B")]
        table = run_cli(["diff", str(x), str(y)], workdir)
        assert table.exit_code == 1 and "differ: config, metrics, checks, expectations, tensors" in table.stdout
    assert run_cli(["diff", str(b), str(b)], workdir).exit_code == 0  # missing on both sides is the same


# ------------------------------------------------------------------------------------------------ replay
def test_replay_of_a_complexity_run_reproduces_and_lists_measurements_as_context(complexity_runs) -> None:
    """load average, peak FLOP/s, timings_plausible and times move between runs: context, never the verdict."""
    root, a, _ = complexity_runs
    r = run_cli(["replay", str(a)], root)
    assert r.exit_code == 0, r.stdout
    assert r.stdout.rstrip().endswith("reproduced") and "NOT" not in r.stdout
    assert "context, not judged" in r.stdout


def test_replay_says_not_reproduced_when_a_result_moved(complexity_runs) -> None:
    """A planted change in a non-timing metric and in a check of the recorded run: the rerun differs."""
    root, a, _ = complexity_runs
    old = root / "planted"
    shutil.copytree(a, old)
    m = pd.read_parquet(old / "metrics.parquet")
    m.loc[m["name"] == "flops_forward_block", "value"] += 1
    m.loc[m["name"] == "load_average_1min", "value"] += 5  # a measurement: still context
    rundir.write_parquet(m, old / "metrics.parquet")
    c = pd.read_parquet(old / "checks.parquet")
    c.loc[c.index[0], "passed"] = False
    rundir.write_parquet(c, old / "checks.parquet")
    r = run_cli(["replay", str(old)], root)
    assert r.exit_code == 1 and "NOT reproduced" in r.stdout
    assert "differ: metrics, checks" in r.stdout and "flops_forward_block" in r.stdout
    assert "differ: 1 of" in r.stdout  # only the planted metric row, not the measured ones


def test_machine_measurements_are_declared_once_in_data() -> None:
    from tfmoe.harness.method.declared_metrics import DECLARED, MEASURED, measured_for

    assert {"load_average_1min", "matmul_peak_flops", "timings_plausible", "time_ms"} <= measured_for("complexity")
    assert "activation_bytes_saved_measured" not in measured_for("complexity")  # saved-tensor bytes: a result
    for experiment, names in MEASURED.items():  # every declared measurement is a metric the experiment records
        assert names <= set(DECLARED.get(experiment, {})) | {"matrix_wall_s", "layer.battery_s"}, experiment
    assert "matrix_wall_s" in measured_for("attn-check")  # literal rec.metric(..., measured=True) counts too


# ------------------------------------------------------------------------------------------------ show/diff/runs text
def test_show_diff_runs_print_the_users_text_literally_never_as_rich_markup(request: pytest.FixtureRequest) -> None:
    """`expect: cli1: tokens_per_text[text=1] == 3` showed as `… tokens_per_text == 3`: rich read `[text=1]` as
    markup. Likewise a runs root whose path holds `[bold]`. The root sits at a short path: under pytest-xdist
    tmp_path is longer (popen-gwN/), and show's title folds a long run path past `[bold]lab`."""
    where = Path(tempfile.mkdtemp(prefix="t")) / "[bold]lab"
    where.mkdir()
    request.addfinalizer(lambda: shutil.rmtree(where.parent, ignore_errors=True))
    ran = run_cli(["shift-labels", "--expect", "sequence_loss[sequence=1] < 100"], where)
    assert ran.exit_code == 0, ran.stderr
    assert f"run directory: {ran.run_dir}" in ran.stdout.replace("\n", "")
    shown = run_cli(["show", str(ran.run_dir), "--full-width"], where)  # each cell whole, on one line
    assert "cli1: sequence_loss[sequence=1] < 100" in shown.stdout  # the config as recorded
    assert "sequence_loss[sequence=1]" in shown.stdout.split("expectations")[1]  # and its table
    assert "[bold]lab" in shown.stdout
    listed = run_cli(["runs", "--runs-root", str(where / "runs")], where)
    assert listed.exit_code == 0 and "[bold]lab" in listed.stdout and "sequence_loss[sequence=1]" in listed.stdout
    differ = run_cli(["diff", str(ran.run_dir), str(ran.run_dir)], where)
    assert differ.exit_code == 0 and "[bold]lab" in differ.stdout


# ------------------------------------------------------------------------------------------------ failures add
TESTS_PY = "import pytest\n\n\n@pytest.mark.parametrize('x', [1])\ndef test_y(x):\n    pass\n\n\nclass TestK:\n" \
           "    def test_m(self):\n        pass\n"


@pytest.fixture
def failed_run(workdir: Path) -> Path:
    """A real `unexpected` run (an expectation that misses; a settings typo writes no run since issue 24) and a
    tests/ folder with real test names."""
    bad = run_cli(["shift-labels", "--expect", "valid_labels < 0"], workdir)
    assert bad.exit_code == 4 and bad.run_dir is not None
    (workdir / "tests").mkdir()
    (workdir / "tests" / "test_x.py").write_text(TESTS_PY)
    return bad.run_dir


def test_check_test_nodes_accepts_real_nodes_and_prose_and_refuses_missing_ones(workdir: Path) -> None:
    from tfmoe.contract.errors import BadInput
    from tfmoe.harness.method.failures import check_test_nodes

    (workdir / "tests").mkdir()
    (workdir / "tests" / "test_x.py").write_text(TESTS_PY)
    for ok in ("tests/test_x.py::test_y", "tests/test_x.py::test_y[1]", "tests/test_x.py::TestK::test_m",
               "tests/test_x.py", "`tests/test_x.py::test_y` and `tests/test_x.py::TestK` (planted: …)",
               "none yet", "none can make a noisy machine quiet"):
        check_test_nodes(ok, [workdir])
    for bad, needle in (("tests/test_x.py::test_nope", "defines no test 'test_nope'"),
                        ("tests/test_x.py::TestK::test_nope", "defines no test 'test_nope'"),
                        ("tests/test_x.py::test_m", "defines no test 'test_m'"),  # a method is not top-level
                        ("tests/test_x.py::test_y::inner", "defines no test 'inner'"),
                        ("tests/test_route_sim.py::test_x", "no file tests/test_route_sim.py"),
                        ("`tests/test_x.py::test_y`, `tests/test_x.py::test_z`", "'test_z'")):
        with pytest.raises(BadInput, match=needle):
            check_test_nodes(bad, [workdir])


def test_failures_add_refuses_a_missing_test_and_a_run_already_logged(failed_run: Path, workdir: Path) -> None:
    log = workdir / "failures.md"
    r = run_cli(["failures", "add", str(failed_run), "--test", "tests/test_x.py::test_x"], workdir)
    assert r.exit_code == 2 and "defines no test 'test_x'" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not log.exists()  # nothing written
    r = run_cli(["failures", "add", str(failed_run), "--test", "tests/test_x.py::test_y[1]"], workdir)
    assert r.exit_code == 0 and "F-1" in r.stdout
    before = log.read_text()
    again = run_cli(["failures", "add", failed_run.name, "--test", "tests/test_x.py::test_y"], workdir)
    assert again.exit_code == 2 and f"run {failed_run.name} is already logged as F-1" in again.stderr
    assert "--again" in again.stderr and log.read_text() == before
    r = run_cli(["failures", "add", str(failed_run), "--again"], workdir)
    assert r.exit_code == 0 and "F-2" in r.stdout and log.read_text().startswith(before)


def test_failures_log_cannot_be_forged_by_a_field(failed_run: Path, workdir: Path) -> None:
    """Issue 29 item 6: a newline and a heading inside --hypothesis made a forged F-999 (the next entry F-1000);
    ESC and U+202E were kept verbatim; empty fields were accepted."""
    log = workdir / "failures.md"
    r = run_cli(["failures", "add", str(failed_run), "--hypothesis", "x\n## F-999: fake heading",
                 "--fix", "a\r\n\n## F-1000: another"], workdir)
    assert r.exit_code == 0 and "F-1:" in r.stdout, r.stdout + r.stderr
    text = log.read_text()
    assert "\n## F-999" not in text and "- **Hypothesis**: x ## F-999: fake heading\n" in text
    listed = run_cli(["failures", "list"], workdir).stdout.splitlines()
    assert [ln.split(":")[0] for ln in listed] == ["F-1"], listed
    again = run_cli(["failures", "add", str(failed_run), "--again"], workdir)
    assert again.exit_code == 0 and "F-2:" in again.stdout  # numbered from real entries only
    before = log.read_text()
    for option, value, said in (("--hypothesis", "\x1b[31mred", "U+001B"), ("--fix", "ok \u202egnp.exe", "U+202E"),
                                ("--title", "a\u2066b", "U+2066"), ("--fix", "", "--fix is empty"),
                                ("--test", " \n ", "--test is empty"), ("--hypothesis", "\x00", "U+0000")):
        r = run_cli(["failures", "add", str(failed_run), "--again", option, value], workdir)
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and said in lines[0], (option, value, r.stderr)
        assert log.read_text() == before  # nothing written
    ok = run_cli(["failures", "add", str(failed_run), "--again", "--hypothesis", "emoji 👩‍🔬 and 我 stay"], workdir)
    assert ok.exit_code == 0 and "emoji 👩‍🔬 and 我 stay" in log.read_text()


def test_an_old_forged_heading_inside_a_field_is_not_an_entry() -> None:
    from tfmoe.harness.method.failures import ENTRY_RE, run_text

    old = "# Failures log\n\n## F-1: real\n\n- **Hypothesis**: x\n## F-999: forged\n- **Fix**: y\n\n## F-2: real too\n"
    assert [n for n, _ in ENTRY_RE.findall(old)] == ["1", "2"]
    assert ENTRY_RE.findall("## F-7: first line of a file\n") == [("7", "first line of a file")]
    assert run_text("detail\n## F-5: x \x1b[2J \u202e") == "detail ## F-5: x \\x1b[2J \\u202e"


@pytest.fixture
def read_only_mount(tmp_path: Path):
    """A real read-only file system: a tmpfs filled, then remounted read-only (root's chmod would not stop writes).
    Yields (the mount point, a function that fills it before it turns read-only)."""
    import subprocess

    point = tmp_path / "ro"
    point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(point)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")

    def seal() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)

    try:
        yield point, seal
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_failures_add_and_conclude_on_a_read_only_file_system_exit_2_in_one_line(failed_run: Path, workdir: Path,
                                                                                  read_only_mount) -> None:
    """Read-only runs/ and failures.md: a filelock traceback and exit 1 before; one line naming the path now."""
    point, seal = read_only_mount
    shutil.copytree(workdir / "runs", point / "runs")
    shutil.copytree(workdir / "tests", point / "tests")
    (point / "failures.md").write_text("# Failures log\n")
    seal()
    r = run_cli(["failures", "add", failed_run.name, "--test", "tests/test_x.py::test_y"], point)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"cannot write {point / 'failures.md'}.lock: Read-only file system" in r.stderr
    r = run_cli(["failures", "add", failed_run.name, "--file", str(point / "failures.md")], workdir)
    assert r.exit_code == 2 and "Read-only file system" in r.stderr  # the log alone read-only
    r = run_cli(["conclude", failed_run.name, "--proven", "valid_labels is never negative"], point)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "cannot write" in r.stderr and "conclusions.parquet" in r.stderr and "Read-only file system" in r.stderr
    assert (point / "failures.md").read_text() == "# Failures log\n"


# ------------------------------------------------------------------ issue 29, item 5: damaged runs say what is damaged
@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The catalog takes every directory as settled (its racy window, catalog.RACY_S, set to 0): a run directory
    that lost its run.parquet a moment ago is then one already (in use, after RACY_S seconds)."""
    from tfmoe.harness.store import catalog

    monkeypatch.setattr(catalog, "RACY_S", 0.0)


def test_a_run_without_run_parquet_is_listed_unreadable_not_dropped(fake_experiment, settled) -> None:
    from tfmoe.api.testing import launched

    _, (gone,) = launched(fake_experiment, [])
    _, (kept,) = launched(fake_experiment, ["seed=1"])
    root = gone.parents[1]
    assert run_cli(["runs", "--runs-root", str(root)], root.parent).exit_code == 0  # the catalog holds both as ok
    (gone / rundir.RUN_FILE).unlink()
    for fresh in (False, True):  # a catalog that knew the run, and one built afresh
        if fresh:
            (root / ".tfmoe-catalog.sqlite3").unlink()
        listing = json.loads(run_cli(["runs", "--format", "json", "--runs-root", str(root)], root.parent).stdout)
        assert {r["run_id"]: r["status"] for r in listing} == {gone.name: "unreadable", kept.name: "ok"}, listing
        sql = run_cli(["sql", "SELECT run_id, status FROM runs ORDER BY status", "--format", "json",
                       "--runs-root", str(root)], root.parent)
        assert json.loads(sql.stdout) == [{"run_id": kept.name, "status": "ok"},
                                          {"run_id": gone.name, "status": "unreadable"}], sql.stdout + sql.stderr
        assert "run.parquet is missing" in sql.stderr
    show = run_cli(["show", gone.name, "--runs-root", str(root)], root.parent)
    assert show.exit_code == 2 and "run.parquet is missing" in show.stderr and len(show.stderr.splitlines()) == 1


def test_a_missing_config_is_named_and_never_counted_as_a_difference(fake_experiment, capsys) -> None:
    from tfmoe.api.testing import launched
    from tfmoe.harness.launching.launch import replay

    _, (a,) = launched(fake_experiment, [])
    _, (b,) = launched(fake_experiment, [])
    (a / ".hydra" / "config.yaml").unlink()
    root = a.parents[1]
    show = run_cli(["show", str(a), "--runs-root", str(root)], root.parent)
    assert show.exit_code == 0 and "config missing" in show.stdout, show.stdout
    d = run_cli(["diff", str(a), str(b), "--runs-root", str(root)], root.parent)
    assert "config missing in A" in d.stdout and "key(s) differ" not in d.stdout, d.stdout
    assert d.exit_code == 0, d.stdout  # nothing that was compared differs (timings aside)
    capsys.readouterr()
    assert replay(str(a), root) == 0
    out = capsys.readouterr().out
    assert "config missing in A" in out and out.rstrip().endswith("reproduced"), out


def test_replay_of_an_interrupted_original_says_so(fake_experiment, capsys) -> None:
    from tfmoe.api.testing import launched
    from tfmoe.harness.launching.launch import replay

    with pytest.raises(KeyboardInterrupt):
        launched(fake_experiment, ["mode=interrupt"])
    (old,) = [p.parent for p in Path("runs").glob("fake/*/run.parquet")]
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):  # the replay is interrupted the same way (same config)
        replay(str(old), Path("runs"))
    lost = launched(fake_experiment, [])[1][0]
    frame = rundir.read_parquet(lost / rundir.RUN_FILE)
    frame["status"] = "running"
    frame["pid"] = 2**22 + 12345  # no such process: `lost`
    frame.to_parquet(lost / rundir.RUN_FILE)
    capsys.readouterr()
    code = replay(str(lost), Path("runs"))
    out = capsys.readouterr().out
    assert "was lost" in out and ("NOT comparable" in out or "as far as the original went" in out), out
    assert code in (0, 1)


def test_export_warns_about_each_run_it_skipped_and_exits_1(fake_experiment, settled, tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from tfmoe.api.testing import launched

    _, (gone,) = launched(fake_experiment, [])
    _, (kept,) = launched(fake_experiment, ["seed=1"])
    (gone / rundir.RUN_FILE).unlink()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    r = run_cli(["export", "mlflow", "--tracking-uri", uri, "--runs-root", "runs"], tmp_path)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "exported 1 run(s)" in r.stdout and f"not exported, unreadable: {gone.name}" in r.stderr, r.stderr


# ------------------------------------------------------------------ issue 29, item 8: diff's headline, show's width
def test_a_metric_that_only_scales_with_a_changed_coefficient_is_not_the_headline(fake_experiment) -> None:
    """aux_loss_coef 0.01 -> 0.1 headlined balance_loss +900 % (the loss includes its coefficient): such rows are
    marked `scales with the config` and the headline is left to the changes that are not."""
    from tfmoe.api.testing import launched

    _, (a,) = launched(fake_experiment, ["coef=0.01"])
    _, (b,) = launched(fake_experiment, ["coef=0.1"])
    r = run_cli(["diff", str(a), str(b)], a.parents[2])
    assert "scales with the config, not headlined: scaled_loss (5 row(s), coef 0.01 -> 0.1: x10)" in r.stdout, r.stdout
    assert "largest: scaled_loss" not in r.stdout and r.exit_code == 1  # it is still a difference
    body = json.loads(run_cli(["diff", str(a), str(b), "--format", "json"], a.parents[2]).stdout)
    assert body["summary"]["largest_metric_changes"] == []
    assert {m["scaled_by"] for m in body["metrics"] if m["name"] == "scaled_loss"} == {"coef 0.01 -> 0.1: x10"}


def test_the_headline_ranks_series_by_where_they_end() -> None:
    """route-sim's case: every strategy's balance_loss x10 (`none` never trains on it), aux_loss's CV moves a
    little at its last step, the per-step rows of one series must not fill the headline."""
    import pandas as pd

    from tfmoe.harness.reading.reports import _headline, _mark_scaled

    config = pd.DataFrame([{"key": "aux_loss_coef", "A": "0.01", "B": "0.1", "differs": True}])
    rows = [{"name": "balance_loss", "step": s, "tags": f"strategy={st}", "A": 0.025 * (s + 1),
             "B": 0.25 * (s + 1) * (1 if st == "none" else 0.97), "differs": True} for s in range(3)
            for st in ("none", "aux_loss")]
    rows += [{"name": "cv", "step": s, "tags": "strategy=aux_loss", "A": 1.022 + s, "B": (0.998 if s == 2 else 5.0) + s,
              "differs": True} for s in range(3)]
    for r in rows:
        r["rel_delta"] = (r["B"] - r["A"]) / abs(r["A"])
    marked = _mark_scaled(pd.DataFrame(rows), config)
    assert set(marked[marked["scaled_by"] != ""]["tags"]) == {"strategy=none"}  # only exact x10 rows
    head = _headline(marked[marked["scaled_by"] == ""])
    assert list(zip(head["name"], head["step"], strict=True)) == [("balance_loss", 2), ("cv", 2)]  # one per series
    assert _headline(marked.iloc[0:0]).empty


def test_show_fits_a_sensible_width_when_not_a_terminal(fake_experiment, monkeypatch) -> None:
    """`show RUN > file` wrote lines up to 2,799 characters; now 120 wide unless --full-width (or COLUMNS)."""
    from tfmoe.api.testing import launched

    _, (run,) = launched(fake_experiment, ["mode=fail_check"])
    checks = rundir.read_parquet(run / "checks.parquet")
    checks["detail"] = "a user's exception text, as long as they come: " + "word " * 60  # 350 characters
    rundir.write_parquet(checks, run / "checks.parquet", schema=rundir.CHECKS_SCHEMA)
    monkeypatch.delenv("COLUMNS", raising=False)
    narrow = run_cli(["show", str(run)], run.parents[2])
    assert narrow.exit_code == 0 and max(len(line) for line in narrow.stdout.splitlines()) <= 120, narrow.stdout
    full = run_cli(["show", str(run), "--full-width"], run.parents[2])
    assert max(len(line) for line in full.stdout.splitlines()) > 120
    monkeypatch.setenv("COLUMNS", "90")
    assert max(len(line) for line in run_cli(["show", str(run)], run.parents[2]).stdout.splitlines()) <= 90
