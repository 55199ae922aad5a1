"""attn-check on third-party attention layers through the shipped adapters: torchtune's MultiHeadAttention
(impl=torchtune:...), x-transformers' Attention (impl=x-transformers:...) and timm's Attention (impl=timm:...).

Every correct configuration listed passes (zero false alarms), and a bug planted inside each library's real class
(tests/buggy_libraries.py) makes the named check fail. The extras `torchtune` and `xtransformers` are installed by
`make setup`, so CI runs these tests; a missing one fails under CI=true and is skipped (with the reason) locally.
timm needs a torchvision built for the installed torch, which PyPI does not have for a CPU torch: its tests skip
with that reason where `import timm` fails, and run in scripts/test-timm.sh (a venv of torch 2.14.1 + torchvision
0.29.1, CI)."""

from __future__ import annotations

import os

import buggy_libraries as bugs
import pytest
import torch
from library_cases import (
    CORRECT,
    EXTRAS,
    PADDED_QUERIES,
    PLANTED,
    PLANTED_GROUPS,
    SMALL,
    describe,
    import_problem,
)
from test_attn_check import failed

from tfmoe.api.testing import run_recorded
from tfmoe.components.references import Rope, rotate
from tfmoe.contract.errors import BadInput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def library(scheme: str) -> None:
    """Skip (locally) or fail (under CI) when the library of impl=<scheme>:... does not import. timm always skips
    then: make setup does not install it (PyPI's torchvision, which it imports, is a CUDA build); scripts/test-timm.sh
    runs these tests in a venv where it imports."""
    problem = import_problem(scheme)
    if not problem:
        return
    extra = EXTRAS[scheme][1]
    if scheme == "timm":
        pytest.skip(f"{problem}: timm needs a torchvision built for torch {torch.__version__}; PyPI has only CUDA "
                    "builds, so make setup does not install the `timm` extra: these cases run in "
                    "scripts/test-timm.sh (torch 2.14.1 + torchvision 0.29.1, CI)")
    reason = f"{problem}: pip install -e '.[{extra}]' (make setup does)"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def battery(spec: str, *overrides: str):
    library(spec.split(":")[0])
    rec = run_recorded("attn-check", [*SMALL, f"impl={spec}", *overrides])
    return {c.check: c for c in rec.checks_rows}, rec


def assert_passes(checks, expected: set[str]) -> None:
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}
    assert expected <= set(checks), sorted(set(checks))


# -------------------------------------------------------------------------- correct configurations pass
@pytest.mark.parametrize(("spec", "overrides", "judged"), CORRECT, ids=[describe(s, o) for s, o, _ in CORRECT])
def test_correct_library_layer_passes(spec, overrides, judged):
    checks, _ = battery(spec, *overrides)
    assert_passes(checks, judged)


@pytest.mark.parametrize(("spec", "overrides", "judged"), PADDED_QUERIES, ids=[describe(s, o) for s, o, _ in PADDED_QUERIES])
def test_x_transformers_with_padded_queries_passes(spec, overrides, judged):
    """Right-padded rows through mask=: the outputs at padded query positions are zeros, which no loss reads."""
    checks, _ = battery(spec, *overrides)
    assert_passes(checks, judged)


def test_x_transformers_default_head_counts_pass():
    """The default head counts at D=16 are 1, 4 and 8; at 8 heads (Dh=2) x-transformers' RotaryEmbedding cannot be
    built (it divides by dim_head - 2), so head_counts is not applicable there, with the reason; never exit 2."""
    checks, _ = battery("x-transformers:attention", "lengths=[6,6]", "checks=[invariances]")
    assert_passes(checks, {"head_counts"})


def test_timm_unfused_nan_rows_need_the_declared_policy():
    """timm's unfused softmax gives NaN for a query that sees no key: the default policy (finite) says so."""
    checks, _ = battery("timm:attention-unfused", "checks=[fully_masked]")
    assert not checks["fully_masked_rows"].passed and "nan" in checks["fully_masked_rows"].detail


# ------------------------------------------------------------------------ bugs planted inside the libraries
@pytest.mark.parametrize(("plant", "spec", "overrides", "must_fail"), PLANTED,
                         ids=[p.__name__.removeprefix("plant_") for p, *_ in PLANTED])
def test_bug_planted_in_the_library_is_caught(monkeypatch, plant, spec, overrides, must_fail):
    library(spec.split(":")[0])
    plant(monkeypatch)
    checks, _ = battery(spec, *overrides, PLANTED_GROUPS)
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
    with pytest.raises(ValueError, match="RoPE pairing 'gptj' is not one of"):
        Rope(10.0, 4, pairing="gptj")


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("spec", "overrides", "fragment"), [
    ("torchtune:gqa", [], "unknown torchtune layer"),
    ("x-transformers:attend", [], "unknown x-transformers layer"),
    ("x-transformers:attention", ["n_heads=8"], "RoPE needs dim_head > 2"),
    ("torchtune:mha", ["n_kv_heads=3"], "does not divide"),
    ("timm:fused", [], "unknown timm layer"),
    ("timm:attention", ["n_kv_heads=2"], "lacks gqa"),
])
def test_bad_library_spec_is_one_line(spec, overrides, fragment):
    library(spec.split(":")[0])
    with pytest.raises(BadInput, match=fragment):
        run_recorded("attn-check", [*SMALL, f"impl={spec}", *overrides])


def plant_release(monkeypatch, distribution: str, release: str) -> None:
    """The installed metadata says ``distribution`` is at ``release`` (what the adapters read)."""
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: release if name == distribution else real(name))


def test_require_tested_release_names_the_release_and_the_extra(monkeypatch):
    """The one rule every library adapter imports its library by: the tested release (a local tag such as +cpu
    ignored) imports; another release, or one that does not import, is BadInput naming what is supported."""
    import pytest as module

    from tfmoe.adapters.base import require_tested_release

    tested = module.__version__
    plant_release(monkeypatch, "pytest", f"{tested}+cpu")
    assert require_tested_release("demo", "pytest", "pytest", tested, "pytest X", "demo") is module
    plant_release(monkeypatch, "pytest", "0.0.1")
    with pytest.raises(BadInput, match=r"^impl=demo:...: found pytest 0.0.1, the adapter is tested on pytest X: "
                                       r"pip install -e '.\[demo\]'$"):
        require_tested_release("demo", "pytest", "pytest", tested, "pytest X", "demo")
    with pytest.raises(BadInput, match=r"needs no-such X: pip install -e '.\[demo\]' \(PackageNotFoundError"):
        require_tested_release("demo", "no-such-distribution-tfmoe", "no_such", "1", "no-such X", "demo")
    with pytest.raises(BadInput, match=r"^a better line$"):
        require_tested_release("demo", "no-such-distribution-tfmoe", "no_such", "1", "no-such X", "demo",
                               lambda exc: "a better line")


def test_torchtune_release_outside_the_tested_one_exits_2(monkeypatch):
    library("torchtune")
    plant_release(monkeypatch, "torchtune", "0.7.0")
    with pytest.raises(BadInput, match=r"found torchtune 0.7.0, the adapter is tested on torchtune 0.6.1"):
        run_recorded("attn-check", [*SMALL, "impl=torchtune:mha"])


def test_x_transformers_release_outside_the_tested_one_exits_2(monkeypatch):
    library("x-transformers")
    plant_release(monkeypatch, "x-transformers", "2.32.0")
    with pytest.raises(BadInput, match=r"found x-transformers 2.32.0, the adapter is tested on x-transformers 2.31.10"):
        run_recorded("attn-check", [*SMALL, "impl=x-transformers:attention"])


def test_library_that_does_not_import_exits_2_with_one_line(tmp_path):
    """Where timm does not import (no torchvision, or a CUDA torchvision beside a CPU torch), impl=timm:... is bad
    input: exit 2, one line naming what to install, no traceback (the run is recorded with status error)."""
    from tfmoe.api.testing import run_cli

    if not import_problem("timm"):
        pytest.skip("timm imports here")
    res = run_cli(["attn-check", "impl=timm:attention", *SMALL], tmp_path)
    assert res.exit_code == 2, res.stdout + res.stderr
    assert "impl=timm:...: needs timm 1.0.31" in res.stderr and "Traceback" not in res.stdout + res.stderr
