"""Every notebook command on every experiment's runs (issue 24, item 1), generated from the registry.

For each experiment in ``tfmoe.contract.registry.EXPERIMENTS``: one run of its config and a 2-job sweep over a key of its own
(both with the experiment's QUICK size overrides in the default suite; the true default config in a `slow` test).
On those runs: ``show`` (every format), ``diff`` (the two sweep jobs; a run against itself), ``export mlflow``
(one tmp sqlite store), ``sql`` (each view), ``failures add`` (a tmp file), ``conclude`` and, slow-marked (each
makes new runs), ``replay``, the true default config and ``claims --run`` for the experiment's claims. Expected: no traceback, the documented exit code and
output naming what differs or what was written. The runs are built once per experiment and module.

A new experiment must add its entry to CASES (the test for it fails loudly until it does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tfmoe.api.testing import CliResult, run_cli
from tfmoe.contract.registry import EXPERIMENTS


@dataclass(frozen=True)
class Case:
    quick: tuple[str, ...]  # size overrides that keep the default suite fast (empty: the default config is fast)
    sweep: str  # KEY=A,B: the 2-job sweep over a key of the experiment's own
    expect: str  # a metric the experiment records without tags: the sweep's jobs predict it wrongly (exit 4),
    #              so `failures add` has a surprising run to log


CASES: dict[str, Case] = {
    "tokenize": Case(("tokenizers=[bytes,chars]", "extras=[]"), "digit_run_max=5,10", "chars"),
    "attn-check": Case(("chunked.probe_T=256", "chunked.probe_block_size=16", "chunked.timing_repeats=1",
                        "dropout_samples=20000", "gradcheck_T=2", "chunked.memory_ratio_max=0.35"),
                       "T=4,5", "future_weight_max"),
    "arch": Case((), "n_layers=1,2", "visibility_tol"),
    "block-stats": Case(("n_layers=2", "batch_size=2", "seq_len=8", "d_model=32"), "n_layers=2,3", "shared_param_fraction"),
    "shift-labels": Case((), "pad_side=right,left", "loss"),
    "decode": Case(("d_model=32", "n_heads=4", "n_layers=1", "train_steps=60", "batch_size=8", "block_size=32",
                    "lr=1e-2", "max_new_tokens=20", "check_tokens=16", "chi2_draws=4000", "timing_lengths=[8,24]",
                    "timing_repeats=1", "max_len=64", "beam_width=3"), "temperature=0.7,0.9", "train_loss"),
    "route-sim": Case(("steps=6", "train_tokens=64"), "top_k=1,2", "cv"),
    "complexity": Case(("T=32", "D=16", "n_heads=2", "min_run_time=0.002", "warmup=0", "peak_matmul_n=64",
                        "n_layers=2", "vocab=100"), "T=16,32", "params_moe_total_built"),
}

# Cases known to fail, each with why: a strict xfail, so a fix shows up as a pass to remove from here. The three that
# stood here (diff and replay of complexity jobs, tokenize's MLflow names) pass since issue 24's fixes landed.
KNOWN: dict[tuple[str, str], str] = {}  # (command, experiment) -> why a case is a strict xfail; none today

NAMES = list(EXPERIMENTS)


def _case(name: str) -> Case:
    if name not in CASES:
        raise AssertionError(f"experiment {name!r} has no entry in tests/test_notebook_cross_product.py CASES: give "
                             "it its quick size overrides, a sweep KEY=A,B over a key of its own and a metric")
    return CASES[name]


def _params(command: str) -> list:
    return [pytest.param(n, id=n, marks=[pytest.mark.xfail(strict=True, reason=KNOWN[(command, n)])]
                         if (command, n) in KNOWN else []) for n in NAMES]


def _clean(r: CliResult, codes: tuple[int, ...] = (0,)) -> CliResult:
    assert r.exit_code in codes, f"exit {r.exit_code}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


@dataclass
class Runs:
    cwd: Path
    single: Path  # a run of the config
    jobs: list[Path]  # the sweep's two job directories


BUILT: dict[str, Runs] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cross")


def _expectation(name: str, case: Case) -> list[str]:
    if not case.expect:
        return []
    return ["--expect", f"{case.expect} < -1e300"]  # never holds: a surprising run


def build(name: str, root: Path) -> Runs:
    """One run and one 2-job sweep of ``name`` (cached for the module)."""
    if name not in BUILT:
        case = _case(name)
        cwd = root / name
        cwd.mkdir()
        single = _clean(run_cli([name, *case.quick], cwd))
        assert single.run_dir is not None
        expect = _expectation(name, case)
        sweep = _clean(run_cli([name, "-m", *case.quick, case.sweep, *expect], cwd), (4,) if expect else (0,))
        jobs = sorted(p.parent for p in (cwd / "runs" / EXPERIMENTS[name].name).glob("multirun-*/*/run.parquet"))
        assert len(jobs) == 2, (jobs, sweep.stdout)
        BUILT[name] = Runs(cwd, single.run_dir, jobs)
    return BUILT[name]


def _all_runs(runs: Runs) -> list[Path]:
    from tfmoe.harness.store.notebook import find_runs

    return [p if p.is_absolute() else runs.cwd / p for p in find_runs(runs.cwd / "runs")]


def test_every_experiment_has_a_case() -> None:
    missing = sorted(set(EXPERIMENTS) - set(CASES))
    assert not missing, f"add these experiments to CASES: {missing}"
    stale = sorted(set(CASES) - set(EXPERIMENTS))
    assert not stale, f"CASES names experiments the registry lacks: {stale}"


@pytest.mark.parametrize("name", _params("show"))
def test_show_every_format(name: str, root: Path) -> None:
    runs = build(name, root)
    from tfmoe.harness.store.notebook import load_run

    for run in (runs.single, runs.jobs[1]):
        run_id = str(load_run(run).run["run_id"])
        for fmt in ("table", "md", "json"):
            r = _clean(run_cli(["show", str(run), "--format", fmt], runs.cwd))
            assert run_id in r.stdout, (fmt, r.stdout[:500])
            if fmt == "json":
                assert json.loads(r.stdout)["run"]["run_id"] == run_id


@pytest.mark.parametrize("name", _params("diff_self"))
def test_diff_a_run_against_itself_is_exit_0(name: str, root: Path) -> None:
    runs = build(name, root)
    _clean(run_cli(["diff", str(runs.single), str(runs.single)], runs.cwd), (0,))


@pytest.mark.parametrize("name", _params("diff_jobs"))
def test_diff_the_two_sweep_jobs_names_the_swept_key(name: str, root: Path) -> None:
    runs = build(name, root)
    key = _case(name).sweep.split("=")[0]
    for fmt in ("table", "json"):
        r = _clean(run_cli(["diff", str(runs.jobs[0]), str(runs.jobs[1]), "--format", fmt], runs.cwd), (1,))
        assert key in r.stdout, r.stdout[:2000]


@pytest.mark.slow  # a fresh run per experiment: kept out of the default suite's 3-minute budget
@pytest.mark.parametrize("name", _params("replay"))
def test_replay_reproduces(name: str, root: Path) -> None:
    runs = build(name, root)
    r = _clean(run_cli(["replay", str(runs.single)], runs.cwd), (0,))
    assert "reproduced" in r.stdout and "NOT reproduced" not in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("name", _params("export"))
def test_export_mlflow_into_a_tmp_store(name: str, root: Path) -> None:
    runs = build(name, root)
    store = f"sqlite:///{root / 'mlflow.db'}"  # one store for every experiment: MLflow creates its schema once
    n = len(_all_runs(runs))  # the run, the sweep's two jobs and any replay
    r = _clean(run_cli(["export", "mlflow", "--tracking-uri", store], runs.cwd))
    assert f"exported {n} run(s) (1 sweep parent run(s))" in r.stdout and store in r.stdout, r.stdout
    again = _clean(run_cli(["export", "mlflow", "--tracking-uri", store], runs.cwd))
    assert "exported 0 run(s)" in again.stdout and f"{n} already there" in again.stdout, again.stdout


@pytest.mark.parametrize("name", _params("sql"))
def test_sql_every_view(name: str, root: Path) -> None:
    from tfmoe.harness.reading.sql import FILE_VIEWS
    from tfmoe.harness.store.notebook import load_run

    runs = build(name, root)
    ids = [str(load_run(d).run["run_id"]) for d in _all_runs(runs)]
    listed = _clean(run_cli(["sql", "SELECT run_id, status FROM runs ORDER BY run_id", "--format", "json"],
                            runs.cwd))
    assert sorted(r["run_id"] for r in json.loads(listed.stdout)) == sorted(ids)
    for view in FILE_VIEWS:
        for fmt in ("table", "json", "csv"):
            r = _clean(run_cli(["sql", f"SELECT run_id, count(*) AS n FROM {view} GROUP BY run_id", "--format", fmt],
                               runs.cwd))
            if fmt == "json" and view in ("metrics", "checks"):  # every experiment records metrics and checks
                assert sorted(row["run_id"] for row in json.loads(r.stdout)) == sorted(ids), (view, r.stdout)
    _sql_prints_every_column_as_pandas_did(runs.cwd / "runs")


def _sql_prints_every_column_as_pandas_did(runs_root: Path) -> None:
    """Every column of every view of this experiment's runs: the same table cells, JSON and CSV that `tfmoe sql`
    printed through pandas (its tag columns, lists and timestamps included), and the CLI prints that text."""
    from sql_pandas_oracle import pandas_texts, tfmoe_texts

    from tfmoe.harness.reading.sql import FILE_VIEWS, connect

    for view in ("runs", *FILE_VIEWS):
        query = f"SELECT * FROM {view} ORDER BY ALL"
        con = connect(runs_root, query)
        try:
            expected = pandas_texts(con, query)
            assert tfmoe_texts(con, query) == expected, view
        finally:
            con.close()
        printed = _clean(run_cli(["sql", query, "--format", "csv", "--runs-root", str(runs_root)], runs_root.parent))
        assert printed.stdout == expected["csv"], view


def test_sql_views_extended_run_by_run_print_as_rebuilt(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every experiment's runs copied one at a time, oldest first, into a new runs root: after each, every view
    prints what a catalog built afresh prints (test_sql_extended_views.rebuilt), and each view was extended from
    its kept file (kept_views.view's Extension) rather than rebuilt at least once for every experiment's runs."""
    import shutil

    from test_sql_extended_views import VIEWS, printed, rebuilt

    from tfmoe.harness.reading import sql
    from tfmoe.harness.store import catalog, kept_views
    from tfmoe.harness.store.notebook import read_run_row

    monkeypatch.setattr(catalog, "RACY_S", 0.0)
    extended: list[tuple[str, str]] = []  # (experiment of the run just copied, catalog view extended)
    real = kept_views._extensible
    copying = [""]

    def spy(conn: object, runs_root: Path, view: str, *args: object) -> object:
        found = real(conn, runs_root, view, *args)
        if found is not None:
            extended.append((copying[0], view))
        return found

    monkeypatch.setattr(kept_views, "_extensible", spy)
    runs = sorted((read_run_row(d)["started_at"], str(d.relative_to(build(name, root).cwd / "runs")), d, name)
                  for name in NAMES for d in _all_runs(build(name, root)))
    target = root / "extended" / "runs"
    for _, rel, run_dir, name in runs:
        copying[0] = name
        shutil.copytree(run_dir, target / rel)
        for view in VIEWS:
            assert printed(target, view) == rebuilt(target, view), (rel, view)
    assert len(sql.query(target, "SELECT run_id FROM runs").rows) == len(runs)
    for name in NAMES:
        assert {v for n, v in extended if n == name} >= {"run", "metrics", "checks"}, (name, extended)


@pytest.mark.parametrize("name", _params("failures_add"))
def test_failures_add_into_a_tmp_file(name: str, root: Path) -> None:
    runs = build(name, root)
    log = runs.cwd / "my-failures.md"
    from tfmoe.harness.store.notebook import load_run

    run = load_run(runs.jobs[0]).run
    if run["status"] == "ok":  # nothing surprising in the experiment's own config: refused in one line
        r = _clean(run_cli(["failures", "add", str(runs.jobs[0]), "--file", str(log)], runs.cwd), (2,))
        assert len(r.stderr.strip().splitlines()) == 1 and "nothing" in r.stderr, r.stderr
        assert not log.exists()
        return
    r = _clean(run_cli(["failures", "add", str(runs.jobs[0]), "--file", str(log), "--hypothesis", "planted"],
                       runs.cwd))
    assert f"appended to {log}" in r.stdout
    assert str(run["run_id"]) in log.read_text() and "**Hypothesis**: planted" in log.read_text()


@pytest.mark.parametrize("name", _params("conclude"))
def test_conclude(name: str, root: Path) -> None:
    from tfmoe.harness.method.conclusions import CONCLUSIONS_FILE

    runs = build(name, root)
    target = runs.jobs[1]
    r = _clean(run_cli(["conclude", str(target), "--proven", "it ran", "--unverified", "on a GPU"], runs.cwd))
    assert f"{CONCLUSIONS_FILE}: 2 conclusion(s), 2 new" in r.stdout and str(target) in r.stdout, r.stdout
    assert (target / CONCLUSIONS_FILE).exists() and "on a GPU" in (target / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_true_default_config_runs_and_shows(name: str, tmp_path: Path) -> None:
    """The experiment's own config, no override: exit 0, then show and replay."""
    r = _clean(run_cli([name], tmp_path))
    assert r.run_dir is not None
    for fmt in ("table", "md", "json"):
        _clean(run_cli(["show", str(r.run_dir), "--format", fmt], tmp_path))
    if ("replay", name) not in KNOWN:
        replay = _clean(run_cli(["replay", str(r.run_dir)], tmp_path))
        assert "reproduced" in replay.stdout and "NOT reproduced" not in replay.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_claims_run_for_the_experiments_claims(name: str, tmp_path: Path) -> None:
    from tfmoe.harness.launching.claims import CLAIMS

    keys = [c.key for c in CLAIMS if c.experiment == name]
    if not keys:
        pytest.skip(f"no claim runs {name}")
    args = ["claims", "--run", "--runs-root", str(tmp_path / "runs")]
    for k in keys:
        args += ["--claim", k]
    r = _clean(run_cli(args, tmp_path))
    for k in keys:
        assert k in r.stdout and "holds" in r.stdout, r.stdout
