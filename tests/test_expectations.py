"""Expectations: the grammar (normal, boundary, malformed), validation before the run, expectations.parquet
written before the result, exit code 4, and failures add from a surprise."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.api.testing import launched, run_cli
from tfmoe.contract.errors import BadInput
from tfmoe.contract.registry import EXPERIMENTS
from tfmoe.contract.status import Status
from tfmoe.harness.method import declared_metrics, expectations, failures
from tfmoe.harness.method.expectations import judge, parse, parse_one
from tfmoe.harness.store import notebook


def rows(*values: float, step: bool = False, **tags):
    return [{"name": "cv", "value": v, **({"step": i} if step else {}), **tags} for i, v in enumerate(values)]


# ------------------------------------------------------------------------------------------ grammar
@pytest.mark.parametrize(("label", "text", "op", "low", "high"), [
    ("cv", "< 0.1", "<", 0.1, None),
    ("cv", "<=0.1", "<=", 0.1, None),
    ("cv", ">  1e-3", ">", 1e-3, None),
    ("cv", ">= -2", ">=", -2.0, None),
    ("cv", "== 0", "==", 0.0, None),
    ("cv", "!= 0", "!=", 0.0, None),
    ("cv", "~ 0.3 ± 0.05", "~", 0.3, 0.05),
    ("cv", "~ 0.3 +- 0.05", "~", 0.3, 0.05),
    ("cv", "in [0, 1]", "in", 0.0, 1.0),
    ("cv", "in [.5,.5]", "in", 0.5, 0.5),  # a one-point interval is allowed
    ("anything", "cv < inf", "<", math.inf, None),
])
def test_grammar_normal_forms(label, text, op, low, high) -> None:
    e = parse_one(label, text)
    assert (e.metric, e.op, e.low, e.high, e.aggregate, e.tags) == ("cv", op, low, high, None, ())


def test_selectors_and_aggregates() -> None:
    e = parse_one("x", "max(cv[strategy=aux_free, seed=1]) < 0.5")
    assert (e.metric, e.aggregate, e.tags) == ("cv", "max", (("strategy", "aux_free"), ("seed", "1")))
    assert e.selector == "max(cv[strategy=aux_free,seed=1])" and e.expected == "< 0.5"
    key = parse_one("cv[strategy=aux_free]", "~ 0.3 ± 0.1")  # the YAML-key form
    assert key.tags == (("strategy", "aux_free"),) and key.op == "~"
    assert [x.label for x in parse({"a": "cv < 1", "b": "mean(cv) > 0"})] == ["a", "b"]
    assert parse({}) == [] and parse(None) == []


@pytest.mark.parametrize(("label", "text", "needle"), [
    ("cv", "0.1", "no operator"),
    ("cv", "< abc", "not a number"),
    ("cv", "<", "not a number"),
    ("cv", "~ 0.3", "needs a tolerance"),
    ("cv", "~ 0.3 ± -1", "negative"),
    ("cv", "in [1, 0]", "is empty"),
    ("cv", "in (0, 1)", "write an interval"),
    ("x", "median(cv) < 1", "unknown aggregate"),
    ("x", "cv[strategy] < 1", "not tag=value"),
    ("x", "", "is empty"),
    ("x", "1 2 3", "no operator"),
])
def test_grammar_malformed_is_refused_with_the_fix(label, text, needle) -> None:
    with pytest.raises(BadInput, match=needle):
        parse_one(label, text)
    with pytest.raises(BadInput, match="not a mapping"):
        parse(["cv < 1"])
    with pytest.raises(BadInput, match="not a string"):
        parse({"cv": [1, 2]})


def test_boundaries_strict_and_closed() -> None:
    assert not judge(parse_one("cv", "< 0.5"), rows(0.5)).held  # strict: the boundary misses, by 0
    assert judge(parse_one("cv", "< 0.5"), rows(0.5)).miss == 0.0
    assert judge(parse_one("cv", "<= 0.5"), rows(0.5)).held
    assert judge(parse_one("cv", "in [0.5, 1]"), rows(0.5)).held and judge(parse_one("cv", "in [0.5, 1]"), rows(1)).held
    assert judge(parse_one("cv", "~ 1 ± 0.25"), rows(1.25)).held  # the tolerance's edge holds
    j = judge(parse_one("cv", "~ 1 ± 0.25"), rows(1.5))
    assert not j.held and j.miss == pytest.approx(0.25)
    nan = judge(parse_one("cv", "!= 0"), rows(float("nan")))
    assert not nan.held and math.isinf(nan.miss)  # NaN never holds


def test_per_step_metric_is_judged_at_its_last_step_unless_aggregated() -> None:
    r = rows(0.9, 0.5, 0.05, step=True)
    assert judge(parse_one("cv", "< 0.1"), r).held  # last step: 0.05
    j = judge(parse_one("x", "max(cv) < 0.1"), r)
    assert not j.held and j.observed == 0.9 and j.miss == pytest.approx(0.8)
    assert judge(parse_one("x", "first(cv) == 0.9"), r).held and judge(parse_one("x", "mean(cv) ~ 0.4833 ± 1e-3"), r).held


def test_tag_selection_and_every_remaining_row_must_hold() -> None:
    r = rows(0.2, step=True, strategy="aux_free") + rows(0.9, step=True, strategy="none")
    assert judge(parse_one("cv[strategy=aux_free]", "< 0.5"), r).held
    both = judge(parse_one("cv", "< 0.5"), r)  # one row per strategy at the last step: the worst is shown
    assert not both.held and both.observed == 0.9 and "all 2 rows must hold" in both.detail
    none = judge(parse_one("cv[strategy=nosuch]", "< 0.5"), r)
    assert not none.held and none.observed is None and "no rows" in none.detail
    assert judge(parse_one("x", "cv[seed=1] < 1"), [{"name": "cv", "value": 0.5, "seed": 1}]).held  # int tags


def test_validation_names_unknown_metric_and_tag_and_lists_what_exists() -> None:
    declared = declared_metrics.declared_for("route-sim")
    expectations.validate(parse({"cv[strategy=aux_free]": "< 0.5", "x": "max(cv[step=3]) < 1"}), declared, "route-sim")
    with pytest.raises(BadInput, match=r"records no metric 'cvv': it records .*balance_loss.*cv"):
        expectations.validate(parse({"cvv": "< 1"}), declared, "route-sim")
    with pytest.raises(BadInput, match=r"no tag 'strat': its tags are step, strategy"):
        expectations.validate(parse({"cv[strat=x]": "< 1"}), declared, "route-sim")


def test_literal_metric_names_are_read_from_the_source_without_importing() -> None:
    found = declared_metrics.literal_metrics("shift_labels")
    assert found["sequence_loss"] == ("sequence",) and found["loss"] == ()
    assert declared_metrics.literal_metrics("complexity")["flops_forward_block"] is None  # **tags: open
    course = declared_metrics.literal_metrics("route_sim")  # the course case's own names (issue 29)
    assert course["course.cv"] == () and course["course.load"] == ("expert",)
    for name in EXPERIMENTS:  # every experiment can judge an expectation
        assert declared_metrics.declared_for(name)


def test_a_real_run_records_only_declared_names_and_tags(workdir: Path) -> None:
    r = run_cli(["shift-labels"], workdir)
    m = pd.read_parquet(r.run_dir / "metrics.parquet")
    declared = declared_metrics.declared_for("shift-labels")
    for name, g in m.groupby("name"):
        assert name in declared, name
        tags = {c for c in g.columns if c not in ("name", "value", "step", "measured") and g[c].notna().any()}
        assert tags <= set(declared[name]), (name, tags)


# ------------------------------------------------------------------------------------------ runs
@pytest.fixture
def fake(fake_experiment, monkeypatch):
    monkeypatch.setitem(declared_metrics.DECLARED, "fake", {"loss": ("variant",), "sums_per_call": ()})
    return fake_experiment


def test_held_expectation_exits_0_and_parquet_records_prediction_before_result(fake) -> None:
    code, dirs = launched(fake, ["expect={loss: \"> 0\"}"])
    assert code == 0
    run_dir = dirs[-1]
    data = notebook.load_run(run_dir)
    e = data.expectations.iloc[0]
    assert bool(e["held"]) and e["expected"] == "> 0" and e["rows"] == 5 and "last step (4)" in e["detail"]
    assert e["written_at"] >= data.run["started_at"] and e["written_at"] <= e["judged_at"] <= data.run["finished_at"]
    last = data.metrics[(data.metrics["name"] == "loss")]["value"].iloc[-1]
    assert e["observed"] == last and "| loss | > 0 |" in (run_dir / "summary.md").read_text()


def test_missed_expectation_exits_4_names_it_and_by_how_much(fake, capsys) -> None:
    code, dirs = launched(fake, ["expect={x: \"loss[variant=a] < 0\"}"])
    assert code == Status.UNEXPECTED.exit_code
    run_dir = dirs[-1]
    data = notebook.load_run(run_dir)
    assert data.run["status"] == "unexpected" and data.run["exit_code"] == 4
    err = capsys.readouterr().err
    # the selector is printed as written (F-48: rich once read "[variant=a]" as markup and dropped it)
    assert "loss[variant=a] < 0 did not hold: observed" in err and "misses by" in err
    assert not bool(data.expectations.iloc[0]["held"]) and data.expectations.iloc[0]["miss"] > 0


def test_failed_check_outranks_a_missed_expectation(fake) -> None:
    code, dirs = launched(fake, ["mode=fail_check", "expect={loss: \"< 0\"}"])
    assert code == 1
    data = notebook.load_run(dirs[-1])
    assert data.run["status"] == "failed" and not bool(data.expectations.iloc[0]["held"])  # judged all the same
    from tfmoe.contract.status import worst_exit_code

    assert worst_exit_code([0, 4]) == 4 and worst_exit_code([4, 1]) == 1 and worst_exit_code([4, 2]) == 2


def test_crash_keeps_the_prediction_and_judges_what_was_recorded(fake) -> None:
    code, dirs = launched(fake, ["mode=crash", "expect={loss: \"> 0\"}"])
    assert code == 3
    e = notebook.load_run(dirs[-1]).expectations.iloc[0]
    assert e["rows"] == 3 and bool(e["held"])  # the steps before the crash


def test_failures_add_from_a_surprise_prefills_expected_observed_and_rows(fake) -> None:
    run_dir = launched(fake, ["expect={loss: \"< 0\"}"])[1][-1]
    title = failures.add(str(run_dir), Path("runs"), Path("failures.md"), None, "h", "f", "t")
    text = Path("failures.md").read_text()
    assert title == "F-1: fake: expected loss < 0"
    assert "expected `loss < 0`" in text and "observed " in text and "misses by" in text
    assert f"metrics.parquet rows of `loss` in run `{run_dir.name}`" in text and "(step=4 variant=a)" in text


@pytest.mark.parametrize(("args", "needle"), [
    (["shift-labels", "--expect", "nosuch < 1"], "records no metric 'nosuch': it records left_right_max_abs, loss"),
    (["shift-labels", "--expect", "sequence_loss[seq=0] < 1"], "no tag 'seq': its tags are sequence, step"),
    (["shift-labels", "--expect", "loss <"], "not a number"),
    (["shift-labels", "--expect", "< 1"], "names no metric"),
    (["shift-labels", 'expect={loss: "about 3"}'], "no operator"),
    (["shift-labels", "expect=3"], "not a mapping"),
    (["shift-labels", "-m", "seed=0,1", "--expect", "nosuch < 1"], "records no metric 'nosuch'"),
])
def test_bad_expectation_exits_2_before_any_run_starts(workdir: Path, args, needle) -> None:
    r = run_cli(args, workdir)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.stderr
    assert r.run_dir is None  # refused before any run directory was made


def test_cli_forms_agree_and_diff_and_replay_carry_expectations(workdir: Path) -> None:
    a = run_cli(["shift-labels", "--expect", "loss < 100", "expect.valid_labels='== 9'"], workdir)
    assert a.exit_code == 0, a.stderr
    df = pd.read_parquet(a.run_dir / "expectations.parquet")
    assert set(df["selector"]) == {"loss", "valid_labels"} and df["held"].all()
    b = run_cli(["shift-labels", "--expect", "loss < 1"], workdir)
    assert b.exit_code == 4 and "loss < 1 did not hold" in b.stderr and "misses by" in b.stderr
    assert "0/1" in b.stdout  # the outcome table's expectations column
    moved = run_cli(["diff", str(a.run_dir), str(b.run_dir), "--format", "json"], workdir)
    import json

    body = json.loads(moved.stdout)
    assert {r["expectation"] for r in body["expectations"]} == {"loss < 100", "loss < 1", "valid_labels == 9"}
    rep = run_cli(["replay", str(b.run_dir)], workdir)
    assert "reproduced" in rep.stdout and "NOT" not in rep.stdout, rep.stdout
    new = max((workdir / "runs" / "shift-labels").iterdir(), key=lambda p: p.stat().st_mtime)
    assert list(pd.read_parquet(new / "expectations.parquet")["expected"]) == ["< 1"]  # carried along


# ------------------------------------------------------------------------------------------ which row, which value
def test_a_miss_names_the_row_and_the_aggregate_it_was_judged_on() -> None:
    """`maxvio < 0.5 did not hold: observed 2.54688` named neither the strategy nor the step, nor that it was the
    last step's value while the run's table prints the mean of the last 10 % of steps."""
    recorded = rows(0.1, 0.2, 0.3, step=True, strategy="a") + rows(0.9, 2.0, 0.7, step=True, strategy="b")
    e = parse_one("m", "cv < 0.5")
    j = judge(e, recorded)
    assert (j.observed, j.where) == (0.7, "strategy=b, step 2") and "last step (2), not an average" in j.detail
    said = expectations.describe_miss(e, j)
    assert said.startswith("cv < 0.5 did not hold: observed 0.7 at strategy=b, step 2 (the value at its last step")
    assert "all 2 rows must hold" in said and "misses by 0.2" in said
    j = judge(parse_one("m", "max(cv) < 0.5"), recorded)
    assert (j.observed, j.where) == (2.0, "strategy=b, step 1") and "the max over 6 row(s)" in j.detail
    j = judge(parse_one("m", "first(cv[strategy=b]) < 0.5"), recorded)
    assert (j.observed, j.where) == (0.9, "strategy=b, step 0")
    j = judge(parse_one("m", "mean(cv[strategy=a]) > 0.5"), recorded)
    assert j.where == "" and math.isclose(j.observed, 0.2) and j.detail == "the mean over 3 row(s)"
    assert "observed 0.2 (the mean over 3 row(s))" in expectations.describe_miss(parse_one("m", "mean(cv) > 5"),
                                                                                 judge(parse_one("m", "mean(cv) > 5"),
                                                                                       recorded[:3]))
    j = judge(parse_one("m", "cv < 5"), [{"name": "cv", "value": 1.0}])  # one untagged row: no row to name
    assert j.held and j.where == ""


def test_a_tag_value_the_run_never_recorded_is_named_at_the_end_with_the_values_it_did() -> None:
    j = judge(parse_one("m", "cv[strategy=bogus] < 0.3"), rows(0.1, strategy="a") + rows(0.2, strategy="b"))
    assert j.observed is None and not j.held
    assert "strategy=bogus is not a value it recorded (strategy: a, b)" in j.detail
    assert "known only once the run has recorded them" in j.detail


def test_validate_tag_values_refuses_a_value_the_settings_rule_out() -> None:
    known = {"strategy": ("none", "aux_free"), "T": (16, 32)}
    expectations.validate_tag_values([parse_one("a", "cv[strategy=aux_free] < 1"),
                                     parse_one("b", "cv[T=16.0] < 1"), parse_one("c", "cv[other=x] < 1")],
                                     known, "route-sim")  # a tag not known up front is left to the end
    with pytest.raises(BadInput, match=r"records cv for strategy=none, strategy=aux_free; not strategy=bogus"):
        expectations.validate_tag_values([parse_one("a", "cv[strategy=bogus] < 1")], known, "route-sim")
    with pytest.raises(BadInput, match="records cv for no strategy at all"):
        expectations.validate_tag_values([parse_one("a", "cv[strategy=none] < 1")], {"strategy": ()}, "route-sim")


def test_unknown_tag_value_exits_2_before_anything_runs(workdir: Path) -> None:
    """It ran for 20 s and exited 4 "could not be judged"; its strategies are known from the settings."""
    r = run_cli(["route-sim", "--expect", "cv[strategy=bogus] < 0.3"], workdir)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "not strategy=bogus" in r.stderr and "strategy=aux_free" in r.stderr and not (workdir / "runs").exists()
    r = run_cli(["complexity", "-m", "T=16,32", "D=16", "--expect", "crossover_T[T=64] > 0"], workdir)
    assert r.exit_code == 2 and "sweep job 0" in r.stderr and "not T=64" in r.stderr
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize(("experiment", "overrides"), [
    ("complexity", ["T=32", "D=16", "n_heads=2", "min_run_time=0.002", "warmup=0", "peak_matmul_n=64",
                    "n_layers=2", "vocab=100"]),
    ("block-stats", ["n_layers=1", "d_model=16", "seq_len=4", "batch_size=2", "lowp_dtypes=[]"]),
])
def test_tag_values_cover_every_value_a_real_run_records(experiment: str, overrides: list[str]) -> None:
    """tag_values(settings) must never refuse a value the run records (no false refusal)."""
    from tfmoe.api.testing import compose, run_recorded

    module = EXPERIMENTS[experiment].load()
    known = module.tag_values(module.settings(compose(experiment, overrides)))
    recorded = pd.DataFrame(run_recorded(experiment, overrides).metrics_rows)
    for tag, values in known.items():
        seen = set(recorded[tag].dropna().astype(str)) if tag in recorded else set()
        assert seen and seen <= {str(v) for v in values}, (tag, seen, values)


def test_a_name_the_run_did_not_record_points_to_the_one_it_did() -> None:
    """`cv < 0.3` on route-sim's course case said only "recorded no rows of cv" while the console printed its CV."""
    recorded = [{"name": "course.cv", "value": 0.18}, {"name": "course.maxvio", "value": 0.4},
                {"name": "train.final_loss", "value": 1.0}]
    j = judge(parse_one("m", "cv < 0.3"), recorded)
    assert j.observed is None and j.detail == "the run recorded no rows of cv; did you mean course.cv?"
    assert "did you mean course.maxvio?" in judge(parse_one("m", "mean(maxvio[strategy=x]) < 1"), recorded).detail
    assert "did you mean course.cv?" in judge(parse_one("m", "course.cvv < 1"), recorded).detail  # a close spelling
    assert "did you mean" not in judge(parse_one("m", "entropy < 1"), recorded).detail  # nothing like it: no guess
    j = judge(parse_one("m", "cv[strategy=bogus] < 0.3"), rows(0.1, strategy="a"))  # the name was recorded
    assert "did you mean" not in j.detail and "strategy=bogus is not a value it recorded" in j.detail


def test_route_sim_course_case_expectation_on_cv_names_course_cv(workdir: Path) -> None:
    r = run_cli(["route-sim", "steps=0", "--expect", "cv < 0.3"], workdir)
    assert r.exit_code == 4, r.stderr
    assert "cv < 0.3 could not be judged: the run recorded no rows of cv; did you mean course.cv or layer.cv?" in r.stderr
