"""The first-contact causes of issue 28 (experiments/zoo.md, measured on five new libraries before any fix), each on
a layer written for it (tests/first_contact_layers.py): the correct ones pass, the planted ones fail the check that
measures them, and nothing crashes blaming tfmoe."""

from __future__ import annotations

import pytest

from tfmoe.api.testing import run_recorded
from tfmoe.contract.errors import BadInput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAST = ["dropout_samples=20000", "gradcheck_T=2"]


def checks_of(rec):
    return {c.check: c for c in rec.checks_rows}


def failed(rec) -> set[str]:
    return {c.check for c in rec.checks_rows if c.outcome == "failed"}


def test_c6_a_kernel_built_on_reentrant_checkpoint_has_its_backward_judged():
    rec = run_recorded("attn-check", ["kernel=first_contact_layers:checkpointed_kernel", "cases.shapes=[[5,7,12]]",
                                      "cases.masks=[none,causal,pad_bool]", "kernel_checks.dropout_p=0"])
    assert failed(rec) == set(), {c.check: c.detail for c in rec.checks_rows if c.outcome == "failed"}
    assert checks_of(rec)["kernel_backward"].passed


def test_c1_nan_rows_by_policy_do_not_stop_the_battery_from_judging_a_bug():
    args = [*FAST, "fully_masked_policy=nan", "lengths=[4,0]", "checks=[masks,sdpa]"]
    rec = run_recorded("attn-check", ["impl=first_contact_layers:NanRowsWrongScale", *args])
    assert "sdpa_match" in failed(rec)
    rec = run_recorded("attn-check", ["impl=first_contact_layers:NanRows", *args])
    assert failed(rec) == set(), {c.check: c.detail for c in rec.checks_rows if c.outcome == "failed"}


def test_c5_weights_outside_registered_parameters_get_their_gradients():
    rec = run_recorded("attn-check", ["impl=first_contact_layers:OutsideWeightsAdapter", *FAST, "checks=[gradients]"])
    grad = checks_of(rec)["grad_match"]
    assert grad.passed and "dw_qkv" in grad.detail and "no gradient" not in grad.detail, grad.detail


def test_c3_a_user_adapter_that_cannot_build_is_bad_input_in_one_line():
    with pytest.raises(BadInput, match="raised ValueError: this layer has one head") as err:
        run_recorded("attn-check", ["impl=first_contact_layers:RefusingAdapter"])
    assert "\n" not in str(err.value)
    rec = run_recorded("attn-check", ["impl=first_contact_layers:RefusingAdapter", "n_heads=1", *FAST,
                                      "checks=[sdpa]"])  # the settings it can build: judged
    assert failed(rec) == set()


def test_c4_builds_that_rename_their_weights_get_them_copied_by_position():
    rec = run_recorded("attn-check", ["impl=first_contact_layers:RenamingAdapter", *FAST, "checks=[gradients]"])
    assert failed(rec) == set(), {c.check: c.detail for c in rec.checks_rows if c.outcome == "failed"}
    assert any("copied between builds by position" in n for n in rec.notes)


def test_c4_builds_whose_state_differs_in_shape_fail_the_copying_checks_not_tfmoe():
    rec = run_recorded("attn-check", ["impl=first_contact_layers:GrowingAdapter", *FAST, "checks=[gradients]"])
    gradcheck = checks_of(rec)["gradcheck"]
    assert gradcheck.outcome == "failed" and "different state_dict keys" in gradcheck.detail
