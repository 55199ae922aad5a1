"""Why a check failed: planted bugs are matched to their catalogue signature, labelled as inferences."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tfmoe.api.testing import run_cli, run_recorded
from tfmoe.contract.registry import EXPERIMENTS
from tfmoe.harness.method import diagnosis
from tfmoe.harness.method.diagnosis import checks_mapping, diagnose

REPO = Path(__file__).resolve().parents[1]
FAST = ["chunked.probe_T=256", "chunked.probe_block_size=16", "chunked.timing_repeats=1", "dropout_samples=20000",
        "gradcheck_T=2", "chunked.memory_ratio_max=0.35"]


def infer(*overrides: str) -> list[diagnosis.Inference]:
    rec = run_recorded("attn-check", [*FAST, *overrides])
    return diagnose("attn-check", checks_mapping(rec.checks_rows), rec.metrics_rows,
                    {"n_heads": 4, **dict(o.split("=", 1) for o in overrides if "=" in o)})


@pytest.mark.parametrize(("bug", "extra"), [
    ("ScaleByDModel", ["checks=[sdpa,invariances]"]),  # weights wrong, rows and masks right
    ("MissingTransposeMerge", ["checks=[masks,sdpa]"]),  # weights right, output wrong
    ("ScaleByDModel", ["n_heads=1", "checks=[sdpa,invariances]"]),  # passes sdpa_match at H=1, head_counts fails
    ("WrongSoftmaxAxis", ["checks=[masks]"]),
    ("CausalOffByOne", ["checks=[masks]"]),
    pytest.param("CacheWithoutOffset", ["checks=[masks,kv_cache]"], marks=pytest.mark.slow),
    ("GlobalMaxSoftmax", ["checks=[invariances]"]),
    pytest.param("DropoutKeepProb", ["checks=[dropout]"], marks=pytest.mark.slow),
])
def test_planted_bug_is_named_as_the_likely_cause(bug: str, extra: list[str]) -> None:
    found = infer(f"impl=buggy_attention:{bug}", *extra)
    assert any(bug in i.planted for i in found), [i.line() for i in found]
    assert all(i.line().startswith("likely cause (inferred, not proven)") for i in found)


def test_scale_and_merge_are_told_apart_by_the_weights() -> None:
    scale = infer("impl=buggy_attention:ScaleByDModel", "checks=[masks,sdpa]")
    merge = infer("impl=buggy_attention:MissingTransposeMerge", "checks=[masks,sdpa]")
    assert [i.planted for i in scale] == [("ScaleByDModel",)] and [i.planted for i in merge] == [("MissingTransposeMerge",)]


def test_correct_module_gets_no_inference() -> None:
    assert infer("impl=buggy_attention:PlainMHA", "checks=[masks,sdpa,invariances]") == []


def test_scale_signature_needs_the_head_count_pattern() -> None:
    base = {"sdpa_match": {"passed": False, "observed": 0.02, "threshold": 1e-7, "detail": ""},
            "row_sums": {"passed": True, "observed": 0.0, "threshold": 1e-6, "detail": ""}}
    per_head = [{"name": "max_abs_err", "comparison": "module_vs_sdpa", "n_heads": h, "value": v}
                for h, v in ((1, 1e-8), (4, 0.04))]
    assert diagnose("attn-check", base, per_head, {})[0].planted == ("ScaleByDModel", "MissingTransposeMerge")
    flat = [{**r, "value": 0.04} for r in per_head]  # wrong at every head count: not this signature
    assert diagnose("attn-check", base, flat, {}) == []
    assert diagnose("attn-check", {**base, "sdpa_match": {**base["sdpa_match"], "passed": True}}, per_head, {}) == []


def test_fully_masked_rows_blames_nan_only_when_values_are_nonfinite() -> None:
    checks = {"fully_masked_rows": {"passed": False, "observed": 8.0, "threshold": 0.0, "detail": ""}}
    finite = [{"name": "fully_masked_nonfinite_values", "value": 0.0}]
    assert not any("NaiveMHAWrapper" in i.planted for i in diagnose("attn-check", checks, finite, {}))
    nan = [{"name": "fully_masked_nonfinite_values", "value": 12.0}]
    assert [i.planted for i in diagnose("attn-check", checks, nan, {})] == [("NaiveMHAWrapper",)]


def test_catalogue_reads_check_names_the_batteries_record() -> None:
    """Every check a signature reads is written by the experiments (a renamed check would silently never match)."""
    source = "".join(p.read_text() for p in (REPO / "src" / "tfmoe" / "experiments").rglob("*.py"))
    for sig in diagnosis.CATALOGUE:
        assert sig.experiment in EXPERIMENTS
        for name in sig.checks:
            bare = name.removeprefix("layer.").removeprefix("lm.")  # the layer and model batteries record PREFIX + name
            assert re.search(rf"[\"'](layer\.|lm\.)?{re.escape(bare)}[\"'\]]", source), f"no experiment records {name}"


@pytest.mark.parametrize("bug", ["SoftmaxOverTokens", *(pytest.param(b, marks=pytest.mark.slow) for b in (
    "NotRenormalised", "ArgminRouting", "FirstComeCapacity"))])
def test_route_layer_planted_bug_is_named(bug: str) -> None:
    from tfmoe.api.testing import compose, make_recorder
    from tfmoe.experiments import route_sim
    from tfmoe.experiments.route_sim import layer as route_layer

    cfg = compose("route-sim", ["steps=0", f"impl=buggy_moe:{bug}", "layer.seq=8"])
    rec = make_recorder(cfg)
    route_layer.run_battery(route_sim.settings(cfg).layer, rec)
    found = diagnose("route-sim", checks_mapping(rec.checks_rows), rec.metrics_rows, {})
    assert any(f"buggy_moe.{bug}" in i.planted for i in found), [i.line() for i in found]


def test_cli_prints_the_inference_next_to_failed_checks_and_show_repeats_it(workdir: Path) -> None:
    import sys

    tests_dir = str(REPO / "tests")
    assert tests_dir in sys.path
    r = run_cli(["attn-check", "impl=buggy_attention:CausalOffByOne", "checks=masks"], workdir)
    assert r.exit_code == 1 and "likely cause (inferred, not proven): the causal mask" in r.stderr, r.stderr
    assert "CausalOffByOne" in r.stderr
    summary = (r.run_dir / "summary.md").read_text()
    assert "Likely causes (inferred" in summary and "off by one" in summary
    assert "likely cause (inferred, not proven)" in run_cli(["show", str(r.run_dir)], workdir).stdout


def test_show_wraps_the_likely_cause_to_a_reading_width(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The likely-cause line was 343 characters on one line at COLUMNS=200; every line of `show` now fits its width,
    prose at most 120 columns, and nothing of the cause is lost in the wrapping."""
    r = run_cli(["attn-check", "impl=buggy_attention:ScaleByDModel", "checks=[sdpa,invariances]", *FAST], workdir)
    assert r.exit_code == 1, r.stderr
    cause = next(line for line in r.stderr.splitlines() if line.startswith("likely cause"))
    assert len(cause) > 120, cause  # long enough to need wrapping
    for columns, prose in (("200", 120), ("90", 90)):
        monkeypatch.setenv("COLUMNS", columns)
        out = run_cli(["show", str(r.run_dir)], workdir).stdout
        lines = out.splitlines()
        assert max(len(line) for line in lines if len(line.split()) > 1) <= int(columns), out  # a path alone may not
        start = next(i for i, line in enumerate(lines) if line.startswith("likely cause"))
        block, said = [], ""
        for line in lines[start:start + 20]:
            block.append(line)
            said = " ".join(x.strip() for x in block)
            if len(said) >= len(" ".join(cause.split())):
                break
        assert said == " ".join(cause.split()), out
        assert len(block) > 1 and all(len(line) <= prose for line in block), block
    full = run_cli(["show", str(r.run_dir), "--full-width"], workdir).stdout
    assert cause in full.splitlines()
