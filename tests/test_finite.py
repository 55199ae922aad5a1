"""Finite or failed (issue 29, item 1): every experiment that trains, or reports a loss, gradient or norm, checks
that what it reported stayed finite; a diverged run is `failed` (exit 1) and the check names the first step and
quantity. Generated from the registry: a new experiment fails ``test_every_experiment_is_classified`` until it is
given a diverging case here (a config that diverges, or a planted bug) or an exemption saying why it reports
nothing that could diverge.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from tfmoe.api.testing import compose, cpu_recorder, run_cli, run_recorded
from tfmoe.contract.errors import BadInput
from tfmoe.contract.registry import EXPERIMENTS
from tfmoe.rules import finite


def _times_inf(cls: type) -> Callable[[pytest.MonkeyPatch], None]:
    """A planted bug: ``cls.forward`` returns its output times inf (a model that blew up)."""
    def plant(monkeypatch: pytest.MonkeyPatch) -> None:
        forward = cls.forward

        def blown(self, *args, **kwargs):
            out = forward(self, *args, **kwargs)
            return out * math.inf if not isinstance(out, tuple) else (out[0] * math.inf, *out[1:])
        monkeypatch.setattr(cls, "forward", blown)
    return plant


def _plant_route_course(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug in the course case: the router z-loss overflows (the training simulation's too)."""
    from tfmoe.components import moe

    z = moe.router_z_loss
    monkeypatch.setattr(moe, "router_z_loss", lambda logits, coef: z(logits, coef) * math.inf)


def _plant_shift_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    from tfmoe.components.lm import TinyCausalLM

    _times_inf(TinyCausalLM)(monkeypatch)


def _plant_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    from tfmoe.components.encdec import DecoderOnly

    _times_inf(DecoderOnly)(monkeypatch)


ROUTE_QUICK = ("steps=4", "train_tokens=32", "strategies=[none]", "layer.batch=2", "layer.seq=4")
DECODE_QUICK = ("d_model=16", "n_heads=2", "n_layers=1", "train_steps=5", "batch_size=2", "block_size=16",
                "max_new_tokens=4", "check_tokens=4", "chi2_draws=500", "timing_lengths=[]", "max_len=32",
                "beam_width=2", "top_p_grid=[0.5,1.0]")
BLOCK_QUICK = ("n_layers=2", "batch_size=2", "seq_len=4", "d_model=16", "n_heads=2", "variants=[pre]")


@dataclass(frozen=True)
class Diverging:
    quick: tuple[str, ...]  # small sizes; the finite check must pass on them
    diverge: tuple[str, ...]  # overrides that make the run diverge (or () with a planted bug)
    check: str  # the check that must fail
    quantity: str  # the quantity its detail names first
    step: bool  # whether the quantity is per step (the detail names "at step N")
    plant: Callable[[pytest.MonkeyPatch], None] | None = field(default=None)


DIVERGING: dict[str, Diverging] = {
    "route-sim": Diverging(ROUTE_QUICK, ("lr=1e30",), "train.finite.none", "z_loss", True),
    "decode": Diverging(DECODE_QUICK, ("lr=1e30",), "train.finite", "train_loss", True),
    "shift-labels": Diverging((), (), "finite", "loss", False, _plant_shift_labels),
    "arch": Diverging(("n_layers=1",), (), "finite", "visibility_tol", False, _plant_arch),
    "block-stats": Diverging(BLOCK_QUICK, ("lowp_dtypes=[fp16]", "lowp_stress_scale=1e6"), "stats_finite[fp16]",
                             "at layer 0, stage input", False),
}
# route-sim's course case (no training, its own check) diverges only by a planted bug
COURSE = Diverging(ROUTE_QUICK + ("steps=0",), (), "course.finite", "course.z_loss", False, _plant_route_course)

EXEMPT: dict[str, str] = {
    "tokenize": "counts tokens, characters and bytes of text: nothing is trained and no loss, gradient or norm",
    "complexity": "reports analytic and counted FLOPs, parameters and bytes and measured times: no loss, gradient "
                  "or norm; the times are judged by timings_plausible",
    "attn-check": "reports errors against references, each judged by check_le, which a NaN or inf fails "
                  "(recorder.within); no training (module owned by the attention checks)",
}


def test_every_experiment_is_classified():
    missing = set(EXPERIMENTS) - set(DIVERGING) - set(EXEMPT)
    assert not missing, (f"experiment(s) {sorted(missing)} have no finiteness case in tests/test_finite.py: give each "
                         "a DIVERGING entry (a check that fails on a diverged run) or an EXEMPT reason")
    assert not set(DIVERGING) & set(EXEMPT)
    assert set(DIVERGING) | set(EXEMPT) <= set(EXPERIMENTS)


def _check(rec, name: str):
    rows = [c for c in rec.checks_rows if c.check == name]
    assert len(rows) == 1, f"check {name} recorded {len(rows)} times: {[c.check for c in rec.checks_rows]}"
    return rows[0]


CASES = {**DIVERGING, "route-sim course case": COURSE}


def _experiment(key: str) -> str:
    return key.split(" ")[0]


@pytest.mark.parametrize("key", list(CASES))
def test_finite_check_passes_on_small_default_sizes(key):
    case = CASES[key]
    rec = run_recorded(_experiment(key), list(case.quick))
    c = _check(rec, case.check)
    assert c.passed and c.observed == 0.0, c.detail


@pytest.mark.parametrize("key", list(CASES))
def test_diverged_run_fails_naming_first_step_and_quantity(key, monkeypatch):
    case = CASES[key]
    if case.plant is not None:
        case.plant(monkeypatch)
    rec = run_recorded(_experiment(key), [*case.quick, *case.diverge])
    c = _check(rec, case.check)
    assert not c.passed and c.observed >= 1, c.detail
    assert "first non-finite" in c.detail and case.quantity in c.detail, c.detail
    if case.step:
        assert " at step " in c.detail, c.detail


def test_route_sim_issue_command_fails_naming_step_and_quantity(tmp_path):
    """The issue's reproduction: exit 0 `ok 29/29` with the task loss nan in 4 of 5 steps."""
    r = run_cli(["route-sim", "lr=1e30", "steps=5", "strategies=[none]", "layer.batch=2", "layer.seq=4"], tmp_path)
    assert r.exit_code == 1, r.stdout + r.stderr
    import pandas as pd

    checks = pd.read_parquet(r.run_dir / "checks.parquet").set_index("check")
    assert not checks.loc["train.finite.none", "passed"]
    detail = checks.loc["train.finite.none", "detail"]
    assert "first non-finite z_loss = inf at step 1 (strategy=none)" in detail and "task_loss 4 of 5" in detail
    assert checks.loc["course.finite", "passed"]


@pytest.mark.parametrize("experiment", ["route-sim", "decode"])
def test_expect_divergence_marks_a_stress_test(experiment):
    case = DIVERGING[experiment]
    rec = run_recorded(experiment, [*case.quick, *case.diverge, "expect_divergence=true"])
    c = _check(rec, case.check)
    assert c.passed and "expect_divergence=true" in c.detail and "first non-finite" in c.detail, c.detail
    calm = run_recorded(experiment, [*case.quick, "expect_divergence=true"])
    c = _check(calm, case.check)
    assert not c.passed and "expected to diverge" in c.detail and "expect_divergence=false" in c.detail, c.detail


def test_decode_skips_decoding_after_divergence():
    """A diverged LM is not sampled (torch.multinomial refuses NaN probabilities: that was a crash, exit 3)."""
    rec = run_recorded("decode", [*DECODE_QUICK, "lr=1e30"])
    assert any("decoding skipped" in n for n in rec.notes)
    assert not any(r["name"] == "generated_tokens" for r in rec.metrics_rows)


@pytest.mark.parametrize("experiment", ["route-sim", "decode"])
@pytest.mark.parametrize("value", ["yes", "1", "null"])
def test_expect_divergence_must_be_a_boolean(experiment, value):
    module = EXPERIMENTS[experiment].load()
    with pytest.raises(BadInput, match="expect_divergence=.* is not a boolean: pass expect_divergence=true"):
        module.settings(compose(experiment, [f"expect_divergence={value}"]))


# ---------------------------------------------------------------------------------------- the rule itself
def _rows(values, name="loss", **tags):
    return [{"name": name, "value": v, "step": i, **tags} for i, v in enumerate(values)]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_scan_finds_the_first_non_finite_value(bad):
    found = finite.scan(_rows([1.0, 2.0, bad, bad, 0.5]))
    assert not found.finite and found.bad == 2 and found.total == 5
    assert found.first["step"] == 2 and found.per_quantity == {"loss": (2, 5)}


def test_scan_of_finite_and_empty_rows():
    assert finite.scan(_rows([0.0, -1e308, 1e308])).finite
    empty = finite.scan([])
    assert empty.finite and empty.total == 0 and empty.first is None


def test_check_finite_selects_by_name_and_tags():
    rec = cpu_recorder()
    rec.metrics_rows += _rows([1.0, math.nan], strategy="a") + _rows([1.0, 2.0], strategy="b")
    rec.metrics_rows += _rows([math.inf], name="other", strategy="b")
    assert finite.check_finite(rec, "b", ["loss"], strategy="b")
    assert not finite.check_finite(rec, "a", ["loss"], strategy="a")
    assert "first non-finite loss = nan at step 1 (strategy=a); non-finite: loss 1 of 2" in rec.checks_rows[-1].detail
    assert not finite.check_finite(rec, "any", ["loss", "other"])


def test_expect_divergence_reads_booleans_only():
    assert finite.expect_divergence({}) is False
    assert finite.expect_divergence({"expect_divergence": True}) is True
    with pytest.raises(BadInput):
        finite.expect_divergence({"expect_divergence": "true"})
