"""route-sim's layer battery (impl=...): the package's own layer, the course's ToyMoE listing verbatim,
transformers' Mixtral / Qwen2-MoE / DeepSeek-V3 blocks, and planted bugs — in the course interface and
monkeypatched into transformers' own MoE code — each caught by the check it targets."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from planted_moe import (
    deepseek_router_forward,
    mixtral_loss_without_expert_factor,
    qwen_shared_expert_ungated,
)

from tfmoe.adapters import moe_layers
from tfmoe.api.testing import compose, make_recorder, run_cli
from tfmoe.components import moe
from tfmoe.components import moe_reference as ref
from tfmoe.contract.errors import BadInput
from tfmoe.experiments import route_sim
from tfmoe.experiments.route_sim import layer as route_layer

REPO = Path(__file__).resolve().parents[1]
COURSE_TOY_MOE = REPO.parent / "shared" / "course" / "toy_moe.py"
HF_TYPES = ("mixtral", "qwen2_moe", "deepseek_v3")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def battery(*overrides: str):
    cfg = compose("route-sim", ["steps=0", *overrides])
    rec = make_recorder(cfg)
    route_layer.run_battery(route_sim.settings(cfg).layer, rec)
    return rec


def result(rec, name: str) -> bool:
    rows = [c for c in rec.checks_rows if c.check == f"layer.{name}"]
    assert len(rows) == 1, f"layer.{name} recorded {len(rows)} times: {[c.check for c in rec.checks_rows]}"
    return rows[0].passed


def failed(rec) -> set[str]:
    return {c.check.removeprefix("layer.") for c in rec.checks_rows if not c.passed}


def not_applicable(rec) -> set[str]:
    """Checks not defined for the design (notes) and checks made n/a by a declaration or a NotImplementedError
    (rows with applicable=False, tfmoe.rules.capabilities)."""
    return {n.removeprefix("n/a: layer.").split(" (")[0] for n in rec.notes if n.startswith("n/a: layer.")} | {
        c.check.removeprefix("layer.") for c in rec.checks_rows if not c.applicable}


def metric(rec, name: str) -> float:
    return next(r["value"] for r in rec.metrics_rows if r["name"] == f"layer.{name}")


# ---------------------------------------------------------------------- the reference itself
def test_reference_deepseek_selects_on_corrected_weights_uncorrected():
    """Hand-worked DeepSeek-V3 case: 4 experts in 2 groups, top-1 group, top-2 experts, scaling 2."""
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]], dtype=torch.float64)
    w = ref.LayerWeights(torch.eye(4, dtype=torch.float64), [], correction_bias=torch.tensor(
        [0.0, 0.0, 0.0, 0.4], dtype=torch.float64))
    sem = ref.RoutingSemantics("sigmoid", 2, normalize=True, scaling=2.0, n_group=2, topk_group=1)
    r = ref.route(logits, sem, w)
    s = torch.sigmoid(logits)[0]  # 0.5, 0.731, 0.881, 0.269
    # corrected group scores: {0, 1}: 0.5 + 0.731 = 1.231; {2, 3}: 0.881 + (0.269 + 0.4) = 1.550 -> group 1
    assert r.selected[0].tolist() == [False, False, True, True]
    expected = torch.stack([s[2], s[3]]) / (s[2] + s[3]) * 2.0  # weighted by the uncorrected scores
    torch.testing.assert_close(r.weights[0, 2:], expected)
    assert float(r.margin[0]) == pytest.approx(1.550 - 1.231, abs=2e-3)
    no_bias = ref.route(logits, sem.variant(use_correction_bias=False), w)  # {2, 3} scores 1.150 < 1.231
    assert no_bias.selected[0].tolist() == [True, True, False, False]


def test_reference_softmax_topk_renormalised_and_margin():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]], dtype=torch.float64)
    w = ref.LayerWeights(torch.eye(4, dtype=torch.float64), [])
    r = ref.route(logits, ref.RoutingSemantics("softmax", 2, normalize=True), w)
    p = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(r.weights[0], torch.stack([p[0], 0 * p[1], p[2], 0 * p[3]]) / (p[0] + p[2]))
    assert float(r.margin[0]) == pytest.approx(float(p[2] - p[1]))
    raw = ref.route(logits, ref.RoutingSemantics("softmax", 2, normalize=False), w)
    torch.testing.assert_close(raw.weights[0, 0], p[0])


# ------------------------------------------------------------------- correct layers pass
def test_own_layer_passes_every_check():
    rec = battery()
    assert not failed(rec), [c for c in rec.checks_rows if not c.passed]
    assert not_applicable(rec) == {"bias_exercised"}
    assert metric(rec, "alt.not renormalised") > 100 * metric(rec, "design.output_error")


def test_course_toy_moe_listing_verbatim_passes_through_the_cli(tmp_path, monkeypatch):
    if not COURSE_TOY_MOE.exists():
        pytest.skip(f"the course's listing {COURSE_TOY_MOE} is absent (../shared/course/ not laid out)")
    shutil.copy(COURSE_TOY_MOE, tmp_path / "course_toy_moe.py")  # the current directory is importable
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    res = run_cli(["route-sim", "impl=course_toy_moe:ToyMoE"], tmp_path)
    assert res.exit_code == 0, res.stdout + res.stderr
    from tfmoe.harness.store.notebook import load_run

    run = load_run(res.run_dir)
    checks = set(run.checks["check"])
    assert run.checks["passed"].all() and "layer.output_vs_reference" in checks
    assert not any(c.startswith(("dispatch", "train.")) for c in checks)  # the battery alone runs


@pytest.mark.parametrize("model_type", HF_TYPES)
def test_hf_blocks_pass_every_check(model_type):
    pytest.importorskip("transformers")
    rec = battery(f"impl=hf:{model_type}")
    assert not failed(rec), [c for c in rec.checks_rows if not c.passed]
    na = not_applicable(rec)
    assert "probs_sum_to_one" in na  # HF routers expose logits and the top-k only
    if model_type == "deepseek_v3":
        assert na == {"probs_sum_to_one", "aux_loss_vs_switch"}  # aux-loss-free: no balancing loss defined
        assert metric(rec, "tokens_bias_changed") > 0
        for alt in ("weights from bias-corrected scores", "bias ignored in selection", "no group limit",
                    "no routed_scaling_factor"):
            assert metric(rec, f"alt.{alt}") > 100 * metric(rec, "design.output_error"), alt
    else:
        assert na == {"probs_sum_to_one", "bias_exercised"}
    if model_type == "qwen2_moe":
        assert metric(rec, "alt.shared expert ungated") > 100 * metric(rec, "design.output_error")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe", "glm4_moe"])
def test_other_model_types_following_a_layout_pass(model_type):
    pytest.importorskip("transformers")
    rec = battery(f"impl=hf:{model_type}", "layer.seq=6")
    assert not failed(rec), [c for c in rec.checks_rows if not c.passed]


def test_qwen_without_normalisation_and_top1_deepseek():
    pytest.importorskip("transformers")
    rec = battery("impl=hf:qwen2_moe", "layer.norm_topk_prob=false", "layer.seq=6")
    assert not failed(rec) and "topk_weights_sum" in not_applicable(rec)
    rec = battery("impl=hf:deepseek_v3", "top_k=1", "layer.topk_group=1", "layer.seq=6")
    assert not failed(rec), [c for c in rec.checks_rows if not c.passed]


@pytest.mark.parametrize("impl, dtype", [
    ("null", "fp64"), ("buggy_moe:Correct", "bf16"), ("hf:qwen2_moe", "fp64"), ("hf:mixtral", "bf16"),
    ("hf:deepseek_v3", "fp16"),
])
def test_correct_layers_pass_in_other_run_dtypes(impl, dtype):
    """Regression: in an fp64 run Qwen2-MoE's router (fp32 softmax, cast back to fp64) failed output and
    weights at fp64 tolerances; in bf16/fp16 runs the weight, sum and loss tolerances were fp32-sized."""
    if impl.startswith("hf:"):
        pytest.importorskip("transformers")
    rec = battery(f"impl={impl}", f"dtype={dtype}", "layer.seq=8")
    assert not failed(rec), [c for c in rec.checks_rows if not c.passed]


def test_same_seed_bit_identical():
    pytest.importorskip("transformers")
    a, b = battery("impl=hf:deepseek_v3", "layer.seq=4"), battery("impl=hf:deepseek_v3", "layer.seq=4")
    for name in ("layer.out", "layer.captured_weights"):
        assert torch.equal(a.tensors_saved[name], b.tensors_saved[name])


# ------------------------------------------------- planted bugs in the course interface
@pytest.mark.parametrize("cls, must_fail, must_pass", [
    ("Correct", set(), set(route_layer.ALL_CHECKS) - {"aux_loss_vs_switch", "bias_exercised"}),
    ("SoftmaxOverTokens", {"probs_sum_to_one", "batch_independence", "output_vs_reference"},
     {"permutation_equivariance"}),
    ("NotRenormalised", {"routing_weights", "topk_weights_sum", "output_vs_reference"},
     {"routing_selection", "probs_sum_to_one"}),
    ("UnstableSoftmax", {"finite.fp16"}, {"output_vs_reference", "finite.bf16"}),
    ("FirstComeCapacity", {"permutation_equivariance", "output_vs_reference", "loads_sum"}, set()),
    ("ArgminRouting", {"routing_selection", "output_vs_reference"}, {"probs_sum_to_one"}),
])
def test_planted_bugs_course_interface(cls, must_fail, must_pass):
    rec = battery(f"impl=buggy_moe:{cls}", "layer.seq=8")
    bad = failed(rec)
    assert must_fail <= bad, (cls, bad)
    assert not (must_pass & bad), (cls, bad)
    if not must_fail:
        assert not bad


# ------------------------------------- correct layers written differently (issue 22: false alarms)
@pytest.mark.parametrize("cls, sparse", [("DenseZeroGates", 0.0), ("StraightThrough", 1.0), ("Correct", 1.0)])
def test_dense_and_straight_through_layers_pass_routing(cls, sparse):
    """Regression (F-120): the selection was read from which rows reached each expert's hook, matched exactly
    against the tokens. A layer running every expert on every token (zero gates off the top-k) then "chose"
    all 8 experts, and a straight-through dispatch x*((1+c)-c) none: routing_selection, loads_sum and cv_maxvio
    failed and the likely cause said "the smallest scores are chosen". The selection is now the experts a
    token's output depends on (measured combine weights); whether dispatch is sparse is an observation."""
    rec = battery(f"impl=buggy_moe:{cls}", "layer.seq=8")
    assert not failed(rec), [c for c in rec.checks_rows if not c.passed]
    assert {"routing_selection", "loads_sum", "cv_maxvio"} <= {c.check.removeprefix("layer.") for c in rec.checks_rows}
    assert metric(rec, "dispatch_sparse") == sparse
    n, e = 2 * 8, 8
    assert metric(rec, "expert_rows") == (n * e if sparse == 0.0 else n * 2)
    assert any(note.startswith("dispatch: ") for note in rec.notes)


def test_measured_combine_weights_are_exact_and_zero_off_the_top_k():
    lut = moe_layers.ToyInterfaceLayer("buggy_moe:DenseZeroGates", moe_layers.LayerSizes(8, 8, 4, 2))
    module = lut.build(0)
    x = torch.randn(1, 5, 8)
    _, cap = lut.run(module, x)
    top = torch.softmax(module.router(x[0]), -1).double().topk(2, -1)
    expected = torch.zeros(5, 4, dtype=torch.float64).scatter(1, top.indices, top.values / top.values.sum(-1, True))
    torch.testing.assert_close(cap.weights, expected, rtol=1e-6, atol=0.0)
    assert torch.equal(cap.selected, expected != 0)  # exactly zero off the top-k, not merely small
    assert cap.expert_rows == 5 * 4


@pytest.mark.parametrize("cls", ["DenseArgmin", "ArgminRouting", "FirstComeCapacity"])
def test_planted_bugs_still_caught_by_the_routing_checks(cls):
    bad = failed(battery(f"impl=buggy_moe:{cls}", "layer.seq=8"))
    assert "routing_selection" in bad and "output_vs_reference" in bad, bad
    if cls == "FirstComeCapacity":  # tokens past an expert's third lose it: fewer than tokens*k assignments
        assert {"loads_sum", "cv_maxvio"} <= bad


# ------------------------------------------------ a layer that raises in one dtype (issue 22)
def test_layer_raising_in_half_precision_fails_those_checks_and_keeps_the_rest():
    """Regression (F-121): a float32 router beside half experts raised inside finite.fp16 and the whole run
    crashed (exit 3, "a tfmoe bug"), losing the checks already judged."""
    rec = battery("impl=buggy_moe:FloatRouter", "layer.seq=8")
    assert failed(rec) == {"finite.fp16", "finite.bf16"}
    detail = next(c.detail for c in rec.checks_rows if c.check == "layer.finite.fp16")
    assert detail.startswith("raised RuntimeError: expected m1 and m2 to have the same dtype")  # the exception leads
    assert result(rec, "output_vs_reference") and result(rec, "routing_selection")
    from tfmoe.harness.method.diagnosis import checks_mapping, diagnose

    # a raised check is never evidence: before, "exp(z)/Σexp(z) without subtracting the max" was inferred from it
    assert diagnose("route-sim", checks_mapping(rec.checks_rows), [], {}) == []


def test_layer_raising_in_half_precision_through_the_cli_exit_1_not_3(tmp_path):
    res = run_cli(["route-sim", "impl=buggy_moe:FloatRouter", "layer.seq=6"], tmp_path)
    assert res.exit_code == 1, res.stdout + res.stderr
    from tfmoe.harness.store.notebook import load_run

    run = load_run(res.run_dir)
    assert run.run["status"] == "failed"
    checks = run.checks.set_index("check")["passed"]
    assert not checks["layer.finite.fp16"] and checks["layer.output_vs_reference"]


def test_layer_raising_in_the_run_dtype_fails_every_check_with_the_exception():
    rec = battery("impl=buggy_moe:FloatRouter", "dtype=fp16", "layer.seq=6")
    judged = [c for c in rec.checks_rows if c.applicable]  # the course layer defines no aux loss nor bias: n/a
    assert judged and not any(c.passed for c in judged)
    assert {c.check.removeprefix("layer.") for c in rec.checks_rows} >= {
        "output_vs_reference", "routing_selection", "loads_sum", "permutation_equivariance", "finite.bf16"}
    assert all("RuntimeError: expected m1 and m2" in c.detail for c in judged)


def test_planted_bug_load_counts_only_first_choice(monkeypatch):
    real = moe.expert_load
    monkeypatch.setattr(moe, "expert_load", lambda idx, n: real(idx[: idx.numel() // 2], n))
    rec = battery("layer.seq=6")
    assert not result(rec, "loads_sum") and not result(rec, "cv_maxvio")


def test_planted_bug_cv_with_sample_std(monkeypatch):
    monkeypatch.setattr(moe, "load_cv", lambda load: load.double().std() / load.double().mean())
    rec = battery("layer.seq=6")
    assert result(rec, "loads_sum") and not result(rec, "cv_maxvio")


def test_planted_bug_own_aux_loss_without_expert_factor(monkeypatch):
    real = moe.switch_aux_loss
    monkeypatch.setattr(moe, "switch_aux_loss", lambda p, i, coef=0.01: real(p, i, coef) / p.shape[1])
    assert not result(battery("layer.seq=6"), "aux_loss_vs_switch")


def test_bias_too_small_to_matter_fails_bias_exercised():
    pytest.importorskip("transformers")
    rec = battery("impl=hf:deepseek_v3", "layer.bias_scale=1e-9", "layer.seq=6")
    assert not result(rec, "bias_exercised") and result(rec, "output_vs_reference")
    rec = battery("impl=hf:deepseek_v3", "layer.bias_scale=0", "layer.seq=6")
    assert not failed(rec) and "bias_exercised" in not_applicable(rec)


# ------------------------------------------ planted bugs in transformers' own MoE code
def _mixtral():
    return pytest.importorskip("transformers.models.mixtral.modeling_mixtral")


def test_planted_bug_transformers_mixtral_router_not_renormalised(monkeypatch):
    m = _mixtral()

    def forward(self, hidden_states):  # MixtralTopKRouter.forward without the renormalisation
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        return router_logits, router_top_value, router_indices

    monkeypatch.setattr(m.MixtralTopKRouter, "forward", forward)
    rec = battery("impl=hf:mixtral", "layer.seq=6")
    assert {"routing_weights", "topk_weights_sum", "output_vs_reference"} <= failed(rec)
    assert result(rec, "routing_selection") and result(rec, "aux_loss_vs_switch")


def test_planted_bug_transformers_mixtral_loss_without_expert_factor(monkeypatch):
    _mixtral()
    mixtral_loss_without_expert_factor(monkeypatch)  # the planted bug of tests/planted_moe.py, here at layer.seq=6
    rec = battery("impl=hf:mixtral", "layer.seq=6")
    assert failed(rec) == {"aux_loss_vs_switch"}


def test_planted_bug_transformers_qwen_shared_expert_ungated(monkeypatch):
    pytest.importorskip("transformers.models.qwen2_moe.modeling_qwen2_moe")
    qwen_shared_expert_ungated(monkeypatch)  # the planted bug of tests/planted_moe.py, here at layer.seq=6
    rec = battery("impl=hf:qwen2_moe", "layer.seq=6")
    assert "output_vs_reference" in failed(rec)
    assert result(rec, "routing_selection") and result(rec, "routing_weights")


_deepseek_router = deepseek_router_forward  # DeepseekV3TopkRouter.forward with one semantic changed


@pytest.mark.parametrize("weight_with_bias, select_with_bias, must_fail", [
    (True, True, {"routing_weights", "output_vs_reference"}),  # weights from bias-corrected scores
    (False, False, {"routing_selection", "output_vs_reference"}),  # bias ignored in selection
])
def test_planted_bug_transformers_deepseek_bias_semantics(monkeypatch, weight_with_bias, select_with_bias,
                                                          must_fail):
    m = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    monkeypatch.setattr(m.DeepseekV3TopkRouter, "forward", _deepseek_router(weight_with_bias, select_with_bias))
    rec = battery("impl=hf:deepseek_v3")
    assert must_fail <= failed(rec), failed(rec)
    assert result(rec, "topk_weights_sum") and result(rec, "permutation_equivariance")


def test_correct_deepseek_router_copy_passes(monkeypatch):
    """The planted-bug router above, with neither change, is the real one: the battery passes it."""
    m = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    monkeypatch.setattr(m.DeepseekV3TopkRouter, "forward", _deepseek_router(False, True))
    assert not failed(battery("impl=hf:deepseek_v3", "layer.seq=6"))


# ------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("overrides, message", [
    (["impl=hf:not_a_model"], "unknown"),
    (["impl=hf:llama"], "not one whose sparse block"),
    (["impl=no_such_module:Layer"], "cannot import"),
    (["impl=buggy_moe:Missing"], "has no 'Missing'"),
    (["impl=buggy_moe"], "not 'pkg.module:Class'"),
    (["impl=buggy_moe:NoRouter"], "lacks `router`, `top_k`"),
    (["impl=buggy_moe:ReturnsTensor"], "not (out, probs)"),
    (["impl=hf:deepseek_v3", "layer.n_group=3"], "not divisible by layer.n_group=3"),
    (["impl=hf:deepseek_v3", "layer.topk_group=1", "top_k=3"], "exceeds the 2 experts"),
    (["impl=hf:deepseek_v3", "layer.n_group=8"], "1 expert per group"),
    (["layer.norm_topk_prob=maybe"], "layer.norm_topk_prob"),
    (["layer.batch=1"], "layer.batch=1"),
])
def test_bad_input_one_line(overrides, message):
    if "hf:" in " ".join(overrides):
        pytest.importorskip("transformers")
    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        battery(*overrides)


def test_bad_input_through_the_cli_exit_2(tmp_path):
    pytest.importorskip("transformers")
    res = run_cli(["route-sim", "impl=hf:llama"], tmp_path)
    assert res.exit_code == 2
    line = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "impl=hf:llama:" in line[0]  # printed as written (no emoji for ':llama:')


def test_without_the_hf_extra_exit_2_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(BadInput, match=r"optional extra `hf`: pip install -e '\.\[hf\]'"):
        battery("impl=hf:mixtral")
    res = run_cli(["route-sim", "impl=hf:mixtral"], tmp_path)
    assert res.exit_code == 2 and "[hf]" in res.stdout + res.stderr


def test_toy_interface_capture_solves_weights_exactly():
    """The combine weights the course interface applies are recovered from the expert hooks."""
    lut = moe_layers.ToyInterfaceLayer("buggy_moe:Correct", moe_layers.LayerSizes(8, 8, 4, 2))
    module = lut.build(0)
    x = torch.randn(1, 5, 8)
    _, cap = lut.run(module, x)
    probs = torch.softmax(module.router(x[0]), -1).double()
    top = probs.topk(2, -1)
    expected = torch.zeros(5, 4, dtype=torch.float64).scatter(1, top.indices, top.values / top.values.sum(-1, True))
    torch.testing.assert_close(cap.weights, expected, rtol=1e-5, atol=1e-6)
