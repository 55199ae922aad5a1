"""Masks, the course's attention (with KV cache), chunked exact attention and attn-check's pure helpers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tfmoe.components import comparison
from tfmoe.components.attention import (
    KVCache,
    MultiHeadCrossAttention,
    MultiHeadSelfAttention,
    attention_weights,
)
from tfmoe.components.chunked_attention import chunked_attention, naive_attention, naive_attention_bytes
from tfmoe.components.masks import causal_mask, combine_masks, padding_mask_from_lengths, visible_queries
from tfmoe.components.references import reference_dtype, sdpa_forward
from tfmoe.experiments.attn_check.checks import dropout
from tfmoe.rules.memory import peak_memory_bytes


def qkv(B=2, H=3, Tq=5, Tk=5, Dh=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Tq, Dh, generator=g, dtype=dtype), torch.randn(B, H, Tk, Dh, generator=g, dtype=dtype),
            torch.randn(B, H, Tk, Dh, generator=g, dtype=dtype))


# ---------------------------------------------------------------------------------------------- masks
def test_causal_mask_lower_triangular_and_offset():
    assert torch.equal(causal_mask(3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(1, offset=2), torch.ones(1, 3, dtype=torch.bool))  # decoding step 3 sees all
    assert causal_mask(1).shape == (1, 1) and bool(causal_mask(1)[0, 0])


def test_padding_mask_from_lengths_boundaries_and_bad_input():
    assert torch.equal(padding_mask_from_lengths([3, 0, 1], 3),
                       torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0]], dtype=torch.bool))
    with pytest.raises(ValueError, match="lie in"):
        padding_mask_from_lengths([4], 3)
    with pytest.raises(ValueError):
        padding_mask_from_lengths([-1], 3)


def test_combine_masks_hides_padded_keys_not_queries():
    pm = padding_mask_from_lengths([2], 3)
    m = combine_masks(3, 3, False, pm)  # (1,1,3,3)
    assert m.shape == (1, 1, 1, 3) and torch.equal(m.expand(1, 1, 3, 3)[0, 0], pm.expand(3, 3))  # broadcasts over queries
    assert combine_masks(3, 3, False, None) is None
    with pytest.raises(ValueError, match="T_k"):
        combine_masks(3, 4, False, pm)


def test_visible_queries_finds_fully_masked_rows():
    pm = torch.tensor([[False, True, True], [False, False, False]])
    vis = visible_queries(combine_masks(3, 3, True, pm), 2, 3)
    assert torch.equal(vis, torch.tensor([[False, True, True], [False, False, False]]))
    assert visible_queries(None, 2, 3).all()


# ------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("causal", [True, False])
def test_mha_matches_sdpa_with_its_own_weights(causal):
    torch.manual_seed(0)
    m = MultiHeadSelfAttention(8, 2, causal).double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    pm = padding_mask_from_lengths([5, 3], 5)
    out, w = m(x, pm)
    ref = sdpa_forward(x, m.qkv.weight, m.out.weight, 2, combine_masks(5, 5, causal, pm))
    assert w.shape == (2, 2, 5, 5) and torch.allclose(out, ref, atol=1e-12)


def test_attention_weights_keep_fp64_regression():
    """Regression: attention_weights used .float(), so an fp64 module computed in fp32 (gradcheck failed)."""
    q, k, _ = qkv()
    w = attention_weights(q, k, None)
    assert w.dtype == torch.float64
    assert torch.allclose(w, (q @ k.transpose(-2, -1) / 2).softmax(-1), atol=1e-15)
    assert attention_weights(q.half(), k.half(), None).dtype == torch.float32  # low precision upcast


def test_fully_masked_rows_are_zero_and_gradients_finite():
    m = MultiHeadSelfAttention(8, 2, causal=True).eval()
    x = torch.randn(1, 4, 8, requires_grad=True)
    pm = torch.tensor([[False, False, True, True]])  # left padding: queries 0 and 1 see nothing
    out, w = m(x, pm)
    assert torch.equal(out[0, :2], torch.zeros(2, 8)) and torch.equal(w[0, :, :2], torch.zeros(2, 2, 4))
    out[0, 2:].sum().backward()
    assert torch.isfinite(x.grad).all()


def test_kv_cache_decoding_reproduces_full_forward():
    torch.manual_seed(1)
    m = MultiHeadSelfAttention(8, 2, causal=True).eval()
    x = torch.randn(2, 6, 8)
    full, _ = m(x)
    cache = KVCache()
    steps = torch.cat([m(x[:, t:t + 1], cache=cache)[0] for t in range(6)], dim=1)
    assert cache.length == 6 and cache.nbytes() == 2 * 2 * 2 * 6 * 4 * 4
    assert torch.allclose(steps, full, atol=1e-6)


def test_mha_rejects_indivisible_heads_and_dropout_off_in_eval():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadSelfAttention(10, 3)
    m = MultiHeadSelfAttention(8, 2, dropout=0.5).eval()
    x = torch.randn(1, 3, 8)
    assert torch.equal(m(x)[0], m(x)[0])


def test_cross_attention_hides_padded_memory():
    torch.manual_seed(2)
    m = MultiHeadCrossAttention(8, 2)
    x, mem = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    out, w = m(x, mem, padding_mask_from_lengths([5, 2], 5))
    assert out.shape == (2, 3, 8) and w.shape == (2, 2, 3, 5)
    assert torch.equal(w[1, :, :, 2:], torch.zeros(2, 3, 3)) and torch.allclose(w.sum(-1), torch.ones(2, 2, 3))


# ---------------------------------------------------------------------------------- chunked attention
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("Tq", "Tk", "block"), [(5, 5, 1), (5, 5, 2), (5, 5, 64), (2, 7, 3)])
def test_chunked_equals_sdpa_in_fp64(causal, Tq, Tk, block):
    q, k, v = qkv(Tq=Tq, Tk=Tk)
    kpm = padding_mask_from_lengths([Tk, Tk - 1], Tk)
    mask = combine_masks(Tq, Tk, causal, kpm, offset=Tk - Tq)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = chunked_attention(q, k, v, causal=causal, key_padding_mask=kpm, block_size=block)
    assert out.dtype == torch.float64 and torch.allclose(out, ref, atol=1e-13)
    assert torch.allclose(naive_attention(q, k, v, causal=causal, key_padding_mask=kpm), ref, atol=1e-13)


def test_chunked_fully_masked_query_gives_zero_not_nan():
    q, k, v = qkv(B=1, Tq=3, Tk=3)
    out = chunked_attention(q, k, v, key_padding_mask=torch.zeros(1, 3, dtype=torch.bool), block_size=2)
    assert torch.equal(out, torch.zeros_like(out))


def test_chunked_low_precision_keeps_dtype_and_is_close():
    q, k, v = qkv(B=1, H=2, Tq=16, Tk=16, Dh=8, dtype=torch.float32)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for dt in (torch.float16, torch.bfloat16):
        out = chunked_attention(q.to(dt), k.to(dt), v.to(dt), causal=True, block_size=4)
        assert out.dtype == dt and (out.float() - ref).abs().max() < 8 * torch.finfo(dt).eps * ref.abs().max()


def test_chunked_bad_input():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="block_size"):
        chunked_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError, match="fit together"):
        chunked_attention(q, k[..., :2], v)
    with pytest.raises(ValueError, match="key_padding_mask"):
        chunked_attention(q, k, v, key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="B,H,T,Dh"):
        chunked_attention(q[0], k, v)


def test_chunked_memory_is_a_fraction_of_naive():
    q, k, v = qkv(B=1, H=4, Tq=512, Tk=512, Dh=32, dtype=torch.float32)
    dev = torch.device("cpu")
    naive = peak_memory_bytes(lambda: naive_attention(q, k, v), dev)
    chunked = peak_memory_bytes(lambda: chunked_attention(q, k, v, block_size=32), dev)
    assert naive >= 2 * 4 * 512 * 512 * 4  # scores + weights at least
    assert chunked < 0.15 * naive
    assert naive_attention_bytes(1, 4, 512, 512, torch.float16) == 3 * 4 * 512 * 512 * 4


def test_measure_peak_memory_sees_a_known_allocation():
    peak = peak_memory_bytes(lambda: torch.empty(1 << 20).fill_(1.0), torch.device("cpu"))
    assert 4 * (1 << 20) <= peak < 5 * (1 << 20)


# ------------------------------------------------------------------------------- attn-check helpers
def test_compare_follows_flashattention_rule():
    ref = torch.linspace(-1, 1, 50, dtype=torch.float64).view(1, 5, 10)
    plain = ref + 1e-3
    c = comparison.compare(ref + 1.5e-3, ref, plain, torch.float16)
    assert c.plain_err == pytest.approx(1e-3) and c.passed and c.threshold > 2e-3
    assert not comparison.compare(ref + 5e-3, ref, plain, torch.float16).passed
    assert not comparison.compare(ref * math.nan, ref, plain, torch.float16).passed  # NaN never passes
    valid = torch.tensor([[True, True, True, True, False]])
    bad_last = ref.clone()
    bad_last[0, 4] = 100
    assert comparison.compare(bad_last, ref, ref, torch.float32, valid).err == 0  # excluded rows do not count


def test_row_sum_and_hidden_weight_helpers():
    w = torch.full((1, 1, 2, 2), 0.5)
    valid = torch.ones(1, 2, dtype=torch.bool)
    assert comparison.row_sum_deviation(w, valid) == 0
    assert comparison.row_sum_deviation(w * 2, valid) == pytest.approx(1.0)
    future = ~torch.ones(2, 2, dtype=torch.bool).tril()
    assert comparison.hidden_weight_max(w, future[None, None], valid) == 0.5
    assert comparison.hidden_weight_max(w.tril(), future[None, None], valid) == 0
    assert comparison.row_sum_deviation(w * math.nan, valid) == math.inf


def test_classify_fully_masked_rows():
    mean_v = torch.ones(2, 4)
    assert comparison.classify_rows(torch.full((2, 4), math.nan), mean_v, torch.float32) == "nan"
    assert comparison.classify_rows(torch.zeros(2, 4), mean_v, torch.float32) == "zeros"
    assert comparison.classify_rows(torch.ones(2, 4), mean_v, torch.float32) == "mean_of_v"
    assert comparison.classify_rows(torch.full((2, 4), 3.0), mean_v, torch.float32) == "other"
    assert comparison.classify_rows(torch.zeros(0, 4), mean_v[:0], torch.float32) == "none"


def test_dropout_readout_reveals_mask_and_scale():
    torch.manual_seed(0)
    m = MultiHeadSelfAttention(8, 2, causal=False, dropout=0.25)
    ref = MultiHeadSelfAttention(8, 2, causal=False, dropout=0.0)
    r = dropout.dropout_readout(m, ref, 0.25, False, 8, 20000, torch.device("cpu"), torch.float32)
    assert r.values.numel() == r.n_expected == 313 * 64  # every visible (query, key) pair read once
    assert dropout._readout_prerequisite(r) == ""
    dropped = r.values == 0
    assert abs(float(dropped.double().mean()) - 0.25) < 0.01
    assert torch.allclose(r.values[~dropped], r.expected_kept[~dropped], rtol=1e-6)
    assert torch.allclose(r.expected_kept[:8], torch.full((8,), 1 / (8 * 0.75), dtype=torch.float64))
    assert not m.training  # handed back in eval mode


def test_reference_dtype_rule():
    assert reference_dtype(torch.float32) == torch.float64
    assert reference_dtype(torch.float16) == torch.float32 and reference_dtype(torch.bfloat16) == torch.float32
