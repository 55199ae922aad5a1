"""Sizes are the user's, never a crash (issue 29, item 2): every experiment estimates its memory before allocating;
an impossible size is exit 2, one line naming the knob that dominates the estimate and a value of it that fits,
and that value is itself accepted. Generated from the registry and the configs: every integer key of every
experiment's config is either a size (tried huge here) or says why it is not one, so a new key or experiment cannot
skip the guard. Each case runs only ``settings()`` (the guard runs before anything is allocated) against a fixed
amount of available memory, so no case depends on what else this machine is doing.
"""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from tfmoe.api.testing import compose, run_cli
from tfmoe.contract.errors import BadInput
from tfmoe.contract.registry import EXPERIMENTS
from tfmoe.rules import memory
from tfmoe.rules.memory import Knob

HUGE = 10**12
AVAILABLE = 16 * 2**30  # what the host is said to have free, in every case
BASE_KEYS = {"seed", "tensor_max_numel", "threads"}  # conf/base.yaml's: the harness's, not an experiment's

# experiment -> size key -> companions: overrides that keep the huge value past the other validation rules
SIZES: dict[str, dict[str, tuple[str, ...]]] = {
    "arch": {"vocab_size": (), "d_model": (), "n_layers": (), "n_classes": (), "batch_size": (),
             "seq_len": (f"vocab_size={HUGE}",), "tgt_len": (f"vocab_size={HUGE}",), "n_heads": ()},
    "block-stats": {"n_layers": (), "d_model": (), "vocab_size": (), "batch_size": (), "seq_len": (), "n_heads": ()},
    "shift-labels": {"model.d_model": (), "model.n_layers": (), "model.n_heads": ()},
    "decode": {"d_model": (), "n_layers": (), "max_len": (), "train_steps": (), "batch_size": (),
               "block_size": (f"max_len={HUGE + 1}",), "beam_width": (), "check_tokens": (f"max_len={HUGE + 10}",),
               "max_new_tokens": (f"max_len={HUGE + 10}",), "chi2_draws": (), "n_heads": ()},
    "route-sim": {"tokens": (), "d_model": (), "d_hidden": (), "n_experts": (), "top_k": (f"n_experts={HUGE}",),
                  "steps": (), "train_tokens": (), "clusters": (), "layer.batch": (), "layer.seq": (),
                  "layer.shared_hidden": ()},
    "complexity": {"T": ("D=512",), "D": ("T=256",), "B": (), "peak_matmul_n": (), "n_experts": (),
                   "d_ff": (), "n_heads": ()},
    "tokenize": {"train.vocab_size": (), "digit_run_max": ()},  # bounded by their validation rules
    "attn-check": {"d_model": (), "B": (), "T": (), "n_heads": (), "gradcheck_T": (), "dropout_samples": (),
                   "chunked.probe_T": (), "chunked.probe_heads": (), "chunked.probe_d_head": ()},
}
# experiment -> integer key that is no size -> why
NOT_SIZES: dict[str, dict[str, str]] = {
    "attn-check": {"chunked.block_size": "a key block: a block longer than T is T (no more memory)",
                   "chunked.probe_block_size": "a key block of the probe: longer than probe_T is probe_T",
                   "chunked.timing_repeats": "repeats of a timing: time, not memory",
                   "kernel_checks.dropout_seeds": "kernel mode's seeds: time, not memory",
                   "cases.batch": "kernel mode's matrix (module mode never reads it): not estimated yet",
                   "cases.q_heads": "kernel mode's matrix (module mode never reads it): not estimated yet"},
    "tokenize": {"show_per_category": "how many samples summary.md shows: never more than the input has"},
    "shift-labels": {"ignore_index": "a label value, refused unless negative"},
    "decode": {"top_k": "a sampling filter, clamped to the vocabulary (sampling.top_k_filter)",
               "timing_repeats": "repeats of a timing: time, not memory",
               "lm.steps": "tokens the model battery decodes: refused when prompt + steps exceed 4096 "
                           "(lm_battery.MAX_TOKENS); tfmoe's own tiny LM stops at its max_len"},
    "route-sim": {"ep_size": "processes (ep_size=W): refused in one line above what the machine can start",
                  "ep_steps": "forward/backward steps of the EP run, on the same tokens: time, not memory",
                  "ep_timeout_s": "the collectives' timeout: time, not memory",
                  "ep_link_gbps": "the scaling model's link bandwidth: a number in a formula, nothing allocated",
                  "ep_link_latency_us": "the scaling model's link latency: a number in a formula, nothing allocated",
                  "layer.n_group": "expert groups, validated against n_experts",
                  "layer.topk_group": "groups kept per token, validated against layer.n_group"},
    "complexity": {"n_layers": "analytic only: the model's totals are computed, never built",
                   "vocab": "analytic only: the model's totals are computed, never built",
                   "top_k": "validated against n_experts", "warmup": "repeats of a timing: time, not memory"},
}
EXEMPT: dict[str, str] = {}


def _int_keys(experiment: str) -> set[str]:
    cfg = OmegaConf.to_container(compose(experiment), resolve=False)
    cfg.pop("hydra", None)

    def flat(d: dict, prefix: str = ""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v
    return {k for k, v in flat(cfg) if isinstance(v, int) and not isinstance(v, bool) and k not in BASE_KEYS}


@pytest.mark.parametrize("experiment", list(EXPERIMENTS))
def test_every_integer_key_is_classified(experiment):
    if experiment in EXEMPT:
        return
    assert experiment in SIZES, f"{experiment} has no SIZES entry in tests/test_size_guard.py"
    unclassified = _int_keys(experiment) - set(SIZES[experiment]) - set(NOT_SIZES.get(experiment, {}))
    assert not unclassified, (f"{experiment}'s integer keys {sorted(unclassified)} are neither in SIZES (tried huge) nor "
                              "in NOT_SIZES (with why) of tests/test_size_guard.py")


@pytest.fixture
def fixed_memory(monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: AVAILABLE)


def _advice(message: str) -> list[str]:
    m = re.search(r"\(at most about ([^()]*)\)$", message)
    assert m, message
    return m[1].split()


CASES = [(e, k) for e, keys in SIZES.items() for k in keys]


@pytest.mark.parametrize(("experiment", "key"), CASES, ids=[f"{e}-{k}" for e, k in CASES])
def test_a_huge_size_is_refused_naming_the_dominant_knob_and_a_fix_that_is_accepted(experiment, key, fixed_memory):
    module = EXPERIMENTS[experiment].load()
    overrides = [f"{key}={HUGE}", *SIZES[experiment][key]]
    with pytest.raises(BadInput) as info:
        module.settings(compose(experiment, overrides))
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    named = {o.split("=")[0] for o in overrides}
    if "dominates it" not in message:  # a validation rule refused it first: it names the key
        assert any(k in message for k in named), message
        return
    dominant = message.split("=")[0]
    assert dominant in named, message
    assert f"{dominant} dominates it" in message and "GiB available" in message
    fix = _advice(message)
    assert fix[0].startswith(f"{dominant}=") and int(fix[0].split("=")[1]) < HUGE
    given = dict(o.split("=") for o in overrides)
    module_cfg = compose(experiment, overrides)
    lowered = re.search(r": lower (.*) \(at most about", message)[1].split(" and ")
    for k, v in (f.split("=") for f in fix):  # no advice to set what is already set (a pinned T/D only repeats it)
        if k in lowered:
            assert str(given.get(k, OmegaConf.select(module_cfg, k))) != v, (k, v, message)
    module.settings(compose(experiment, [*overrides, *fix]))  # the advised fix is itself accepted


@pytest.mark.parametrize("experiment", [e for e in EXPERIMENTS if e not in EXEMPT])
def test_the_default_config_is_accepted(experiment, fixed_memory):
    EXPERIMENTS[experiment].load().settings(compose(experiment))


def test_route_sim_advice_is_no_longer_circular(fixed_memory):
    """`d_model=1000000000 steps=0` said "lower tokens (at most about tokens=1)"; tokens=1 said the same."""
    from tfmoe.experiments import route_sim

    for extra in ([], ["tokens=1"]):
        with pytest.raises(BadInput) as info:
            route_sim.settings(compose("route-sim", ["d_model=1000000000", "steps=0", *extra]))
        message = str(info.value)
        assert message.startswith("d_model=1000000000 needs about") and "d_model dominates it" in message
        fix = _advice(message)
        assert fix[0].startswith("d_model=") and "tokens" not in " ".join(fix)
        route_sim.settings(compose("route-sim", ["d_model=1000000000", "steps=0", *extra, *fix]))


def test_arch_huge_d_model_is_exit_2_not_a_crash(tmp_path):
    """`tfmoe arch d_model=1000000000` exited 3 ("arch crashed (RuntimeError: ... 200000000000 bytes)")."""
    r = run_cli(["arch", "d_model=1000000000"], tmp_path)
    assert r.exit_code == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("error: d_model=1000000000 needs about"), line
    assert "d_model dominates it" in line and "lower d_model (at most about d_model=" in line
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("run.parquet"))


# ------------------------------------------------------------------------------------------ the rule itself
def _linear(z: dict[str, int]) -> int:
    return 100 * z["a"] + z["a"] * z["b"] + z["c"]


def test_size_advice_picks_the_knob_whose_lowering_frees_most():
    knobs = {"a": Knob(1000), "b": Knob(10), "c": Knob(5)}
    advice = memory.size_advice(_linear, knobs, budget=50_000)
    assert advice[0][0] == "a" and _linear({"a": advice[0][1], "b": 10, "c": 5}) <= 50_000
    assert _linear({"a": advice[0][1] + 1, "b": 10, "c": 5}) > 50_000  # the largest that fits


def test_size_advice_keeps_the_step_and_minimum():
    knobs = {"a": Knob(1000, minimum=8, multiple=8), "b": Knob(10), "c": Knob(5)}
    (key, value), = memory.size_advice(_linear, knobs, budget=50_000)
    assert key == "a" and value % 8 == 0 and value >= 8


def test_size_advice_lowers_a_second_knob_when_the_first_is_not_enough():
    knobs = {"a": Knob(1000, minimum=400), "b": Knob(10), "c": Knob(10**9)}
    assert dict(memory.size_advice(_linear, knobs, budget=200_000)).keys() == {"c"}  # c frees most, fits alone
    knobs = {"a": Knob(1000, minimum=600), "b": Knob(1000), "c": Knob(1)}
    advice = memory.size_advice(_linear, knobs, budget=100_000)  # b to its floor is not enough: a too, then b back
    assert [k for k, _ in advice] == ["b", "a"] and _linear({"c": 1, **dict(advice)}) <= 100_000
    assert _linear({"c": 1, **dict(advice), "b": dict(advice)["b"] + 1}) > 100_000  # b raised back as far as fits


def test_size_advice_respects_a_minimum_that_depends_on_another_knob():
    knobs = {"a": Knob(10**6, minimum=lambda z: z["b"]), "b": Knob(10**6), "c": Knob(1)}
    advice = dict(memory.size_advice(_linear, knobs, budget=100_000))
    assert advice["a"] >= advice["b"] and _linear({"c": 1, **advice}) <= 100_000


def test_nothing_fits_says_so():
    with pytest.raises(BadInput, match="even at the smallest sizes"):
        memory.refuse_oversized(_linear, {"a": Knob(10, minimum=10), "b": Knob(1), "c": Knob(1)}, 100, "the host's",
                                "x")
    memory.refuse_oversized(_linear, {"a": Knob(1), "b": Knob(1), "c": Knob(1)}, 10**6, "the host's", "x")  # fits
