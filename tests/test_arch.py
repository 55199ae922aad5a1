"""tfmoe arch: positions (sinusoidal, RoPE), the three tiny architectures, the hook trace, the data-flow
pictures, and the check battery — every check seen failing on a planted bug — plus bad input and the CLI."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from tfmoe.api.testing import check_passed, cpu_recorder
from tfmoe.components import positions as positions_mod
from tfmoe.components.attention import MultiHeadCrossAttention, MultiHeadSelfAttention
from tfmoe.components.encdec import DecoderOnly, EncoderDecoder, EncoderOnly, MeanPool
from tfmoe.components.positions import (
    RoPESelfAttention,
    SinusoidalPositions,
    apply_rope,
    rope_angles,
    sinusoidal_positions,
)
from tfmoe.contract.errors import BadInput
from tfmoe.experiments import arch
from tfmoe.experiments.arch import checks as arch_checks
from tfmoe.experiments.arch import trace as arch_trace

V, D, H, L, T, TT = 40, 32, 4, 2, 8, 6


make_rec = cpu_recorder
passed = check_passed


@pytest.fixture(scope="module")
def base_cfg():
    from tfmoe.api.testing import compose

    return compose("arch")


def cfg_with(base, **overrides):
    cfg = copy.deepcopy(base)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def test_settings_touch_no_device(base_cfg):
    """settings() runs for every job of a sweep before any starts: a device this machine lacks is no error there."""
    s = arch.settings(cfg_with(base_cfg, device="cuda:7", dtype="bf16"))
    assert s.d_model == base_cfg.d_model and s.rope == bool(base_cfg.rope)


def models(seed: int = 0, **bugs):
    torch.manual_seed(seed)
    enc = bugs.get("encoder") or EncoderOnly(V, D, H, L, 3)
    dec = bugs.get("decoder") or DecoderOnly(V, D, H, L)
    ed = bugs.get("encdec") or EncoderDecoder(V, V, D, H, L)
    return enc.eval(), dec.eval(), ed.eval()


def ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:n]


# ------------------------------------------------------------------------------------- planted bugs
class MemoryBlindEncoderDecoder(EncoderDecoder):
    """Bug: the decoder is handed a zeroed memory (cross-attention wired to nothing)."""

    def forward(self, src, tgt, src_padding_mask=None, tgt_padding_mask=None):
        memory = self.encode(src, src_padding_mask)
        return self.decode(tgt, torch.zeros_like(memory), tgt_padding_mask, src_padding_mask)


class TransposedCrossAttention(MultiHeadCrossAttention):
    """Bug: returns the weights as (B, H, T_src, T_tgt)."""

    def forward(self, x, memory, memory_padding_mask=None):
        out, w = super().forward(x, memory, memory_padding_mask)
        return out, w.transpose(-1, -2)


def encdec_with_transposed_weights() -> EncoderDecoder:
    torch.manual_seed(0)
    m = EncoderDecoder(V, V, D, H, L)
    for layer in m.decoder:
        layer.cross_attn = TransposedCrossAttention(D, H)
    return m.eval()


class WideEmbedding(nn.Embedding):
    """Bug: a table with an extra row (V+1 x D), e.g. a forgotten special token."""


# ---------------------------------------------------------------------------------------- positions
def test_sinusoidal_positions_module_adds_the_table_with_offset():
    x = torch.randn(2, 5, D)
    got = SinusoidalPositions(D)(x, offset=3)
    assert torch.equal(got, x + sinusoidal_positions(8, D)[3:])


def test_rope_matches_complex_rotation_reference():
    q = torch.randn(2, H, T, 8, dtype=torch.float64)
    cos, sin = rope_angles(T, 8, offset=2)
    got = apply_rope(q.float(), cos, sin).double()
    # Independent reference: pair (x_i, x_{i+4}) as a complex number, multiply by e^{i m θ_i}.
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    m = torch.arange(2, 2 + T, dtype=torch.float64)
    rot = torch.polar(torch.ones(T, 4, dtype=torch.float64), torch.outer(m, theta))
    z = torch.complex(q[..., :4], q[..., 4:]) * rot
    ref = torch.cat([z.real, z.imag], dim=-1)
    assert (got - ref).abs().max() < 1e-5


def test_rope_scores_depend_on_relative_position_only():
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(mq, mk):
        cq, sq = rope_angles(1, 8, offset=mq)
        ck, sk = rope_angles(1, 8, offset=mk)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3


def test_rope_attention_cache_matches_parallel_and_odd_head_size_is_refused():
    torch.manual_seed(0)
    attn = RoPESelfAttention(D, H, causal=True).eval()
    x = torch.randn(1, T, D)
    full = attn(x)[0]
    from tfmoe.components.attention import KVCache

    cache = KVCache()
    steps = torch.cat([attn(x[:, t:t + 1], cache=cache)[0] for t in range(T)], dim=1)
    assert (full - steps).abs().max() < 1e-5
    with pytest.raises(ValueError, match="even head size"):
        RoPESelfAttention(12, 4)  # head size 3
    with pytest.raises(ValueError, match="even head size"):
        rope_angles(4, 5)


# ------------------------------------------------------------------------------------ the models
def test_model_shapes_and_mean_pool_padding():
    enc, dec, ed = models()
    x = torch.randint(0, V, (2, T))
    assert enc(x).shape == (2, T, D) and enc.classify(x).shape == (2, 3)
    assert dec(x).shape == (2, T, V)
    assert ed(x, torch.randint(0, V, (2, TT))).shape == (2, TT, V)
    h = torch.randn(2, 4, D)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    pooled = MeanPool()(h, mask)
    assert torch.allclose(pooled[0], h[0, :2].mean(0)) and torch.allclose(pooled[1], h[1].mean(0))


# --------------------------------------------------------------------------- permutation equivariance
def equivariance_setup():
    torch.manual_seed(0)
    emb = nn.Embedding(V, D)
    attn = MultiHeadSelfAttention(D, H, causal=False).eval()
    g = torch.Generator().manual_seed(0)
    e = emb(arch_checks.distinct_ids(2, T, V, g)).detach()
    perm = arch_checks.nontrivial_permutation(T, g)
    return attn, e, perm


def test_equivariance_checks_pass_on_correct_modules():
    attn, e, perm = equivariance_setup()
    pe = sinusoidal_positions(T, D)
    rope = RoPESelfAttention(D, H).eval()
    rope.load_state_dict(attn.state_dict())
    diffs = {"none": arch_checks.relative_permutation_diff(lambda x: attn(x)[0], e, perm),
             "sinusoidal": arch_checks.relative_permutation_diff(lambda x: attn(x + pe)[0], e, perm),
             "rope": arch_checks.relative_permutation_diff(lambda x: rope(x)[0], e, perm)}
    rec = make_rec()
    arch_checks.check_equivariance(rec, diffs, 64 * torch.finfo(torch.float32).eps, 0.01)
    assert rec.all_passed and len(rec.checks_rows) == 3
    assert diffs["none"] < 1e-6 and diffs["sinusoidal"] > 0.05 and diffs["rope"] > 0.05


def test_equivariance_check_fails_for_a_causal_layer():
    """Planted bug: the 'attention without positions' is causal, so permuting the input is not a relabelling."""
    attn, e, perm = equivariance_setup()
    causal = MultiHeadSelfAttention(D, H, causal=True).eval()
    causal.load_state_dict(attn.state_dict())
    rec = make_rec()
    diffs = {"none": arch_checks.relative_permutation_diff(lambda x: causal(x)[0], e, perm), "sinusoidal": 1.0}
    arch_checks.check_equivariance(rec, diffs, 64 * torch.finfo(torch.float32).eps, 0.01)
    assert not passed(rec, "attention_permutation_equivariant_without_positions")


def test_position_checks_fail_when_positions_carry_no_position(monkeypatch):
    """Planted bugs: every position gets position 0's encoding; RoPE rotates every token by angle 0."""
    attn, e, perm = equivariance_setup()
    pe0 = sinusoidal_positions(1, D).expand(T, D)
    real_angles = positions_mod.rope_angles
    monkeypatch.setattr(positions_mod, "rope_angles",
                        lambda T, d, base=1e4, offset=0, device=None: tuple(a.expand(T, -1) for a in
                                                                            real_angles(1, d, base, 0, device)))
    rope = RoPESelfAttention(D, H).eval()
    rope.load_state_dict(attn.state_dict())
    diffs = {"none": 0.0, "sinusoidal": arch_checks.relative_permutation_diff(lambda x: attn(x + pe0)[0], e, perm),
             "rope": arch_checks.relative_permutation_diff(lambda x: rope(x)[0], e, perm)}
    rec = make_rec()
    arch_checks.check_equivariance(rec, diffs, 1e-5, 0.01)
    assert not passed(rec, "sinusoidal_positions_break_equivariance")
    assert not passed(rec, "rope_positions_break_equivariance")


def test_nontrivial_permutation_and_distinct_ids_boundaries():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert not torch.equal(arch_checks.nontrivial_permutation(2, g), torch.arange(2))
    x = arch_checks.distinct_ids(3, V, V, g)  # T = V: every id exactly once per row
    assert all(sorted(r.tolist()) == list(range(V)) for r in x)


# ----------------------------------------------------------------------------------- visibility
def test_visibility_matrix_on_hand_made_functions():
    emb = torch.randn(V, 3, dtype=torch.float64)
    prefix_sum = lambda b: emb[b].cumsum(dim=1)  # noqa: E731 — output i depends on tokens <= i
    m, diffs, tol = arch_checks.visibility_matrix(prefix_sum, ids(5), V, 16)
    assert torch.equal(m, torch.tril(torch.ones(5, 5, dtype=torch.int64)))
    total = lambda b: emb[b].sum(dim=1, keepdim=True).expand(-1, 5, -1)  # noqa: E731
    assert arch_checks.visibility_matrix(total, ids(5), V, 16)[0].all()
    one = arch_checks.visibility_matrix(prefix_sum, ids(1), V, 16)[0]  # boundary: a single token
    assert one.tolist() == [[1]]


def test_visibility_battery_passes_on_correct_models():
    rec = make_rec()
    mats = arch_checks.run_visibility(rec, *models(), ids(T), ids(TT, seed=2), V, 16)
    assert rec.all_passed and len(rec.checks_rows) == 4
    assert mats["visibility_cross"].shape == (TT, T)
    assert torch.equal(mats["visibility_decoder"], torch.tril(torch.ones(T, T, dtype=torch.int64)))


@pytest.mark.parametrize("bug, check", [
    ({"decoder": DecoderOnly(V, D, H, L, causal=False)}, "visibility_decoder_lower_triangular"),
    ({"encoder": EncoderOnly(V, D, H, L, 3, causal=True)}, "visibility_encoder_all_ones"),
    ({"encdec": EncoderDecoder(V, V, D, H, L, decoder_causal=False)}, "visibility_encdec_target_lower_triangular"),
    ({"encdec": MemoryBlindEncoderDecoder(V, V, D, H, L)}, "visibility_cross_all_ones"),
])
def test_visibility_checks_fail_on_planted_bugs(bug, check):
    rec = make_rec()
    arch_checks.run_visibility(rec, *models(**bug), ids(T), ids(TT, seed=2), V, 16)
    assert not passed(rec, check)
    others = [c for c in rec.checks_rows if c.check != check]
    assert all(c.passed for c in others), [c.check for c in others if not c.passed]
    assert f"failing.{check}.matrix" in rec.tensors_saved


# ----------------------------------------------------------------------------------- hook trace
def test_trace_records_every_module_with_shapes():
    _, _, ed = models()
    src, tgt = torch.randint(0, V, (2, T)), torch.randint(0, V, (2, TT))
    rows = arch_trace.trace_shapes(ed, lambda: ed(src, tgt))
    names = {r.module for r in rows}
    assert names == {n for n, m in ed.named_modules() if not isinstance(m, nn.ModuleList)}  # containers never run
    by = {r.module: r for r in rows}
    assert by[""].out_shapes == [(2, TT, V)] and by["src_emb"].in_shapes == [(2, T)]
    assert by["decoder.0.cross_attn"].in_shapes == [(2, TT, D), (2, T, D)]
    assert by["decoder.0.cross_attn"].out_shapes == [(2, TT, D), (2, H, TT, T)]
    assert [r.order for r in rows] == list(range(len(rows))) and rows[0].module == ""
    assert not any(h for m in ed.modules() for h in (m._forward_hooks, m._forward_pre_hooks))  # removed


def test_cross_weight_shape_check_passes_and_fails_on_planted_bugs():
    src, tgt = torch.randint(0, V, (2, T)), torch.randint(0, V, (2, TT))
    _, dec, ed = models()
    rec = make_rec()
    assert arch_checks.check_cross_weights(rec, arch_trace.trace_shapes(ed, lambda: ed(src, tgt)), 2, H, TT, T)
    bad = encdec_with_transposed_weights()
    rec = make_rec()
    assert not arch_checks.check_cross_weights(rec, arch_trace.trace_shapes(bad, lambda: bad(src, tgt)), 2, H, TT, T)
    rec = make_rec()  # a model with no cross-attention at all
    assert not arch_checks.check_cross_weights(rec, arch_trace.trace_shapes(dec, lambda: dec(src)), 2, H, TT, T)


def test_embedding_check_passes_and_fails_on_a_wrong_table():
    x = torch.randint(0, V, (2, T))
    rec = make_rec()
    assert arch_checks.check_embedding(rec, nn.Embedding(V, D), x, D, V)
    assert not arch_checks.check_embedding(rec, WideEmbedding(V + 1, D), x, D, V)
    assert not arch_checks.check_embedding(rec, nn.Embedding(V, D + 2), x, D, V)
    # the run checks every model's own tables: one wrong table among correct ones fails the check
    tables = {"encoder.tok_emb": nn.Embedding(V, D), "encdec.tgt_emb": WideEmbedding(V + 1, D)}
    assert not arch_checks.check_embedding(rec, tables, x, D, V)
    assert arch_checks.check_embedding(rec, {"a": nn.Embedding(V, D), "b": nn.Embedding(V, D)}, x, D, V)


def test_flows_mermaid_and_pictures_carry_traced_shapes(base_cfg):
    s = arch.settings(base_cfg)
    enc, dec, ed = (m.eval() for m in arch.build_models(s, torch.device("cpu"), torch.float32))
    src = torch.randint(0, s.vocab_size, (s.batch_size, s.seq_len))
    tgt = torch.randint(0, s.vocab_size, (s.batch_size, s.tgt_len))
    trace = {r.module: r for r in arch_trace.trace_shapes(ed, lambda: ed(src, tgt))}
    flow = arch_trace.flow_encdec(trace, s)
    text = arch_trace.mermaid(flow)
    B, T_, TT_, D_ = s.batch_size, s.seq_len, s.tgt_len, s.d_model
    assert text.startswith("flowchart TD")
    assert f'n_enc_norm -->|"memory ({B}, {T_}, {D_})"| n_decoder_0' in text
    assert f'n_tgt_ids -->|"({B}, {TT_})"| n_tgt_emb' in text
    assert f"cross weights ({B}, {s.n_heads}, {TT_}, {T_})" in text
    assert "?" not in text  # every edge found its traced shape
    fig = arch_trace.draw_flow(flow)
    drawn = {t.get_text() for t in fig.axes[0].texts}
    assert {label for _, label, _, _ in flow.nodes} <= drawn and {label for _, _, label in flow.edges} <= drawn
    enc_flow = arch_trace.flow_encoder({r.module: r for r in arch_trace.trace_shapes(enc, lambda: enc.classify(src))}, s)
    assert ("cls_head", "out", f"({B}, {s.n_classes})") in enc_flow.edges


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("overrides, match", [
    ({"n_heads": 5}, "not divisible"),
    ({"d_model": 33, "n_heads": 3}, "is odd"),
    ({"d_model": 36, "n_heads": 4}, "RoPE"),  # head size 9
    ({"vocab_size": 5}, "distinct tokens"),
    ({"seq_len": 1}, "seq_len"),
    ({"tgt_len": True}, "tgt_len"),
    ({"visibility_tol_eps": 0}, "visibility_tol_eps"),
    ({"min_position_effect": -1.0}, "min_position_effect"),
])
def test_bad_input_is_refused(base_cfg, overrides, match):
    with pytest.raises(BadInput, match=match):
        arch.settings(cfg_with(base_cfg, **overrides))


def test_rope_off_accepts_odd_head_size(base_cfg):
    s = arch.settings(cfg_with(base_cfg, d_model=36, n_heads=4, rope=False))
    assert s.d_model == 36 and not s.rope


# ----------------------------------------------------------------------------------------- CLI
def test_cli_end_to_end_saves_matrices_pictures_and_trace(workdir):
    from tfmoe.api.testing import run_cli
    from tfmoe.harness.store.notebook import load_run

    res = run_cli(["arch"], workdir)
    assert res.exit_code == 0, res.stdout + res.stderr
    run = load_run(res.run_dir)
    assert run.checks["passed"].all() and len(run.checks) == 10  # 9 + finite
    t = run.tensors
    assert t["visibility_encoder"].shape == (8, 8) and t["visibility_encoder"].eq(1).all()
    assert torch.equal(t["visibility_decoder"].long(), torch.tril(torch.ones(8, 8, dtype=torch.long)))
    assert t["visibility_cross"].shape == (6, 8) and t["visibility_cross"].eq(1).all()
    for name in ("dataflow_encoder", "dataflow_decoder", "dataflow_encdec", "visibility"):
        assert (res.run_dir / f"{name}.png").stat().st_size > 5000
    summary = (res.run_dir / "summary.md").read_text()
    assert summary.count("```mermaid") == 3 and "hook trace: encdec" in summary
    trace = run.metrics[run.metrics["name"] == "trace_out_numel"]
    assert set(trace["arch"]) == {"encoder", "decoder", "encdec"}


def test_cli_bad_input_exits_2(workdir):
    from tfmoe.api.testing import run_cli

    res = run_cli(["arch", "n_heads=5"], workdir)
    assert res.exit_code == 2
    assert "n_heads" in res.stderr + res.stdout


def test_same_seed_gives_identical_results():
    from tfmoe.api.testing import run_recorded

    a, b = run_recorded("arch"), run_recorded("arch")
    assert [r["value"] for r in a.metrics_rows] == [r["value"] for r in b.metrics_rows]
    assert all(torch.equal(a.tensors_saved[k], b.tensors_saved[k]) for k in a.tensors_saved)


def test_low_precision_run_measures_visibility_in_fp32():
    """Regression: with dtype=bf16 the visible changes (~0.06) fell under the 16-ulp bf16 tolerance (0.2-0.3),
    so every visibility matrix came out as the identity and all four checks failed."""
    from tfmoe.api.testing import run_recorded

    rec = run_recorded("arch", ["dtype=bf16"])
    assert rec.all_passed, [c.check for c in rec.checks_rows if not c.passed]
    assert rec.tensors_saved["visibility_encoder"].eq(1).all()


def test_visibility_perturbs_tokens_on_the_ids_device_and_returns_host_matrices():
    """The arch experiment on CUDA (found by a fake-device audit after the first GPU run, not on a GPU): the
    perturbed batch added a host arange to device ids, and the device matrix was compared with host patterns and
    drawn with .numpy(). Ids on the meta device stand in for CUDA here (meta refuses a host operand too)."""
    from tfmoe.experiments.arch.checks import visibility_matrix

    seen: list[torch.device] = []

    def forward(batch: torch.Tensor) -> torch.Tensor:  # (N,T) ids -> (N,T,4); output i sees tokens j <= i
        seen.append(batch.device)
        g = torch.Generator().manual_seed(0)
        emb = torch.randn(16, 4, generator=g)
        return emb[torch.tensor([[1, 2, 3, 4]] * batch.shape[0])].cumsum(dim=1) + torch.arange(batch.shape[0])[:, None, None]

    matrix, diffs, _ = visibility_matrix(forward, torch.tensor([1, 2, 3, 4]).to("meta"), 16, 8.0)
    assert seen == [torch.device("meta")] and matrix.device.type == "cpu" and diffs.device.type == "cpu"
