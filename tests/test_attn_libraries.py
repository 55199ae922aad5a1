"""attn-check on third-party attention layers through the shipped adapters: torchtune's MultiHeadAttention
(impl=torchtune:...), x-transformers' Attention (impl=x-transformers:...) and timm's Attention (impl=timm:...).

Every correct configuration listed passes (zero false alarms), and a bug planted inside each library's real class
(tests/buggy_libraries.py) makes the named check fail. The extras `torchtune` and `xtransformers` are installed by
`make setup`, so CI runs these tests; a missing one fails under CI=true and is skipped (with the reason) locally.
timm needs a torchvision built for the installed torch, which PyPI does not have for a CPU torch: its tests skip
with that reason where `import timm` fails (see pyproject.toml's `timm` extra)."""

from __future__ import annotations

import os

import buggy_libraries as bugs
import pytest
import torch
from test_attn_adapters import SMALL
from test_attn_check import failed

from tfmoe.components.references import Rope, rotate
from tfmoe.errors import BadInput
from tfmoe.testing import run_recorded

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXTRAS = {"torchtune": ("torchtune.modules", "torchtune"), "x-transformers": ("x_transformers", "xtransformers"),
          "timm": ("timm.layers", "timm")}
FAST_GROUPS = "checks=[masks,sdpa,invariances]"
FULL = ["lengths=[6,6]"]  # no padded rows: x-transformers zeroes padded query rows (see PADDED_QUERIES)
PADDED_QUERIES = pytest.mark.xfail(strict=True, reason="holes: padded query rows are excluded from comparisons by "
                                   "default (padded_query_policy); x-transformers' mask= zeroes them")


def library(scheme: str) -> None:
    """Skip (locally) or fail (CI) when the library of impl=<scheme>:... does not import."""
    module, extra = EXTRAS[scheme]
    try:
        __import__(module)
    except ImportError as exc:
        reason = f"the `{extra}` extra is not installed ({exc}): pip install -e '.[{extra}]'" + (
            " (make setup does)" if scheme != "timm" else " beside a torchvision built for this torch (make setup "
            "does not: PyPI's torchvision is a CUDA build, see pyproject.toml)")
        if os.environ.get("CI") and scheme != "timm":
            pytest.fail(reason)
        pytest.skip(reason)
    except RuntimeError as exc:  # timm -> torchvision whose C ops do not load beside this torch
        pytest.skip(f"`import {module}` fails in torchvision ({exc}): timm needs a torchvision built for torch "
                    f"{torch.__version__}; PyPI has only CUDA builds, so the `timm` extra is not in make setup")


def battery(spec: str, *overrides: str):
    library(spec.split(":")[0])
    rec = run_recorded("attn-check", [*SMALL, f"impl={spec}", *overrides])
    return {c.check: c for c in rec.checks_rows}, rec


def assert_passes(checks, expected: set[str]) -> None:
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}
    assert expected <= set(checks), sorted(set(checks))


# -------------------------------------------------------------------------- correct configurations pass
# (spec, overrides, checks that must have been judged); every config: fp32 unless it says a dtype
CORRECT = [
    ("torchtune:mha", [], {"sdpa_match", "grad_match", "batch_sizes", "head_counts", "dropout_rate"}),  # MHA, RoPE, causal, padding
    ("torchtune:mha", ["n_kv_heads=2", FAST_GROUPS], {"sdpa_match", "batch_sizes"}),  # GQA
    ("torchtune:mha", ["n_kv_heads=1", FAST_GROUPS], {"sdpa_match"}),  # MQA
    ("torchtune:mha-nope", ["causal=false", FAST_GROUPS], {"sdpa_match", "head_counts"}),
    ("torchtune:mha", ["dtype=bf16", "n_kv_heads=2", "checks=[sdpa]"], {"sdpa_match"}),
    ("torchtune:mha", ["dtype=fp16", "checks=[sdpa]"], {"sdpa_match"}),
    ("x-transformers:attention", [*FULL, "head_counts=[1,2,4]"],
     {"sdpa_match", "row_sums", "causal_zero", "grad_match", "head_counts", "dropout_rate"}),  # MHA, RoPE, causal
    ("x-transformers:attention", ["n_kv_heads=2", *FULL, FAST_GROUPS], {"sdpa_match", "row_sums"}),  # GQA (tiled)
    ("x-transformers:attention-flash", ["n_kv_heads=2", *FULL, FAST_GROUPS], {"sdpa_match"}),
    ("x-transformers:attention-nope", ["causal=false", *FULL, "head_counts=[1,2,4,8]", FAST_GROUPS],
     {"sdpa_match", "head_counts"}),
    ("x-transformers:attention", ["checks=[masks]"], {"padding_zero", "causal_zero"}),  # key padding: the weights
    ("x-transformers:attention", ["dtype=fp16", "n_kv_heads=2", *FULL, "checks=[sdpa]"], {"sdpa_match"}),
    ("x-transformers:attention-flash", ["dtype=bf16", *FULL, "checks=[sdpa]"], {"sdpa_match"}),
    ("timm:attention", [], {"sdpa_match", "gradcheck", "head_counts", "dropout_rate"}),  # causal, padding
    ("timm:attention-unfused", ["fully_masked_policy=nan"], {"sdpa_match", "gradcheck", "head_counts"}),
    ("timm:attention", ["causal=false", FAST_GROUPS], {"sdpa_match"}),
    ("timm:attention-unfused", ["dtype=bf16", "checks=[sdpa]"], {"sdpa_match"}),
    ("timm:attention", ["dtype=fp16", "checks=[sdpa]"], {"sdpa_match"}),
]


def config_id(case) -> str:
    spec, overrides, _ = case
    return " ".join([spec, *(o for o in overrides if not o.startswith("checks="))])


@pytest.mark.parametrize(("spec", "overrides", "judged"), CORRECT, ids=[config_id(c) for c in CORRECT])
def test_correct_library_layer_passes(spec, overrides, judged):
    checks, _ = battery(spec, *overrides)
    assert_passes(checks, judged)


@PADDED_QUERIES
@pytest.mark.parametrize("spec", ["x-transformers:attention", "x-transformers:attention-flash"])
def test_x_transformers_with_padded_queries_passes(spec):
    """Right-padded rows through mask=: the outputs at padded query positions are zeros, which no loss reads."""
    checks, _ = battery(spec, "checks=[sdpa]")
    assert_passes(checks, {"sdpa_match"})


def test_timm_unfused_nan_rows_need_the_declared_policy():
    """timm's unfused softmax gives NaN for a query that sees no key: the default policy (finite) says so."""
    checks, _ = battery("timm:attention-unfused", "checks=[fully_masked]")
    assert not checks["fully_masked_rows"].passed and "nan" in checks["fully_masked_rows"].detail


# ------------------------------------------------------------------------ bugs planted inside the libraries
# (plant, spec, overrides, the checks that must fail; None = at least those, others may fail too)
PLANTED = [
    (bugs.plant_torchtune_softmax_axis, "torchtune:mha", [], {"sdpa_match"}),
    (bugs.plant_torchtune_scale, "torchtune:mha", [], {"sdpa_match"}),
    (bugs.plant_torchtune_causal_off_by_one, "torchtune:mha", ["lengths=[6,6]"], {"sdpa_match"}),
    (bugs.plant_torchtune_padding_ignored, "torchtune:mha", [], {"sdpa_match"}),
    (bugs.plant_torchtune_rope_half, "torchtune:mha", [], {"sdpa_match"}),
    (bugs.plant_torchtune_gqa_tiled, "torchtune:mha", ["n_kv_heads=2"], {"sdpa_match"}),
    (bugs.plant_xt_softmax_axis, "x-transformers:attention", FULL, {"sdpa_match", "row_sums"}),
    (bugs.plant_xt_scale, "x-transformers:attention-flash", FULL, {"sdpa_match"}),
    (bugs.plant_xt_causal_off_by_one, "x-transformers:attention", FULL, {"sdpa_match", "causal_zero"}),
    (bugs.plant_xt_padding_ignored, "x-transformers:attention", [], {"padding_zero"}),
    (bugs.plant_xt_rope_half, "x-transformers:attention", FULL, {"sdpa_match"}),
    (bugs.plant_xt_gqa_interleaved, "x-transformers:attention", ["n_kv_heads=2", *FULL], {"sdpa_match"}),
    (bugs.plant_timm_softmax_axis, "timm:attention-unfused", [], {"sdpa_match"}),
    (bugs.plant_timm_scale, "timm:attention", [], {"sdpa_match"}),
    (bugs.plant_timm_causal_off_by_one, "timm:attention", ["lengths=[6,6]"], {"sdpa_match"}),
    (bugs.plant_timm_padding_ignored, "timm:attention", ["causal=false"], {"sdpa_match"}),
]


@pytest.mark.parametrize(("plant", "spec", "overrides", "must_fail"), PLANTED,
                         ids=[p.__name__.removeprefix("plant_") for p, *_ in PLANTED])
def test_bug_planted_in_the_library_is_caught(monkeypatch, plant, spec, overrides, must_fail):
    library(spec.split(":")[0])
    plant(monkeypatch)
    checks, _ = battery(spec, *overrides, "checks=[masks,sdpa]")
    assert must_fail <= failed(checks), {n: (c.passed, c.detail) for n, c in checks.items()}


@pytest.mark.parametrize("plant", [bugs.plant_timm_correct_rewrite])
def test_the_rewritten_forward_without_its_bug_passes(monkeypatch, plant):
    """The control for the planted timm bugs: the same rewritten forward, bug-free, passes."""
    library("timm")
    plant(monkeypatch)
    for spec in ("timm:attention", "timm:attention-unfused"):
        checks, _ = battery(spec, "checks=[masks,sdpa]")
        assert_passes(checks, {"sdpa_match"})


def test_torchtune_rewritten_attention_call_without_its_bug_passes(monkeypatch):
    library("torchtune")
    bugs._patch_torchtune_call(monkeypatch)
    checks, _ = battery("torchtune:mha", "checks=[masks,sdpa]")
    assert_passes(checks, {"sdpa_match"})


# ------------------------------------------------------------------------------- the reference's RoPE pairing
def test_interleaved_rope_rotates_pairs_2i_2i_plus_1():
    """First principles: dims (2i, 2i+1) are the complex number t_2i + j·t_2i+1 times e^{j·pos·theta^(-2i/d)}."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64)
    pos = torch.arange(5)
    out = rotate(t, Rope(100.0, 8, pairing="interleaved"), pos)
    angle = pos[:, None].double() * 100.0 ** (-torch.arange(4, dtype=torch.float64) * 2 / 8)  # (T, 4)
    z = torch.complex(t[..., 0::2], t[..., 1::2]) * torch.polar(torch.ones_like(angle), angle)
    expected = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    half = rotate(t, Rope(100.0, 8), pos)
    assert (half - out).abs().max() > 0.1  # the two pairings differ at positions > 0
    plain = rotate(t.float(), Rope(100.0, 8, pairing="interleaved"), pos, exact=False)  # the same-dtype yardstick
    assert torch.allclose(plain.double(), expected, atol=1e-6, rtol=0)


def test_unknown_rope_pairing_is_refused():
    with pytest.raises(ValueError, match="unknown RoPE pairing 'gptj'"):
        rotate(torch.ones(1, 1, 2, 4), Rope(10.0, 4, pairing="gptj"), torch.arange(2))


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("spec", "overrides", "fragment"), [
    ("torchtune:gqa", [], "unknown torchtune layer"),
    ("x-transformers:attend", [], "unknown x-transformers layer"),
    ("x-transformers:attention", ["n_heads=8"], "RoPE needs dim_head > 2"),
    ("torchtune:mha", ["n_kv_heads=3"], "does not divide"),
    ("timm:fused", [], "unknown timm layer"),
    ("timm:attention", ["n_kv_heads=2"], "no grouped kv heads"),
])
def test_bad_library_spec_is_one_line(spec, overrides, fragment):
    library(spec.split(":")[0])
    with pytest.raises(BadInput, match=fragment):
        run_recorded("attn-check", [*SMALL, f"impl={spec}", *overrides])


def test_torchtune_release_outside_the_tested_one_exits_2(monkeypatch):
    library("torchtune")
    import torchtune

    monkeypatch.setattr(torchtune, "__version__", "0.7.0")
    with pytest.raises(BadInput, match=r"found torchtune 0.7.0, the adapter is tested on torchtune 0.6.1"):
        run_recorded("attn-check", [*SMALL, "impl=torchtune:mha"])


def test_x_transformers_release_outside_the_tested_one_exits_2(monkeypatch):
    library("x-transformers")
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.32.0" if name == "x-transformers" else real(name))
    with pytest.raises(BadInput, match=r"found x-transformers 2.32.0, the adapter is tested on ==2.31.10"):
        run_recorded("attn-check", [*SMALL, "impl=x-transformers:attention"])
