"""MoE adapters (issue 22): the MoEAdapter protocol (a user's layout through `impl=pkg.module:Adapter`) and the
shipped adapters of st-moe-pytorch 0.1.8 and mixture-of-experts 0.2.3 (`impl=lib:...`), with their
straight-through and capacity options: zero false alarms on correct configurations, and bugs planted inside each
library's real module caught (those now live in tests/planted_moe.py)."""

from __future__ import annotations

import pytest
from test_route_layer import battery, failed, metric, not_applicable

from tfmoe.api.testing import run_cli
from tfmoe.contract.errors import BadInput

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def st_moe():
    return pytest.importorskip("st_moe_pytorch.st_moe_pytorch")


def moe_lib():
    return pytest.importorskip("mixture_of_experts.mixture_of_experts")


# --------------------------------------------------------------------------- the protocol
def test_user_adapter_softmax_after_topk_passes():
    rec = battery("impl=adapted_moe:SoftmaxAfterTopKAdapter", "layer.seq=8")
    assert not failed(rec), [c for c in rec.checks_rows if not c.passed]
    assert metric(rec, "dispatch_sparse") == 0.0  # every expert on every token, zero gates: routing still read
    assert metric(rec, "alt.not renormalised") > 100 * metric(rec, "design.output_error")


def test_user_adapter_planted_bug_weights_without_softmax():
    bad = failed(battery("impl=adapted_moe:RawLogitWeightsAdapter", "layer.seq=8"))
    assert {"routing_weights", "topk_weights_sum", "output_vs_reference"} <= bad
    assert "routing_selection" not in bad  # the same experts, weighted wrongly


# ------------------------------------------------------------------ st-moe-pytorch 0.1.8
@pytest.mark.parametrize("overrides", [
    [], ["layer.straight_through=false"], ["layer.capacity_factor=8.0"], ["top_k=3"], ["seed=3"],
    ["layer.capacity_factor=1.0", "seed=1"], ["dtype=fp64"],
])
def test_st_moe_correct_configurations_pass(overrides):
    st_moe()
    rec = battery("impl=lib:st_moe_pytorch", "layer.seq=12", *overrides)
    assert not failed(rec), [c for c in rec.checks_rows if not c.passed]
    assert {"finite.fp16", "finite.bf16", "permutation_equivariance"} <= not_applicable(rec)
    detail = next(c.detail for c in rec.checks_rows if c.check == "layer.finite.fp16")
    assert detail.startswith("not applicable: the layer declares it lacks fp16") and "one_hot" in detail


def test_st_moe_capacity_is_exercised():
    """At the default capacity factor some assignments are really dropped (so the capacity rule is judged), and
    ignoring capacity is far from the layer's output."""
    st_moe()
    rec = battery("impl=lib:st_moe_pytorch")
    assert metric(rec, "alt.dropless (capacity ignored)") > 100 * metric(rec, "design.output_error")


# ------------------------------------------------------------------ mixture-of-experts 0.2.3
# (both libraries' planted bugs, inside their own code, are in tests/planted_moe.py: run by tests/test_moe_planted.py
# under the default config)
@pytest.mark.parametrize("overrides", [[], ["layer.capacity_factor=8.0"], ["seed=2"], ["dtype=fp64"]])
def test_mixture_of_experts_correct_configurations_pass(overrides):
    moe_lib()
    rec = battery("impl=lib:mixture_of_experts", *overrides)
    assert not failed(rec), [c for c in rec.checks_rows if not c.passed]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("overrides, message", [
    (["impl=lib:st_moe_pytorch", "top_k=1"], "top_n >= 2"),
    (["impl=lib:mixture_of_experts", "top_k=3"], "routes to 2 experts"),
    (["impl=lib:nothing"], "no shipped MoE adapter 'nothing'"),
    (["impl=adapted_moe:NeedsArgumentsAdapter"], "must build with no arguments"),
    (["impl=adapted_moe:WrongShapeAdapter"], "must return the layer's output shaped like x"),
    (["impl=lib:st_moe_pytorch", "dtype=fp16"], r"cannot run in float16 \(it declares it lacks fp16\)"),
    (["impl=lib:st_moe_pytorch", "layer.capacity_factor=0"], "layer.capacity_factor=0"),
    (["impl=lib:st_moe_pytorch", "layer.straight_through=maybe"], "layer.straight_through"),
])
def test_bad_input_one_line(overrides, message):
    st_moe()
    moe_lib()
    with pytest.raises(BadInput, match=message):
        battery(*overrides)


def test_untested_library_version_exit_2(tmp_path, monkeypatch):
    st_moe()
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: "0.1.7" if d == "st-moe-pytorch" else real(d))
    res = run_cli(["route-sim", "impl=lib:st_moe_pytorch"], tmp_path)
    assert res.exit_code == 2
    assert "tested on st-moe-pytorch==0.1.8" in res.stdout + res.stderr


def test_shipped_adapter_through_the_cli(tmp_path):
    st_moe()
    res = run_cli(["route-sim", "impl=lib:st_moe_pytorch", "layer.straight_through=false", "layer.seq=8"], tmp_path)
    assert res.exit_code == 0, res.stdout + res.stderr
