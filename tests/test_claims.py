"""tfmoe claims: the six claims are listed with experiment, overrides and checks; each check fails on a planted
counterexample; --run judges them and exits 0 only when every claim holds."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from claims_counterexamples import AlwaysOnExpert, DenseMoE, SelfOnlyAttention

from tfmoe.api.testing import run_cli, run_recorded
from tfmoe.contract.registry import EXPERIMENTS
from tfmoe.experiments.block_stats import checks as bc
from tfmoe.experiments.complexity import checks as cxc
from tfmoe.harness.launching import claims

REPO = Path(__file__).resolve().parents[1]


def test_six_claims_listed_as_json_and_table_without_torch() -> None:
    code = ("import sys\nfrom tfmoe import cli\nsys.argv=['tfmoe','claims','--format','json']\ntry:\n    cli.main()\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'tfmoe claims imported torch'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert len(body) == 7 and all({"claim", "experiment", "check", "overrides"} <= set(c) for c in body)
    assert {c["experiment"] for c in body} <= set(EXPERIMENTS) and all(c["check"] for c in body)
    assert [c["key"] for c in body] == ["tokens", "attention_by_content", "encoder_vs_decoder",
                                        "attention_mixes_ffn_per_token", "parallel_training_serial_generation",
                                        "moe_params_not_compute", "ep_bytes_not_flops"]


def test_table_format(workdir: Path) -> None:
    r = run_cli(["claims"], workdir)
    assert r.exit_code == 0 and "visibility_decoder_lower_triangular" in r.stdout and "moe_compute_flat" in r.stdout
    assert "round_trip[cl100k_base]" in r.stdout  # F-50: rich markup once ate the [...]


@pytest.mark.parametrize("claim", claims.CLAIMS, ids=[c.key for c in claims.CLAIMS])
def test_every_falsifying_test_exists(claim: claims.Claim) -> None:
    """Each claim names tests that plant a counterexample; they must exist (they run in the default suite)."""
    for node in claim.falsified_by:
        path, name = node.split("::")
        tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, node
    assert claim.overrides is not None and claim.checks


@pytest.mark.parametrize("claim", claims.CLAIMS, ids=[c.key for c in claims.CLAIMS])
def test_every_claim_check_is_recorded_by_its_experiment(claim: claims.Claim) -> None:
    """A renamed check would leave a claim 'not judged' for ever: each name must still be written by the source."""
    import re

    source = "".join(p.read_text() for p in (REPO / "src" / "tfmoe" / "experiments").rglob("*.py"))
    for check in claim.checks:
        base = re.split(r"[\[.]", check)[0]  # round_trip[cl100k_base] / moe_active_lt_total.T32_D16
        prefixed = check.partition(".")[2]  # ep.rows_per_token: PREFIX + "rows_per_token"
        assert re.search(rf"[\"']{re.escape(base)}[\"'\[{{]", source) or \
            (prefixed and re.search(rf"PREFIX \+ [\"']{re.escape(prefixed)}[\"']", source)), \
            f"no experiment records {check}"


def test_verdicts_from_a_checks_table() -> None:
    c = claims.CLAIMS[2]
    ok = pd.DataFrame({"check": list(c.checks), "passed": [True, True]})
    assert claims.verdict(c, ok)[0] == "holds"
    assert claims.verdict(c, ok.assign(passed=[True, False]))[0] == "falsified"
    assert claims.verdict(c, ok.iloc[:1])[0] == "not judged"  # a check that did not run proves nothing


# ------------------------------------------------------------------------ counterexamples for new checks
def test_attention_that_ignores_content_fails_sdpa_match() -> None:
    rec = run_recorded("attn-check", ["impl=claims_counterexamples:UniformAttention", "checks=[sdpa]"])
    row = next(c for c in rec.checks_rows if c.check == "sdpa_match")
    assert not row.passed, row.detail
    good = run_recorded("attn-check", ["impl=buggy_attention:PlainMHA", "checks=[sdpa]"])
    assert next(c for c in good.checks_rows if c.check == "sdpa_match").passed


def test_attention_that_does_not_mix_fails_attention_mixes_tokens() -> None:
    torch.manual_seed(0)
    from tfmoe.components.attention import MultiHeadSelfAttention

    assert bc.check_attention_mixes_tokens(MultiHeadSelfAttention(16, 4, causal=True), 16).passed
    assert bc.check_attention_mixes_tokens(MultiHeadSelfAttention(16, 4, causal=False), 16, seq_len=2).passed
    out = bc.check_attention_mixes_tokens(SelfOnlyAttention(16), 16)
    assert not out.passed and out.observed == 0.0 and set(out.evidence) == {"x", "x_changed", "y", "y_changed"}


def test_dense_moe_fails_moe_compute_flat_in_experts() -> None:
    assert cxc.moe_compute_outcome(4, 2).passed
    assert cxc.moe_compute_outcome(2, 2).passed  # boundary: k == E
    dense = cxc.moe_compute_outcome(4, 2, layer_fn=DenseMoE)
    assert not dense.passed and dense.observed > 0, dense.detail


def test_an_always_on_expert_fails_moe_compute_flat_in_experts() -> None:
    """Regression (issue 22): top-k plus an always-on expert is flat in E, and passed. The count must now equal
    N·k·(one expert) + the router exactly: it is off by N·(one expert) = 64·(2·2·32·64) at each E."""
    shared = cxc.moe_compute_outcome(4, 2, layer_fn=AlwaysOnExpert)
    assert not shared.passed and shared.observed == 2 * 64 * 2 * 2 * 32 * 64, shared.detail
    assert "more than its top-k experts" in shared.detail
    assert cxc.moe_compute_outcome(4, 1).passed and cxc.moe_compute_outcome(8, 2, tokens=1).passed  # boundaries


# ------------------------------------------------------------------------------------------ --run
def test_claims_run_one_claim_holds_and_a_planted_counterexample_is_falsified(workdir: Path, monkeypatch) -> None:
    r = run_cli(["claims", "--run", "--claim", "tokens"], workdir)
    assert r.exit_code == 0, r.stdout + r.stderr
    run_id = next(p for p in (workdir / "runs" / "tokenize").iterdir()).name
    assert f"tokens -> holds -> {run_id}" in r.stdout
    planted = claims.Claim("uniform", "attention selects by content", "attn-check",
                           ("impl=claims_counterexamples:UniformAttention", "checks=sdpa"), ("sdpa_match",), "", ())
    monkeypatch.setattr(claims, "CLAIMS", (planted,))
    r = run_cli(["claims", "--run"], workdir)
    assert r.exit_code == 1 and "uniform -> falsified ->" in r.stdout
    assert run_cli(["claims", "--run", "--claim", "nosuch"], workdir).exit_code == 2


@pytest.mark.slow
def test_all_six_claims_hold(workdir: Path) -> None:
    r = run_cli(["claims", "--run"], workdir)
    assert r.exit_code == 0, r.stdout
    assert r.stdout.count("-> holds ->") == 7
