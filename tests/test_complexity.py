"""`tfmoe complexity`: the analytic model against the real block, every check seen failing on a planted bug."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from tfmoe import complexity_model as cm
from tfmoe.components.block import TransformerBlock
from tfmoe.errors import BadInput
from tfmoe.experiments import complexity as cx
from tfmoe.memory import peak_memory_bytes

SMALL = cm.BlockShape(B=2, T=16, D=32, H=4)


def _block(shape: cm.BlockShape, dtype: torch.dtype = torch.float32, **kw) -> TransformerBlock:
    torch.manual_seed(0)
    return TransformerBlock(shape.D, shape.H, d_ff=shape.d_ff, **kw).to(dtype)


def _x(shape: cm.BlockShape, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(shape.B, shape.T, shape.D, dtype=dtype, requires_grad=grad)


# ------------------------------------------------------------------------------------ analytic FLOPs
def test_forward_flops_by_hand():
    f = cm.forward_flops(SMALL)  # B=2, T=16, D=32, H=4, d_ff=128
    assert f["qkv"] == 2 * 2 * 16 * 32 * 96
    assert f["scores"] == f["attn_v"] == 2 * 2 * 16 * 16 * 32
    assert f["out_proj"] == 2 * 2 * 16 * 32 * 32
    assert f["ffn"] == 2 * 2 * 2 * 16 * 32 * 128
    assert f["softmax"] == 3 * 2 * 4 * 16 * 16
    assert f["bias"] == 2 * 16 * (128 + 32)
    assert f["matmul"] == sum(f[c] for c in cm.MATMUL_COMPONENTS)
    assert {c for c, g in cm.GROWTH.items() if g == "T^2"} == {"scores", "softmax", "attn_v"}


@pytest.mark.parametrize("shape", [SMALL, cm.BlockShape(1, 1, 8, 2), cm.BlockShape(3, 7, 24, 3, d_ff=40)])
def test_counted_flops_equal_analytic_forward_and_backward(shape):
    block, x = _block(shape), _x(shape, grad=True)
    f = cm.forward_flops(shape)
    assert cx.counted_flops(block, x) == f["matmul"]
    assert cx.counted_flops(block, x, backward=True) == 3 * f["matmul"] == f["matmul"] + cm.backward_matmul_flops(shape)


def test_meta_device_count_equals_cpu_count():
    shape = cm.BlockShape(2, 12, 16, 2, d_ff=24)
    for backward in (False, True):
        on_cpu = cx.counted_flops(_block(shape), _x(shape, grad=backward), backward=backward)
        assert cx.counted_block_flops(shape, torch.float32, backward) == on_cpu


def test_swiglu_variant_matches_block():
    shape = cm.BlockShape(1, 8, 24, 3, ffn="swiglu")
    block = TransformerBlock(24, 3, ffn="swiglu")
    assert cm.block_params(shape)["total"] == sum(p.numel() for p in block.parameters())
    assert cx.counted_flops(block, torch.randn(1, 8, 24)) == cm.forward_flops(shape)["matmul"]
    assert cm.forward_flops(shape)["bias"] == 0


def test_flops_check_fails_on_a_block_with_an_extra_matmul():
    class LeakyFFN(nn.Module):  # planted bug: an extra D x D projection nobody accounted for
        def __init__(self, ffn: nn.Module, d: int):
            super().__init__()
            self.ffn, self.extra = ffn, nn.Linear(d, d, bias=False)

        def forward(self, x):
            return self.ffn(self.extra(x))

    block = _block(SMALL)
    block.ffn = LeakyFFN(block.ffn, SMALL.D)
    o = cx.exact_outcome("fwd", cm.forward_flops(SMALL)["matmul"], cx.counted_flops(block, _x(SMALL)))
    assert not o.passed and o.observed == 2 * SMALL.B * SMALL.T * SMALL.D ** 2


def test_decode_flops_with_cache():
    f = cm.forward_flops(cm.BlockShape(1, 1, 32, 4), T_k=100)
    assert f["scores"] == 2 * 100 * 32 and f["qkv"] == 2 * 32 * 96


# ------------------------------------------------------------------------------------- parameters
def test_params_by_hand_and_against_block():
    p = cm.block_params(SMALL)
    assert p["total"] == 4 * 32 * 32 + (2 * 32 * 128 + 128 + 32) + 4 * 32
    assert p["weights"] == 12 * 32 * 32  # Kaplan's 12·D² per layer with d_ff = 4D
    assert cx.params_outcome(_block(SMALL), SMALL).passed


def test_params_check_fails_when_the_block_grows_a_bias():
    block = _block(SMALL)
    block.attn.qkv = nn.Linear(SMALL.D, 3 * SMALL.D, bias=True)  # planted bug
    o = cx.params_outcome(block, SMALL)
    assert not o.passed and o.observed == 3 * SMALL.D


def test_moe_params():
    p = cm.moe_block_params(SMALL, n_experts=8, top_k=2)
    expert = 2 * 32 * 128 + 128 + 32
    assert p["total"] == 4 * 32 * 32 + 4 * 32 + 32 * 8 + 8 * expert
    assert p["active"] == p["total"] - 6 * expert
    dense = cm.moe_block_params(SMALL, 4, 4)
    assert dense["active"] == dense["total"]
    with pytest.raises(ValueError):
        cm.moe_block_params(SMALL, 4, 5)
    per_token = cm.moe_ffn_flops_per_token(SMALL, 8, 2)
    assert per_token["active"] == 2 * 32 * 8 + 2 * (2 * 2 * 32 * 128 + 128 + 32)


def test_moe_check_passes_and_fails_on_a_router_that_counts_every_expert():
    assert cx.moe_outcome(SMALL, 8, 2).passed
    assert cx.moe_outcome(SMALL, 4, 4).passed  # k == E: active == total is right

    def all_experts(shape, n_experts, top_k):  # planted bug: ignores top_k
        return cm.moe_block_params(shape, n_experts, n_experts)

    assert not cx.moe_outcome(SMALL, 8, 2, params_fn=all_experts).passed


# ----------------------------------------------------------------------------- crossover, Kaplan
def test_crossover_is_d_ff():
    for shape in (cm.BlockShape(1, 8, 64, 4), cm.BlockShape(2, 8, 64, 4, d_ff=100)):
        T = cm.crossover_T(shape)
        assert T == shape.hidden
        at = cm.forward_flops(cm.BlockShape(shape.B, int(T), shape.D, shape.H, shape.d_ff))
        below = cm.forward_flops(cm.BlockShape(shape.B, int(T) - 1, shape.D, shape.H, shape.d_ff))
        assert at["scores"] + at["attn_v"] == at["ffn"]
        assert below["scores"] + below["attn_v"] < below["ffn"]
        assert cm.crossover_T_all_linear(shape) == 2 * shape.D + shape.hidden


@pytest.mark.parametrize("L,T,D", [(12, 1024, 768), (2, 7, 16)])
def test_kaplan_cross_check(L, T, D):
    shape = cm.BlockShape(1, T, D, 4)
    N = cm.model_params(shape, L, 1000)["non_embedding_weights"]
    assert N == 12 * L * D * D == 2 * D * L * (2 * D + 4 * D)
    ours = cm.model_forward_flops_per_token(shape, L, 1000, causal_visible=True)
    kaplan = cm.kaplan_forward_flops_per_token(N, L, T, D)
    assert ours - kaplan == pytest.approx(2 * L * D, rel=1e-12)  # (T+1)/2 visible keys vs Kaplan's T/2
    dense = cm.model_forward_flops_per_token(shape, L, 1000)
    assert dense == pytest.approx(2 * N + 4 * L * T * D, rel=1e-12)
    assert cm.model_forward_flops_per_token(shape, L, 1000, include_logits=True) - dense == 2 * D * 1000


# ----------------------------------------------------------------------------------------- memory
def test_score_and_kv_bytes():
    assert cm.score_elements(SMALL) == 2 * 4 * 16 * 16
    assert cm.score_bytes(SMALL)["bf16"] * 2 == cm.score_bytes(SMALL)["fp32"]
    assert cm.kv_cache_bytes_per_token(SMALL, 2, n_layers=12) == 2 * 32 * 2 * 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_check_against_built_cache(dtype):
    o, cache = cx.kv_cache_outcome(_block(SMALL, dtype), SMALL, _x(SMALL, dtype))
    assert o.passed and cache.nbytes() == 2 * SMALL.B * SMALL.T * SMALL.D * (4 if dtype == torch.float32 else 2)


def test_kv_cache_check_fails_on_a_formula_missing_v():
    def k_only(shape, n_tokens, dtype_bytes):  # planted bug
        return shape.B * n_tokens * shape.D * dtype_bytes

    o, _ = cx.kv_cache_outcome(_block(SMALL), SMALL, _x(SMALL), formula=k_only)
    assert not o.passed


@pytest.mark.parametrize("dtype,shape", [(torch.float32, SMALL), (torch.float32, cm.BlockShape(1, 1, 8, 2)),
                                         (torch.bfloat16, cm.BlockShape(2, 8, 16, 2)),
                                         (torch.float32, cm.BlockShape(3, 5, 12, 3, d_ff=20))])
def test_activation_bytes_equal_saved_tensors(dtype, shape):
    e = torch.finfo(dtype).bits // 8
    saved = cx.saved_activation_bytes(_block(shape, dtype), _x(shape, dtype))
    assert saved == cm.training_activation_bytes(shape, e)


def test_activation_check_fails_when_dropout_saves_masks():
    block = _block(SMALL, dropout=0.1).train()  # planted: dropout keeps a mask per dropped tensor
    saved = cx.saved_activation_bytes(block, _x(SMALL))
    assert not cx.exact_outcome("act", cm.training_activation_bytes(SMALL, 4), saved).passed


def test_step_peak_bytes_sees_two_live_buffers():
    n = 2**18  # 1 MiB of fp32

    def fn():
        a = torch.ones(n)
        b = a + 1
        return float(b[0])

    peak = peak_memory_bytes(fn, torch.device("cpu"))
    assert 2 * 4 * n <= peak < 2.2 * 4 * n


def test_step_peak_of_a_training_step_is_near_the_estimate():
    shape = cm.BlockShape(1, 64, 32, 4)
    block, x = _block(shape), _x(shape)
    peak = peak_memory_bytes(lambda: block(x).sum().backward(), torch.device("cpu"))
    estimate = cm.training_peak_estimate_bytes(shape, 4) - cm.block_params(shape)["total"] * 4
    assert cm.training_activation_bytes(shape, 4) < peak <= estimate


# ------------------------------------------------------------------------------------------- SDPA
def test_sdpa_report_and_custom_mapping():
    report = cx.sdpa_flop_report(torch.device("cpu"), torch.float32)
    assert report["kernels"] and report["mapped_forward"] == report["analytic"] > 0
    assert cx.sdpa_outcome(report).passed
    if torch.__version__.startswith("2.13"):  # the behaviour the issue describes: CPU flash kernel uncounted
        assert report["default_forward"] == 0
        assert "_scaled_dot_product_flash_attention_for_cpu" in report["registered"]
        assert report["mapped_backward"] == 5 * report["analytic"] // 2  # backward recomputes the scores


def test_sdpa_check_fails_with_a_formula_that_forgets_weights_v():
    def qk_only(q, k, v, *args, **kwargs):  # planted bug
        return 2 * q[0] * q[1] * q[2] * k[2] * q[3]

    report = cx.sdpa_flop_report(torch.device("cpu"), torch.float32)
    ops = [getattr(torch.ops.aten, name) for name in report["registered"]]
    buggy = cx.sdpa_flop_report(torch.device("cpu"), torch.float32, mapping={op: qk_only for op in ops})
    assert not cx.sdpa_outcome(buggy).passed


# ---------------------------------------------------------------------------------------- timings
def test_timings_check():
    assert cx.timings_outcome({"a": 0.1, "b": 3.0}).passed
    for bad in ({"a": 0.1, "b": float("nan")}, {"a": 0.0}, {"a": -1.0}, {"a": float("inf")}, {}):
        assert not cx.timings_outcome(bad).passed


# -------------------------------------------------------------------------------------- bad input
def _cfg(**kw):
    base = OmegaConf.load("conf/complexity.yaml")
    base.pop("defaults")
    base.dtype = "fp32"
    for k, v in kw.items():
        base[k] = v
    return base


@pytest.mark.parametrize("kw,words", [
    ({"T": 0, "D": 64}, "T=0"), ({"T": 64, "D": -8}, "D=-8"), ({"T": 64, "D": 30}, "not divisible"),
    ({"dtype": "fp8"}, "dtype"), ({"T": 64}, "give both"), ({"top_k": 9}, "top_k=9"),
    ({"groups": [[64]]}, "pair"), ({"d_ff": 0}, "d_ff"), ({"B": 0}, "B=0"), ({"threads": 0}, "threads"),
])
def test_bad_input(kw, words):
    with pytest.raises(BadInput, match=words):
        cx.settings_from(_cfg(**kw))


def test_memory_refusal_names_the_estimate():
    s = cx.settings_from(_cfg(T=4096, D=1024, B=8))
    need = cx.estimated_run_bytes(s.shape(4096, 1024), 4, s.peak_matmul_n)
    assert need > 8 * 4 * 4096 * 4096 * 4  # eight batches of fp32 score matrices at least
    with pytest.raises(BadInput, match=r"GiB \(estimate\)"):
        cx.refuse_oversized(s, 4, available=int(need))  # 80 % of exactly the need is too little
    cx.refuse_oversized(s, 4, available=int(2 * need))


def test_settings_single_group_and_boundaries():
    s = cx.settings_from(_cfg(T=1, D=4, n_heads=4))
    assert s.groups == [(1, 4)] and s.d_ff is None
    assert cx.settings_from(_cfg()).groups == [(256, 512), (1024, 256), (2048, 128)]


# --------------------------------------------------------------------------------- whole run, CLI
QUICK = ["T=32", "D=16", "n_heads=2", "repeats=1", "warmup=0", "peak_matmul_n=64", "n_layers=2", "vocab=100"]


def test_run_records_every_name_with_T_and_D():
    from tfmoe.testing import run_recorded

    rec = run_recorded("complexity", QUICK)
    assert rec.all_passed, [c for c in rec.checks_rows if not c.passed]
    m = pd.DataFrame(rec.metrics_rows)
    assert m["T"].eq(32).all() and m["D"].eq(16).all()
    for name in ("flops_forward_block", "flops_counted_forward_block", "params_block", "crossover_T",
                 "peak_fraction"):
        assert name in set(m["name"])
    value = m.set_index("name")["value"]
    assert value["flops_forward_block"] == value["flops_counted_forward_block"]
    assert value["crossover_T"] == 64
    assert set(m[m["name"] == "peak_fraction"]["component"]) >= {"ffn", "ffn_fc1", "qkv", "prefill"}
    assert {c.check.split(".")[0] for c in rec.checks_rows} == {
        "sdpa_counted_with_custom_mapping", "moe_active_lt_total", "flops_forward_match", "flops_fwd_bwd_match",
        "params_match", "kv_cache_bytes_match", "activation_bytes_match", "timings_valid"}
    # sweep plot from two jobs' rows
    rec2 = run_recorded("complexity", [*QUICK[:1], "D=32", *QUICK[2:]])
    df = pd.concat([pd.DataFrame(rec.metrics_rows), pd.DataFrame(rec2.metrics_rows)], ignore_index=True)
    figs = cx.sweep_plots(df)
    assert list(figs) == ["sweep_attention_vs_ffn"] and figs["sweep_attention_vs_ffn"].axes


def test_cli_exit_codes(tmp_path):
    from tfmoe.notebook import load_run
    from tfmoe.testing import run_cli

    ok = run_cli(["complexity", *QUICK], tmp_path)
    assert ok.exit_code == 0, ok.stdout + ok.stderr
    run = load_run(ok.run_dir)
    assert (ok.run_dir / "complexity_groups.png").exists()
    assert run.checks["passed"].all() and not run.metrics.empty
    bad = run_cli(["complexity", "T=64", "D=30"], tmp_path)
    assert bad.exit_code == 2
    assert "not divisible" in bad.stdout + bad.stderr


@pytest.mark.slow
def test_cli_multirun_writes_sweep_plot(tmp_path):
    from tfmoe.testing import run_cli

    res = run_cli(["complexity", "-m", "T=16,32", "D=16,32", *QUICK[2:]], tmp_path)
    assert res.exit_code == 0, res.stdout + res.stderr
    sweeps = list((tmp_path / "runs" / "complexity").glob("multirun-*"))
    assert sweeps and (sweeps[0] / "sweep.parquet").exists()
    assert (sweeps[0] / "sweep_attention_vs_ffn.png").exists()
    df = pd.read_parquet(sweeps[0] / "sweep.parquet")
    assert set(df["T"].dropna().astype(int)) == {16, 32} and math.isfinite(df["value"].sum())
