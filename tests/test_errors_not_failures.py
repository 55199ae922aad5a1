"""Errors are not failures (issue 22, item 1): an exception in the user's layer is that check's failure, led by the
exception in full; an exception that is tfmoe's or a shipped adapter's crashes the run (exit 3) naming the library,
its version and the supported range; a likely cause is only ever inferred from measured checks."""

from __future__ import annotations

import pytest
import torch

from tfmoe.adapters.transformers_support import SUPPORTED
from tfmoe.api.testing import caught, run_cli
from tfmoe.contract.errors import AdapterError, ContractError
from tfmoe.harness.method.diagnosis import common_exception, diagnose
from tfmoe.harness.store.notebook import load_run
from tfmoe.rules.faults import is_raised, raised_detail, tfmoe_fault

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL = ["d_model=16", "n_heads=4", "T=6", "chunked.probe_T=256", "chunked.probe_block_size=16",
         "chunked.timing_repeats=1", "gradcheck_T=2"]


def hf():
    return pytest.importorskip("transformers", reason="the `hf` extra (transformers 5.x) is not installed")


def _user_code_raises() -> None:
    torch.zeros(2, 3) @ torch.zeros(2, 3)  # (2,3)@(2,3): a shape error raised by torch for the user's code


# ------------------------------------------------------------------------------------ whose fault it is
def test_an_exception_in_user_code_is_the_users():
    exc = caught(_user_code_raises)
    assert tfmoe_fault(exc, "tfmoe") is None
    assert tfmoe_fault(exc, "tfmoe", "transformers", SUPPORTED) is None  # torch frames are passed over


def test_an_exception_raised_inside_tfmoe_is_tfmoes():
    from tfmoe.components.references import visibility

    exc = caught(visibility, 4, 4, False, torch.ones(2, 3, dtype=torch.bool))  # tfmoe's own ValueError
    fault = tfmoe_fault(exc, "tfmoe")
    assert isinstance(fault, AdapterError) and "references.py" in str(fault) and "not a failure of the layer" in str(fault)


def test_an_exception_inside_the_library_a_shipped_adapter_drives_names_library_version_and_range():
    hf()
    import transformers
    from transformers.masking_utils import create_causal_mask

    exc = caught(create_causal_mask, config=None, inputs_embeds=torch.zeros(1, 2, 4), attention_mask=None,
                  cache=None, position_ids=None)  # raises inside transformers (config None)
    fault = tfmoe_fault(exc, "impl=hf:llama", "transformers", SUPPORTED)
    assert isinstance(fault, AdapterError)
    assert f"transformers {transformers.__version__}" in str(fault) and f"transformers{SUPPORTED}" in str(fault)
    # the same exception under a user's own adapter (no library declared) is the user's
    assert tfmoe_fault(exc, "impl=my:Adapter", None) is None


def test_a_contract_error_is_the_users_unless_a_shipped_adapter_made_it():
    exc = caught(lambda: (_ for _ in ()).throw(ContractError("output shape (2, 6) != (2, 6, 16)")))
    assert tfmoe_fault(exc, "impl=my:Layer") is None
    assert isinstance(tfmoe_fault(exc, "impl=hf:llama", "transformers", SUPPORTED), AdapterError)
    assert isinstance(tfmoe_fault(AdapterError("x"), "tfmoe"), AdapterError)


def test_raised_detail_keeps_the_whole_message_first():
    detail = raised_detail(RuntimeError("line one\nline two"))
    assert detail == "raised RuntimeError: line one line two" and is_raised(None, detail)
    assert not is_raised(0.5, detail) and not is_raised(None, "max abs err 0.1")


# ------------------------------------------------------------------- the verdict on a layer that raises
def test_user_layer_raising_in_every_check_is_one_verdict_line_and_no_likely_cause(tmp_path):
    """Before: each detail held only the message's first line, the verdict listed the failed checks with no word
    of the exception, and likely causes about layouts were inferred from checks that measured nothing."""
    res = run_cli(["attn-check", "impl=raising_attention:RaisesInForward", *SMALL,
                   "checks=[masks,sdpa,gradients,invariances,fully_masked]"], tmp_path)
    assert res.exit_code == 1, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("attn-check: every failed check raised RuntimeError: my attention expects a cache"), lines
    assert res.stderr.count("raised RuntimeError") == 1 and "likely cause" not in res.stderr, res.stderr
    checks = load_run(res.run_dir).checks
    failed = checks[~checks["passed"]]
    assert len(failed) >= 5 and failed["observed"].isna().all()
    for detail in failed["detail"]:
        assert detail == "raised RuntimeError: my attention expects a cache but none was set up (second line)", detail
    summary = (res.run_dir / "summary.md").read_text()
    assert "every failed check raised RuntimeError" in summary and "Likely causes" not in summary


THREE_RAISED = {  # issue 22: hf:llama on transformers 5.23.0 before the fix (3/14 checks, nothing observed)
    "shapes": {"passed": False, "observed": None, "threshold": None,
               "detail": "raised TypeError: create_causal_mask() got an unexpected keyword argument 'cache'"},
    "sdpa_match": {"passed": False, "observed": None, "threshold": None,
                   "detail": "raised TypeError: create_causal_mask() got an unexpected keyword argument 'cache'"},
    "row_sums": {"passed": False, "observed": None, "threshold": None,
                 "detail": "raised TypeError: create_causal_mask() got an unexpected keyword argument 'cache'"},
    "chunked_match": {"passed": True, "observed": 1e-7, "threshold": 1e-6, "detail": "max abs err 1e-07"},
}


def test_diagnosis_never_takes_a_raised_check_for_evidence():
    assert diagnose("attn-check", THREE_RAISED, [], {"n_heads": 4}) == []
    assert common_exception(THREE_RAISED) == THREE_RAISED["shapes"]["detail"]
    # a measured failure next to raised ones is still explained, from the measured check alone
    mixed = {**THREE_RAISED, "row_sums": {"passed": False, "observed": 0.5, "threshold": 1e-6, "detail": "rows"}}
    found = diagnose("attn-check", mixed, [], {"n_heads": 4})
    assert [i.planted for i in found] == [("WrongSoftmaxAxis",)], [i.line() for i in found]
    assert common_exception(mixed) is None


# ------------------------------------------------------------------------- a shipped adapter's fault
def test_shipped_adapter_fault_crashes_exit_3_naming_transformers_version_and_range(tmp_path, monkeypatch):
    """A transformers release whose mask builder wants an argument the adapter does not know: the run is
    `crashed` (exit 3), the message names transformers, its version and the supported range, and no check
    blames the layer. Before: every check "failed" (exit 1) with the TypeError and likely causes about masks."""
    hf()
    import transformers
    from transformers import masking_utils

    from tfmoe.adapters.transformers_support import SUPPORTED

    def create_causal_mask(config, inputs_embeds, attention_mask, cache, block_table, position_ids=None):
        raise AssertionError("never called: the adapter cannot fill block_table")

    monkeypatch.setattr(masking_utils, "create_causal_mask", create_causal_mask)
    res = run_cli(["attn-check", "impl=hf:llama", *SMALL, "checks=[masks,sdpa]"], tmp_path)
    assert res.exit_code == 3, res.stdout + res.stderr
    assert f"transformers {transformers.__version__}" in res.stderr and SUPPORTED in res.stderr, res.stderr
    assert "block_table" in res.stderr and "likely cause" not in res.stderr
    run = load_run(res.run_dir)
    assert run.run["status"] == "crashed"
    assert run.checks is None or not (~run.checks["passed"]).any(), run.checks  # the layer is never blamed


def test_hf_llama_on_the_older_mask_builder_signature_passes(monkeypatch):
    """transformers 5.0-5.23's create_causal_mask(config, input_embeds, attention_mask, cache_position,
    past_key_values, ...) (the floor's own is tested for real by scripts/test-hf-floor.sh): the adapter fills
    whichever names the installed function takes. Before: `cache=` raised TypeError in every check."""
    hf()
    from transformers import masking_utils

    real = masking_utils.create_causal_mask

    def create_causal_mask(config, input_embeds, attention_mask, cache_position, past_key_values, position_ids=None):
        assert cache_position.shape == (input_embeds.shape[1],)
        return real(config=config, inputs_embeds=input_embeds, attention_mask=attention_mask, cache=past_key_values,
                    position_ids=position_ids)

    monkeypatch.setattr(masking_utils, "create_causal_mask", create_causal_mask)
    from tfmoe.api.testing import run_recorded

    rec = run_recorded("attn-check", ["impl=hf:llama", *SMALL, "checks=[masks,sdpa]"])
    assert rec.checks_rows and all(c.passed for c in rec.checks_rows), [(c.check, c.detail) for c in rec.checks_rows]
