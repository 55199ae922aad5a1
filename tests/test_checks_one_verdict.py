"""One verdict (issue 31): the same case through the CLI (in-process, `tfmoe.api.testing.run_cli`, a real run directory)
and through the Python API gives the same checks, in the same order, with the same outcome, observed value, limit
and detail (bit-identical on CPU: one implementation, one seed), and the same one line for bad input (exit 2 /
BadSettings).

Cases are generated from the planted-bug files of the three modes (attention modules: tests/buggy_attention.py,
kernels: tests/buggy_kernels.py, MoE layers: tests/buggy_moe.py), each with its correct layer. The default suite
runs a representative subset covering every check family of each mode; the full cross-product is marked slow:

    PYTHONPATH=src pytest tests/test_checks_one_verdict.py -m slow -p no:cacheprovider
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import buggy_attention
import buggy_kernels
import buggy_moe
import pytest
import torch.nn as nn

from tfmoe.api import checking as checks
from tfmoe.api.testing import caught, run_cli
from tfmoe.harness.store.notebook import load_run

# small matrices, so one case costs seconds through both paths (the API's quick profile is tested elsewhere)
KERNEL = {"cases": {"shapes": [[5, 7, 8], [1, 9, 16], [9, 1, 8]], "kv_heads": [6, 2]},
          "kernel_checks": {"dropout_shape": [8, 6, 8]}}
MOE = {"layer": {"seq": 8}}
ATTENTION_GROUPS = [g for g in checks.ATTENTION_GROUPS if g != "chunked"]


def generated() -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, layer spec, settings) for every layer of the three planted-bug files."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for name, obj in vars(buggy_attention).items():
        if inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__module__ == "buggy_attention" \
                and not name.startswith("_"):
            out.append(("attention", f"buggy_attention:{name}", {"checks": ATTENTION_GROUPS}))
    for name, obj in vars(buggy_kernels).items():
        if inspect.isfunction(obj) and (name.startswith("kernel_") or name == "plain_kernel"):
            out.append(("kernel", f"buggy_kernels:{name}", KERNEL))
    for name, obj in vars(buggy_moe).items():
        if inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__module__ == "buggy_moe":
            out.append(("moe", f"buggy_moe:{name}", MOE))
    return out


# the default suite's subset (~1 minute): each mode's correct layer over every check family, planted bugs failing
# the families that cost little (a failed fp64 gradcheck costs ~40 s, torch re-running it in slow mode to report:
# the module's gradient and dropout bugs are in the slow cross-product), and a refusal
SUBSET = [
    ("attention", "buggy_attention:PlainMHA", {"checks": ATTENTION_GROUPS, "dropout_samples": 25281}),
    ("attention", "buggy_attention:CausalOffByOne", {"checks": ["masks", "sdpa", "fully_masked"]}),
    ("attention", "buggy_attention:CacheWithoutOffset", {"checks": ["kv_cache", "invariances"]}),
    ("attention", "buggy_attention:NoQkvLayer", {"checks": ["sdpa"]}),
    ("kernel", "buggy_kernels:plain_kernel", KERNEL),
    ("kernel", "buggy_kernels:kernel_gqa_modulo", KERNEL),
    ("kernel", "buggy_kernels:kernel_wrong_grad", KERNEL),
    ("kernel", "buggy_kernels:kernel_dropout_no_rescale", KERNEL),
    ("moe", "buggy_moe:Correct", MOE),
    ("moe", "buggy_moe:NotRenormalised", MOE),
    ("moe", "buggy_moe:ArgminRouting", MOE),
]


def cli_args(kind: str, spec: str, settings: dict[str, Any]) -> list[str]:
    own = "kernel" if kind == "kernel" else "impl"
    texts = [checks._override_text(k, v) for k, v in checks._flatten(settings).items()]
    return [checks.KINDS[kind], f"{own}={spec}", *texts]


def same(a: float | None, b: float | None) -> bool:
    """Equal, bit for bit; None and NaN are both 'no value' (parquet stores a missing float as NaN)."""
    a, b = (None if x is None or math.isnan(x) else x for x in (a, b))
    return a == b


def assert_one_verdict(kind: str, spec: str, settings: dict[str, Any], cwd: Path) -> None:
    cli = run_cli(cli_args(kind, spec, settings), cwd)
    call = {"attention": checks.check_attention, "kernel": checks.check_kernel, "moe": checks.check_moe}[kind]
    if cli.exit_code == 2:  # bad input: the same one line
        exc = caught(call, spec, **settings)
        assert isinstance(exc, checks.BadSettings), exc
        assert f"error: {exc}" in " ".join(cli.stderr.split()), (cli.stderr, str(exc))
        return
    assert cli.exit_code in (0, 1), cli.stdout + cli.stderr
    verdict = call(spec, **settings)
    rows = load_run(cli.run_dir).checks.to_dict("records")
    assert [r["check"] for r in rows] == [c.name for c in verdict.checks]
    for row, c in zip(rows, verdict.checks, strict=True):
        assert bool(row["passed"]) == c.passed, (c.name, row, c)
        if "applicable" in row:
            assert bool(row["applicable"]) == (c.outcome != "n/a"), (c.name, row, c)
        assert same(row["observed"], c.observed) and same(row["threshold"], c.limit), (c.name, row, c)
        assert row["detail"] == c.detail, c.name
    assert verdict.passed == (cli.exit_code == 0)


@pytest.mark.parametrize(("kind", "spec", "settings"), SUBSET, ids=[s for _, s, _ in SUBSET])
def test_the_cli_and_the_api_give_one_verdict(kind: str, spec: str, settings: dict[str, Any], tmp_path: Path) -> None:
    assert_one_verdict(kind, spec, settings, tmp_path)


def test_the_subset_is_generated_and_fails_where_the_planted_bugs_are() -> None:
    assert {(k, s) for k, s, _ in SUBSET} <= {(k, s) for k, s, _ in generated()}
    assert {k for k, _, _ in SUBSET} == set(checks.KINDS)


FULL = [case for case in generated() if case not in SUBSET]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "spec", "settings"), FULL, ids=[s for _, s, _ in FULL])
def test_every_generated_case_gives_one_verdict(kind: str, spec: str, settings: dict[str, Any],
                                                tmp_path: Path) -> None:
    assert_one_verdict(kind, spec, settings, tmp_path)


# ------------------------------------------------------------------------------------- whole causal LMs
# check_model runs the model battery of arch, shift-labels and decode; the CLI runs each as its own command. The
# verdict's rows are the three runs' rows, in order, named "<experiment>:<check>" (tests/planted_models.py).
# the default suite: a planted cache bug (rows passing and failing in all three); the rest is slow-marked
MODEL_CASES = [
    ("planted_models:CacheKeepsLastN", {"lm": {"steps": 8}}),
    pytest.param("planted_models:RotaryObjectCache", {"lm": {"steps": 8}}, marks=pytest.mark.slow),
    pytest.param("planted_models:NoMaskLM", {}, marks=pytest.mark.slow),  # decode refuses it (lacks kv_cache)
]


@pytest.mark.parametrize(("spec", "settings"), MODEL_CASES)
def test_the_cli_and_check_model_give_one_verdict(spec: str, settings: dict[str, Any], tmp_path: Path) -> None:
    import planted_models

    (tmp_path / "planted_models.py").write_text(Path(planted_models.__file__).read_text())
    texts = [checks._override_text(k, v) for k, v in checks._flatten(settings).items()]
    rows, refused = [], None
    for experiment in checks.MODEL_EXPERIMENTS:
        keyed = [t for t in texts if checks._has_key(experiment, t.partition("=")[0])]
        cli = run_cli([experiment, f"impl={spec}", *keyed], tmp_path)
        if cli.exit_code == 2:
            refused = " ".join(cli.stderr.split())
            break
        assert cli.exit_code in (0, 1), cli.stdout + cli.stderr
        rows += [{**r, "check": f"{experiment}:{r['check']}"} for r in load_run(cli.run_dir).checks.to_dict("records")]
    if refused is not None:
        exc = caught(checks.check_model, spec, **settings)
        assert isinstance(exc, checks.BadSettings), exc
        assert f"error: {exc}" in refused, (refused, str(exc))
        return
    verdict = checks.check_model(spec, **settings)
    assert [r["check"] for r in rows] == [c.name for c in verdict.checks]
    for row, c in zip(rows, verdict.checks, strict=True):
        assert bool(row["passed"]) == c.passed, (c.name, row, c)
        assert same(row["observed"], c.observed) and same(row["threshold"], c.limit), (c.name, row, c)
        assert row["detail"] == c.detail, c.name
