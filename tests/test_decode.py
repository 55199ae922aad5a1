"""tfmoe decode: the sampling components, beam search, the chi-square helpers, the check battery (every check
seen failing on a planted bug), bad input and the CLI end to end."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from tfmoe.api.testing import check_passed, cpu_recorder
from tfmoe.components import sampling, sampling_reference
from tfmoe.components.attention import KVCache
from tfmoe.components.lm import TinyCausalLM
from tfmoe.contract.errors import BadInput
from tfmoe.experiments import decode
from tfmoe.experiments.decode import cache_checks, sampling_checks
from tfmoe.experiments.decode import lm as decode_lm

SMALL = ["d_model=32", "n_heads=4", "n_layers=1", "train_steps=60", "batch_size=8", "block_size=32", "lr=1e-2",
         "max_new_tokens=20", "check_tokens=16", "chi2_draws=4000", "timing_lengths=[8,24]", "timing_repeats=1",
         "max_len=64", "beam_width=3"]


make_rec = cpu_recorder
passed = check_passed


@pytest.fixture(scope="module")
def base_cfg():
    from tfmoe.api.testing import compose

    return compose("decode", SMALL)


def cfg_with(base, **overrides):
    cfg = copy.deepcopy(base)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


@pytest.fixture(scope="module")
def lab(base_cfg):
    """A lightly trained tiny LM (60 steps), its vocabulary, streams and the prompt."""
    s = decode.settings(base_cfg)
    lines = decode_lm.load_corpus(None)
    vocab = decode_lm.CharVocab(sorted({c for line in lines for c in line}))
    stream = decode_lm.corpus_stream(lines, vocab)
    torch.manual_seed(0)
    rec = make_rec()
    model = decode_lm.train_lm(rec, s, stream[:-500], vocab.size)
    prompt = decode.prompt_tensor(s, vocab, torch.device("cpu"))
    return s, vocab, stream, model, prompt, rec


# ------------------------------------------------------------------------------ scripted models
class ScriptedLM(torch.nn.Module):
    """logits depend only on the last token: a (V,V) table of next-token log-probabilities."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def new_caches(self):
        return []

    def forward(self, idx, caches=None):
        return self.table[idx]  # (B,T,V)


def successor_lm(V: int = 10) -> ScriptedLM:
    """Always predicts (last + 1) % V."""
    return ScriptedLM(torch.nn.functional.one_hot((torch.arange(V) + 1) % V, V).float() * 10)


def myopic_lm() -> ScriptedLM:
    """Token 0 (start): A=1 with p 0.6, B=2 with p 0.4. After A: 5 continuations equally likely (p 0.2 each),
    after B: EOS=3 with p ~1. Greedy takes A (total p 0.12); the best sequence is B, EOS (p 0.4)."""
    V = 9
    probs = torch.full((V, V), 1e-9)
    probs[0, 1], probs[0, 2] = 0.6, 0.4
    probs[1, 4:9] = 0.2
    probs[2, 3] = 1.0
    probs[3:, 3] = 1.0
    return ScriptedLM(probs.log())


# ------------------------------------------------------------------------------------- components
@pytest.mark.parametrize("kw, match", [({"temperature": -0.1}, "temperature"), ({"temperature": math.inf}, "finite"),
                                       ({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p")])
def test_validate_sampling_refuses_out_of_domain(kw, match):
    with pytest.raises(ValueError, match=match):
        sampling.validate_sampling(**kw)


def test_top_k_filter_keeps_k_and_boundaries():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    assert torch.isfinite(sampling.top_k_filter(logits, 2)).sum() == 2
    assert torch.isfinite(sampling.top_k_filter(logits, 2))[0, [1, 3]].all()
    assert torch.isfinite(sampling.top_k_filter(logits, 99)).all()  # k >= V keeps everything
    assert sampling.top_k_filter(logits, 1).argmax() == 1


def test_top_p_keep_mask_hand_examples():
    probs = torch.tensor([0.125, 0.5, 0.0625, 0.3125])  # dyadic: cumulative sums 0.5, 0.8125, 0.9375, 1 are exact
    kept = lambda p: set(torch.nonzero(sampling.top_p_keep_mask(probs, p)).flatten().tolist())  # noqa: E731
    assert kept(1e-9) == {1}
    assert kept(0.5) == {1}  # 0.5 already reaches p
    assert kept(0.51) == {1, 3}
    assert kept(0.8125) == {1, 3}  # exactly reaches p: the next token is not needed
    assert kept(0.82) == {0, 1, 3}
    assert kept(0.94) == {0, 1, 2, 3}
    assert kept(1.0) == {0, 1, 2, 3}


def test_next_token_probs_temperature_and_greedy():
    logits = torch.randn(3, 7)
    assert torch.equal(sampling.next_token_probs(logits, 0.0).argmax(-1), logits.argmax(-1))
    assert sampling.next_token_probs(logits, 0.0).sum(-1).eq(1).all()
    assert torch.allclose(sampling.next_token_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))


def test_sample_next_is_reproducible_with_a_generator():
    logits = torch.zeros(50, 20)
    a = sampling.sample_next(logits, generator=torch.Generator().manual_seed(3))
    torch.rand(5)  # the global RNG moving must not matter
    b = sampling.sample_next(logits, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.unique().numel() > 5


def test_generate_eos_pads_finished_rows_and_stops_when_all_done():
    lm = successor_lm()
    out = sampling.generate(lm, torch.tensor([[0], [3]]), 10, temperature=0.0, eos_id=2, pad_id=9)
    # row 0 ends at step 2 and is padded; row 1 reaches EOS after 9 tokens, then decoding stops
    assert out.tokens.tolist() == [[0, 1, 2, 9, 9, 9, 9, 9, 9, 9], [3, 4, 5, 6, 7, 8, 9, 0, 1, 2]]
    assert out.finished.tolist() == [True, True]
    single = sampling.generate(lm, torch.tensor([[0]]), 10, temperature=0.0, eos_id=2)
    assert single.tokens.tolist() == [[0, 1, 2]]  # stops right after EOS


def test_generate_zero_new_tokens_and_bad_length():
    lm = successor_lm()
    out = sampling.generate(lm, torch.tensor([[4]]), 0)
    assert out.tokens.tolist() == [[4]] and out.step_logits.shape == (1, 0, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampling.generate(lm, torch.tensor([[4]]), -1)


def test_beam_search_finds_the_sequence_greedy_misses():
    lm = myopic_lm()
    prompt = torch.tensor([[0]])
    greedy = sampling.generate(lm, prompt, 2, temperature=0.0, eos_id=3).tokens
    assert greedy[0, 1] == 1  # greedy takes A
    beam = sampling.beam_search(lm, prompt, 2, 5, eos_id=3)
    assert beam.tokens.tolist() == [[0, 2, 3]] and beam.finished
    assert beam.logprob == pytest.approx(math.log(0.4), abs=1e-5)
    assert sampling.beam_search(lm, prompt, 1, 2, eos_id=3).tokens[0, 1] == 1  # width 1 = greedy


def test_beam_search_bad_input():
    lm = successor_lm()
    with pytest.raises(ValueError, match="beam_width"):
        sampling.beam_search(lm, torch.tensor([[0]]), 0, 3)
    with pytest.raises(ValueError, match="one prompt"):
        sampling.beam_search(lm, torch.tensor([[0], [1]]), 2, 3)
    assert sampling.beam_search(lm, torch.tensor([[0]]), 2, 0).tokens.tolist() == [[0]]


def test_chi2_helpers_match_table_values():
    assert sampling.chi2_critical(0.05, 1) == pytest.approx(3.841, abs=1e-3)
    assert sampling.chi2_critical(0.001, 10) == pytest.approx(29.588, abs=1e-3)
    assert sampling.chi2_critical(0.001, 25) == pytest.approx(52.620, abs=1e-3)
    assert sampling.chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)
    with pytest.raises(ValueError):
        sampling.chi2_sf(1.0, 0)


def test_chi2_goodness_of_fit_accepts_right_and_rejects_wrong_samples():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 1e-6])
    g = torch.Generator().manual_seed(0)
    good = torch.multinomial(probs, 20000, replacement=True, generator=g)
    res = sampling.chi2_goodness_of_fit(good, probs, 1e-3)
    assert res.p_value > 1e-3 and res.n_bins == 5  # the 1e-6 category is pooled into the "rest" bin
    bad = torch.multinomial(torch.tensor([0.45, 0.3, 0.15, 0.1, 0.0]), 20000, replacement=True, generator=g)
    assert sampling.chi2_goodness_of_fit(bad, probs, 1e-3).p_value < 1e-6


def test_chi2_fails_at_once_on_a_sample_of_a_zero_probability_token():
    """Regression (issue 11 item 7): 41 impossible samples in 20,000 were pooled away and still gave p = 0.72."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    g = torch.Generator().manual_seed(0)
    samples = torch.multinomial(probs, 20000, replacement=True, generator=g)
    assert sampling.chi2_goodness_of_fit(samples, probs).p_value > 1e-3
    samples[:41] = 3  # drawn from a token the distribution forbids
    res = sampling.chi2_goodness_of_fit(samples, probs)
    assert res.p_value == 0.0 and res.impossible == 41 and res.stat == math.inf
    one = sampling.chi2_goodness_of_fit(torch.zeros(50, dtype=torch.long), torch.tensor([1.0, 0.0]))
    assert one.p_value == 1.0 and one.df == 0  # one possible token, every sample is it: nothing to reject
    assert sampling.chi2_goodness_of_fit(torch.ones(50, dtype=torch.long), torch.tensor([1.0, 0.0])).p_value == 0.0


def test_reference_truncated_distributions_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert sampling_reference.reference_top_k_probs(logits, 2).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert sampling_reference.reference_top_p_probs(logits, 0.6).tolist() == pytest.approx([0.625, 0.375, 0, 0])  # crosses 0.6
    assert sampling_reference.reference_top_p_probs(logits, 0.5).tolist() == pytest.approx([1, 0, 0, 0])
    assert sampling_reference.reference_top_p_probs(logits, 1.0).tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])
    assert sampling_reference.reference_top_k_probs(torch.tensor([1.0, 1.0, 0.0]), 1).tolist() == pytest.approx([0.5, 0.5, 0])


# ----------------------------------------------------------------------------- model-level facts
def test_reference_greedy_matches_generate(lab):
    _, _, _, model, prompt, _ = lab
    out = sampling.generate(model, prompt, 12, temperature=0.0)
    assert torch.equal(sampling_reference.reference_greedy(model, prompt, 12), out.tokens)


def test_sequence_logprob_matches_generation_logits(lab):
    _, _, _, model, prompt, _ = lab
    out = sampling.generate(model, prompt, 10, temperature=0.0)
    from_steps = torch.log_softmax(out.step_logits[0], -1).gather(-1, out.new_tokens[0][:, None]).sum()
    assert sampling.sequence_logprob(model, out.tokens, prompt.shape[1]) == pytest.approx(float(from_steps),
                                                                                         abs=1e-4)


def test_training_beats_unigram_and_unshifted_labels_do_not(lab, monkeypatch):
    s, vocab, stream, model, _, _ = lab
    train, val = stream[:-500], stream[-500:]
    unigram = decode_lm.unigram_cross_entropy(train, val, vocab.size)
    rec = make_rec()
    rec.check("trained_beats_unigram", decode_lm.eval_loss(model, val, 32) < unigram)
    assert rec.all_passed
    # Planted bug: labels not shifted (the model learns to copy its input token).
    real = decode_lm.lm_loss
    monkeypatch.setattr(decode_lm, "lm_loss", lambda m, w: torch.nn.functional.cross_entropy(
        m(w[:, :-1]).reshape(-1, vocab.size), w[:, :-1].reshape(-1)))
    torch.manual_seed(0)
    bad = decode_lm.train_lm(make_rec(), s, train, vocab.size)
    monkeypatch.setattr(decode_lm, "lm_loss", real)
    assert decode_lm.eval_loss(bad, val, 32) > unigram


# ------------------------------------------------------------------------------- checks: passing
def test_check_battery_passes_on_the_real_components(lab):
    s, vocab, stream, model, prompt, _ = lab
    rec = make_rec()
    sampling_checks.check_greedy_limits(rec, model, prompt, s.check_tokens, s, 0)
    sampling_checks.check_seed_reproducible(rec, model, prompt, s.check_tokens, 0)
    sampling_checks.check_eos_stops(rec, model, prompt, s.check_tokens)
    seq = stream[-40:][None]
    probs = torch.softmax(model(seq)[0].detach(), -1)
    sampling_checks.check_top_p_sets(rec, probs, s.top_p_grid)
    sampling_checks.check_chi2(rec, model(seq)[0, 5].detach(), s.chi2_draws, s.chi2_alpha, 0)
    sampling_checks.check_truncated_sampling(rec, model(seq)[0, 5].detach(), s.chi2_draws, s.chi2_alpha, 0, s.top_k, s.top_p)
    cache_checks.check_parallel_vs_serial(rec, model, seq, s, torch.float32)
    cache_checks.check_kv_cache(rec, model, prompt, s.check_tokens, s, torch.float32)
    assert rec.all_passed, [c for c in rec.checks_rows if not c.passed]
    assert len(rec.checks_rows) == 15


# ------------------------------------------------------------------------- checks: planted bugs
def greedy_limit_failures(lab, **patches) -> set[str]:
    s, _, _, model, prompt, _ = lab
    rec = make_rec()
    sampling_checks.check_greedy_limits(rec, model, prompt, s.check_tokens, s, 0)
    return {c.check for c in rec.checks_rows if not c.passed}


def test_top_k_off_by_one_fails_top_k1(lab, monkeypatch):
    real = sampling.top_k_filter
    monkeypatch.setattr(sampling, "top_k_filter", lambda logits, k: real(logits, k + 1))
    assert greedy_limit_failures(lab) == {"top_k1_equals_greedy"}


def test_top_p_ignoring_p_fails_top_p_tiny(lab, monkeypatch):
    monkeypatch.setattr(sampling, "top_p_keep_mask", lambda probs, p: torch.ones_like(probs, dtype=torch.bool))
    assert greedy_limit_failures(lab) == {"top_p_tiny_equals_greedy"}


def test_temperature_bugs_fail_the_temperature_limits(lab, monkeypatch):
    real_probs, real_sample = sampling.next_token_probs, sampling.sample_next
    # Bug 1: the temperature is never applied (logits used as they are).
    monkeypatch.setattr(sampling, "next_token_probs", lambda logits, temperature=1.0, top_k=None, top_p=None:
                        real_probs(logits, 1.0 if temperature else 0.0, top_k, top_p))
    assert "temperature_tiny_equals_greedy" in greedy_limit_failures(lab)
    monkeypatch.setattr(sampling, "next_token_probs", real_probs)
    # Bug 2: temperature 0 read as "unset" and replaced by 1.
    monkeypatch.setattr(sampling, "sample_next", lambda logits, temperature=1.0, top_k=None, top_p=None,
                        generator=None: real_sample(logits, temperature or 1.0, top_k, top_p, generator))
    assert greedy_limit_failures(lab) == {"temperature_zero_equals_greedy"}


def test_beam_search_dropping_the_prompt_fails_beam1(lab, monkeypatch):
    real = sampling.beam_search

    def prompt_dropping_beam(model, prompt, width, n, eos_id=None, length_penalty=0.0):
        res = real(model, prompt[:, -1:], width, n, eos_id, length_penalty)  # bug: only the last prompt token
        res.tokens = torch.cat([prompt[:, :-1], res.tokens], dim=1)
        return res

    monkeypatch.setattr(sampling, "beam_search", prompt_dropping_beam)
    assert greedy_limit_failures(lab) == {"beam1_equals_greedy"}


def test_sampler_ignoring_the_generator_fails_seed_check(lab, monkeypatch):
    s, _, _, model, prompt, _ = lab
    real = sampling.sample_next
    monkeypatch.setattr(sampling, "sample_next", lambda logits, temperature=1.0, top_k=None, top_p=None,
                        generator=None: real(logits, temperature, top_k, top_p, None))
    rec = make_rec()
    sampling_checks.check_seed_reproducible(rec, model, prompt, s.check_tokens, 0)
    assert not passed(rec, "sampling_seed_reproducible")


def test_generate_ignoring_eos_fails_eos_check(lab, monkeypatch):
    s, _, _, model, prompt, _ = lab
    real = sampling.generate
    monkeypatch.setattr(sampling, "generate", lambda *a, eos_id=None, **kw: real(*a, **kw))
    rec = make_rec()
    sampling_checks.check_eos_stops(rec, model, prompt, s.check_tokens)
    assert not passed(rec, "eos_stops_generation")


def test_top_p_dropping_the_crossing_token_fails_smallest_set(lab, monkeypatch):
    s, _, stream, model, _, _ = lab

    def drops_crossing(probs, p):  # bug: keeps tokens while cumsum <= p, so the mass stays below p
        sp, order = torch.sort(probs.double(), dim=-1, descending=True)
        keep = torch.cumsum(sp, -1) <= p
        keep[..., 0] = True
        return torch.zeros_like(keep).scatter(-1, order, keep)

    monkeypatch.setattr(sampling, "top_p_keep_mask", drops_crossing)
    rec = make_rec()
    sampling_checks.check_top_p_sets(rec, torch.softmax(model(stream[-40:][None])[0].detach(), -1), s.top_p_grid)
    assert not passed(rec, "top_p_smallest_set")
    assert sampling_reference.top_p_violations(torch.tensor([[0.6, 0.4]]), 0.5, torch.tensor([[True, True]])) == 1  # too big


@pytest.mark.parametrize("bug", ["colder", "uniform"])
def test_chi2_check_fails_for_a_wrong_sampler(lab, monkeypatch, bug):
    s, _, stream, model, _, _ = lab
    real = sampling.sample_next

    def wrong(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
        if bug == "colder":  # samples at 0.8 instead of the temperature asked for
            return real(logits, temperature * 0.8, top_k, top_p, generator)
        return real(torch.zeros_like(logits), temperature, top_k, top_p, generator)

    monkeypatch.setattr(sampling, "sample_next", wrong)
    logits = model(stream[-40:][None])[0].detach()
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    rec = make_rec()
    sampling_checks.check_chi2(rec, logits[int(entropy.argmax())], s.chi2_draws, s.chi2_alpha, 0)
    assert not passed(rec, "temperature1_matches_softmax")


def _truncated_failures(lab) -> set[str]:
    s, _, stream, model, _, _ = lab
    logits = model(stream[-40:][None])[0].detach()
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    rec = make_rec()
    sampling_checks.check_chi2(rec, logits[int(entropy.argmax())], s.chi2_draws, s.chi2_alpha, 0)
    sampling_checks.check_truncated_sampling(rec, logits[int(entropy.argmax())], s.chi2_draws, s.chi2_alpha, 0, 5, 0.7)
    return {c.check for c in rec.checks_rows if not c.passed}


def test_truncated_sampling_passes_and_fails_on_planted_filter_bugs(lab, monkeypatch):
    """top-k / top-p sampled distributions, tested statistically (issue 11 item 7): each planted filter bug fails
    its own check only (temperature-1 sampling does not use the filters)."""
    assert _truncated_failures(lab) == set()
    real_k = sampling.top_k_filter
    monkeypatch.setattr(sampling, "top_k_filter", lambda logits, k: real_k(logits, k + 1))  # keeps one too many
    assert _truncated_failures(lab) == {"top_k_sampling_matches"}
    monkeypatch.setattr(sampling, "top_k_filter", real_k)

    def drops_crossing(probs, p):  # keeps tokens while cumsum <= p: the crossing token is lost
        sp, order = torch.sort(probs.double(), dim=-1, descending=True)
        keep = torch.cumsum(sp, -1) <= p
        keep[..., 0] = True
        return torch.zeros_like(keep).scatter(-1, order, keep)

    monkeypatch.setattr(sampling, "top_p_keep_mask", drops_crossing)
    assert _truncated_failures(lab) == {"top_p_sampling_matches"}


class ForgetfulCache(KVCache):
    """Bug: keeps only the newest token's keys/values (no concatenation)."""

    def append(self, k, v):
        self.k, self.v = k, v
        return k, v


class PositionlessCache(KVCache):
    """Bug: reports length 0, so every new token gets position 0."""

    @property
    def length(self) -> int:
        return 0


class KeysOnlyBytesCache(KVCache):
    """Bug: counts the bytes of the keys only."""

    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.numel() * self.k.element_size()


def with_cache(model: TinyCausalLM, cache_cls: type) -> TinyCausalLM:
    bad = copy.deepcopy(model)
    bad.new_caches = lambda: [cache_cls() for _ in bad.blocks]
    return bad


def test_parallel_vs_serial_fails_for_non_causal_model_and_positionless_cache(lab):
    s, _, stream, model, _, _ = lab
    seq = stream[-30:][None]
    leaky = TinyCausalLM(model.vocab_size, 32, 4, 1, 64, causal=False)
    leaky.load_state_dict(model.state_dict())
    for bad in (leaky.eval(), with_cache(model, PositionlessCache)):
        rec = make_rec()
        cache_checks.check_parallel_vs_serial(rec, bad, seq, s, torch.float32)
        assert not passed(rec, "parallel_equals_incremental")


def test_kv_cache_checks_fail_on_planted_cache_bugs(lab):
    s, _, _, model, prompt, _ = lab
    rec = make_rec()
    cache_checks.check_kv_cache(rec, with_cache(model, ForgetfulCache), prompt, s.check_tokens, s, torch.float32)
    assert not passed(rec, "kv_cache_tokens_identical") and not passed(rec, "kv_cache_logits_close")
    rec = make_rec()
    cache_checks.check_kv_cache(rec, with_cache(model, KeysOnlyBytesCache), prompt, s.check_tokens, s, torch.float32)
    assert passed(rec, "kv_cache_logits_close") and not passed(rec, "kv_cache_bytes_match_formula")


def test_cache_bytes_formula():
    assert sampling_reference.cache_bytes_formula(2, 1, 10, 64, torch.float32) == 2 * 2 * 10 * 64 * 4
    assert sampling_reference.cache_bytes_formula(3, 2, 5, 8, torch.bfloat16) == 2 * 3 * 2 * 5 * 8 * 2


# --------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("overrides, match", [
    ({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.5}, "temperature"), ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"beam_width": 0}, "beam_width"), ({"n_heads": 5}, "divisible"), ({"timing_lengths": [1]}, "timing_lengths"),
    ({"top_p_grid": [0.5, 0.0]}, "top_p_grid"), ({"chi2_alpha": 1.0}, "chi2_alpha"), ({"lr": 0.0}, "lr"),
    ({"timing_lengths": [128]}, "max_len"),
])
def test_bad_settings_are_refused(base_cfg, overrides, match):
    with pytest.raises(BadInput, match=match):
        decode.settings(cfg_with(base_cfg, **overrides))


@pytest.mark.parametrize("overrides, match", [
    ({"prompt": "THE CAT"}, "outside the vocabulary"), ({"prompt_ids": [1, 999]}, "outside the vocabulary"),
    ({"prompt_ids": [-1]}, "outside the vocabulary"), ({"prompt": ""}, "empty"),
    ({"max_new_tokens": 60}, "max_len"),
])
def test_bad_prompts_are_refused(base_cfg, lab, overrides, match):
    vocab = lab[1]
    with pytest.raises(BadInput, match=match):
        decode.prompt_tensor(decode.settings(cfg_with(base_cfg, **overrides)), vocab, torch.device("cpu"))


def test_boundary_settings_are_accepted(base_cfg, lab):
    s = decode.settings(cfg_with(base_cfg, top_k=None, top_p=1.0, temperature=0.0, max_new_tokens=0,
                                 beam_width=1, prompt_ids=[0], timing_lengths=[]))
    assert decode.prompt_tensor(s, lab[1], torch.device("cpu")).tolist() == [[0]]


def test_settings_touch_no_device_and_read_no_corpus(base_cfg):
    """settings() runs before any job of a sweep: the corpus and the device are run()'s business."""
    s = decode.settings(cfg_with(base_cfg, device="cuda:7", corpus_path="/no/such/corpus.txt", prompt_ids=[3, 5]))
    assert s.corpus_path == "/no/such/corpus.txt" and s.prompt_ids == (3, 5) and s.timing_lengths == (8, 24)


def test_sampling_references_import_nothing_they_judge():
    """components/sampling_reference.py is written from first principles: no tfmoe module, no sampling helper."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(sampling_reference))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "math", "torch"}, imported


def test_missing_corpus_file_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="not a file"):
        decode_lm.load_corpus(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("\n \n")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café au lait\n".encode("latin-1"))
    with pytest.raises(BadInput, match="not UTF-8"):
        decode_lm.load_corpus(str(latin1))
    with pytest.raises(BadInput, match="no text"):
        decode_lm.load_corpus(str(tmp_path / "empty.txt"))


# --------------------------------------------------------------------------------------------- CLI
def test_cli_end_to_end(workdir):
    from tfmoe.api.testing import run_cli
    from tfmoe.harness.store.notebook import load_run

    res = run_cli(["decode", *SMALL], workdir)
    assert res.exit_code == 0, res.stdout + res.stderr
    run = load_run(res.run_dir)
    assert run.checks["passed"].all() and len(run.checks) == 19  # 16 + train.finite + the two lm.* batched checks
    steps = run.timings[run.timings["stage"] == "next_token"]
    assert set(steps["cache"]) == {"on", "off"} and set(steps["length"]) == {8, 24}
    assert (res.run_dir / "kv_cache_timing.png").exists() and (res.run_dir / "training_loss.png").exists()
    assert "## Continuations" in (res.run_dir / "summary.md").read_text()


def test_cli_bad_input_exits_2(workdir):
    from tfmoe.api.testing import run_cli

    res = run_cli(["decode", *SMALL, "top_k=0"], workdir)
    assert res.exit_code == 2 and "top_k" in res.stderr + res.stdout


def test_cli_untrained_model_fails_the_training_check(workdir):
    from tfmoe.api.testing import run_cli

    res = run_cli(["decode", *SMALL, "train_steps=0", "timing_lengths=[]"], workdir)
    assert res.exit_code == 1
    from tfmoe.harness.store.notebook import load_run

    checks = load_run(res.run_dir).checks.set_index("check")["passed"]
    assert not checks["trained_beats_unigram"] and checks.drop("trained_beats_unigram").all()


def test_same_seed_gives_identical_results():
    from tfmoe.api.testing import run_recorded

    args = [*SMALL, "train_steps=15", "timing_lengths=[]", "chi2_draws=500"]
    a, b = run_recorded("decode", args), run_recorded("decode", args)
    assert [r["value"] for r in a.metrics_rows] == [r["value"] for r in b.metrics_rows]


def test_low_precision_tolerance_is_twice_the_same_dtype_error(lab):
    s, _, stream, model, _, _ = lab
    seq = stream[-30:][None]
    lowp = copy.deepcopy(model).to(torch.bfloat16)
    tol = cache_checks.low_precision_tol(s, lowp, model, seq)
    with torch.no_grad():
        err = float((lowp(seq).double() - model(seq).double()).abs().max())
    assert tol == pytest.approx(max(2 * err, cache_checks.logit_tol(s, torch.float32, model(seq))))
    assert 0 < tol < cache_checks.logit_tol(s, torch.bfloat16, model(seq))  # tighter than 64 bf16 ulps
    rec = make_rec()
    cache_checks.check_parallel_vs_serial(rec, lowp, seq, s, torch.bfloat16, tol)
    assert rec.all_passed
