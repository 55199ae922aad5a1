"""tfmoe block-stats: the block components, the statistics, the check battery (each check with a planted bug
that makes it fail), bad input, the sweep plots and the CLI end to end."""

from __future__ import annotations

import copy
import math

import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf

from tfmoe.components import attention as attention_mod
from tfmoe.components.block import (
    FeedForward,
    LayerNorm32,
    RMSNorm,
    TransformerBlock,
    make_norm,
    swiglu_hidden,
)
from tfmoe.components.lm import TransformerStack, xavier_init_
from tfmoe.components.norm_reference import plain_norm
from tfmoe.contract.errors import BadInput
from tfmoe.experiments import block_stats as bs
from tfmoe.experiments.block_stats import checks as bc
from tfmoe.experiments.block_stats import plots as bp
from tfmoe.experiments.block_stats import stacks as bst

D, H = 32, 4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def base_cfg():
    from tfmoe.api.testing import compose

    return compose("block-stats", ["d_model=32", "n_layers=3", "batch_size=2", "seq_len=8", "vocab_size=64"])


def cfg_with(base, **overrides):
    cfg = copy.deepcopy(base)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def stack(variant: str = "pre", n_layers: int = 3, causal: bool = True, seed: int = 0,
          dtype: torch.dtype = torch.float32) -> TransformerStack:
    v = bst.parse_variant(variant)
    torch.manual_seed(seed)
    s = TransformerStack(64, D, H, n_layers, norm_position=v.norm_position, norm=v.norm, ffn=v.ffn, causal=causal)
    xavier_init_(s)
    return s.to(dtype)


def batch(B=2, T=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)


# ------------------------------------------------------------------------------------ planted bugs
class SqueezeBlock(TransformerBlock):
    """Bug: squeezes the output, so B=1 (or T=1) loses a dimension."""

    def forward(self, x, padding_mask=None, taps=None, cache=None):
        return super().forward(x, padding_mask, taps, cache).squeeze()


class NoResidualBlock(TransformerBlock):
    """Bug: forgets both residual connections (Pre-Norm layout)."""

    def forward(self, x, padding_mask=None, taps=None, cache=None):
        t = taps if taps is not None else {}
        t["input"] = x
        t["norm1"] = self.norm1(x)
        t["attn_out"] = self.attn(t["norm1"])[0]
        t["resid1"] = t["attn_out"]
        t["norm2"] = self.norm2(t["resid1"])
        t["ffn_out"] = self.ffn(t["norm2"])
        t["resid2"] = t["ffn_out"]
        return t["resid2"]


class WrongSourcePostBlock(TransformerBlock):
    """Bug: Post-Norm block whose FFN residual adds the block input instead of norm1's output."""

    def forward(self, x, padding_mask=None, taps=None, cache=None):
        t = taps if taps is not None else {}
        t["input"] = x
        t["attn_out"] = self.attn(x)[0]
        t["resid1"] = x + t["attn_out"]
        t["norm1"] = self.norm1(t["resid1"])
        t["ffn_out"] = self.ffn(t["norm1"])
        t["resid2"] = x + t["ffn_out"]
        t["norm2"] = self.norm2(t["resid2"])
        return t["norm2"]


class TokenMixingFFN(FeedForward):
    """Bug: the FFN adds the sequence mean (a 'global context' shortcut): mixes positions."""

    def forward(self, x):
        return super().forward(x + x.mean(dim=1, keepdim=True))


class ConstantFFN(nn.Module):
    """Bug: ignores its input entirely (would pass a leak-only test vacuously)."""

    def __init__(self, d):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return self.bias.expand_as(x).clone()


class NoCenteringLayerNorm(nn.Module):
    """Bug: 'LayerNorm' that divides by the std but forgets to subtract the mean."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight, self.bias = eps, nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        var = x.float().var(dim=-1, keepdim=True, correction=0)
        return (x.float() * torch.rsqrt(var + self.eps) * self.weight + self.bias).to(x.dtype)


class BatchAxisNorm(nn.Module):
    """Bug: normalises each feature over the batch axis (BatchNorm-like) instead of over the hidden axis."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight, self.bias = eps, nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        x32 = x.float()
        mu = x32.mean(dim=0, keepdim=True)
        var = x32.var(dim=0, keepdim=True, correction=0)
        return ((x32 - mu) * torch.rsqrt(var + self.eps) * self.weight + self.bias).to(x.dtype)


class SequenceNorm(nn.Module):
    """Bug: RMS over (T, D) of each sequence instead of per token."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(dim=(-2, -1), keepdim=True) + self.eps) * self.weight).to(x.dtype)


class Fp32RMSNorm(RMSNorm):
    """The block.py RMSNorm before the fix: always computed in fp32, so fp64 inputs lose precision."""

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class SameDtypeRMSNorm(RMSNorm):
    """Bug: RMSNorm computed in the input dtype: in fp16, x² overflows past |x| = 256."""

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return y * self.weight


def low_precision_scores(q, k, mask):
    """Bug: attention scores computed in the input dtype (fp16 q·k overflows on large activations)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1)


# --------------------------------------------------------------------------------------- components
def test_rmsnorm_matches_torch_in_fp32_and_fp64_and_fp16():
    x = torch.randn(3, 5, D, dtype=torch.float64) * 2 + 0.5
    for dtype, tol in [(torch.float64, 1e-14), (torch.float32, 1e-6), (torch.float16, 2e-3)]:
        got = RMSNorm(D).to(dtype)(x.to(dtype))
        ref = F.rms_norm(x, (D,), eps=1e-5)
        assert got.dtype == dtype
        assert (got.double() - ref).abs().max().item() <= tol


def test_norms_keep_fp64_precision():
    """Regression: RMSNorm/LayerNorm32 used to compute in fp32 even for fp64 input (error ~1e-7)."""
    x = torch.randn(4, D, dtype=torch.float64) * 3 + 1
    assert (RMSNorm(D).double()(x) - F.rms_norm(x, (D,), eps=1e-5)).abs().max().item() < 1e-14
    assert (LayerNorm32(D).double()(x) - F.layer_norm(x, (D,), eps=1e-5)).abs().max().item() < 1e-14


def test_swiglu_hidden_follows_llama_and_matches_gelu_params():
    assert swiglu_hidden(64) == 176  # 2/3 * 256 = 170.7 -> multiple of 8
    assert swiglu_hidden(3, multiple_of=1) == 8
    gelu = sum(p.numel() for p in FeedForward(64, kind="gelu", bias=False).parameters())
    swiglu = sum(p.numel() for p in FeedForward(64, kind="swiglu").parameters())
    assert abs(swiglu - gelu) / gelu < 0.05
    with pytest.raises(ValueError):
        FeedForward(64, kind="relu")


def test_stack_layout_and_final_norm():
    pre, post = stack("pre"), stack("post")
    ids, _ = batch()
    assert pre(ids).shape == (2, 8, 64)
    assert isinstance(pre.norm_f, LayerNorm32) and isinstance(post.norm_f, nn.Identity)
    assert isinstance(stack("pre_rms").norm_f, RMSNorm)
    one = TransformerStack(64, D, H, 1)
    assert one(torch.zeros(1, 1, dtype=torch.long)).shape == (1, 1, 64)  # boundary: B=T=L=1


def test_xavier_init_inits_q_k_v_as_separate_matrices():
    s = stack("pre", n_layers=2)
    bound = math.sqrt(6 / (2 * D))  # xavier-uniform bound of a (D,D) matrix
    for block in s.blocks:
        for w in block.attn.qkv.weight.split(D, dim=0):
            assert w.abs().max().item() <= bound
            assert w.abs().max().item() > 0.9 * bound  # not the (3D,D) bound sqrt(6/4D)
        assert torch.all(block.ffn.fc1.bias == 0)
    assert abs(s.tok_emb.weight.std().item() - 1.0) < 0.05


# ------------------------------------------------------------------------------------------ variants
@pytest.mark.parametrize("name,want", [
    ("pre", ("pre", "layernorm", "gelu")),
    ("post", ("post", "layernorm", "gelu")),
    ("pre_rms_swiglu", ("pre", "rmsnorm", "swiglu")),
    ("POST_swiglu_ln", ("post", "layernorm", "swiglu")),  # boundary: case and order free
])
def test_parse_variant(name, want):
    v = bst.parse_variant(name)
    assert (v.norm_position, v.norm, v.ffn) == want


@pytest.mark.parametrize("name", ["mid", "", "pre_rms_rms", "pre_relu", "pre_rms_ln", "post__rms"])
def test_parse_variant_bad(name):
    with pytest.raises(BadInput, match="variant"):
        bst.parse_variant(name)


@pytest.mark.parametrize("overrides,match", [
    ({"variants": ["pre", "bogus"]}, "unknown variant 'bogus'"),
    ({"variants": []}, "non-empty"),
    ({"variants": ["pre", "pre"]}, "repeats"),
    ({"n_layers": 0}, "n_layers=0"),
    ({"n_layers": -3}, "n_layers=-3"),
    ({"d_model": 30, "n_heads": 4}, "not divisible"),
    ({"eps": 0.0}, "eps=0.0"),
    ({"eps": -1e-5}, "eps="),
    ({"init": "kaiming"}, "init="),
    ({"lowp_dtypes": ["fp8"]}, "lowp_dtypes"),
    ({"seq_len": 1}, "seq_len"),
    ({"lowp_stress_scale": 0}, "lowp_stress_scale"),
])
def test_settings_bad_input(base_cfg, overrides, match):
    with pytest.raises(BadInput, match=match) as info:
        bs.settings(cfg_with(base_cfg, **overrides))
    assert ":" in str(info.value)  # names the problem and the fix


def test_settings_touch_no_device(base_cfg):
    """settings() runs for every job of a sweep before any starts: a device this machine lacks is no error there."""
    s = bs.settings(cfg_with(base_cfg, device="cuda:7", dtype="bf16"))
    assert [v.name for v in s.variants] == ["pre", "post"] and s.lowp_dtypes == ("fp16", "bf16")


def test_settings_boundary(base_cfg):
    s = bs.settings(cfg_with(base_cfg, n_layers=1, d_model=4, n_heads=4))
    assert [v.name for v in s.variants] == ["pre", "post"]
    assert bs.settings(cfg_with(base_cfg, variants="post_rms")).variants[0].norm == "rmsnorm"  # a bare string


def test_build_variants_share_initial_weights(base_cfg):
    cfg = cfg_with(base_cfg, variants=["pre", "post", "pre_swiglu"])
    s = bs.settings(cfg)
    stacks, shared = bst.build_variants(s.variants, s, CPU, torch.float32, seed=int(cfg.seed))
    pre, post, swi = (dict(stacks[n].named_parameters()) for n in ("pre", "post", "pre_swiglu"))
    for name, p in post.items():
        assert torch.equal(p, pre[name]), name
    assert torch.equal(swi["blocks.2.attn.qkv.weight"], pre["blocks.2.attn.qkv.weight"])
    assert shared["pre"] == 0.0 and shared["post"] == 1.0 and 0.0 < shared["pre_swiglu"] < 1.0


# ------------------------------------------------------------------------------------------- stats
def test_collect_stats_matches_independent_autograd():
    s = stack("pre")
    ids, targets = batch()
    stats = bst.collect_stats(s, ids, targets)
    assert len(stats.activations) == 3 * len(bst.STAGES)
    # reference: autograd.grad of the same loss w.r.t. the same taps, computed separately
    taps = []
    x = s.embed(ids)
    logits = s.head(s.hidden(x, taps))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    a = taps[1]["attn_out"]
    g = torch.autograd.grad(loss, [a, s.blocks[2].ffn.fc2.weight])
    assert stats.value(1, "attn_out", "grad_norm") == pytest.approx(g[0].norm().item(), rel=1e-5)
    assert stats.param_grad(2, "ffn.fc2.weight") == pytest.approx(g[1].norm().item(), rel=1e-5)
    assert stats.value(1, "attn_out", "std") == pytest.approx(a.std(correction=0).item(), rel=1e-5)
    assert stats.value(0, "input", "max_abs") == pytest.approx(x.abs().max().item(), rel=1e-6)
    assert stats.value(0, "input", "rms") == pytest.approx(x.pow(2).mean().sqrt().item(), rel=1e-5)
    assert stats.loss == pytest.approx(loss.item(), rel=1e-6)
    params = {r["param"] for r in stats.param_grads}
    assert {"attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.out.weight", "ffn.fc1.weight"} <= params
    assert all(p.grad is None for p in s.parameters())  # leaves the model clean


def test_collect_stats_is_bit_identical_for_the_same_seed():
    ids, targets = batch()
    a = bst.collect_stats(stack("post", seed=3), ids, targets)
    b = bst.collect_stats(stack("post", seed=3), ids, targets)
    assert a.activations == b.activations and a.param_grads == b.param_grads
    assert torch.equal(a.hidden, b.hidden)
    c = bst.collect_stats(stack("post", seed=4), ids, targets)
    assert c.activations != a.activations


def test_residual_var_slope():
    assert bst.residual_var_slope([1.0, math.sqrt(2), math.sqrt(3), 2.0]) == pytest.approx(1.0)
    assert bst.residual_var_slope([1.0, 1.0, 1.0]) == pytest.approx(0.0)
    assert bst.residual_var_slope([3.0]) == 0.0  # boundary: one layer


# ---------------------------------------------------------------------------------- check: shapes
def test_shape_preserved_passes_on_real_blocks():
    for variant in ("pre", "post_rms_swiglu"):
        assert bc.check_shape_preserved(stack(variant), D).passed


def test_shape_preserved_fails_on_squeezing_block():
    s = stack("pre")
    bad = SqueezeBlock(D, H)
    bad.load_state_dict(s.blocks[1].state_dict())
    s.blocks[1] = bad
    out = bc.check_shape_preserved(s, D)
    assert not out.passed and out.observed > 0 and "(1, 1, 32)" in out.detail
    assert bc.check_shape_preserved(s, D, shapes=((2, 5),)).passed  # only B=1/T=1 exposes it


# ---------------------------------------------------------------------------- check: position-wise
@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_ffn_position_wise_passes(kind):
    torch.manual_seed(0)
    ffn = FeedForward(D, kind=kind)
    assert bc.check_ffn_position_wise(ffn, D).passed
    assert bc.check_ffn_position_wise(ffn, D, seq_len=2).passed  # boundary: first == middle-1, last


def test_ffn_position_wise_fails_on_token_mixing_ffn():
    torch.manual_seed(0)
    out = bc.check_ffn_position_wise(TokenMixingFFN(D), D)
    assert not out.passed and out.observed > out.threshold and "x_changed" in out.evidence


def test_ffn_position_wise_fails_on_ffn_that_ignores_its_input():
    out = bc.check_ffn_position_wise(ConstantFFN(D), D)
    assert not out.passed and math.isinf(out.observed)


# ------------------------------------------------------------------------------ check: norm stats
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_statistics_pass_in_every_dtype(kind):
    out = bc.check_norm_statistics(kind, make_norm(kind, D), 1e-5, D,
                                   [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                                   [1e-2, 1.0, 512.0], CPU)
    assert out.passed, out.detail


def test_norm_statistics_boundary_large_eps_and_tiny_inputs():
    """eps dominates tiny inputs: std is sqrt(var/(var+eps)), far from 1, and must still pass."""
    out = bc.check_norm_statistics("layernorm", make_norm("layernorm", D, eps=0.5), 0.5, D,
                                   [torch.float32], [1e-3], CPU)
    assert out.passed, out.detail


def test_norm_statistics_fail_on_uncentred_layernorm():
    out = bc.check_norm_statistics("layernorm", NoCenteringLayerNorm(D), 1e-5, D, [torch.float32], [1.0], CPU)
    assert not out.passed and out.observed > 1 and "y" in out.evidence


def test_norm_statistics_reference_is_independent_of_f_layer_norm(monkeypatch):
    """Regression (issue 11 item 2): the reference was F.layer_norm, the op LayerNorm32 calls (deviation ratio
    exactly 0.5). A bug in that op (here: Bessel-corrected variance) must fail the check."""
    real = F.layer_norm

    def bessel_layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
        d = x.shape[-1]
        return real(x, shape, weight, bias, eps) * math.sqrt((d - 1) / d)  # var / (d-1) instead of / d

    ok = bc.check_norm_statistics("layernorm", LayerNorm32(D), 1e-5, D, [torch.float32, torch.float16], [1.0], CPU)
    assert ok.passed and ok.observed != 0.5, ok.detail
    monkeypatch.setattr(F, "layer_norm", bessel_layer_norm)
    out = bc.check_norm_statistics("layernorm", LayerNorm32(D), 1e-5, D, [torch.float32], [1.0], CPU)
    assert not out.passed and out.observed > 10, out.detail


def test_norm_reference_imports_nothing_it_judges():
    """The reference norm is written from the definition: it imports torch only (no tfmoe module, so neither
    LayerNorm32 / RMSNorm nor their upcast helper), and uses no torch norm op."""
    import ast
    import inspect

    from tfmoe.components import norm_reference

    source = inspect.getsource(norm_reference)
    imported = {a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "torch"}, imported
    for op in ("layer_norm", "rms_norm", ".mean(", ".var(", ".std(", "rsqrt"):
        assert op not in source.split('"""', 2)[2], op


def test_plain_norm_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 6.0]], dtype=torch.float64)  # mean 3, var 3.5
    want = (x - 3.0) / math.sqrt(3.5 + 1e-5)
    torch.testing.assert_close(plain_norm("layernorm", x, 1e-5), want)
    torch.testing.assert_close(plain_norm("rmsnorm", x, 1e-5), x / math.sqrt(50 / 4 + 1e-5))
    assert plain_norm("layernorm", x.half(), 1e-5).dtype == torch.float16


def test_norm_statistics_fail_on_batch_axis_norm():
    out = bc.check_norm_statistics("layernorm", BatchAxisNorm(D), 1e-5, D, [torch.float32], [1.0], CPU)
    assert not out.passed


def test_norm_statistics_fail_on_fp32_norm_in_fp64():
    """Regression guard: the fp32-only RMSNorm loses precision in fp64 runs."""
    out = bc.check_norm_statistics("rmsnorm", Fp32RMSNorm(D), 1e-5, D, [torch.float64], [1.0], CPU)
    assert not out.passed and out.observed > 100
    fixed = bc.check_norm_statistics("rmsnorm", RMSNorm(D), 1e-5, D, [torch.float64], [1.0], CPU)
    assert fixed.passed


def test_norm_statistics_fail_on_fp16_overflowing_rmsnorm():
    out = bc.check_norm_statistics("rmsnorm", SameDtypeRMSNorm(D), 1e-5, D, [torch.float16], [1.0, 512.0], CPU)
    assert not out.passed and "fp16 scale 512" in out.detail
    assert bc.check_norm_statistics("rmsnorm", SameDtypeRMSNorm(D), 1e-5, D, [torch.float16], [1.0], CPU).passed


# ----------------------------------------------------------------------------- check: per token
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_per_token_passes(kind, dtype):
    assert bc.check_norm_per_token(make_norm(kind, D), D, CPU, dtype).passed


@pytest.mark.parametrize("bad", [BatchAxisNorm, SequenceNorm])
def test_norm_per_token_fails_on_norm_over_the_wrong_axis(bad):
    out = bc.check_norm_per_token(bad(D), D, CPU, torch.float32)
    assert not out.passed


# ---------------------------------------------------------------------------- check: residual
@pytest.mark.parametrize("variant", ["pre", "post", "pre_rms_swiglu", "post_rms"])
def test_residual_identity_passes(variant):
    assert bc.check_residual_identity(stack(variant).blocks[0], D).passed


def test_residual_identity_fails_without_residual():
    block = NoResidualBlock(D, H)
    out = bc.check_residual_identity(block, D)
    assert not out.passed and out.observed > 1
    assert set(out.evidence) == {"x", "got", "want"}


def test_residual_identity_fails_on_post_norm_residual_from_the_wrong_source():
    torch.manual_seed(0)
    out = bc.check_residual_identity(WrongSourcePostBlock(D, H, norm_position="post"), D)
    assert not out.passed


def test_residual_identity_in_bf16_boundary():
    assert bc.check_residual_identity(stack("post").blocks[0].to(torch.bfloat16), D).passed


# ----------------------------------------------------------------------------- check: causality
@pytest.mark.parametrize("variant", ["pre", "post_rms_swiglu"])
def test_causal_stack_passes(variant):
    ids, _ = batch()
    assert bc.check_causal_stack(stack(variant), ids).passed
    assert bc.check_causal_stack(stack(variant, n_layers=1), ids[:1, :2]).passed  # boundary: T=2, L=1


def test_causal_stack_fails_on_non_causal_attention():
    ids, _ = batch()
    out = bc.check_causal_stack(stack("pre", causal=False), ids)
    assert not out.passed and out.observed > 1e-3 and "ids_changed" in out.evidence


def test_causal_stack_fails_when_only_the_last_layer_leaks():
    ids, _ = batch()
    s = stack("post", n_layers=3)
    s.blocks[2].attn.causal = False
    assert not bc.check_causal_stack(s, ids).passed


# ---------------------------------------------------------------------------- check: finiteness
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stats_finite_in_low_precision(dtype):
    ids, targets = batch(B=1, T=4)
    stats = [bst.collect_stats(stack(v, n_layers=2, dtype=dtype), ids, targets, input_scale=scale)
             for v in ("pre", "post") for scale in (1.0, 512.0)]
    assert bc.check_stats_finite(stats, "test").passed


def test_stats_finite_fails_on_fp16_attention_scores(monkeypatch):
    monkeypatch.setattr(attention_mod, "attention_weights", low_precision_scores)
    ids, targets = batch(B=1, T=4)
    s = stack("post", n_layers=2, dtype=torch.float16)
    assert bc.check_stats_finite([bst.collect_stats(s, ids, targets, 1.0)], "scale 1").passed
    out = bc.check_stats_finite([bst.collect_stats(s, ids, targets, 512.0)], "scale 512")
    assert not out.passed and out.observed > 0


def test_stats_finite_counts_nan():
    ids, targets = batch(B=1, T=4)
    stats = bst.collect_stats(stack("pre", n_layers=1), ids, targets)
    stats.activations[3]["std"] = math.nan
    out = bc.check_stats_finite([stats], "planted")
    assert not out.passed and out.observed == 1.0


# ------------------------------------------------------------------------------------ sweep plots
def synthetic_sweep() -> pd.DataFrame:
    """Pre-LN's last-layer gradient ∝ L^-1/2, Post-LN's flat, as a sweep.parquet would hold them."""
    rows = []
    for job, L in enumerate((2, 8, 32)):
        for variant, last in (("pre", 0.2 / math.sqrt(L)), ("post", 0.25)):
            rows.append({"job": str(job), "name": "last_layer_grad_norm", "value": last, "variant": variant,
                         "n_layers": L})
            for layer in range(L):
                rows.append({"job": str(job), "name": "grad_norm_param", "value": last * (1 + 0.1 * layer),
                             "variant": variant, "layer": layer, "param": "ffn.fc2.weight", "n_layers": L})
                rows.append({"job": str(job), "name": "resid_std", "value": math.sqrt(1 + layer),
                             "variant": variant, "layer": layer, "n_layers": L})
    return pd.DataFrame(rows)


def test_depth_slopes_and_sweep_plots():
    df = synthetic_sweep()
    slopes = bp.depth_slopes(df)
    assert slopes["pre"] == pytest.approx(-0.5) and slopes["post"] == pytest.approx(0.0, abs=1e-12)
    figs = bs.sweep_plots(df)
    assert set(figs) == {"sweep_grad_norm_per_layer", "sweep_last_layer_grad_vs_depth", "sweep_std_per_layer"}
    assert len(figs["sweep_grad_norm_per_layer"].axes) == 2


def test_sweep_plots_boundary_single_depth_and_foreign_frame():
    df = synthetic_sweep()
    one = df[df["job"] == "0"]
    assert math.isnan(bp.depth_slopes(one)["pre"])  # one depth: no slope
    assert len(bs.sweep_plots(one)) == 3
    assert bs.sweep_plots(pd.DataFrame({"job": ["0"], "name": ["x"], "value": [1.0]})) == {}


# ------------------------------------------------------------------------------------------- CLI
def test_cli_end_to_end(tmp_path):
    from tfmoe.api.testing import run_cli
    from tfmoe.harness.store.notebook import load_run

    res = run_cli(["block-stats", "n_layers=2", "d_model=32", "seq_len=8", "lowp_dtypes=[bf16]"], tmp_path)
    assert res.exit_code == 0, res.stdout + res.stderr
    run = load_run(res.run_dir)
    m = run.metrics
    acts = m[m["name"].isin(["mean", "std", "rms", "max_abs", "grad_norm"])]
    assert len(acts) == 2 * 2 * len(bst.STAGES) * 5  # variants x layers x stages x stats
    assert set(acts["variant"]) == {"pre", "post"} and set(acts["layer"]) == {0, 1}
    assert set(acts["stage"]) == set(bst.STAGES)
    params = m[m["name"] == "grad_norm_param"]
    assert "ffn.fc2.weight" in set(params["param"]) and params["value"].gt(0).all()
    assert run.checks["passed"].all() and len(run.checks) == 14  # 5 per variant + 2 norm + 2 finite
    assert {"input_ids", "final_hidden.pre", "final_hidden.post"} <= set(run.tensors)
    assert run.tensors["final_hidden.pre"].shape == (8, 8, 32)
    for png in ("grad_norm_per_layer", "std_per_stage", "act_grad_norm_per_stage"):
        assert (res.run_dir / f"{png}.png").exists()


def test_cli_bad_input_exits_2(tmp_path):
    from tfmoe.api.testing import run_cli

    res = run_cli(["block-stats", "variants=[pre,sideways]"], tmp_path)
    assert res.exit_code == 2
    assert "unknown variant 'sideways'" in res.stdout + res.stderr


def test_cli_planted_causality_bug_exits_1(tmp_path, monkeypatch):
    from tfmoe.api.testing import run_cli
    from tfmoe.harness.store.notebook import load_run

    monkeypatch.setattr(attention_mod, "combine_masks", lambda *a, **k: None)  # the causal mask is lost
    res = run_cli(["block-stats", "n_layers=1", "d_model=32", "seq_len=8", "lowp_dtypes=[]"], tmp_path)
    assert res.exit_code == 1
    checks = load_run(res.run_dir).checks.set_index("check")
    assert not checks.loc["causal_stack[pre]", "passed"] and not checks.loc["causal_stack[post]", "passed"]
    assert checks.drop(["causal_stack[pre]", "causal_stack[post]"])["passed"].all()


@pytest.mark.slow
def test_cli_depth_sweep_writes_sweep_plots(tmp_path):
    """The documented `-m n_layers=...` sweep through the core's multirun: sweep.parquet + this module's plots."""
    from tfmoe.api.testing import run_cli

    res = run_cli(["block-stats", "-m", "n_layers=1,3", "d_model=16", "seq_len=4", "batch_size=2",
                   "lowp_dtypes=[]"], tmp_path)
    assert res.exit_code == 0, res.stdout + res.stderr
    sweep_dir = res.run_dir.parent
    df = pd.read_parquet(sweep_dir / "sweep.parquet")
    assert sorted(df["n_layers"].unique()) == [1, 3]
    slopes = bp.depth_slopes(df)
    assert set(slopes) == {"pre", "post"} and all(math.isfinite(v) for v in slopes.values())
    for name in ("sweep_grad_norm_per_layer", "sweep_last_layer_grad_vs_depth", "sweep_std_per_layer"):
        assert (sweep_dir / f"{name}.png").stat().st_size > 0


def test_terminal_table_and_summary_show_mean_std_grad_per_stage_under_parquet_names(base_cfg):
    """Regression (issue 11 item 10): the table left out the mean and called the last stage "output" while
    metrics.parquet calls it resid2 (pre) / norm2 (post)."""
    from rich.console import Console

    from tfmoe.api.testing import make_recorder

    cfg = cfg_with(base_cfg, lowp_dtypes=[])
    rec = make_recorder(cfg)
    rec.console = Console(record=True, width=200)
    bs.run(bs.settings(cfg), rec)
    text = rec.console.export_text()
    assert "std output" not in text and "|g| output" not in text and "resid2" in text
    for column in ("mean", "std", "‖dL/dx‖"):
        assert column in text
    metrics = pd.DataFrame(rec.metrics_rows)
    stages = set(metrics["stage"].dropna())
    assert stages == set(bst.STAGES)
    summary = "\n".join(rec.summary_parts)
    pre = metrics[(metrics["variant"] == "pre") & (metrics["layer"] == 2) & (metrics["stage"] == "resid2")]
    mean = pre[pre["name"] == "mean"]["value"].item()
    std = pre[pre["name"] == "std"]["value"].item()
    grad = pre[pre["name"] == "grad_norm"]["value"].item()
    assert f"| 2 | resid2 | {mean:.3g} | {std:.3g} | {grad:.3g} |" in summary
    assert "the block's output is norm2" in summary  # post-norm


def test_each_planted_bug_fails_only_its_own_family(monkeypatch):
    """Blame audit (issue 11 item 9), whole runs: a bug of one family fails that family's checks and only the others
    the maths forces (an FFN that mixes tokens over the sequence also lets the future leak into the past)."""
    from tfmoe.api.testing import run_recorded
    from tfmoe.components import block as block_mod

    def failed() -> set[str]:
        rec = run_recorded("block-stats", ["n_layers=2", "d_model=32", "seq_len=8", "batch_size=2", "lowp_dtypes=[]"])
        return {c.check for c in rec.checks_rows if not c.passed}

    # (the same run without a planted bug passes every check: test_cli_end_to_end)
    with monkeypatch.context() as m:
        m.setattr(attention_mod, "combine_masks", lambda *a, **k: None)
        assert failed() == {"causal_stack[pre]", "causal_stack[post]"}

    def uncentred(self, x):
        x32 = block_mod.upcast(x)
        y = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(x32.dtype) + self.bias.to(x32.dtype)).to(x.dtype)

    with monkeypatch.context() as m:
        m.setattr(block_mod.LayerNorm32, "forward", uncentred)
        assert failed() == {"norm_statistics[layernorm]"}
    real_ffn = block_mod.FeedForward.forward
    with monkeypatch.context() as m:
        m.setattr(block_mod.FeedForward, "forward",
                  lambda self, x: real_ffn(self, x) + 0.1 * real_ffn(self, x).mean(dim=-2, keepdim=True))
        assert failed() == {"ffn_position_wise[pre]", "ffn_position_wise[post]", "causal_stack[pre]",
                            "causal_stack[post]"}
