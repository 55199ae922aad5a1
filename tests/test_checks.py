"""tfmoe.api.checking, the batteries as a Python API (issue 31): correct layers pass and planted ones fail with the table,
in every form a layer can be passed; bad settings are one BadSettings line like the CLI's exit 2; the config is the
one Hydra composes; record= writes a run directory the notebook commands read."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import buggy_attention
import buggy_kernels
import buggy_moe
import pytest
import torch

import tfmoe
from tfmoe.adapters.torch_mha import TorchMHA
from tfmoe.api import checking as checks
from tfmoe.api.testing import caught, compose, run_cli

SMALL_KERNEL = {"cases": {"shapes": [[5, 7, 8], [1, 9, 16]], "kv_heads": [6, 2]},
                "kernel_checks": {"dropout_p": 0.0}}


@pytest.mark.parametrize(("experiment", "overrides"), [
    ("attn-check", {}),
    ("attn-check", {"dtype": "bf16", "n_kv_heads": 1, "checks": ["masks", "sdpa"], "lengths": [4, 2]}),
    ("attn-check", {"kernel": "torch:sdpa", "cases.shapes": [[1, 2, 3]], "kernel_checks.fully_masked_expect":
                    {"bool": "zeros", "additive": "nan"}}),
    ("route-sim", {"impl": "buggy_moe:Correct", "top_k": 1, "layer.seq": 8, "capacity_factor": None}),
])
def test_the_config_is_the_one_hydra_composes(experiment: str, overrides: dict) -> None:
    from omegaconf import OmegaConf

    texts = [checks._override_text(k, v) for k, v in overrides.items()]
    ours = OmegaConf.to_container(checks.compose(experiment, overrides))
    hydras = OmegaConf.to_container(compose(experiment, texts))
    assert ours == hydras


def test_a_correct_layer_passes_and_a_planted_one_fails_with_the_table() -> None:
    verdict = tfmoe.assert_attention_conforms(buggy_attention.PlainMHA, profile="quick")
    assert verdict.passed and {c.outcome for c in verdict.checks} == {"passed"}
    assert {"sdpa_match", "grad_match", "dropout_rate", "kv_cache_decode"} <= {c.name for c in verdict.checks}
    assert "chunked_match" not in {c.name for c in verdict.checks}  # quick: chunked judges chunked.impl, not the layer

    verdict = tfmoe.check_attention(buggy_attention.ScaleByDModel, profile="quick")
    assert not verdict.passed and verdict["sdpa_match"].outcome == "failed"
    assert verdict["sdpa_match"].observed > verdict["sdpa_match"].limit
    assert any("likely cause" in c for c in verdict.likely_causes), verdict.table()

    exc = caught(tfmoe.assert_attention_conforms, buggy_attention.ScaleByDModel, checks=["sdpa", "invariances"])
    assert isinstance(exc, AssertionError)
    text = str(exc)
    assert "check(s) failed" in text and "sdpa_match" in text and "head_counts" in text
    assert "likely cause (inferred, not proven)" in text


class LocalMHA(buggy_attention.PlainMHA):
    """Importable by name: its spec is this module's."""


def test_every_form_a_layer_can_take() -> None:
    class Nested(buggy_attention.PlainMHA):  # not importable by name
        pass

    def factory(d_model, n_heads, causal=True, dropout=0.0):
        return buggy_attention.PlainMHA(d_model, n_heads, causal=causal, dropout=dropout)

    forms = {"class": (LocalMHA, "test_checks:LocalMHA"), "local class": (Nested, checks.OBJECTS_MODULE),
             "factory": (factory, checks.OBJECTS_MODULE), "lambda": (lambda d, h, causal=True:
                                                                     buggy_attention.PlainMHA(d, h, causal=causal),
                                                                     checks.OBJECTS_MODULE),
             "adapter instance": (TorchMHA(), checks.OBJECTS_MODULE), "spec": ("torch:mha", "torch:mha")}
    for form, (layer, spec) in forms.items():
        kwargs = {"fully_masked_policy": "any"} if form in ("adapter instance", "spec") else {}
        verdict = tfmoe.check_attention(layer, checks=["sdpa"], **kwargs)
        assert verdict.passed, f"{form}: {verdict.table()}"
        assert verdict.impl.startswith(spec), form
        assert "sdpa_match" in {c.name for c in verdict.checks}
    left = [a for a in vars(sys.modules[checks.OBJECTS_MODULE]) if not a.startswith("__")]
    assert not left  # nothing kept after the check

    def buggy_factory(d_model, n_heads, causal=True):
        return buggy_attention.ScaleByDModel(d_model, n_heads, causal=causal)

    assert not tfmoe.check_attention(buggy_factory, checks=["sdpa"]).passed


def test_kernels_and_moe_layers() -> None:
    verdict = tfmoe.assert_kernel_conforms(buggy_kernels.plain_kernel, **SMALL_KERNEL)
    assert verdict.experiment == "attn-check" and verdict.impl == "buggy_kernels:plain_kernel"
    assert not tfmoe.check_kernel(buggy_kernels.kernel_ignores_scale, **SMALL_KERNEL).passed
    assert not tfmoe.check_kernel(lambda q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                  enable_gqa=False: buggy_kernels.kernel_ignores_scale(q, k, v, attn_mask, dropout_p,
                                                                                       is_causal, scale, enable_gqa),
                                  **SMALL_KERNEL).passed

    tfmoe.assert_moe_conforms(buggy_moe.Correct, layer={"seq": 8})
    exc = caught(tfmoe.assert_moe_conforms, buggy_moe.NotRenormalised, layer={"seq": 8})
    assert isinstance(exc, AssertionError) and "failed" in str(exc)


@pytest.mark.parametrize(("call", "says"), [
    (lambda: tfmoe.check_attention(buggy_attention.PlainMHA, heads=2), "unknown setting 'heads' for attn-check"),
    (lambda: tfmoe.check_attention(buggy_attention.PlainMHA, causal="yes"), "causal='yes': expected true/false"),
    (lambda: tfmoe.check_attention(buggy_attention.PlainMHA, d_model=10, n_heads=4), "not divisible by n_heads=4"),
    (lambda: tfmoe.check_attention(buggy_attention.PlainMHA, profile="fast"), "profile='fast' is unknown"),
    (lambda: tfmoe.check_attention(buggy_attention.PlainMHA(8, 2)), "instance: pass the class PlainMHA"),
    (lambda: tfmoe.check_attention(buggy_attention.PlainMHA, impl="torch:mha"), "first argument of check_attention"),
    (lambda: tfmoe.check_attention("no_such_module:Attn"), "cannot import 'no_such_module'"),
    (lambda: tfmoe.check_attention(lambda d_model: None), "as a factory it cannot take (d_model, n_heads, causal=...)"),
    (lambda: tfmoe.check_kernel(buggy_kernels.plain_kernel, cases={"shapes": [[1, 2]]}), "cases.shapes="),
    (lambda: tfmoe.check_moe(buggy_moe.Correct, top_k=9), "top_k"),
    (lambda: tfmoe.check_attention(None), "pass the layer"),
])
def test_bad_settings_are_one_line_like_the_clis_exit_2(call, says: str) -> None:
    exc = caught(call)
    assert isinstance(exc, checks.BadSettings) and isinstance(exc, ValueError) and isinstance(exc, tfmoe.BadInput)
    assert says in str(exc) and "\n" not in str(exc), str(exc)


def test_record_writes_a_run_the_notebook_commands_read(tmp_path: Path) -> None:
    verdict = tfmoe.check_attention(buggy_attention.ScaleByDModel, checks=["sdpa"], record=tmp_path / "runs",
                                    dtype=torch.float32)
    assert verdict.run_dir is not None and verdict.run_dir.parent == tmp_path / "runs" / "attn-check"
    run = tfmoe.load_run(verdict.run_dir)
    assert run.run["status"] == "failed"
    assert set(run.checks["check"]) == {c.name for c in verdict.checks}
    assert "sdpa_match" in (verdict.run_dir / "summary.md").read_text()
    shown = run_cli(["show", verdict.run_dir.name], tmp_path)
    assert shown.exit_code == 0 and "sdpa_match" in shown.stdout, shown.stdout + shown.stderr
    replay = run_cli(["replay", verdict.run_dir.name], tmp_path)
    assert replay.exit_code == 1, replay.stdout + replay.stderr  # the planted bug fails again, from the record


PROBE = """
import json, sys
import tfmoe, tfmoe.api.checking, tfmoe.api.pytest_plugin
before = sorted({m.split(".")[0] for m in sys.modules})
verdict = tfmoe.check_attention("tfmoe.components.attention:MultiHeadSelfAttention", checks=["sdpa"])
after = sorted({m.split(".")[0] for m in sys.modules})
print(json.dumps({"passed": verdict.passed, "before": before, "after": after}))
"""


def test_importing_the_api_costs_nothing_and_a_check_uses_no_hydra() -> None:
    """`import tfmoe` (and the plugin, which pytest loads in every session) imports no torch, OmegaConf or Hydra;
    a check imports torch and OmegaConf but never Hydra, pandas or matplotlib (no launcher, no parquet, no plot)."""
    import json
    import os
    import subprocess

    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["passed"]
    assert not {"torch", "omegaconf", "hydra", "pandas", "numpy"} & set(got["before"]), got["before"]
    assert not {"hydra", "pandas", "matplotlib", "pyarrow"} & set(got["after"]), got["after"]


def test_a_verdict_lists_not_applicable_checks_and_never_counts_them() -> None:
    rows = (checks.CheckResult("sdpa_match", "passed", 1e-8, 1e-7, "ok"),
            checks.CheckResult("fully_masked_rows", "n/a", None, None, "not applicable: the layer declares it lacks "
                               "padding_mask"),
            checks.CheckResult("kv_cache_decode", "failed", 0.5, 1e-6, "off"))
    verdict = checks.Verdict("attn-check", "my:Attn", rows)
    assert not verdict.passed and verdict.failed == (rows[2],)
    assert checks.Verdict("attn-check", "my:Attn", rows[:2]).passed  # n/a is not a failure
    lines = verdict.table().splitlines()
    assert "1 check(s) failed" in lines[0]
    assert any(line.split()[:2] == ["fully_masked_rows", "n/a"] for line in lines)
    assert verdict["kv_cache_decode"].outcome == "failed"
    assert "no check 'gradcheck' in this verdict" in str(caught(verdict.__getitem__, "gradcheck"))


@pytest.mark.parametrize(("p", "samples"), [(0.1, 25281), (0.9, 25281), (0.5, 70225), (0.0, 1000), (1e-6, 1000),
                                            (0.999, 1000), (1.5, 100_000), ("x", 100_000), (True, 100_000)])
def test_the_quick_dropout_draws_enough_for_a_false_alarm_below_1e_7(p, samples: int) -> None:
    """5.3 standard deviations of the sampled rate fit in dropout_rate's fixed limit 0.01 (a bad p is left to
    settings(cfg), which refuses it in one line)."""
    assert checks.quick_dropout_samples(p) == samples
    if isinstance(p, float) and 0 < p < 1 and samples > 1000:
        assert 5.3 * math.sqrt(p * (1 - p) / samples) <= 0.01 < 5.3 * math.sqrt(p * (1 - p) / (samples - 1))


@pytest.mark.slow
def test_the_api_benchmark_runs_to_its_end() -> None:
    """benchmarks/bench_api.py times every case it names (its figures are docs/checking-your-own-layers.md's)."""
    import subprocess

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_api.py"
    r = subprocess.run([sys.executable, str(bench), "1"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for label in ("attention", "kernel", "moe"):
        assert any(line.startswith(label) and "CLI same case" in line for line in r.stdout.splitlines()), r.stdout


@pytest.mark.parametrize("where", ["a_file", "a_file/below", "/proc/1/nope"])
def test_a_record_place_that_cannot_be_written_is_bad_settings_before_running(tmp_path: Path, where: str) -> None:
    from tfmoe.api.checking import BadSettings

    (tmp_path / "a_file").write_text("x")
    record = tmp_path / where if not where.startswith("/") else Path(where)
    with pytest.raises(BadSettings, match="record=") as err:
        tfmoe.check_kernel(buggy_kernels.plain_kernel, record=record, **SMALL_KERNEL)
    assert "\n" not in str(err.value)


def test_a_record_refused_while_writing_is_bad_settings_with_the_verdict(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk refuses the run directory after the battery ran: BadSettings, and the verdict's table is in it."""
    from tfmoe.api import checking as checks
    from tfmoe.api.checking import BadSettings

    def refused(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "rec"))

    monkeypatch.setattr(checks, "_record", refused)
    with pytest.raises(BadSettings, match="No space left on device") as err:
        tfmoe.check_kernel(buggy_kernels.plain_kernel, record=tmp_path / "rec", **SMALL_KERNEL)
    assert "the verdict, not recorded" in str(err.value) and "kernel" in str(err.value).split("\n", 1)[1]
