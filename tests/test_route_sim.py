"""tfmoe route-sim: MoE router, capacity, two dispatches, balancing losses, and the experiment's checks.

Every check of the experiment has a test below that plants a real bug and sees that check fail.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import sigint_default
from omegaconf import OmegaConf

from tfmoe.api.testing import compose, make_recorder, run_cli
from tfmoe.components import moe
from tfmoe.components import moe_reference as moe_ref
from tfmoe.contract.errors import BadInput
from tfmoe.experiments import route_sim as rs
from tfmoe.experiments.route_sim import checks as route_checks
from tfmoe.experiments.route_sim import course as route_course
from tfmoe.experiments.route_sim import plots as route_plots
from tfmoe.experiments.route_sim import training as route_training

REPO = Path(__file__).resolve().parents[1]
SMALL = ["steps=6", "train_tokens=64", "strategies=[none,aux_loss,z_loss,noisy_topk,aux_free]"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def small_cfg():
    return compose("route-sim", SMALL)


def _params(cfg, **changes):
    merged = OmegaConf.merge(cfg, OmegaConf.create(changes))
    return rs.settings(merged), merged


def _check(rec, name):
    rows = [c for c in rec.checks_rows if c.check == name]
    assert rows, f"no check {name}; have {[c.check for c in rec.checks_rows]}"
    return rows[-1]


def _course(cfg, **changes):
    p, merged = _params(cfg, **changes)
    rec = make_recorder(merged)
    route_course.course_case(p, rec)
    return rec


# ------------------------------------------------------------------------ router & stats
def test_router_softmax_topk_weights_renormalised():
    torch.manual_seed(0)
    router = moe.Router(16, 8, 2)
    x = torch.randn(50, 16)
    r = router(x)
    assert r.probs.shape == (50, 8) and r.topk_idx.shape == (50, 2)
    torch.testing.assert_close(r.probs.sum(-1), torch.ones(50))
    torch.testing.assert_close(r.topk_weight.sum(-1), torch.ones(50))
    assert (r.topk_idx[:, 0] != r.topk_idx[:, 1]).all()
    # the chosen experts are the two largest probabilities, best first
    torch.testing.assert_close(r.probs.gather(1, r.topk_idx), r.probs.topk(2, dim=-1).values)
    ref = F.softmax(x @ router.gate.weight.t(), -1).topk(2, -1).values
    torch.testing.assert_close(r.topk_weight, ref / ref.sum(-1, keepdim=True))


def _router_grad_from_task_loss(top_k: int, **kw) -> float:
    """|dL/dW_router| of an MSE task loss alone (no balancing loss) through an MoE layer."""
    torch.manual_seed(0)
    layer = moe.MoELayer(16, 32, 8, top_k, capacity_factor=None, **kw)
    x, y = torch.randn(64, 16), torch.randn(64, 16)
    F.mse_loss(layer(x).out, y).backward()
    return float(layer.router.gate.weight.grad.norm())


def test_router_learns_from_the_task_loss_at_top_1():
    """Regression (issue 11 item 5): at k=1 the one chosen weight was renormalised to exactly 1, so the task loss
    gave the router no gradient (2e-9 vs 0.024 at k=2). Switch Transformer gates by the raw probability."""
    torch.manual_seed(0)
    router = moe.Router(16, 8, 1)
    r = router(torch.randn(50, 16))
    torch.testing.assert_close(r.topk_weight, r.probs.gather(1, r.topk_idx))  # the unnormalised probability
    assert (r.topk_weight < 1).all()
    k1, k2 = _router_grad_from_task_loss(1), _router_grad_from_task_loss(2)
    assert k1 > 0.1 * k2 > 0  # same order as k=2
    assert _router_grad_from_task_loss(1, renormalize=True) < 1e-6 * k2  # the old behaviour, still on request
    assert moe.Router(16, 8, 2).renormalize and not moe.Router(16, 8, 1).renormalize
    # and it learns: a few steps of the task loss alone move the router towards the better expert
    torch.manual_seed(0)
    layer = moe.MoELayer(16, 32, 2, 1, capacity_factor=None)
    x = torch.randn(256, 16)
    with torch.no_grad():
        y = x + layer.experts[0](x)  # expert 0, fully weighted, is the task
    opt = torch.optim.Adam(layer.router.parameters(), lr=0.1)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = F.mse_loss(layer(x).out, y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0]


def test_top_1_run_passes_the_layer_battery_and_the_course_case():
    """The layer battery's reference for the package's own layer follows the same rule (raw weight at k=1)."""
    from tfmoe.api.testing import run_recorded

    rec = run_recorded("route-sim", ["top_k=1", "steps=0"])
    assert rec.all_passed, [(c.check, c.detail) for c in rec.checks_rows if not c.passed]


def test_router_sigmoid_scores_normalised_probs():
    torch.manual_seed(1)
    router = moe.Router(8, 6, 3, score_func="sigmoid")
    r = router(torch.randn(20, 8))
    torch.testing.assert_close(r.scores, r.logits.sigmoid())
    torch.testing.assert_close(r.probs.sum(-1), torch.ones(20))
    chosen = r.scores.gather(1, r.topk_idx)
    torch.testing.assert_close(r.topk_weight, chosen / chosen.sum(-1, keepdim=True))


def test_selection_bias_changes_choice_not_weights():
    torch.manual_seed(2)
    router = moe.Router(8, 4, 2)
    x = torch.randn(30, 8)
    router.selection_bias[3] = 10.0  # expert 3 always selected...
    r = router(x)
    assert (r.topk_idx == 3).any(dim=-1).all()
    chosen = r.probs.gather(1, r.topk_idx)  # ...but weighted by its unbiased probability
    torch.testing.assert_close(r.topk_weight, chosen / chosen.sum(-1, keepdim=True))


def test_noisy_router_noise_only_in_training():
    torch.manual_seed(3)
    router = moe.Router(8, 4, 1, noisy=True)
    x = torch.randn(10, 8)
    clean = F.linear(x, router.gate.weight)
    router.eval()
    torch.testing.assert_close(router(x).logits, clean)
    router.train()
    noisy = router(x, torch.Generator().manual_seed(0)).logits
    assert not torch.allclose(noisy, clean)
    again = router(x, torch.Generator().manual_seed(0)).logits
    assert torch.equal(noisy, again)


@pytest.mark.parametrize("kwargs", [dict(n_experts=0, top_k=1), dict(n_experts=4, top_k=0),
                                    dict(n_experts=4, top_k=5), dict(n_experts=4, top_k=2, score_func="relu")])
def test_router_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        moe.Router(8, **kwargs)


def test_load_cv_maxvio_against_numpy():
    load = torch.tensor([18, 24, 25, 32, 29, 25, 28, 19])
    ref = load.numpy().astype(np.float64)
    assert float(moe.load_cv(load)) == pytest.approx(ref.std() / ref.mean(), rel=1e-14)
    assert float(moe.load_maxvio(load)) == pytest.approx((32 - 25) / 25, rel=1e-14)
    balanced = torch.full((8,), 25)
    assert float(moe.load_cv(balanced)) == 0.0 and float(moe.load_maxvio(balanced)) == 0.0
    assert float(moe.load_cv(torch.tensor([7]))) == 0.0  # one expert: trivially balanced


def test_expert_load_counts_every_choice():
    idx = torch.tensor([[0, 1], [0, 2], [3, 0]])
    assert moe.expert_load(idx, 5).tolist() == [3, 1, 1, 1, 0]


def test_router_entropy_uniform_and_onehot():
    assert float(moe.router_entropy(torch.full((4, 8), 1 / 8))) == pytest.approx(math.log(8))
    assert float(moe.router_entropy(torch.eye(4))) == 0.0


# ------------------------------------------------------------------------------ capacity
def test_expert_capacity_exact_rational():
    assert moe.expert_capacity(100, 2, 8, 1.0) == 25
    assert moe.expert_capacity(100, 2, 8, 1.25) == 32  # ceil(31.25)
    # regression: 100*2/4*1.1 = 55.00000000000001 in floats -> ceil 56; the exact capacity is 55
    assert math.ceil(100 * 2 / 4 * 1.1) == 56
    assert moe.expert_capacity(100, 2, 4, 1.1) == 55
    assert moe.expert_capacity(1, 1, 8, 0.01) == 1  # never 0 for a positive factor
    assert moe.expert_capacity(100, 2, 8, None) is None
    with pytest.raises(ValueError):
        moe.expert_capacity(100, 2, 8, 0.0)


def test_capacity_keep_priority_first_choices_then_token_order():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    keep = moe.capacity_keep(idx, 3, 2)
    # expert 0 queue: t0 1st, t1 1st, t2 1st, t3 2nd -> keeps t0, t1; expert 1: t3 1st, t0 2nd, t2 2nd
    assert keep.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    assert moe.capacity_keep(idx, 3, None).all()
    kept_per_expert = torch.bincount(idx[keep], minlength=3)
    assert (kept_per_expert <= 2).all()


# ------------------------------------------------------------------------------ dispatch
def _layer(E=8, k=2, cf=None, d=16, h=32, seed=0):
    torch.manual_seed(seed)
    return moe.MoELayer(d, h, E, k, cf)


@pytest.mark.parametrize("cf", [None, 1.0, 0.5])
def test_loop_and_sorted_dispatch_bit_identical_fp32(cf):
    layer = _layer(cf=cf)
    x = torch.randn(100, 16)
    with torch.no_grad():
        a, b = layer(x, dispatch="loop"), layer(x, dispatch="sorted")
        ref = moe_ref.dense_mixture(x, a.routing.topk_idx, a.routing.topk_weight, a.keep, layer.experts,
                               torch.float64)
    assert torch.equal(a.out, b.out) and torch.equal(a.mixture, b.mixture)
    assert torch.equal(a.processed, b.processed)
    torch.testing.assert_close(b.mixture.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(b.out, x + b.mixture)
    if cf is not None:
        assert int(b.processed.max()) <= a.capacity


def test_dispatch_bf16_tiny_agrees():
    layer = _layer(E=4, k=2, cf=1.0, d=8, h=8).to(torch.bfloat16)
    x = torch.randn(12, 8).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x, dispatch="loop").out, layer(x, dispatch="sorted").out)


@pytest.mark.parametrize("dispatch", ["sorted", "loop"])
def test_dropped_token_passes_through_residual_kept_token_gets_mixture(dispatch):
    """Regression: the layer returned the mixture alone, so a dropped token came out as 0, not as itself."""
    layer = _layer(E=4, k=2, cf=0.25)  # capacity ceil(20*2/4*0.25) = 3 per expert
    x = torch.randn(2, 10, 16)
    with torch.no_grad():
        res = layer(x, dispatch=dispatch)
        r = res.routing
        ref = moe_ref.dense_mixture(x.reshape(20, 16), r.topk_idx, r.topk_weight, res.keep, layer.experts,
                               torch.float64)
    assert res.out.shape == res.mixture.shape == (2, 10, 16) and res.capacity == 3
    out, mix, x2 = res.out.reshape(20, 16), res.mixture.reshape(20, 16), x.reshape(20, 16)
    dropped = ~res.keep.any(dim=-1)  # (N,) every assignment of the token dropped
    kept = res.keep.all(dim=-1)  # (N,) both assignments kept
    assert dropped.sum() > 0 and kept.sum() > 0 and (~dropped & ~kept).sum() > 0
    assert torch.equal(out[dropped], x2[dropped])  # exactly its input
    assert (mix[dropped] == 0).all()
    assert torch.equal(out[~dropped], x2[~dropped] + mix[~dropped])  # input + mixture (partial drops too)
    torch.testing.assert_close(mix.double(), ref, rtol=1e-5, atol=1e-6)
    assert (mix[kept].abs().sum(-1) > 0).all()


def test_residual_false_returns_the_mixture_alone():
    layer = _layer(E=4, k=1, cf=0.25)
    layer.residual = False
    x = torch.randn(20, 16)
    with torch.no_grad():
        res = layer(x)
    assert torch.equal(res.out, res.mixture)
    assert (res.out[~res.keep.any(dim=-1)] == 0).all()


def test_single_expert_top1_is_the_dense_ffn_plus_residual():
    layer = _layer(E=1, k=1)
    x = torch.randn(7, 16)
    with torch.no_grad():
        res = layer(x)
        assert torch.equal(res.mixture, layer.experts[0](x))
        assert torch.equal(res.out, x + layer.experts[0](x))


def test_unknown_dispatch_rejected():
    with pytest.raises(ValueError):
        moe.MoELayer(8, 8, 2, 1, dispatch="grouped")


# ------------------------------------------------------------------------ balancing losses
def test_switch_aux_loss_formula_balanced_and_hf_relation():
    probs, idx = moe_ref.uniform_routing(8, 2)
    assert float(moe.switch_aux_loss(probs, idx, coef=0.01)) == pytest.approx(0.01, rel=1e-6)
    torch.manual_seed(0)
    probs = torch.randn(50, 8).softmax(-1)
    idx = probs.topk(2, -1).indices
    f = torch.bincount(idx.flatten(), minlength=8).double() / 100
    expected = 0.01 * 8 * (f * probs.double().mean(0)).sum()
    assert float(moe.switch_aux_loss(probs, idx, 0.01)) == pytest.approx(float(expected), rel=1e-6)
    hf_form = 8 * (torch.bincount(idx.flatten(), minlength=8).double() / 50 * probs.double().mean(0)).sum()
    assert float(hf_form) == pytest.approx(2 * float(moe.switch_aux_loss(probs, idx, 1.0)), rel=1e-6)


def test_aux_loss_gradient_flows_through_probs_only():
    logits = torch.randn(20, 4, requires_grad=True)
    probs = logits.softmax(-1)
    moe.switch_aux_loss(probs, probs.topk(2, -1).indices, 1.0).backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_router_z_loss_formula():
    logits = torch.randn(30, 8)
    expected = 1e-3 * (torch.logsumexp(logits, -1) ** 2).mean()
    torch.testing.assert_close(moe.router_z_loss(logits, 1e-3), expected)


def test_update_selection_bias_sign_rule():
    bias = torch.zeros(4)
    moe.update_selection_bias(bias, torch.tensor([10, 2, 4, 4]), 0.001)  # mean 5
    torch.testing.assert_close(bias, torch.tensor([-0.001, 0.001, 0.001, 0.001]))
    moe.update_selection_bias(bias, torch.tensor([5, 5, 5, 5]), 0.001)  # balanced: unchanged
    torch.testing.assert_close(bias, torch.tensor([-0.001, 0.001, 0.001, 0.001]))


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("change, message", [
    (dict(top_k=0), "top_k=0"), (dict(top_k=9), "top_k=9"), (dict(n_experts=0), "n_experts=0"),
    (dict(tokens=0), "tokens=0"), (dict(capacity_factor=0), "capacity_factor=0"),
    (dict(capacity_factor=-1.5), "capacity_factor=-1.5"), (dict(strategies=["none", "magic"]), "magic"),
    (dict(strategies=[]), "strategies"), (dict(aux_loss_coef=-0.01), "aux_loss_coef=-0.01"),
    (dict(z_loss_coef=-1), "z_loss_coef=-1"), (dict(bias_update_rate=-0.001), "bias_update_rate"),
    (dict(steps=-1), "steps=-1"), (dict(tokens=2.5), "tokens=2.5"), (dict(score_func="tanh"), "tanh"),
    (dict(dispatch="grouped"), "grouped"), (dict(strategies=["none", "none"]), "twice"),
])
def test_bad_config_raises_bad_input(small_cfg, change, message):
    with pytest.raises(BadInput, match=message.replace("[", r"\[")):
        _params(small_cfg, **change)


def test_good_config_boundaries(small_cfg):
    p, _ = _params(small_cfg, top_k=8, n_experts=8, capacity_factor=None, tokens=1, steps=0)
    assert p.top_k == 8 and p.capacity_factor is None and p.steps == 0
    p, _ = _params(small_cfg, strategies="aux_free")
    assert p.strategies == ("aux_free",)


def test_moe_reference_imports_nothing_it_judges():
    """components/moe_reference.py recomputes from first principles: no tfmoe module (moe.py's statistics and
    dispatch are what it judges), no transformers."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(moe_ref))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "copy", "collections.abc", "dataclasses", "numpy", "torch", "torch.nn",
                        "torch.nn.functional", "torch.func"}, imported  # torch.func: black-box experts


def test_settings_import_no_layer_and_touch_no_device():
    """settings() runs before any job of a sweep: an impl that cannot be imported and a device this machine lacks
    are run()'s business (the battery refuses them there)."""
    s = rs.settings(compose("route-sim", ["impl=no_such_module:Layer", "device=cuda:7", "layer.seq=3"]))
    assert s.layer.impl == "no_such_module:Layer" and s.layer.seq == 3 and s.layer.sizes.n_experts == s.n_experts
    assert "no_such_module" not in sys.modules


# --------------------------------------------------------------- the course case & checks
def test_course_case_all_checks_pass_and_tensors_named(small_cfg):
    rec = _course(small_cfg)
    assert all(c.passed for c in rec.checks_rows), [c for c in rec.checks_rows if not c.passed]
    t = rec.tensors_saved
    assert t["router_probs"].shape == (100, 8) and t["topk_idx"].shape == (100, 2)
    assert t["topk_weight"].shape == (100, 2) and t["expert_load"].shape == (8,)
    assert int(t["expert_load"].sum()) == 200
    names = {c.check for c in rec.checks_rows}
    assert {"dispatch_agree.capacity", "dispatch_agree.dropless", "dispatch_vs_dense.capacity"} <= names
    cv = [r for r in rec.metrics_rows if r["name"] == "course.cv"][0]
    assert "strategy" not in cv and "step" not in cv
    assert not [r for r in rec.metrics_rows if r["name"] == "cv"]  # the training simulation's name only
    assert _check(rec, "dispatch_agree.capacity").observed == 0.0


def test_course_case_dropless_and_tiny_bf16(small_cfg):
    rec = _course(small_cfg, capacity_factor=None)
    assert all(c.passed for c in rec.checks_rows)
    assert "dispatch_agree.capacity" not in {c.check for c in rec.checks_rows}
    rec = _course(small_cfg, dtype="bf16", tokens=12, n_experts=4, d_model=8, d_hidden=8)
    assert all(c.passed for c in rec.checks_rows), [c for c in rec.checks_rows if not c.passed]


def test_planted_bug_load_counts_only_first_choice(small_cfg, monkeypatch):
    monkeypatch.setattr(moe, "expert_load", lambda idx, n: torch.bincount(idx[:, 0], minlength=n))
    rec = _course(small_cfg)
    assert not _check(rec, "loads_sum").passed
    assert not _check(rec, "cv_maxvio_recomputed").passed  # recomputed from the saved assignments


def test_planted_bug_cv_with_sample_std(small_cfg, monkeypatch):
    monkeypatch.setattr(moe, "load_cv", lambda load: load.double().std() / load.double().mean())
    rec = _course(small_cfg)
    assert not _check(rec, "cv_maxvio_recomputed").passed
    assert _check(rec, "loads_sum").passed


def test_planted_bug_maxvio_uses_min(small_cfg, monkeypatch):
    monkeypatch.setattr(moe, "load_maxvio", lambda load: (load.max() - load.min()).double() / load.double().mean())
    assert not _check(_course(small_cfg), "cv_maxvio_recomputed").passed


_REAL_SORTED = moe.dispatch_sorted


def _dispatch_ignoring_capacity(x, topk_idx, topk_weight, keep, experts):
    """A real bug: capacity computed (keep mask, dropped count) but the dispatch runs every assignment."""
    return _REAL_SORTED(x, topk_idx, topk_weight, torch.ones_like(keep), experts)


def test_planted_bug_capacity_computed_but_not_applied(small_cfg, monkeypatch):
    monkeypatch.setattr(moe, "dispatch_sorted", _dispatch_ignoring_capacity)
    rec = _course(small_cfg)
    assert not _check(rec, "capacity_respected.sorted").passed
    assert not _check(rec, "dropped_plus_kept.sorted").passed
    assert _check(rec, "capacity_respected.loop").passed


def test_planted_bug_capacity_off_by_one(small_cfg, monkeypatch):
    real = moe.capacity_keep
    monkeypatch.setattr(moe, "capacity_keep", lambda idx, n, cap: real(idx, n, None if cap is None else cap + 1))
    rec = _course(small_cfg)
    assert not _check(rec, "capacity_respected.loop").passed
    assert not _check(rec, "capacity_respected.sorted").passed


def _hf_aux_loss(probs, topk_idx, coef=0.01):
    n, e = probs.shape
    f = moe.expert_load(topk_idx, e).to(probs.dtype) / n  # sums to k: HF Mixtral's normalisation
    return coef * e * (f * probs.mean(0)).sum()


def test_planted_bug_aux_loss_other_normalisation(small_cfg, monkeypatch):
    monkeypatch.setattr(moe, "switch_aux_loss", _hf_aux_loss)
    rec = _course(small_cfg)
    assert not _check(rec, "aux_loss_formula").passed
    assert not _check(rec, "aux_loss_balanced_value").passed


def test_planted_bug_aux_loss_uses_topk_weights_not_probs(small_cfg, monkeypatch):
    real = moe.switch_aux_loss

    def from_weights(probs, topk_idx, coef=0.01):
        sparse = torch.zeros_like(probs).scatter(1, topk_idx, probs.gather(1, topk_idx))
        return real(sparse, topk_idx, coef)

    monkeypatch.setattr(moe, "switch_aux_loss", from_weights)
    assert not _check(_course(small_cfg), "aux_loss_formula").passed


def test_check_aux_balanced_fails_without_expert_factor():
    rec = make_recorder(compose("route-sim", SMALL))
    assert not route_checks.check_aux_balanced(rec, "b", 8, 2,
                                               lambda p, i, coef: moe.switch_aux_loss(p, i, coef) / 8)
    assert route_checks.check_aux_balanced(rec, "ok", 8, 2)


def test_planted_bug_sorted_dispatch_weights_unsorted(small_cfg, monkeypatch):
    def buggy(x, topk_idx, topk_weight, keep, experts):
        k = topk_idx.shape[1]
        flat_e, flat_t = topk_idx.reshape(-1)[keep.reshape(-1)], torch.arange(x.shape[0]).repeat_interleave(k)
        flat_t, flat_w = flat_t[keep.reshape(-1)], topk_weight.reshape(-1)[keep.reshape(-1)]
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=len(experts))
        out, start = torch.zeros_like(x), 0
        for e, end in enumerate(counts.cumsum(0).tolist()):
            tok = flat_t[order][start:end]
            out.index_add_(0, tok, experts[e](x[tok]) * flat_w[start:end, None])  # bug: w not sorted
            start = end
        return out, counts

    monkeypatch.setattr(moe, "dispatch_sorted", buggy)
    rec = _course(small_cfg)
    assert not _check(rec, "dispatch_agree.capacity").passed
    assert not _check(rec, "dispatch_agree.dropless").passed
    assert not _check(rec, "dispatch_vs_dense.capacity").passed


def test_planted_bug_both_dispatches_forget_weights(small_cfg, monkeypatch):
    for name in ("dispatch_loop", "dispatch_sorted"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda x, i, w, k, ex, real=real: real(x, i, torch.ones_like(w), k, ex))
    rec = _course(small_cfg)
    assert _check(rec, "dispatch_agree.capacity").passed  # they agree with each other...
    assert not _check(rec, "dispatch_vs_dense.capacity").passed  # ...but not with the reference
    assert not _check(rec, "dispatch_vs_dense.dropless").passed


def test_check_dispatch_agree_tolerance_off_cpu_is_relative():
    rec = make_recorder(compose("route-sim", SMALL))
    a = torch.ones(3, 2)
    assert route_checks.check_dispatch_agree(rec, "same", a, a.clone())
    assert not route_checks.check_dispatch_agree(rec, "ulp", a, a + torch.finfo(torch.float32).eps)


# ---------------------------------------------------------------- training simulation
def test_training_checks_pass_and_metrics_per_step(small_cfg):
    p, cfg = _params(small_cfg)
    rec = make_recorder(cfg)
    traces = route_training.train_strategies(p, rec)
    route_training.check_training(p, rec, traces)
    assert all(c.passed for c in rec.checks_rows), [c for c in rec.checks_rows if not c.passed]
    df = pd.DataFrame(rec.metrics_rows)
    for name in ("cv", "maxvio", "dropped_fraction", "tokens_dropped_fraction", "balance_loss", "router_entropy"):
        sub = df[df["name"] == name]
        assert sorted(sub["strategy"].unique()) == sorted(p.strategies)
        assert sub.groupby("strategy")["step"].apply(list).map(lambda s: s == list(range(6))).all()
    applied = df[df["name"] == "applied_loss"].groupby("strategy")["value"].max()
    assert applied["none"] == 0 and applied["aux_free"] == 0 and applied["aux_loss"] > 0 and applied["z_loss"] > 0
    plots = route_plots.training_plots(traces, p.n_experts, p.train_tokens, p.top_k)
    assert set(plots) == {"cv_maxvio", "train_cost", "final_loads"}
    _assert_strategy_names_whole(route_training.strategies_rows(p, traces), p.strategies)


def _assert_strategy_names_whole(rows, strategies) -> None:
    """Regression (issue 12 item 8): the terminal table cut strategy names to `aux_lo…`. On an 80-column
    terminal, redirected, and in markdown, every name is printed whole and no line is wider than the terminal."""
    import io

    from rich.console import Console

    for terminal in (True, False):
        out = io.StringIO()
        rows.print_to(Console(file=out, width=80, force_terminal=terminal, color_system=None))
        text = out.getvalue()
        assert "…" not in text and all(name in text for name in strategies), text
        if terminal:
            assert max(map(len, text.splitlines())) <= 80, text
    assert all(f" {name} |" in rows.markdown() for name in strategies)


def test_training_task_loss_is_on_the_residual_output(small_cfg):
    """Regression: the training MSE was taken on the mixture alone (dropped tokens output 0). Step 0's
    recorded task loss, recomputed independently from the same init and batch, is MSE(x + mixture, y)."""
    p, cfg = _params(small_cfg, steps=1, strategies=["none"], capacity_factor=0.5)
    rec = make_recorder(cfg)
    route_training.train_strategies(p, rec)
    recorded = [r["value"] for r in rec.metrics_rows if r["name"] == "task_loss"][0]
    task = route_training.ClusterTask.make(p.d_model, p.clusters, rec.seed + 3)
    layer = moe.MoELayer(p.d_model, p.d_hidden, p.n_experts, p.top_k, p.capacity_factor, residual=False)
    layer.load_state_dict(route_training.initial_state(p, task, rec.seed + 4))
    x, y = task.sample(p.train_tokens, torch.Generator().manual_seed(rec.seed + 1))
    with torch.no_grad():
        res = layer(x)
    assert (~res.keep.any(-1)).any()  # some tokens fully dropped
    tokens_dropped = [r["value"] for r in rec.metrics_rows if r["name"] == "tokens_dropped_fraction"][0]
    assert tokens_dropped == int((~res.keep.any(-1)).sum()) / p.train_tokens
    assert recorded == pytest.approx(float(F.mse_loss(x + res.mixture, y)), rel=1e-6)
    assert recorded != pytest.approx(float(F.mse_loss(res.mixture, y)), rel=1e-2)


def test_identical_init_and_data_across_strategies(small_cfg):
    """Step 0 happens before any update: strategies without noise see the same routing."""
    p, cfg = _params(small_cfg, steps=1)
    rec = make_recorder(cfg)
    traces = route_training.train_strategies(p, rec)
    first = {s: t.history["cv"][0] for s, t in traces.items()}
    assert first["none"] == first["aux_loss"] == first["z_loss"] == first["aux_free"]


def test_same_seed_bit_identical(small_cfg):
    p, cfg = _params(small_cfg, steps=3)
    rows = []
    for _ in range(2):
        rec = make_recorder(cfg)
        route_training.train_strategies(p, rec)
        rows.append(rec.metrics_rows)
    assert rows[0] == rows[1]


def test_training_planted_bugs(small_cfg, monkeypatch):
    monkeypatch.setitem(moe.DISPATCH, "sorted", _dispatch_ignoring_capacity)
    monkeypatch.setattr(moe, "expert_load", lambda idx, n: torch.bincount(idx[:, 0], minlength=n))
    p, cfg = _params(small_cfg, steps=3, strategies=["none"], capacity_factor=0.5)
    rec = make_recorder(cfg)
    route_training.check_training(p, rec, route_training.train_strategies(p, rec))
    assert not _check(rec, "train.capacity_respected.none").passed
    assert not _check(rec, "train.dropped_plus_kept.none").passed
    assert not _check(rec, "train.loads_sum.none").passed
    assert not _check(rec, "train.cv_maxvio_recomputed.none").passed
    assert not _check(rec, "train.cv_maxvio_every_step.none").passed


def test_training_planted_bug_cv_wrong_at_one_middle_step(small_cfg, monkeypatch):
    """A CV bug that shows only at step 1 of 3: the final-step recomputation cannot see it, the every-step
    check must."""
    real, calls = moe.load_cv, {"n": 0}

    def wrong_once(load):
        calls["n"] += 1
        return real(load) * (1.5 if calls["n"] == 2 else 1.0)

    monkeypatch.setattr(moe, "load_cv", wrong_once)
    p, cfg = _params(small_cfg, steps=3, strategies=["none"])
    rec = make_recorder(cfg)
    route_training.check_training(p, rec, route_training.train_strategies(p, rec))
    assert calls["n"] == 3
    assert _check(rec, "train.cv_maxvio_recomputed.none").passed
    assert not _check(rec, "train.cv_maxvio_every_step.none").passed


def test_interrupt_keeps_steps_done_so_far(small_cfg):
    p, cfg = _params(small_cfg, steps=1000)
    rec = make_recorder(cfg)

    def stop_after_five(strategy, step):
        if step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        route_training.train_strategies(p, rec, on_step=stop_after_five)
    cv = [r for r in rec.metrics_rows if r["name"] == "cv"]
    assert [r["step"] for r in cv] == [0, 1, 2, 3, 4] and {r["strategy"] for r in cv} == {"none"}


def test_thread_count_restored_after_interrupt():
    """route-sim runs on conf's `threads: 1`; the runner restores torch's thread count even after Ctrl-C."""
    from tfmoe.api.testing import compose
    from tfmoe.contract.runtime import torch_threads

    assert compose("route-sim").threads == 1
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(KeyboardInterrupt), torch_threads(1):
            assert torch.get_num_threads() == 1
            raise KeyboardInterrupt
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_sweep_plots():
    df = pd.DataFrame({"name": ["cv"] * 4, "value": [1.0, 0.5, 0.9, 0.4], "step": [9, 9, 9, 9],
                       "strategy": ["none", "aux_free"] * 2, "job": [0, 0, 1, 1]})
    assert set(rs.sweep_plots(df)) == {"sweep_final_cv"}
    assert rs.sweep_plots(pd.DataFrame({"name": []})) == {}
    course_only = pd.DataFrame({"name": ["course.cv"] * 2, "value": [0.2, 0.3], "job": [0, 1]})  # steps=0 sweep
    fig = rs.sweep_plots(course_only)["sweep_final_cv"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["course case"]


# ------------------------------------------------------------------------------- CLI
def test_cli_run_bad_input_and_interrupt(tmp_path, monkeypatch):
    from tfmoe.harness.store.notebook import load_run

    res = run_cli(["route-sim", "steps=5", "train_tokens=64"], tmp_path)
    assert res.exit_code == 0, res.stdout + res.stderr
    run = load_run(res.run_dir)
    assert run.checks["passed"].all()
    assert {"router_probs", "topk_idx", "topk_weight", "expert_load"} <= set(run.tensors)
    m = run.metrics
    assert {"cv", "maxvio", "dropped_fraction", "balance_loss"} <= set(m["name"])
    course = m[m["name"] == "course.cv"]  # the course case's own address, apart from the training rows
    assert len(course) == 1 and course["strategy"].isna().all() and course["step"].isna().all()
    assert m[m["name"] == "cv"]["step"].notna().all()
    assert (res.run_dir / "cv_maxvio.png").exists() and (res.run_dir / "course_loads.png").exists()
    assert "…" not in res.stdout and "aux_loss" in res.stdout and "noisy_topk" in res.stdout, res.stdout

    assert run_cli(["route-sim", "top_k=9"], tmp_path).exit_code == 2
    assert run_cli(["route-sim", "strategies=[none,magic]"], tmp_path).exit_code == 2

    calls = {"n": 0}
    real = moe.router_z_loss

    def interrupting_z_loss(*args, **kwargs):  # called once by the course case, then once per step
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(moe, "router_z_loss", interrupting_z_loss)
    res = run_cli(["route-sim", "steps=1000", "train_tokens=64"], tmp_path)
    assert res.exit_code == 130
    run = load_run(res.run_dir)
    assert run.run["status"] == "interrupted"
    steps = run.metrics[(run.metrics["name"] == "cv") & run.metrics["step"].notna()]["step"]
    assert sorted(steps.astype(int)) == list(range(7))


@pytest.mark.slow
def test_real_ctrl_c_stops_fast(tmp_path):
    """A real SIGINT to a long run: the loop stops and the records are written within a second, the process
    exits 130 (interpreter teardown included) within a few, and the steps done so far are readable."""
    from tfmoe.harness.store.notebook import find_runs, load_run

    tfmoe_bin = Path(sys.executable).with_name("tfmoe")
    proc = subprocess.Popen([str(tfmoe_bin), "route-sim", "steps=100000"], cwd=tmp_path, preexec_fn=sigint_default, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(12)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    stamped = [(time.monotonic() - t0, line) for line in proc.stdout]
    proc.wait(timeout=30)
    total = time.monotonic() - t0
    written = [t for t, line in stamped if "interrupted (exit 130)" in line]
    assert proc.returncode == 130, "".join(line for _, line in stamped)
    assert written and written[0] < 1.0, stamped[-5:]
    assert total < 5.0
    run = load_run(tmp_path / find_runs(tmp_path / "runs")[-1])
    assert run.run["status"] == "interrupted"
    assert (run.metrics["name"] == "cv").sum() > 10


# ------------------------------------------------------------------ the course case's own address (issue 29, item 8)
def test_course_case_quantities_have_their_own_address(tmp_path):
    """`cv[strategy=none]` was judged at the training simulation's last step, the course case's CV (stored as
    `cv, strategy=none, step=null`) could not be addressed at all; now it is `course.cv` (and its kin)."""
    from tfmoe.harness.store.notebook import load_run

    res = run_cli(["route-sim", "steps=3", "train_tokens=32", "strategies=[none]",
                   "--expect", "course.cv ~ 0.3 ± 0.3", "--expect", "course.load[expert=0] >= 0",
                   "--expect", "max(course.dropped) >= 0", "--expect", "course.maxvio >= 0",
                   "--expect", "course.dropped_fraction in [0, 1]"], tmp_path)
    assert res.exit_code == 0, res.stdout + res.stderr
    run = load_run(res.run_dir)
    m = run.metrics
    course_cv = float(m[m["name"] == "course.cv"]["value"].iloc[0])
    load = m[m["name"] == "course.load"].sort_values("expert")["value"].to_numpy()
    assert load.sum() == 100 * 2 and len(load) == 8  # tokens * top_k over the 8 experts
    kept = m[m["name"] == "course.kept"].sort_values("expert")["value"].to_numpy()
    dropped = m[m["name"] == "course.dropped"].sort_values("expert")["value"].to_numpy()
    assert (kept + dropped == load).all()
    exp = pd.read_parquet(res.run_dir / "expectations.parquet").set_index("selector")
    assert exp.loc["course.cv", "held"] and exp.loc["course.cv", "observed"] == course_cv
    assert exp["held"].all(), exp
    # the training simulation's rows keep `cv[strategy=none]`, judged at its last step, never the course case
    res = run_cli(["route-sim", "steps=3", "train_tokens=32", "strategies=[none]",
                   "--expect", "cv[strategy=none] >= 0"], tmp_path)
    exp = pd.read_parquet(res.run_dir / "expectations.parquet")
    assert "last step (2)" in exp["detail"].iloc[0]
    # strategy=course is not a strategy: refused before the run, naming the strategies it records
    res = run_cli(["route-sim", "steps=3", "strategies=[none]", "--expect", "cv[strategy=course] < 1"], tmp_path)
    assert res.exit_code == 2 and "strategy=none" in res.stdout + res.stderr
