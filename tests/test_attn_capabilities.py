"""The capability model in module mode (tfmoe.rules.capabilities, issue 28): declarations are read, a declared lack of
the run's own setting is exit 2, a lacking feature's checks are n/a (listed, never failed), an undeclared
NotImplementedError is n/a too, other exceptions fail, precision is declared or detected, unused parameters are
listed and a detached one fails, and the default run catches a layer that ignores its padding mask."""

from __future__ import annotations

import pytest

from tfmoe.api.testing import run_cli, run_recorded
from tfmoe.contract.errors import BadInput
from tfmoe.rules import capabilities as caps

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the layer's own checks (the chunked group judges tfmoe's kernel, not the layer, and costs the most)
LAYER_GROUPS = "checks=[masks,sdpa,fully_masked,gradients,kv_cache,invariances,dropout]"
FAST = [LAYER_GROUPS, "dropout_samples=20000", "gradcheck_T=2"]


def battery(*overrides: str):
    rec = run_recorded("attn-check", [*FAST, *overrides])
    return {c.check: c for c in rec.checks_rows}, rec


def outcomes(checks, outcome: str) -> set[str]:
    return {name for name, c in checks.items() if c.outcome == outcome}


# ------------------------------------------------------------------- the learner's bug, under the defaults
def test_a_module_ignoring_its_padding_mask_fails_the_default_run(tmp_path):
    """No options at all: `tfmoe attn-check impl=...` exits 1 on the chapter's listing without its padding line."""
    res = run_cli(["attn-check", "impl=buggy_attention:IgnoresPaddingMask"], tmp_path)
    assert res.exit_code == 1, res.stdout + res.stderr
    from tfmoe.harness.store.notebook import load_run

    checks = load_run(res.run_dir).checks.set_index("check")
    assert not checks.loc["left_padding_match", "passed"]
    assert checks["passed"].sum() == len(checks) - 1  # nothing else is blamed


def test_the_correct_module_passes_the_left_padded_probe():
    checks, _ = battery("impl=buggy_attention:PlainMHA")
    assert checks["left_padding_match"].outcome == "passed" and outcomes(checks, "failed") == set()


# ------------------------------------------------------------------------ rule 2: declared -> n/a
@pytest.mark.parametrize("overrides", [
    ["impl=buggy_attention:CausalOnlyNoPadding"],  # its class says tfmoe_lacks = ("padding_mask",)
    ["impl=buggy_attention:NoPaddingSupport", "lacks=[padding_mask]"],  # the config says it
])
def test_a_declared_missing_padding_mask_makes_its_checks_not_applicable(overrides):
    checks, rec = battery(*overrides)
    assert outcomes(checks, "failed") == set(), {n: checks[n].detail for n in outcomes(checks, "failed")}
    na = outcomes(checks, "n/a")
    assert {"left_padding_match", "fully_masked_rows"} <= na
    assert all("lacks padding_mask" in checks[n].detail or "NotImplementedError" in checks[n].detail for n in na)
    assert {"sdpa_match", "grad_match", "gradcheck", "batch_independence"} <= outcomes(checks, "passed")
    assert any("full rows" in n for n in rec.notes)


def test_a_declared_lack_does_not_hide_a_real_bug():
    checks, _ = battery("impl=buggy_attention:CausalOnlyIgnoringDeclaredPadding")
    assert "sdpa_match" in outcomes(checks, "failed")


# ------------------------------------------------------------ rule 3: undeclared NotImplementedError -> n/a
def test_an_undeclared_not_implemented_error_is_not_applicable_with_its_message():
    checks, rec = battery("impl=buggy_attention:NoPaddingSupport")
    assert outcomes(checks, "failed") == set()
    assert checks["left_padding_match"].outcome == "n/a"
    assert "padding is not supported" in checks["left_padding_match"].detail
    assert "sdpa_match" in outcomes(checks, "passed")
    assert any("NotImplementedError" in n for n in rec.notes)


def test_any_other_exception_still_fails_its_checks():
    checks, _ = battery("impl=buggy_attention:RaisesOnPadding", "checks=[masks,sdpa]")
    assert not checks["shapes"].passed and checks["shapes"].detail.startswith("raised ValueError")


# ---------------------------------------------------------------------- rule 1: refusal of the main setting
@pytest.mark.parametrize(("overrides", "fragment", "fix"), [
    (["impl=buggy_attention:NoGqaDeclared", "n_kv_heads=1"], "lacks gqa", "n_kv_heads=null"),
    (["impl=capability_layers:NoGqaAdapter", "n_kv_heads=1"], "lacks gqa", "n_kv_heads=null"),
    (["impl=capability_layers:LacksDeclaredAdapter", "n_kv_heads=1"], "lacks gqa", "n_kv_heads=null"),
    (["impl=buggy_attention:CausalOnlyNoPadding", "lengths=[4,2]"], "lacks padding_mask", "lengths=null"),
    (["lacks=[non_causal]", "causal=false"], "lacks non_causal", "causal=true"),
    (["lacks=[bf16]", "dtype=bf16"], "lacks bf16", "dtype=fp32"),
])
def test_a_declared_lack_of_the_runs_own_setting_is_exit_2_and_the_fix_is_accepted(overrides, fragment, fix):
    with pytest.raises(BadInput, match=fragment) as err:
        battery(*overrides)
    assert "\n" not in str(err.value) and fix in str(err.value)
    key = fix.split("=")[0]
    fixed = [o for o in overrides if not o.startswith(key + "=") and not o.startswith("--")] + [fix]
    checks, _ = battery(*fixed, "checks=[sdpa]")
    assert outcomes(checks, "failed") == set()


def test_an_unknown_feature_name_is_exit_2_naming_the_known_ones():
    with pytest.raises(BadInput, match="unknown feature") as err:
        battery("lacks=[padding]")
    assert "padding_mask" in str(err.value) and "\n" not in str(err.value)


def test_the_supports_gqa_flag_was_read_before_tfmoe_could_crash():
    """Issue 28: supports_gqa = False was never read; n_kv_heads=1 then crashed in tfmoe's shapes check (exit 3)."""
    res = run_cli(["attn-check", "impl=capability_layers:NoGqaAdapter", "n_kv_heads=1"], _tmp())
    assert res.exit_code == 2 and "lacks gqa" in res.stderr and "Traceback" not in res.stderr + res.stdout


def _tmp():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp())


# -------------------------------------------------------------------------------- rule 4: precision
def test_an_undeclared_lower_precision_fails_naming_the_cause_and_the_declaration():
    checks, _ = battery("impl=buggy_attention:Bf16Internal", "checks=[sdpa]")
    detail = checks["sdpa_match"].detail
    assert not checks["sdpa_match"].passed and "computes in bfloat16" in detail and "compute_dtype=bf16" in detail


def test_a_declared_lower_precision_is_judged_at_that_precision():
    checks, rec = battery("impl=buggy_attention:Bf16Declared")
    assert outcomes(checks, "failed") == set(), {n: checks[n].detail for n in outcomes(checks, "failed")}
    assert "declared" in checks["sdpa_match"].detail and "bfloat16" in checks["sdpa_match"].detail
    assert checks["gradcheck"].outcome == "n/a"


def test_the_declaration_from_the_config_is_read_the_same_way():
    checks, _ = battery("impl=buggy_attention:Bf16Internal", "compute_dtype=bf16", "checks=[sdpa]")
    assert outcomes(checks, "failed") == set()


def test_a_declared_precision_does_not_hide_a_real_bug():
    checks, _ = battery("impl=buggy_attention:Bf16DeclaredWrongScale", "checks=[sdpa]")
    assert not checks["sdpa_match"].passed


# -------------------------------------------------------------------------------------------- gradients
def test_parameters_the_attention_never_reads_are_listed_not_judged():
    """Issue 28: a block adapter's layer norms and MLP were scored inf ("dln_1.weight: inf (limit 0)")."""
    checks, rec = battery("impl=capability_layers:BlockAttentionAdapter", "checks=[gradients]")
    assert checks["grad_match"].passed, checks["grad_match"].detail
    assert "ln_1.weight" in checks["grad_match"].detail and "not judged" in checks["grad_match"].detail
    assert checks["gradcheck"].passed


def test_a_detached_parameter_fails_grad_match():
    checks, _ = battery("impl=capability_layers:DetachedOutAdapter", "checks=[gradients]")
    assert not checks["grad_match"].passed and "no gradient from the layer" in checks["grad_match"].detail


# ------------------------------------------------------------------------------------------- the model
def test_declarations_read_every_source_and_the_legacy_flags():
    class Adapter:
        lacks = ("dropout",)
        supports_gqa = False
        compute_dtype = "bfloat16"

    class Layer:
        tfmoe_lacks = "kv_cache"

    decl = caps.declared(Adapter(), Layer, config_lacks=["backward"], config_precisions={"expert_dtype": "fp16"})
    assert decl.lacks == {"dropout", "gqa", "kv_cache", "backward"}
    assert decl.precisions == {"attention": "bf16", "experts": "fp16"}
    assert "supports_gqa = False" in decl.why("gqa") and "config" in decl.why("backward")


@pytest.mark.parametrize(("value", "fragment"), [("fp8", "not a precision"), (3, "not a precision")])
def test_a_bad_precision_is_refused(value, fragment):
    with pytest.raises(BadInput, match=fragment):
        caps.precision_name(value, "compute_dtype")


def test_explaining_precision_picks_the_finest_that_covers_the_error():
    limits = {"fp16": 1e-3, "bf16": 8e-3}
    assert caps.explaining_precision(5e-4, "fp32", limits) == "fp16"
    assert caps.explaining_precision(5e-3, "fp32", limits) == "bf16"
    assert caps.explaining_precision(5e-2, "fp32", limits) is None
    assert caps.explaining_precision(float("nan"), "fp32", limits) is None
    assert caps.explaining_precision(1e-4, "bf16", limits) is None  # nothing is coarser than bf16


def test_not_implemented_detail_keeps_the_first_line():
    detail = caps.not_implemented_detail(NotImplementedError("no padding\nsecond line"), "padding_mask")
    assert detail.startswith("not applicable:") and "no padding" in detail and "second line" not in detail
    assert "(no message)" in caps.not_implemented_detail(NotImplementedError())


# ----------------------------------------------------------------------- chunked_match's yardstick (F-163)
def test_chunked_match_yardstick_does_not_come_from_the_kernels_own_file(monkeypatch):
    """A broken naive path in the chunked kernel's own file cannot move chunked_match's limit any more."""
    import torch

    from tfmoe.components import chunked_attention
    from tfmoe.experiments.attn_check.checks import chunked

    def broken(q, k, v, **kwargs):
        return torch.full_like(q, float("nan"))

    monkeypatch.setattr(chunked_attention, "naive_attention", broken)
    monkeypatch.setattr(chunked, "naive_attention", broken)
    rec = run_recorded("attn-check", ["checks=[chunked]", "chunked.probe_T=128", "chunked.timing_repeats=1",
                                      "chunked.memory_ratio_max=1"])
    checks = {c.check: c for c in rec.checks_rows}
    assert checks["chunked_match"].passed and checks["chunked_match"].observed < 1e-5


# ------------------------------------------------------------- negative limits, in every mode (issue 29)
@pytest.mark.parametrize("override", ["cases.batch=-1", "cases.q_heads=0", "cases.scale=-0.5",
                                      "kernel_checks.dropout_p=-0.1", "kernel_checks.dropout_seeds=0",
                                      "kernel_checks.grad_factor=-2"])
def test_kernel_limits_are_refused_in_module_mode_too(override):
    with pytest.raises(BadInput) as err:
        run_recorded("attn-check", [override])
    assert override.split("=")[0] in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------- sizes are the user's (issue 29 item 2)
@pytest.mark.parametrize("override", ["d_model=1000000000", "B=1000000000", "T=1000000000"])
def test_a_huge_layer_is_refused_naming_the_dominant_knob(override, monkeypatch):
    import re

    from tfmoe.api.testing import compose
    from tfmoe.experiments import attn_check
    from tfmoe.rules import memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda: 16 * 2**30)
    with pytest.raises(BadInput) as err:
        attn_check.settings(compose("attn-check", [override]))
    message = str(err.value)
    assert "\n" not in message and message.startswith(override.split("=")[0])
    fix = re.search(r"\(at most about ([^()]*)\)$", message)
    if fix:  # the size guard's advice is itself accepted
        attn_check.settings(compose("attn-check", [override, *fix[1].split()]))
    else:  # T: the naive path's own guard (refuse_if_too_big) names T and mode=chunked
        assert "mode=chunked" in message or "T=" in message


# ------------------------------------------------ rows that see no key: one policy vocabulary in every mode
ACCEPTED = {"finite": {"zeros", "mean_of_v", "other"}, "zeros": {"zeros"}, "nan": {"nan"},
            "mean_of_v": {"mean_of_v"}, "uniform": {"mean_of_v"}, "any": {"zeros", "mean_of_v", "other", "nan"}}


@pytest.mark.parametrize("kind", ["zeros", "nan", "mean_of_v", "other"])
def test_fully_masked_policies_mean_the_same_in_module_and_kernel_mode(kind):
    """The same rows (zeros, NaN, the uniform average of v, finite and unspecified) meet the same policies in
    module mode (fully_masked_policy) and kernel mode (kernel_checks.fully_masked_expect): `any` accepts
    anything (NaN included), `finite` any finite value; a finite unspecified row no longer fails under `any`."""
    import buggy_kernels as bk

    for policy, kinds in ACCEPTED.items():
        assert caps.fully_masked_accepts(policy, kind) == (kind in kinds)
        module = run_recorded("attn-check", [f"impl=buggy_kernels:{bk.EMPTY_ROW_MODULES[kind]}", "checks=[fully_masked]",
                                             f"fully_masked_policy={policy}", "dropout=0"])
        row = {c.check: c for c in module.checks_rows}["fully_masked_rows"]
        kernel = run_recorded("attn-check", [f"kernel=buggy_kernels:{bk.EMPTY_ROW_KERNELS[kind]}",
                                             "cases.shapes=[[5,7,12],[1,6,16]]", "kernel_checks.long_row=null",
                                             "kernel_checks.dropout_p=0", "cases.masks=[none,pad_bool,fully_masked]",
                                             f"kernel_checks.fully_masked_expect={policy}"])
        fam = {c.check: c for c in kernel.checks_rows}["kernel_fully_masked"]
        assert row.passed == fam.passed == (kind in kinds), (policy, kind, row.detail, fam.detail)
        if not fam.passed and kind == "other":  # the fix it names is itself accepted
            assert "set it to finite" in fam.detail


def test_unknown_policy_is_refused_in_both_modes_with_the_vocabulary():
    with pytest.raises(BadInput, match="finite, zeros, nan, mean_of_v, any"):
        run_recorded("attn-check", ["kernel=torch:sdpa", "kernel_checks.fully_masked_expect=ones"])
    with pytest.raises(BadInput, match="'finite', 'zeros', 'nan', 'mean_of_v', 'any'"):
        run_recorded("attn-check", ["fully_masked_policy=ones"])
