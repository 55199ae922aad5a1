"""The layer battery on MoE layers in other mixing forms and layouts (tests/mixing_moe.py), under the defaults a user
runs: the weight applied inside the expert, a latent MoE projecting after the mixture, experts returning
(out, bias), several shared experts, experts no layout describes (black boxes), a layer holding a ProcessGroup,
and the probe hook's return types."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tfmoe.api.testing import compose, make_recorder
from tfmoe.contract.errors import BadInput
from tfmoe.experiments import route_sim
from tfmoe.experiments.route_sim import layer as route_layer

HERE = Path(__file__).resolve().parent


def battery(impl: str, *overrides: str):
    """The battery exactly as `tfmoe route-sim impl=<impl>` composes it."""
    cfg = compose("route-sim", [f"impl={impl}", *overrides])
    rec = make_recorder(cfg)
    route_layer.run_battery(route_sim.settings(cfg).layer, rec)
    return rec


def rows(rec):
    return {c.check.removeprefix("layer."): c for c in rec.checks_rows}


def failed(rec) -> set[str]:
    return {name for name, c in rows(rec).items() if not c.passed}


def not_judged(rec) -> dict[str, str]:
    """Checks the battery could not judge on this layer (not those the design does not define: n/a)."""
    return {name: c.detail for name, c in rows(rec).items() if not c.applicable
            and not c.detail.startswith("not applicable: ")}


# --------------------------------------------------------------------------- the mixing forms, undeclared
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("impl, form", [("mixing_moe:InsideWeight", "weight_inside_expert"),
                                        ("mixing_moe:LatentFolded", "post_mixture_projection")])
def test_a_correct_layer_of_each_mixing_form_passes_undeclared_and_the_form_is_named(impl, form, seed):
    """Regression (F-250): the probe reads the weight where it multiplies the expert's output; a layer applying it
    elsewhere read 0.25-1.0 against a 1e-6 limit and drew "top-k weights not renormalised"."""
    rec = battery(impl, f"seed={seed}")
    assert not failed(rec), failed(rec)
    skipped = not_judged(rec)
    assert skipped["routing_weights"].startswith(f"not judged: mixing detected, {form}")
    assert "topk_weights_sum" in skipped and "likely cause" not in skipped["routing_weights"]
    assert rows(rec)["output_vs_reference"].passed and rows(rec)["output_vs_reference"].applicable
    assert any(n.startswith(f"mixing: {form}") for n in rec.notes)


@pytest.mark.parametrize("impl", ["mixing_moe:InsideNotRenormalised", "mixing_moe:LatentFoldedNotRenormalised"])
def test_a_weight_bug_in_each_mixing_form_is_caught_undeclared(impl):
    assert "output_vs_reference" in failed(battery(impl))


# --------------------------------------------------------------------------- the mixing forms, declared
def test_weight_inside_expert_declared_is_measured_inside_the_experts():
    rec = battery("mixing_moe:InsideWeightDeclared")
    assert not failed(rec) and not not_judged(rec)
    assert "measured inside the experts" in rows(rec)["routing_weights"].detail
    assert any(n.startswith("declared: mixing = weight_inside_expert (tfmoe_mixing)") for n in rec.notes)
    bad = failed(battery("mixing_moe:InsideDeclaredNotRenormalised"))
    assert {"output_vs_reference", "routing_weights", "topk_weights_sum"} <= bad
    # the same through the config
    assert not failed(battery("mixing_moe:InsideWeight", "layer.mixing=weight_inside_expert"))


def test_weight_inside_expert_with_no_expert_module_is_read_off_the_router_and_says_so():
    rec = battery("mixing_moe:InsideRouterRead")
    assert not failed(rec)
    assert "read off the layer's own router" in rows(rec)["routing_weights"].detail
    assert not_judged(rec)["topk_weights_sum"].startswith("not judged: the combine weights are read off the router")


def test_latent_moe_given_its_projections_has_its_weights_measured_along_them():
    rec = battery("mixing_moe:LatentProjected")
    assert not failed(rec) and not not_judged(rec)
    assert "along the declared projection" in rows(rec)["routing_weights"].detail
    bad = failed(battery("mixing_moe:LatentProjectedNotRenormalised"))
    assert {"output_vs_reference", "routing_weights", "topk_weights_sum"} <= bad


def test_a_mixing_form_the_battery_does_not_know_is_bad_input():
    with pytest.raises(BadInput, match="layer.mixing='inside'.*weight_inside_expert or post_mixture_projection"):
        battery("mixing_moe:InsideWeight", "layer.mixing=inside")


# --------------------------------------------------------------------------- layouts
def test_experts_returning_out_and_bias_are_judged():
    rec = battery("mixing_moe:TupleExperts")
    assert not failed(rec) and rows(rec)["routing_weights"].applicable


def test_several_shared_experts_are_summed_and_one_dropped_is_caught():
    assert not failed(battery("mixing_moe:SeveralShared"))
    assert "output_vs_reference" in failed(battery("mixing_moe:SecondSharedDropped"))


def test_shared_experts_declared_and_given_must_agree():
    with pytest.raises(BadInput, match=r"shared_experts=1 but reference_weights gives 2 shared expert"):
        battery("mixing_moe:SharedMiscount")


def test_probe_targets_may_return_a_plain_list_and_a_wrong_type_is_bad_input_naming_the_hook():
    assert not failed(battery("mixing_moe:PlainListProbe"))
    with pytest.raises(BadInput, match=r"probe_targets\(module\) returned dict.*list of modules"):
        battery("mixing_moe:WrongProbeType")


def test_wrong_probe_type_exits_2_from_the_cli(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([str(Path(sys.executable).with_name("tfmoe")), "route-sim", "impl=mixing_moe:WrongProbeType",
                        "steps=0", f"run_root={tmp_path / 'runs'}"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "probe_targets" in p.stderr and "Traceback" not in p.stderr


# --------------------------------------------------------------------------- experts as black boxes
def test_experts_no_layout_describes_run_as_black_boxes_and_everything_else_is_judged():
    rec = battery("mixing_moe:BlackBox")
    assert not failed(rec)
    assert not_judged(rec)["expert_internals"].startswith("not judged: 8 of 8 experts")
    assert "tfmoe_expert_ffn" in not_judged(rec)["expert_internals"]
    judged = {n for n, c in rows(rec).items() if c.applicable}
    assert {"output_vs_reference", "routing_selection", "routing_weights", "topk_weights_sum", "loads_sum",
            "cv_maxvio", "permutation_equivariance", "batch_independence", "finite.fp16", "finite.bf16"} <= judged


def test_a_routing_bug_around_black_box_experts_is_caught():
    rec = battery("mixing_moe:BlackBoxArgmin")
    assert {"output_vs_reference", "routing_selection"} <= failed(rec)
    assert not_judged(rec)["routing_weights"].startswith("not judged: no token reached")  # never a vacuous pass


# --------------------------------------------------------------------------- a layer holding a ProcessGroup
@pytest.fixture
def gloo_group(tmp_path):
    """A real gloo process group of world size 1 in this process, torn down after the test."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def test_a_layer_holding_a_process_group_runs_its_dtype_checks(gloo_group):
    """Regression (F-252): the fp16/bf16 checks deep-copied the layer; a ProcessGroup cannot be pickled, so the run
    crashed (exit 3). The copies are now rebuilt through the layer's factory."""
    import mixing_moe

    with pytest.raises(TypeError, match="pickle"):
        copy.deepcopy(mixing_moe.WithGroup(16, 32, 8, 2))  # the premise: this layer cannot be deep-copied
    rec = battery("mixing_moe:WithGroup")
    assert not failed(rec)
    assert rows(rec)["finite.fp16"].applicable and rows(rec)["finite.bf16"].applicable


def test_a_capacity_over_the_whole_batch_makes_batch_independence_not_applicable():
    """Regression (F-253): sequences compete for a batch-wide capacity by design; batch_independence failed it."""
    rec = battery("mixing_moe:BatchCapacity", "top_k=1")
    assert not failed(rec)
    assert rows(rec)["batch_independence"].detail.startswith("not applicable: a capacity counted over the whole")
    assert int(rec.tensors_saved["layer.expert_load"].sum()) < 24  # the capacity dropped assignments


def test_an_expert_bug_in_an_undeclared_latent_moe_draws_no_renormalisation_cause():
    """The probe reads every weight times the projection's gain (one factor): the top-k sum is not judged, so the
    diagnosis cannot blame a missing renormalisation; the expert bug fails output_vs_reference."""
    from tfmoe.harness.method.diagnosis import checks_mapping, diagnose

    rec = battery("mixing_moe:LatentFoldedExpertBug")
    assert "output_vs_reference" in failed(rec)
    assert not_judged(rec)["topk_weights_sum"].startswith("not judged: the probe reads every weight x")
    causes = " ".join(i.line() for i in diagnose("route-sim", checks_mapping(rec.checks_rows), rec.metrics_rows, {}))
    assert "not renormalised" not in causes


def test_a_weight_inside_the_expert_before_a_last_bias_is_named_undeclared_and_passes_declared():
    """down(w · h) + b is another function than w · (down(h) + b): undeclared, output_vs_reference fails and names
    the reading that matches and its declaration; declared, every check passes."""
    rec = battery("mixing_moe:InsideWeightBiased")
    assert "output_vs_reference" in failed(rec)
    assert rows(rec)["output_vs_reference"].detail.startswith("CAUSE: the layer matches the reference read with the "
                                                               "weight inside the expert")
    rec = battery("mixing_moe:InsideWeightBiasedDeclared")
    assert not failed(rec) and "measured inside the experts" in rows(rec)["routing_weights"].detail


def test_a_black_box_expert_not_callable_as_expert_x_leaves_the_mixture_not_judged_and_the_rest_judged():
    """Regression (F-254): a declared weight_inside_expert layer without tfmoe_expert_ffn has experts taking (x, w);
    the reference called them as expert(x) and the run crashed (exit 3) with the user's TypeError."""
    rec = battery("mixing_moe:InsideNoHook")
    skipped = not_judged(rec)
    for name in ("output_vs_reference", "expert_internals"):
        assert skipped[name].startswith("not judged: raised TypeError: ScaledFFN.forward() missing 1 required")
        assert "callable as expert(x)" in skipped[name] and "tfmoe_expert_ffn" in skipped[name]
    assert not failed(rec), failed(rec)
    judged = {n for n, c in rows(rec).items() if c.applicable}
    assert {"routing_selection", "routing_weights", "loads_sum", "cv_maxvio", "permutation_equivariance",
            "batch_independence", "finite.fp16", "finite.bf16"} <= judged
    # the weights are read off the router; nothing claims the combine was judged
    assert "the combine is not judged" in rows(rec)["routing_weights"].detail


def test_the_semantics_note_states_only_what_the_design_sets():
    """Regression (F-255): the verdict's note printed every field, so an ungated shared expert read
    `shared_gated=True`; a deliberately wrong variant's switch is named only when set."""
    rec = battery("mixing_moe:SeveralShared")
    note = next(n for n in rec.notes if n.startswith("layer battery on"))
    assert "RoutingSemantics(score_func='softmax', top_k=2, normalize=True" in note
    assert "shared_gated" not in note and "use_correction_bias" not in note
    from tfmoe.components.moe_reference import RoutingSemantics

    assert str(RoutingSemantics("sigmoid", 8, True).variant(shared_gated=False, capacity=3)) == (
        "RoutingSemantics(score_func='sigmoid', top_k=8, normalize=True, shared_gated=False, capacity=3)")


@pytest.mark.parametrize("impl, via", [("mixing_moe:InsideWeightDeclared", "through tfmoe_expert_ffn as MlpExpert"),
                                       ("mixing_moe:TupleExperts", "from reference_weights as MlpExpert")])
def test_experts_rebuilt_from_their_weights_are_judged_against_their_own_modules(impl, via):
    """expert_internals is a judged row wherever every expert is rebuilt and its module receives the token rows (the
    weight inside the expert fitted per row first); a planted x1.5 fails it (tests/planted_moe.py)."""
    row = rows(battery(impl))["expert_internals"]
    assert row.applicable and row.passed and via in row.detail


def test_the_run_count_labels_every_n_a_and_not_judged_row_the_table_shows():
    """Regression (F-256): the table showed the checks a design does not define as n/a rows while the run's count left
    them out and called the not judged ones n/a (`8/9 (+2 n/a)` over 2 n/a and 2 not judged rows)."""
    from tfmoe.harness.store.rundir import checks_cell

    rec = battery("mixing_moe:InsideWeight")
    shown = [r[1] for r in route_layer.battery_rows(rec, "t").texts()]
    na, unjudged = shown.count("n/a"), shown.count("not judged")
    assert na >= 2 and unjudged == 2, shown  # aux loss and correction bias undefined; the weights' two checks
    cell = checks_cell([{"passed": c.passed, "applicable": c.applicable, "detail": c.detail} for c in rec.checks_rows])
    assert cell.endswith(f"(+{na} n/a, +{unjudged} not judged)"), cell
    assert len(rec.checks_rows) == len(shown)


def test_a_course_interface_shared_expert_given_through_its_hook_is_judged():
    """The course interface names its shared experts with tfmoe_shared_experts(); a shared expert doubled fails, and
    one the class does not name fails output_vs_reference (the course's semantics have none)."""
    assert not failed(battery("mixing_moe:CourseShared"))
    assert "output_vs_reference" in failed(battery("mixing_moe:CourseSharedDoubled"))
    assert "output_vs_reference" in failed(battery("mixing_moe:CourseSharedUndeclared"))


def test_the_protocol_names_import_from_tfmoe_adapters_and_a_biased_glu_reads_as_documented():
    """docs/checking-your-own-layers.md: the protocol's names come from tfmoe.adapters; GluExpert is bias-free and a
    GLU with biases is a ChunkedGluExpert, up (value) half first."""
    import torch

    from tfmoe.adapters import ChunkedGluExpert, GluExpert, LayerWeights, MlpExpert, MoEAdapter, MoESemantics
    from tfmoe.components import moe_reference as ref

    assert (LayerWeights, MlpExpert, GluExpert, ChunkedGluExpert) == (ref.LayerWeights, ref.MlpExpert, ref.GluExpert,
                                                                      ref.ChunkedGluExpert)
    assert MoEAdapter and MoESemantics
    g = torch.Generator().manual_seed(0)
    gate, up, bg, bu = (torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g,
                        dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64),
                        torch.randn(6, generator=g, dtype=torch.float64))
    down, bd = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    lin = torch.nn.functional.linear
    want = lin(torch.nn.functional.silu(lin(x, gate, bg)) * lin(x, up, bu), down, bd)
    got = ChunkedGluExpert(torch.cat([up, gate]), down, "silu", b_in=torch.cat([bu, bg]), b_down=bd)(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(GluExpert(gate, up, down, "silu")(x),
                               lin(torch.nn.functional.silu(lin(x, gate)) * lin(x, up), down), rtol=1e-12, atol=1e-12)
