"""Errors are not failures in kernel mode too (issue 22's leftover): an exception from the user's kernel fails that
case, led by the exception in full (so no likely cause is drawn from it); an exception that is tfmoe's — a built-in
kernel's wrapper, the arguments the battery built, the battery's own code — crashes the run (exit 3) naming tfmoe
and torch's version, and no check blames the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tfmoe.api.testing import caught, run_cli, run_recorded
from tfmoe.contract.errors import AdapterError, ContractError
from tfmoe.experiments.attn_check import kernel_battery, kernel_judging
from tfmoe.experiments.attn_check.kernel_judging import enter_kernel, kernel_fault
from tfmoe.experiments.attn_check.kernels import Kernel
from tfmoe.harness.store.notebook import load_run
from tfmoe.rules.faults import is_raised

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL = ["cases.shapes=[[5,7,12],[7,5,8],[1,6,16]]", "kernel_checks.long_row=null"]  # test_attn_kernels.py's
USER = Kernel("my_attn:attend", F.scaled_dot_product_attention, None, "top_left")
BUILTIN = Kernel("torch:sdpa", F.scaled_dot_product_attention, None, "top_left")


def _users_code_raises():
    raise ValueError("mask layout not understood")


def failed(rec) -> dict[str, object]:
    return {c.check: c for c in rec.checks_rows if not c.passed}


# ------------------------------------------------------------------------------------------ whose fault
def test_whose_fault_a_kernel_exception_is():
    from tfmoe.components.references import visibility

    users = caught(_users_code_raises)
    assert kernel_fault(USER, users, "forward") is None
    tfmoes = caught(visibility, 4, 4, False, torch.ones(2, 3, dtype=torch.bool))  # raised inside tfmoe
    fault = kernel_fault(USER, tfmoes, "forward")
    assert isinstance(fault, AdapterError) and "references.py" in str(fault) and "bug of tfmoe" in str(fault)
    q = torch.randn(1, 2, 3, 4)
    native = caught(enter_kernel, Kernel("my:matmul", torch.matmul, None, "top_left"), q, q, q, {})
    assert kernel_fault(USER, native, "forward") is None  # a native kernel's own error: no Python frame of its own
    contract = caught(lambda: (_ for _ in ()).throw(ContractError("the kernel returned shape (1,)")))
    assert kernel_fault(USER, contract, "forward") is None
    for exc in (users, native, contract):  # a built-in kernel is tfmoe's code: whatever it raises is tfmoe's
        fault = kernel_fault(BUILTIN, exc, "forward")
        assert isinstance(fault, AdapterError) and f"torch {torch.__version__}" in str(fault)
        assert "not a failure of the kernel under test" in str(fault)


# ----------------------------------------------------------------------------------- the user's kernel
def test_user_kernel_raising_on_masks_fails_those_families_once_led_by_the_exception(tmp_path):
    """Before: each detail read '3 of 3 cases failed ...; worst (Tq=..): the kernel raised ValueError: ...', observed
    3.0 (a measurement), and the verdict did not say that one exception was all there was."""
    res = run_cli(["attn-check", "kernel=buggy_kernels:kernel_crashes_on_masks", *SMALL], tmp_path)
    assert res.exit_code == 1, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines[0] == ("attn-check: every failed check raised ValueError: mask layout not understood (one "
                        "exception in each; no check measured a wrong value: fix it first)"), lines
    assert res.stderr.count("raised ValueError") == 1 and "likely cause" not in res.stderr.lower(), res.stderr
    checks = load_run(res.run_dir).checks
    bad = checks[~checks["passed"]]
    assert set(bad["check"]) == {"kernel_padding_bool", "kernel_padding_additive"}
    assert bad["observed"].isna().all() and (bad["detail"] == "raised ValueError: mask layout not understood").all()
    assert checks[checks["check"] == "kernel_scale"]["passed"].all()  # what has no mask still passes


def test_user_kernel_raising_in_its_backward_fails_only_the_backward():
    rec = run_recorded("attn-check", ["kernel=buggy_kernels:kernel_backward_raises", *SMALL])
    bad = failed(rec)
    assert set(bad) == {"kernel_backward"}, {n: c.detail for n, c in bad.items()}
    row = bad["kernel_backward"]
    assert row.detail == "raised RuntimeError: my backward is not written yet (see TODO)"
    assert is_raised(row.observed, row.detail)
    assert any(n.startswith("kernel_backward: ") and "judged cases raised ((Tq=" in n for n in rec.notes)


def test_a_native_user_kernel_that_raises_fails_not_crashes():
    rec = run_recorded("attn-check", ["kernel=buggy_kernels:native_matmul", *SMALL, "kernel_checks.backward=false"])
    row = failed(rec)["kernel_scale"]
    assert row.detail.startswith("raised TypeError: ") and is_raised(row.observed, row.detail), row.detail


def test_a_measured_failure_leads_over_a_raised_case(monkeypatch):
    """Mixed: one case raises, the others measure a wrong value: the measurement leads (the diagnosis may read
    it), and the raised case is named after it."""
    import buggy_kernels

    def raises_on_decode(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.shape[2] == 1:
            raise ValueError("decode is not supported")
        return buggy_kernels.kernel_ignores_scale(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    monkeypatch.setattr(buggy_kernels, "mixed_kernel", raises_on_decode, raising=False)
    # 6 cases of the matrix and the family's exact-output probe (scores all 0 there: a scale bug cannot show)
    row = failed(run_recorded("attn-check", ["kernel=buggy_kernels:mixed_kernel", *SMALL]))["kernel_scale"]
    assert not is_raised(row.observed, row.detail) and row.observed == 4.0, row.detail
    assert row.detail.startswith("4 of 7 cases failed") and "2 cases raised: raised ValueError: decode" in row.detail


# ------------------------------------------------------------------------------------------ tfmoe's own
def test_torch_refusing_arguments_tfmoe_built_wrongly_crashes_exit_3_naming_tfmoe_and_torch(tmp_path, monkeypatch):
    """A battery bug: the boolean masks it gives the kernel are one key short. torch:sdpa refuses them; torch's
    frames are passed over, so the culprit is tfmoe's call of its built-in kernel: tfmoe's bug, never torch:sdpa
    failing kernel_padding_bool (as before, exit 1)."""
    real = kernel_battery.make_inputs

    def one_key_short(*args, **kwargs):
        inp = real(*args, **kwargs)
        mask = inp.kwargs.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:
            inp.kwargs["attn_mask"] = mask[..., :-1]
        return inp

    monkeypatch.setattr(kernel_battery, "make_inputs", one_key_short)
    res = run_cli(["attn-check", "kernel=torch:sdpa", *SMALL], tmp_path)
    assert res.exit_code == 3, res.stdout + res.stderr
    assert f"on torch {torch.__version__}" in res.stderr and "a bug of tfmoe" in res.stderr, res.stderr
    assert "built-in kernel torch:sdpa" in res.stderr and "kernel_padding_bool" not in res.stderr
    run = load_run(res.run_dir)
    assert run.run["status"] == "crashed"
    assert run.checks is None or run.checks["passed"].all(), run.checks  # the kernel is never blamed


def test_a_fault_in_a_built_in_wrapper_is_tfmoes(monkeypatch):
    from tfmoe.components import chunked_attention as module

    real = module.chunked_attention
    monkeypatch.setattr(module, "chunked_attention", lambda *a, **kw: real(*a, **{**kw, "block_size": 0}))
    with pytest.raises(AdapterError, match=r"kernel=tfmoe:chunked: raised ValueError: block_size=0 must be >= 1 "
                                           r"in the forward(?: with a one-hot v \(weights probe\))? of case .* at "
                                           r"chunked_attention.py:\d+") as err:
        run_recorded("attn-check", ["kernel=tfmoe:chunked", *SMALL])
    assert "built-in kernel tfmoe:chunked" in str(err.value)


def test_a_fault_in_the_battery_itself_is_tfmoes_with_a_users_kernel(monkeypatch):
    """The judging code after the kernel's call raises: tfmoe's error, not the (correct) user's kernel failing."""
    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(kernel_judging, "measured_weights_atol", broken)
    with pytest.raises(AdapterError, match="while judging case .*tfmoe's kernel battery, a bug of tfmoe") as err:
        run_recorded("attn-check", ["kernel=buggy_kernels:plain_kernel", *SMALL])
    assert "raised ZeroDivisionError: float division by zero" in str(err.value)
