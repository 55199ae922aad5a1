"""tfmoe attn-check: the battery passes correct modules and flags each planted bug by the check's name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tfmoe.api.testing import run_cli, run_recorded
from tfmoe.contract.errors import BadInput
from tfmoe.experiments.attn_check.checks import shapes

REPO_ROOT = Path(__file__).resolve().parents[1]

# Small probe sizes keep each battery run to a second or two; the defaults are exercised by the CLI test.
# At T=256 the O(T·Dh) terms weigh more against the naive T², hence a looser memory ratio than the default 0.1
# (a chunked path that materialises the scores still reads > 1).
FAST = ["chunked.probe_T=256", "chunked.probe_block_size=16", "chunked.timing_repeats=1", "dropout_samples=20000",
        "gradcheck_T=2", "chunked.memory_ratio_max=0.35"]
ALL_CHECKS = {"shapes", "row_sums", "causal_zero", "padding_zero", "sdpa_match", "left_padding_match", "fully_masked_rows", "gradcheck",
              "grad_match", "kv_cache_decode", "chunked_match", "chunked_match_large", "chunked_memory",
              "batch_independence", "batch_sizes", "head_counts", "dropout_eval_identity", "dropout_rate",
              "dropout_scale", "dropout_seed"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def battery(*overrides: str):
    rec = run_recorded("attn-check", [*FAST, *overrides])
    return {c.check: c for c in rec.checks_rows}, rec


def failed(checks) -> set[str]:
    return {name for name, c in checks.items() if not c.passed}


# ------------------------------------------------------------------------------------------- correct
def test_course_module_passes_every_check():
    checks, rec = battery()
    assert set(checks) == ALL_CHECKS
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}
    assert checks["sdpa_match"].observed < 1e-6  # fp32 vs fp64 SDPA: tight
    assert any("SDPA -> zeros" in n for n in rec.notes)


def test_plain_fixture_base_passes():
    """The planted bugs' base class is correct: each bug class differs from it by one step."""
    checks, _ = battery("impl=buggy_attention:PlainMHA", "dtype=fp64")
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}


def test_mha_wrapper_written_differently_passes():
    checks, rec = battery("impl=buggy_attention:MHAWrapper")
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}
    # its forward takes no cache: listed as not applicable (tfmoe.rules.capabilities), not faked, not failed
    assert checks["kv_cache_decode"].outcome == "n/a" and "kv_cache" in checks["kv_cache_decode"].detail


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp64"])
def test_course_module_passes_in_every_cpu_dtype(dtype):
    checks, _ = battery(f"dtype={dtype}")
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}


def test_non_causal_full_rows_skip_the_mask_checks():
    checks, _ = battery("causal=false", "lengths=[4,4]", "dropout=0")
    assert "causal_zero" not in checks  # not asked for: the layer is not causal
    assert not checks["padding_zero"].applicable and "vacuous" in checks["padding_zero"].detail  # said, not passed
    assert failed(checks) == set()


def test_same_seed_is_bit_identical():
    _, a = battery("checks=[masks]", "seed=3")
    _, b = battery("checks=[masks]", "seed=3")
    for name in ("x", "w_qkv", "attn", "out"):
        assert torch.equal(a.tensors_saved[name], b.tensors_saved[name]), name


# ------------------------------------------------------------------------------------- planted bugs
# Each planted bug runs through the WHOLE battery and must fail exactly these checks: its own family's, and only
# the others the maths forces (issue 11 item 9: no blame leak). Checks a bug makes unjudgeable (a wrong forward
# for grad_match / kv_cache_decode / head_counts, a wrong output shape for everything) are not judged, with a
# note naming the check to fix first.
BLAME = [  # (overrides, the exact set of failing checks, why the set is what the maths forces)
    (["impl=buggy_attention:WrongSoftmaxAxis"], {"row_sums", "sdpa_match", "left_padding_match"}, "weights and output both wrong"),
    (["impl=buggy_attention:ScaleByDModel"], {"sdpa_match", "left_padding_match"}, ""),
    (["impl=buggy_attention:ScaleByDModel", "n_heads=1", "head_counts=[1,2]"], {"head_counts"},
     "sqrt(d_model) = sqrt(d_head) at H=1: only another head count shows it"),
    (["impl=buggy_attention:CausalOffByOne"], {"causal_zero", "sdpa_match", "left_padding_match"}, "a future key seen changes the output"),
    (["impl=buggy_attention:PaddingOnQueries"], {"left_padding_match"},
     "causal + right padding: padded keys are seen only by padded queries, whose rows are don't-care by default; "
     "the left-padded probe's real queries follow padded keys (issue 28: the default run catches it)"),
    (["impl=buggy_attention:PaddingOnQueries", "padded_query_policy=attend"], {"row_sums", "sdpa_match", "left_padding_match"},
     "padded queries judged: the bug blanks them"),
    (["impl=buggy_attention:PaddingOnQueries", "causal=false"], {"padding_zero", "sdpa_match", "left_padding_match"},
     "real queries see padded keys; the blanked padded query rows are don't-care (row_sums skips them)"),
    (["impl=buggy_attention:MissingTransposeMerge"], {"sdpa_match", "left_padding_match"}, ""),
    (["impl=buggy_attention:HeadAveragedWeights"], {"shapes"}, ""),
    (["impl=buggy_attention:TimeMajorOutput"], {"shapes"}, ""),
    (["impl=buggy_attention:NaiveMHAWrapper"], {"fully_masked_rows"}, ""),
    (["impl=buggy_attention:WrongSoftmaxBackward"], {"gradcheck", "grad_match"}, ""),
    (["impl=buggy_attention:DowncastToFp32"], set(), "fp32 compute is correct in an fp32 run"),
    (["impl=buggy_attention:DowncastToFp32", "dtype=fp64"], {"sdpa_match", "left_padding_match"}, ""),
    (["impl=buggy_attention:Bf16Internal"], {"sdpa_match", "left_padding_match"}, ""),
    (["impl=buggy_attention:CacheWithoutOffset"], {"kv_cache_decode"}, ""),
    (["impl=buggy_attention:GlobalMaxSoftmax"], {"batch_independence", "fully_masked_rows"},
     "a second real defect: its 0/0 in fully masked rows, hidden by torch.where, is NaN in the backward"),
    (["impl=buggy_attention:RepeatMaskBug"], {"batch_sizes", "sdpa_match", "left_padding_match"},
     "row b gets another row's padding: output changed, B=1 differs from B=2; the padded keys it lets through are "
     "seen only by padded queries (causal), don't-care by default"),
    (["impl=buggy_attention:RepeatMaskBug", "padded_query_policy=attend"], {"batch_sizes", "padding_zero", "sdpa_match",
                                                                        "left_padding_match"},
     "padded queries judged: they see the padded keys"),
    (["impl=buggy_attention:DropoutAlwaysOn"], {"dropout_eval_identity"}, ""),
    (["impl=buggy_attention:DropoutNoRescale"], {"dropout_scale"}, ""),
    (["impl=buggy_attention:DropoutKeepProb"], {"dropout_rate", "dropout_scale"}, "keeps p and scales by 1/p"),
    (["impl=buggy_attention:DropoutNumpyRNG"], {"dropout_seed"}, ""),
    (["chunked.impl=buggy_attention:chunked_no_rescale"], {"chunked_match", "chunked_match_large"}, ""),
    (["chunked.impl=buggy_attention:chunked_materialized"], {"chunked_memory"}, ""),
]


@pytest.mark.parametrize(("overrides", "expected", "why"), BLAME,
                         ids=["-".join(o.split(":")[-1] for o in b[0]) for b in BLAME])
def test_planted_bug_fails_exactly_its_family(overrides, expected, why):
    """Every check proven able to fail, and no check blamed for another family's bug (whole battery)."""
    checks, _ = battery(*overrides)
    assert failed(checks) == expected, {n: checks[n].detail for n in failed(checks) ^ expected if n in checks}


def test_bf16_internal_is_named_in_fp16():
    checks, _ = battery("impl=buggy_attention:Bf16Internal", "dtype=fp16", "checks=[sdpa]")
    assert not checks["sdpa_match"].passed and "computes in bfloat16" in checks["sdpa_match"].detail


def test_scale_bug_no_longer_fails_fully_masked_rows():
    """Issue 11 item 9 (F-73): fully_masked_rows re-judged the other rows against SDPA, so a sqrt(d_model) scale
    also failed it ("8 values of the other rows off the reference"). It now judges only fully masked rows."""
    checks, _ = battery("impl=buggy_attention:ScaleByDModel", "checks=[fully_masked]")
    assert checks["fully_masked_rows"].passed, checks["fully_masked_rows"].detail


def test_prerequisites_are_named_not_blamed():
    _, rec = battery("impl=buggy_attention:TimeMajorOutput", "checks=[sdpa,gradients]")
    assert any("not judged" in n and "see shapes" in n for n in rec.notes)
    _, rec = battery("impl=buggy_attention:ScaleByDModel", "checks=[gradients,invariances]")
    assert any("grad_match not judged" in n for n in rec.notes)
    assert any("head_counts not judged" in n for n in rec.notes)


def test_padding_on_queries_in_the_default_causal_case():
    # causal + right padding: padded keys are visible only to padded queries, which the bug blanks out, so
    # padding_zero cannot see it there (test above uses causal=false); the blanked rows fail row_sums instead
    checks, _ = battery("impl=buggy_attention:PaddingOnQueries", "checks=[masks,sdpa]", "padded_query_policy=attend")
    assert checks["padding_zero"].passed and not checks["row_sums"].passed and not checks["sdpa_match"].passed


def test_failed_check_saves_its_failing_inputs():
    _, rec = battery("impl=buggy_attention:CausalOffByOne", "checks=[masks]")
    assert {"failing.causal_zero.x", "failing.causal_zero.attn"} <= set(rec.tensors_saved)


def test_failed_dropout_and_memory_checks_save_their_inputs():
    """dropout_rate / chunked_memory failures carry what reproduces them (readout x, both outputs, the kept
    mask; the probe's q, k, v) so `tfmoe failures add` can point at them."""
    checks, rec = battery("impl=buggy_attention:DropoutKeepProb", "checks=[dropout]")
    assert not checks["dropout_rate"].passed
    saved = set(rec.tensors_saved)
    assert {f"failing.dropout_rate.{n}" for n in ("x", "padding_mask", "w_qkv", "out_train", "out_no_dropout",
                                                  "kept_mask")} <= saved
    kept = rec.tensors_saved["failing.dropout_rate.kept_mask"]
    assert kept.dtype == torch.bool and 0.05 < kept.double().mean() < 0.2  # keeps ~p of the entries (keep_prob bug)
    checks, rec = battery("chunked.impl=buggy_attention:chunked_materialized", "checks=[chunked]")
    assert not checks["chunked_memory"].passed
    assert {"failing.chunked_memory.q", "failing.chunked_memory.k", "failing.chunked_memory.v"} <= set(rec.tensors_saved)


def test_dropout_checks_do_not_blame_dropout_for_a_merge_bug():
    """The dropout readout divides train-mode by a dropout=0 readout of the same class, so a bug elsewhere
    (heads merged without the transpose) does not fail the dropout checks; a masking bug is named as a
    prerequisite in the detail instead of being blamed on dropout."""
    checks, _ = battery("impl=buggy_attention:MissingTransposeMerge", "checks=[dropout]")
    for name in ("dropout_eval_identity", "dropout_rate", "dropout_scale", "dropout_seed"):
        assert checks[name].passed, checks[name].detail
    checks, _ = battery("impl=buggy_attention:CausalOffByOne", "checks=[dropout]")
    assert checks["dropout_rate"].passed and "PREREQUISITE" in checks["dropout_rate"].detail


def test_kv_cache_compares_with_the_modules_own_forward():
    # ScaleByDModel's forward is off SDPA, but its cache reproduces its own full forward: kv_cache_decode passes
    checks, rec = battery("impl=buggy_attention:ScaleByDModel", "checks=[kv_cache]")
    assert checks["kv_cache_decode"].passed, checks["kv_cache_decode"].detail
    by_cmp = {r.get("comparison"): r["value"] for r in rec.metrics_rows if r["name"] == "max_abs_err"}
    assert by_cmp["kv_cache_vs_full_forward"] <= checks["kv_cache_decode"].threshold
    assert by_cmp["kv_cache_vs_sdpa"] > 1e-3  # the extra SDPA metric still shows the forward's own error
    # the merge bug makes T=1 steps (correct) disagree with the full forward (wrong): the cache is not to blame,
    # so kv_cache_decode is not judged and a note points at the forward's checks
    checks, rec = battery("impl=buggy_attention:MissingTransposeMerge", "checks=[kv_cache]")
    assert "kv_cache_decode" not in checks
    assert any("kv_cache_decode not judged" in n and "sdpa_match" in n for n in rec.notes)


def test_shapes_judges_only_what_the_module_shows(capsys):
    rows = [shapes.ShapeRow("qkv", "(B, T, 3D)", (2, 4, 24), None, "module", True),
            shapes.ShapeRow("scores", "(B, H, T, T)", (2, 2, 4, 4), (9, 9), "derived", False),
            shapes.ShapeRow("output", "(B, T, D)", (2, 4, 8), (4, 2, 8), "module", True)]
    wrong, unobserved = shapes.judge_shapes(rows)
    assert wrong == ["output: (4, 2, 8) != (2, 4, 8)"] and unobserved == ["qkv"]  # derived rows never judged
    assert shapes.judge_shapes(rows[1:2]) == ([], [])
    # a module that never calls qkv/out as layers (weights handed to nn.MultiheadAttention): said, not hidden
    checks, rec = battery("impl=buggy_attention:MHAWrapper", "checks=[masks]")
    assert checks["shapes"].passed and "NOT observed" in checks["shapes"].detail
    assert "qkv = x·W_qkvᵀ" in checks["shapes"].detail and any("not observed" in n for n in rec.notes)
    checks, _ = battery("checks=[masks]")
    assert "NOT observed" not in checks["shapes"].detail
    # a layer with no fused qkv layer to hook was called all the same: the table says what was observed
    capsys.readouterr()
    checks, rec = battery("impl=torch:mha", "checks=[masks]")
    assert checks["shapes"].passed and "NOT observed" not in checks["shapes"].detail
    assert "no fused qkv / output layer" in checks["shapes"].detail
    table = capsys.readouterr().out
    assert "no such layer to hook" in table and "never called" not in table


def test_module_that_raises_fails_its_checks_instead_of_crashing():
    checks, rec = battery("impl=buggy_attention:RaisesOnPadding", "checks=[masks,sdpa]")
    assert not checks["shapes"].passed and "raised ValueError" in checks["shapes"].detail
    assert not checks["row_sums"].passed and any("ValueError" in n for n in rec.notes)


# -------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("overrides", "fragment"), [
    (["d_model=10", "n_heads=3"], "not divisible"),
    (["T=0"], "T=0"),
    (["lengths=[4,5]"], "outside 0..T"),
    (["lengths=[4]"], "1 entries but B=2"),
    (["impl=no_such_pkg.mod:Attn"], "cannot import"),
    (["impl=buggy_attention:Missing"], "has no"),
    (["impl=buggy_attention:NOT_A_MODULE"], "not a torch.nn.Module"),
    (["impl=buggy_attention:chunked_no_rescale"], "not a torch.nn.Module"),
    (["impl=buggy_attention:NoPaddingArg"], "padding_mask"),
    (["impl=noColon"], "python.module:Name"),
    (["T=1000000"], "mode=chunked"),
    (["dropout=1.5"], "dropout"),
    (["chunked.impl=buggy_attention:NOT_A_MODULE"], "not callable"),
    (["mode=fast"], "mode"),
    (["checks=[masks,speed]"], "unknown groups"),
])
def test_bad_input_is_refused_with_the_fix(overrides, fragment):
    with pytest.raises(BadInput, match=fragment) as err:
        run_recorded("attn-check", overrides)
    assert ":" in str(err.value) and "\n" not in str(err.value)


def test_settings_import_no_user_code_and_pick_the_battery():
    """Issue 12: settings(cfg) only validates (a sweep validates every job before any starts): it must not import
    impl= / kernel= / chunked.impl= (run() does, and gives the one-line exit 2 there); kernel=SPEC selects the
    kernel battery's settings."""
    import sys

    from tfmoe.api.testing import compose
    from tfmoe.experiments import attn_check

    s = attn_check.settings(compose("attn-check", ["impl=i12_never_imported:Attn",
                                                   "chunked.impl=i12_never_imported_either:f"]))
    assert isinstance(s, attn_check.Settings) and isinstance(s.battery, attn_check.ModuleSettings)
    assert s.battery.impl == "i12_never_imported:Attn" and s.battery.n_kv_heads == s.battery.n_heads == 2
    assert "i12_never_imported" not in sys.modules and "i12_never_imported_either" not in sys.modules
    k = attn_check.settings(compose("attn-check", ["kernel=i12_never_imported_kernel:attention"]))
    assert isinstance(k.battery, attn_check.KernelSettings) and len(k.battery.cases) == 12 * 15 + 2  # + dropout, long_rows
    assert "i12_never_imported_kernel" not in sys.modules
    with pytest.raises(BadInput, match="unknown groups"):
        attn_check.settings(compose("attn-check", ["checks=[masks,speed]"]))


def test_metrics_written_in_the_battery_modules_are_declared():
    """Issue 12 (F-77): an expectation's metric is checked against the names the experiment's source writes; with
    the checks moved to experiments/attn_check/, metrics written only there (fp64_forward_max_abs_err, and kernel
    mode's err / case_passed) would be refused as unknown."""
    from tfmoe.harness.method import declared_metrics

    declared = declared_metrics.declared_for("attn-check")
    assert {"fp64_forward_max_abs_err", "err", "case_passed", "sdpa_match"} - set(declared) == {"sdpa_match"}
    assert declared["max_abs_err"] is not None and "comparison" in declared["max_abs_err"]


# ----------------------------------------------------------------------------------------------- CLI
def test_cli_default_run_exit_0_and_run_directory(tmp_path):
    from tfmoe.harness.store.notebook import load_run

    res = run_cli(["attn-check"], tmp_path)
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "attention shapes" in res.stdout and "(2, 2, 4, 4)" in res.stdout
    run = load_run(res.run_dir)
    assert run.checks["passed"].all() and set(run.checks["check"]) == ALL_CHECKS
    tensors = run.tensors
    assert tuple(tensors["x"].shape) == (2, 4, 8) and tuple(tensors["attn"].shape) == (2, 2, 4, 4)
    assert tuple(tensors["w_qkv"].shape) == (24, 8) and tuple(tensors["w_out"].shape) == (8, 8)
    assert tensors["padding_mask"].dtype == torch.bool and not bool(tensors["padding_mask"].all())
    assert (res.run_dir / "attention_heatmap.png").exists()
    assert {"naive", "chunked", "sdpa"} <= set(run.metrics.loc[run.metrics["name"] == "peak_mem_bytes", "variant"])
    summary = (res.run_dir / "summary.md").read_text()
    assert summary.count("| check | passed |") == 1, summary  # issue 12: the checks table was written twice
    assert "| check | detail |" in summary and "| sdpa_match | module vs SDPA" in summary


def test_cli_flags_a_bug_with_exit_1_and_names_the_check(tmp_path):
    res = run_cli(["attn-check", "impl=buggy_attention:MissingTransposeMerge", *FAST], tmp_path)
    assert res.exit_code == 1, res.stdout + res.stderr
    assert "check(s) failed" in res.stderr and "sdpa_match" in res.stderr


def test_cli_bad_input_exit_2_one_line(tmp_path):
    res = run_cli(["attn-check", "d_model=10", "n_heads=3"], tmp_path)
    assert res.exit_code == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "divisible" in lines[0]


def test_chunked_mode_runs_without_the_naive_path():
    rec = run_recorded("attn-check", ["mode=chunked", "T=512", "B=1", "n_heads=2", "d_model=64",
                                      "chunked.probe_block_size=16"])
    checks = {c.check: c for c in rec.checks_rows}
    assert set(checks) == {"chunked_match_large", "chunked_memory"} and all(c.passed for c in checks.values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_cuda_battery_passes(dtype):
    """On CUDA the chunked memory probe runs at its default T=1024 (F-212: at FAST's T=256 the output and the fp32
    accumulators alone were 0.37 of the naive peak on an H200, over memory_ratio_max=0.1)."""
    rec = run_recorded("attn-check", [o for o in FAST if not o.startswith("chunked.probe_T=")] +
                       ["device=cuda", f"dtype={dtype}"])
    checks = {c.check: c for c in rec.checks_rows}
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}
    assert any(r["device_ms"] is not None for r in rec.timings_rows)  # CUDA events


# ------------------------------------------------------------------ issue 11: references share no code
def test_reference_masks_do_not_share_the_packages_mask_helper(monkeypatch):
    """Issue 11 item 1 (F-71): the references built their masks with tfmoe's own combine_masks/causal_mask, so
    an off-by-one in that helper (each query also sees the next key) left sdpa_match passing (3e-8) while
    chunked_match was blamed. The reference now writes its own lower-triangular matrix."""
    from tfmoe.components import masks

    def causal_off_by_one(T, device=None, offset=0, T_k=None):
        T_k = T + offset if T_k is None else T_k
        return torch.arange(T_k, device=device)[None, :] <= torch.arange(T, device=device)[:, None] + offset + 1

    monkeypatch.setattr(masks, "causal_mask", causal_off_by_one)
    checks, _ = battery("checks=[masks,sdpa,chunked]")
    assert not checks["sdpa_match"].passed, checks["sdpa_match"].detail
    assert not checks["causal_zero"].passed
    assert checks["chunked_match"].passed, checks["chunked_match"].detail  # the chunked kernel is not to blame


def test_references_import_nothing_they_judge():
    """The reference module imports neither tfmoe's masks/attention/chunked kernels nor any library helper."""
    import ast
    import inspect

    from tfmoe.components import comparison, reference_attention, references

    allowed = {"__future__", "math", "dataclasses", "torch", "torch.nn.functional"}
    for module in (references, reference_attention, comparison):  # references reads the kernel reference's masks
        tree = ast.parse(inspect.getsource(module))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert imported <= allowed | {"tfmoe.components.reference_attention"}, (module.__name__, imported)


# ----------------------------------------------------------- issue 11: the course's own listing, verbatim
COURSE = REPO_ROOT / ".." / "shared" / "course"


def course_listing(monkeypatch):
    if not (COURSE / "multi_head_self_attention.py").exists():
        pytest.skip(f"the course listings are not at {COURSE} (../shared/course from the repo root)")
    monkeypatch.chdir(COURSE)  # impl= imports from the current directory, as a reader would run it
    return "impl=multi_head_self_attention:MultiHeadSelfAttention"


def test_course_listing_verbatim_passes_the_whole_battery_in_fp32(monkeypatch):
    """Issue 11 item 3 (F-72): the listing's .float() softmax computes fp64 input in fp32, so fp64 gradcheck
    failed a module whose gradients are right. Now the battery detects it, says so, and grad_match judges."""
    checks, rec = battery(course_listing(monkeypatch))
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}
    assert "gradcheck" not in checks and checks["grad_match"].passed
    assert any("gradcheck not run" in n and "computes in float32" in n for n in rec.notes)


def test_course_listing_in_fp64_fails_naming_float32(monkeypatch):
    checks, _ = battery(course_listing(monkeypatch), "dtype=fp64", "checks=[masks,sdpa]")
    assert not checks["sdpa_match"].passed
    assert "computes in float32" in checks["sdpa_match"].detail
    assert not checks["row_sums"].passed and "computes its softmax in float32" in checks["row_sums"].detail


def test_downcast_fixture_is_diagnosed_not_blamed_on_gradients():
    checks, rec = battery("impl=buggy_attention:DowncastToFp32", "checks=[gradients]")
    assert "gradcheck" not in checks and checks["grad_match"].passed
    assert any("computes in float32" in n for n in rec.notes)


# ------------------------------------------------------------------------------ padded query rows (issue 22)
def test_a_layer_that_zeroes_padded_queries_passes_by_default():
    """Regression: x-transformers with mask= zeroes the output of padded query positions; sdpa_match failed it
    although those rows are don't-care in every loss (FlashAttention's tests strip them)."""
    checks, rec = battery("impl=padded_query_layers:ZeroesPaddedQueries")
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}
    assert any("padded query rows" in n and "padded_query_policy=any" in n for n in rec.notes)
    checks, _ = battery("impl=padded_query_layers:ZeroesPaddedQueries", "padded_query_policy=zeros",
                        "checks=[sdpa]")
    assert checks["padded_query_rows"].passed and checks["sdpa_match"].passed
    checks, _ = battery("impl=padded_query_layers:ZeroesPaddedQueries", "padded_query_policy=attend",
                        "checks=[sdpa]")
    assert not checks["sdpa_match"].passed  # what the layer does not promise, when the user requires it


def test_padded_query_policy_zeros_requires_zeros_and_any_does_not():
    checks, _ = battery("impl=padded_query_layers:HalvesPaddedQueries", "checks=[sdpa,gradients,invariances]")
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}
    checks, _ = battery("impl=padded_query_layers:HalvesPaddedQueries", "padded_query_policy=zeros",
                        "checks=[sdpa]")
    assert failed(checks) == {"padded_query_rows"} and "padded query rows" in checks["padded_query_rows"].detail


def test_a_bug_in_the_real_rows_still_fails_sdpa_match():
    checks, _ = battery("impl=padded_query_layers:ZeroesTheLastRealQueryToo", "checks=[sdpa]")
    assert not checks["sdpa_match"].passed, checks["sdpa_match"].detail


@pytest.mark.parametrize("value", ["skip", "ZEROS", "[any]"])
def test_bad_padded_query_policy(value):
    with pytest.raises(BadInput, match="padded_query_policy"):
        run_recorded("attn-check", [f"padded_query_policy={value}"])


# ------------------------------------------------------------------------------------ head_counts (issue 22)
def test_head_counts_is_not_applicable_where_the_layer_cannot_be_rebuilt():
    """Regression: a layer whose structure changes with the head count (x-transformers drops to_out at H=1)
    failed head_counts with the load error cut to its first line, 'Error(s) in loading state_dict for ...:'.
    Now that head count is not applicable, the whole message in the note; the other head counts are judged."""
    checks, rec = battery("impl=padded_query_layers:OutGainAboveOneHead", "checks=[invariances]",
                          "head_counts=[1,2,4]")
    assert checks["head_counts"].passed and "H=4" in checks["head_counts"].detail
    note = next(n for n in rec.notes if "head_counts not applicable" in n)
    assert "H=1: RuntimeError: Error(s) in loading state_dict for OutGainAboveOneHead:" in note
    assert 'Unexpected key(s) in state_dict: "out_gain"' in note  # the reason, not only the first line
    checks, rec = battery("impl=padded_query_layers:OutGainAboveOneHead", "checks=[invariances]",
                          "head_counts=[1]")
    assert "head_counts" not in checks and any("head_counts n/a" in n for n in rec.notes)


def test_full_message_keeps_a_real_libraries_load_error_whole():
    xt = pytest.importorskip("x_transformers.x_transformers")
    from tfmoe.experiments.attn_check.checks.invariances import full_message

    two, one = xt.Attention(16, heads=2, dim_head=8), xt.Attention(16, heads=1, dim_head=16)
    with pytest.raises(RuntimeError) as err:
        one.load_state_dict(two.state_dict())
    text = full_message(err.value)
    assert text.startswith("RuntimeError: Error(s) in loading state_dict for Attention:")
    assert '"to_out.weight"' in text and "\n" not in text


def test_module_mode_families_judged_only_vacuously_say_not_judged():
    """A causal mask over one key, and a padding mask that pads nothing, hide nothing: not judged, never pass."""
    checks, _ = battery("T=1", "checks=[masks]", "lengths=[1,1]")
    assert not checks["causal_zero"].applicable and checks["causal_zero"].detail.startswith("not judged")
    assert not checks["padding_zero"].applicable and "vacuous" in checks["padding_zero"].detail
    checks, _ = battery("checks=[masks]")
    assert checks["causal_zero"].applicable and checks["padding_zero"].applicable
