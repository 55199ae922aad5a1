"""The chapter's six self-test claims (本章自测), and its MoE section's claim about expert parallelism, each as a
run that could falsify it.

Each claim names one experiment, the overrides that make the run small, and the check(s) that would fail were the
claim false; ``falsified_by`` names the tests that plant a counterexample and see those checks fail.
``tfmoe claims`` lists them (no torch imported); ``tfmoe claims --run`` runs them and prints claim -> verdict ->
run id. A claim holds when every one of its checks ran and passed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from tfmoe.contract.errors import BadInput
from tfmoe.contract.status import Status
from tfmoe.contract.tables import Rows

VERDICT_STYLES = {"holds": "green", "falsified": "red", "not judged": "yellow"}


@dataclass(frozen=True)
class Claim:
    key: str
    claim: str
    experiment: str
    overrides: tuple[str, ...]
    checks: tuple[str, ...]
    why: str  # what each check would show were the claim false
    falsified_by: tuple[str, ...]  # tests that plant a counterexample and see the check(s) fail


CLAIMS: tuple[Claim, ...] = (
    Claim("tokens",
          "Text reaches the model as tokens: integer ids of a fixed vocabulary, by a lossless mapping that the "
          "tokenizer's own vocabulary defines (each id then selects one embedding row)",
          "tokenize", ("tokenizers=[cl100k_base]", "extras=[]"),
          ("round_trip[cl100k_base]", "matches_reference_bpe[cl100k_base]"),
          "a lossy mapping fails round_trip (decode(encode(x)) != x); ids that are not the vocabulary's own merges "
          "fail matches_reference_bpe (an independent byte-pair merge over the published ranks)",
          ("tests/test_tokenize.py::test_round_trip_check_fails_for_a_lossy_decoder",
           "tests/test_tokenize.py::test_reference_check_fails_for_the_wrong_vocabulary")),
    Claim("attention_by_content",
          "Attention selects information by content: each query weighs the values by softmax(q·k/√d_head), "
          "so what a token receives depends on what the other tokens contain",
          "attn-check", ("checks=sdpa",), ("sdpa_match",),
          "weights that ignore q·k (uniform, or fixed by position) give outputs that differ from PyTorch's "
          "scaled_dot_product_attention on the same projections",
          ("tests/test_claims.py::test_attention_that_ignores_content_fails_sdpa_match",
           "tests/test_attn_check.py::test_planted_bug_fails_exactly_its_family")),
    Claim("encoder_vs_decoder",
          "An encoder is bidirectional (every position sees every position) while a decoder is causal "
          "(position i sees only positions <= i)",
          "arch", (), ("visibility_encoder_all_ones", "visibility_decoder_lower_triangular"),
          "perturbing input token j and watching which outputs move gives the visibility matrix: a causal encoder "
          "is not all ones, a decoder that sees the future is not lower-triangular",
          ("tests/test_arch.py::test_visibility_checks_fail_on_planted_bugs",)),
    Claim("attention_mixes_ffn_per_token",
          "Attention communicates between tokens while the FFN transforms each token on its own",
          "block-stats", ("variants=[pre]", "n_layers=2", "lowp_dtypes=[]", "seq_len=8", "batch_size=2"),
          ("attention_mixes_tokens[pre]", "ffn_position_wise[pre]"),
          "an attention that does not mix leaves later positions unchanged when token 0 changes; an FFN that mixes "
          "tokens changes positions other than the one whose input changed",
          ("tests/test_claims.py::test_attention_that_does_not_mix_fails_attention_mixes_tokens",
           "tests/test_block_stats.py::test_ffn_position_wise_fails_on_token_mixing_ffn")),
    Claim("parallel_training_serial_generation",
          "Training predicts every position in parallel (one causal forward gives every next-token prediction), "
          "while generation produces one token at a time",
          "decode", (), ("parallel_equals_incremental",),
          "a model whose position t sees later tokens (or loses positions in incremental mode) gives parallel "
          "logits that differ from the token-by-token ones",
          ("tests/test_decode.py::test_parallel_vs_serial_fails_for_non_causal_model_and_positionless_cache",)),
    Claim("moe_params_not_compute",
          "MoE grows the parameter count without growing per-token compute: more experts add parameters, while "
          "each token still runs only its top-k experts",
          "complexity", ("groups=[[32,16]]", "n_heads=2", "min_run_time=0.002", "warmup=0", "peak_matmul_n=64",
                         "n_layers=2", "vocab=100"),
          ("moe_compute_flat_in_experts", "moe_active_lt_total.T32_D16"),
          "a layer that runs every expert on every token grows its counted FLOPs with E beyond the router's "
          "2·N·D·E; one that runs more than its top-k experts (e.g. plus an always-on one) counts more than "
          "N·k·(one expert's FLOPs) + the router's; active parameters equal to the total mean nothing is saved",
          ("tests/test_claims.py::test_dense_moe_fails_moe_compute_flat_in_experts",
           "tests/test_claims.py::test_an_always_on_expert_fails_moe_compute_flat_in_experts",
           "tests/test_complexity.py::test_moe_checks_fail_on_planted_layer_bugs")),
    Claim("ep_bytes_not_flops",
          "Expert parallelism keeps each token's expert compute flat (k experts, however many experts and ranks) "
          "while its All-to-All bytes grow with k·(W−1)/W: a token's expert sits on another rank with "
          "probability (W−1)/W",
          "route-sim", ("ep_size=4", "capacity_factor=null", "tokens=1024"),
          ("ep.rows_per_token", "ep.a2a_bytes_per_token"),
          "a layer that sends every token to every expert computes E rows per token, not k, and writes "
          "2·E·(W−1)/W rows per token on the wire, far outside 4 sigma of 2·k·(W−1)/W (the bytes are measured "
          "by the workers' write counters, apart from the dispatcher's split sizes)",
          ("tests/test_route_ep.py::test_claim_holds_dropless_and_dense_dispatch_falsifies_it",)),
)


def as_records() -> list[dict[str, object]]:
    """JSON-ready: one object per claim with at least ``claim``, ``experiment``, ``check``."""
    out = []
    for c in CLAIMS:
        d = asdict(c)
        d["overrides"], d["falsified_by"] = list(c.overrides), list(c.falsified_by)
        d["check"] = list(c.checks)
        del d["checks"]
        out.append(d)
    return out


def claims_table() -> Rows:
    """The seven claims: experiment, overrides and the check(s) that would fail were each false."""
    table = Rows("the chapter's seven claims (tfmoe claims --run runs them)",
                 ["claim", "experiment", "overrides", "check(s) that would fail were it false"])
    for c in CLAIMS:
        table.add(c.claim, c.experiment, " ".join(c.overrides) or "(defaults)", c.checks)
    return table


def print_list(fmt: str) -> None:
    if fmt == "json":
        print(json.dumps(as_records(), ensure_ascii=False))
        return
    from rich.console import Console

    claims_table().print_to(Console(highlight=False))


def verdict(claim: Claim, checks: pd.DataFrame) -> tuple[str, str]:
    """('holds' | 'falsified' | 'not judged', detail) from a run's checks.parquet."""
    passed = dict(zip(checks.get("check", []), checks.get("passed", []), strict=False))
    missing = [c for c in claim.checks if c not in passed]
    if missing:
        return "not judged", f"the run recorded no check {', '.join(missing)}"
    failed = [c for c in claim.checks if not bool(passed[c])]
    if failed:
        return "falsified", f"failed: {', '.join(failed)}"
    return "holds", f"passed: {', '.join(claim.checks)}"


def run_all(runs_root: Path, only: list[str] | None = None) -> int:
    """Run each claim's experiment; print claim -> verdict -> run id. 0 when every claim holds, else 1."""
    from rich.console import Console

    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.harness.launching.launch import run_experiment
    from tfmoe.harness.store.rundir import read_parquet

    chosen = [c for c in CLAIMS if not only or c.key in only]
    unknown = sorted(set(only or []) - {c.key for c in CLAIMS})
    if unknown:
        raise BadInput(f"unknown claim(s) {', '.join(unknown)}: choose from {', '.join(c.key for c in CLAIMS)}")
    rows = []
    for c in chosen:
        made: list[Path] = []
        try:
            run_experiment(EXPERIMENTS[c.experiment], [*c.overrides, f"run_root={runs_root}"], quiet=True, made=made)
        except BadInput as exc:
            rows.append((c, "not judged", f"the run was refused: {exc}", ""))
            continue
        if not made:
            rows.append((c, "not judged", "no run directory was made", ""))
            continue
        run_dir = made[-1]
        checks = read_parquet(run_dir / "checks.parquet") if (run_dir / "checks.parquet").exists() \
            else pd.DataFrame(columns=["check", "passed"])
        v, detail = verdict(c, checks)
        rows.append((c, v, detail, run_dir.name))
    table = Rows("claims", ["claim", "verdict", "run id", "evidence"])
    for c, v, detail, run_id in rows:
        table.add(c.claim, v, run_id, f"{c.experiment}: {detail}", style=VERDICT_STYLES[v])
    table.print_to(Console(highlight=False))
    for c, v, _, run_id in rows:
        print(f"{c.key} -> {v} -> {run_id}")
    return Status.OK.exit_code if all(v == "holds" for _, v, _, _ in rows) else Status.FAILED.exit_code
