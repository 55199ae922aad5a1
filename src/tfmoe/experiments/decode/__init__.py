"""tfmoe decode — course §2.5 / §2.8: next-token decoding strategies and the KV cache.

A tiny character-level causal LM (the package's blocks) is trained briefly on the project's own corpus
(src/tfmoe/data/decode_corpus.txt, one sentence per line, each followed by an <eos> token) with the
shifted-label loss, so its next-token distributions are not uniform noise. Then:

- the strategies (greedy, temperature, top-k, top-p, beam search) continue a prompt; EOS stops a sequence;
- limits: top-k with k=1, top-p with p->0, temperature->0 and beam width 1 all reproduce greedy decoding;
  the top-p kept set is the smallest set with mass >= p; temperature-1 sampling matches the softmax
  (chi-square test); a seed makes sampling reproducible;
- parallel training vs serial inference: one parallel forward's logits at position t equal those of
  incremental (cached) decoding at step t;
- KV cache: cached and uncached greedy decoding agree (tokens identical, logits within tolerance), the
  cache's bytes match 2·layers·B·T·D·bytes, and the time per generated token is measured as T grows.

This module is the recipe: :class:`Settings`, :func:`settings`, :func:`run`. The parts it runs:
  decode_lm.py               the corpus, its character vocabulary and the tiny LM's training
  decode_sampling_checks.py  greedy limits, seed, EOS, top-p smallest set, chi-square sampling tests
  decode_cache_checks.py     parallel vs incremental logits, KV cache on vs off, cache bytes, timing
  decode_report.py           the tables, summary.md and the figures
  components/sampling_reference.py  the first-principles references those checks compare with
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig

from tfmoe.components import sampling
from tfmoe.components.lm import TinyCausalLM
from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.experiments import lm_battery
from tfmoe.experiments.decode import cache_checks, sampling_checks
from tfmoe.experiments.decode.lm import (
    CharVocab,
    corpus_stream,
    eval_loss,
    load_corpus,
    train_lm,
    unigram_cross_entropy,
)
from tfmoe.experiments.decode.report import continuations_rows, loss_figure, summarize, timing_figure
from tfmoe.experiments.decode.settings import Settings
from tfmoe.experiments.lm_battery import lm_settings
from tfmoe.rules import finite, memory
from tfmoe.rules.memory import (
    DTYPE_BYTES,
    Knob,
    available_memory_bytes,
    block_activation_elements,
    block_params,
)
from tfmoe.rules.validate import require_int, require_number


def settings(cfg: DictConfig) -> Settings:
    """Validate every key; bad input -> BadInput naming the problem and the fix. The corpus and the prompt are
    checked in :func:`run` (they need the corpus's vocabulary)."""
    top_k = cfg.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise BadInput(f"top_k={top_k!r} is below 1: pass top_k >= 1 (or top_k=null to disable it)")
    top_p = cfg.get("top_p")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0.0 < float(top_p) <= 1.0):
        raise BadInput(f"top_p={top_p!r} is outside (0, 1]: pass 0 < top_p <= 1 (or top_p=null to disable it)")
    temperature = require_number(cfg, "temperature")
    if temperature < 0:
        raise BadInput(f"temperature={temperature} is negative: pass temperature >= 0 (0 = greedy)")
    prompt_ids = cfg.get("prompt_ids")
    if prompt_ids is not None:
        if not isinstance(prompt_ids, (list, ListConfig)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in prompt_ids):
            raise BadInput(f"prompt_ids={prompt_ids!r} is not a list of integer ids: pass e.g. prompt_ids=[3,5]")
        prompt_ids = tuple(int(i) for i in prompt_ids)
    grid = cfg.get("top_p_grid")
    if not isinstance(grid, (list, ListConfig)) or not grid or not all(
            isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1 for p in grid):
        raise BadInput(f"top_p_grid={grid!r} must be a non-empty list of numbers in (0, 1]: e.g. [0.1,0.5,0.9,1.0]")
    lengths = cfg.get("timing_lengths")
    if not isinstance(lengths, (list, ListConfig)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 2 for n in lengths):
        raise BadInput(f"timing_lengths={lengths!r} must be a list of integers >= 2 (or [] to skip timing)")
    s = Settings(
        corpus_path=cfg.get("corpus_path"),
        d_model=require_int(cfg, "d_model", 2), n_heads=require_int(cfg, "n_heads", 1), n_layers=require_int(cfg, "n_layers", 1),
        max_len=require_int(cfg, "max_len", 2), train_steps=require_int(cfg, "train_steps", 0),
        batch_size=require_int(cfg, "batch_size", 1), block_size=require_int(cfg, "block_size", 2), lr=require_number(cfg, "lr"),
        val_fraction=require_number(cfg, "val_fraction"), prompt=str(cfg.get("prompt") or ""), prompt_ids=prompt_ids,
        max_new_tokens=require_int(cfg, "max_new_tokens", 0, "pass max_new_tokens >= 0"),
        temperature=temperature, top_k=top_k, top_p=None if top_p is None else float(top_p),
        beam_width=require_int(cfg, "beam_width", 1, "pass beam_width >= 1 (1 = greedy)"),
        length_penalty=require_number(cfg, "length_penalty"), check_tokens=require_int(cfg, "check_tokens", 2),
        tiny_top_p=require_number(cfg, "tiny_top_p"), tiny_temperature=require_number(cfg, "tiny_temperature"),
        top_p_grid=tuple(float(p) for p in grid), chi2_draws=require_int(cfg, "chi2_draws", 100),
        chi2_alpha=require_number(cfg, "chi2_alpha"), logit_tol_eps=require_number(cfg, "logit_tol_eps"),
        timing_lengths=tuple(int(n) for n in lengths), timing_repeats=require_int(cfg, "timing_repeats", 1),
        expect_divergence=finite.expect_divergence(cfg), lm=lm_settings(cfg), own_lm=lm_settings(cfg, own=True),
    )
    if s.d_model % s.n_heads:
        raise BadInput(f"d_model={s.d_model} is not divisible by n_heads={s.n_heads}: pick n_heads dividing d_model")
    if not s.lr > 0:
        raise BadInput(f"lr={s.lr} is not positive: pass e.g. lr=3e-3")
    if not 0 < s.val_fraction < 1:
        raise BadInput(f"val_fraction={s.val_fraction} is outside (0, 1): pass e.g. 0.1")
    if not 0 < s.tiny_top_p < 1 or not 0 < s.tiny_temperature < 1:
        raise BadInput("tiny_top_p and tiny_temperature must be in (0, 1): they probe the limits p->0 and T->0")
    if not 0 < s.chi2_alpha < 1:
        raise BadInput(f"chi2_alpha={s.chi2_alpha} is outside (0, 1): pass e.g. 0.001")
    if s.length_penalty < 0:
        raise BadInput(f"length_penalty={s.length_penalty} is negative: pass >= 0 (0 = plain sum of log-probs)")
    if not s.logit_tol_eps > 0:
        raise BadInput(f"logit_tol_eps={s.logit_tol_eps} is not positive: pass e.g. 64")
    if s.block_size >= s.max_len + 1:
        raise BadInput(f"block_size={s.block_size} exceeds max_len={s.max_len}: pass block_size <= max_len")
    if max(s.timing_lengths, default=0) > s.max_len:
        raise BadInput(f"timing_lengths up to {max(s.timing_lengths)} exceed max_len={s.max_len}: "
                       "shorten them or raise max_len")
    prompt = len(s.prompt_ids) if s.prompt_ids is not None else len(s.prompt)  # characters: the vocabulary's tokens
    if prompt + max(s.max_new_tokens, s.check_tokens) > s.max_len:  # as prompt_tensor, before any run starts
        raise BadInput(f"prompt ({prompt} tokens) + {max(s.max_new_tokens, s.check_tokens)} new tokens exceeds "
                       f"max_len={s.max_len}: shorten the prompt, lower max_new_tokens/check_tokens or raise max_len")
    if str(cfg.get("device")) == "cpu":  # the host's RAM is the device's: refused before anything is allocated
        refuse_oversized(s, str(cfg.get("dtype")), memory.host_available_bytes(), "the host's")
    return s


VOCAB_BOUND = 512  # characters of a corpus assumed by the estimate before the corpus is read (the built-in has ~40)


def estimated_bytes(z: dict[str, int], dtype: str, n_heads: int) -> int:
    """Peak bytes of a decode run with sizes ``z``: the LM trained with AdamW (weights, gradients, two moments, an
    fp32 reference copy and the run-dtype copy), a training step's activations (kept for backward), the recorded
    rows of every step, the chi-square draws, the beams and the KV caches of the timing lengths."""
    d, n_layers, v, t = z["d_model"], z["n_layers"], VOCAB_BOUND, z["max_len"]
    params = 2 * v * d + t * d + n_layers * block_params(d)
    block = z["block_size"]
    train_acts = 3 * n_layers * block_activation_elements(z["batch_size"] * block, d, n_heads, block)
    train = 4 * (6 * params + train_acts + 3 * z["batch_size"] * block * v)
    decode = (DTYPE_BYTES.get(dtype, 4) + 4) * (z["beam_width"] * t * (v + 2 * n_layers * d) + 2 * t * t * n_heads)
    tokens = 8 * (z["beam_width"] + 4) * (z["max_new_tokens"] + z["check_tokens"])  # the generated ids
    return train + decode + tokens + 16 * z["chi2_draws"] + 400 * z["train_steps"]


def refuse_oversized(s: Settings, dtype: str, available: int, where: str) -> None:
    """BadInput (exit 2) naming the size that dominates the estimate and a value of it that fits (max_len stays
    above what the other settings need of it, d_model a multiple of n_heads)."""
    prompt = len(s.prompt_ids) if s.prompt_ids is not None else len(s.prompt)
    timing = max(s.timing_lengths, default=2)

    def longest(z: dict[str, int]) -> int:  # what max_len must hold
        return max(z["block_size"], timing, prompt + max(z["max_new_tokens"], z["check_tokens"]))
    knobs = {"d_model": Knob(s.d_model, s.n_heads, s.n_heads), "n_layers": Knob(s.n_layers),
             "max_len": Knob(s.max_len, minimum=longest), "batch_size": Knob(s.batch_size),
             "block_size": Knob(s.block_size, minimum=2), "beam_width": Knob(s.beam_width),
             "chi2_draws": Knob(s.chi2_draws, minimum=100), "train_steps": Knob(s.train_steps, minimum=min(s.train_steps, 1)),
             "max_new_tokens": Knob(s.max_new_tokens, minimum=0), "check_tokens": Knob(s.check_tokens, minimum=2)}
    memory.refuse_oversized(lambda z: estimated_bytes(z, dtype, s.n_heads), knobs, available, where, "decode")


def prompt_tensor(s: Settings, vocab: CharVocab, device: torch.device) -> torch.Tensor:
    """The prompt as (1, T0) ids; refuses empty prompts and ids outside the vocabulary."""
    if s.prompt_ids is not None:
        bad = [i for i in s.prompt_ids if not 0 <= i < vocab.size]
        if bad:
            raise BadInput(f"prompt_ids {bad} are outside the vocabulary 0..{vocab.size - 1}: use ids in range")
        ids = s.prompt_ids
    else:
        ids = vocab.encode(s.prompt)
    if not ids:
        raise BadInput("the prompt is empty: pass prompt='some text' (or prompt_ids=[...]) with at least one token")
    longest = len(ids) + max(s.max_new_tokens, s.check_tokens)
    if longest > s.max_len:
        raise BadInput(f"prompt ({len(ids)} tokens) + {max(s.max_new_tokens, s.check_tokens)} new tokens exceeds "
                       f"max_len={s.max_len}: shorten the prompt, lower max_new_tokens/check_tokens or raise max_len")
    return torch.tensor([ids], dtype=torch.long, device=device)


# ------------------------------------------------------------------------------------------ run


def run(s: Settings, rec: Recorder) -> None:
    """Train the tiny LM, decode the prompt with every strategy, run the checks, time the cache.
    (`threads`, conf: 1, is applied by the runner.)"""
    if s.lm is not None:  # impl=...: the user's whole causal LM, judged for its cache and batched generation
        lm_battery.run_decode(s.lm, rec)
        return
    if rec.device.type != "cpu":  # a CUDA run's memory is not the host's
        refuse_oversized(s, {torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
            rec.dtype, "fp32"), available_memory_bytes(rec.device), f"{rec.device}'s")
    lines = load_corpus(s.corpus_path)
    vocab = CharVocab(sorted({c for line in lines for c in line}))
    prompt = prompt_tensor(s, vocab, rec.device)
    stream = corpus_stream(lines, vocab)
    n_val = max(2, int(stream.numel() * s.val_fraction))
    if stream.numel() - n_val < s.block_size + 1:
        raise BadInput(f"the corpus ({stream.numel()} tokens) is too short for block_size={s.block_size}: "
                       "lower block_size or use a longer corpus")
    train, val = stream[:-n_val], stream[-n_val:]

    # Train briefly (fp32), then decode in the configured dtype.
    with rec.stage("train"):
        model = train_lm(rec, s, train, vocab.size)
    losses = [r["value"] for r in rec.metrics_rows if r["name"] == "train_loss"]
    val_loss = eval_loss(model, val.to(rec.device), s.block_size)
    unigram = unigram_cross_entropy(train, val, vocab.size)
    rec.metric("val_loss", val_loss)
    rec.metric("unigram_val_loss", unigram)
    rec.metric("uniform_loss", math.log(vocab.size))
    rec.check("trained_beats_unigram", val_loss < unigram, val_loss, unigram,
              "held-out loss of the trained LM must be below the context-free unigram model's "
              "(the distributions use context, they are not noise)")
    if losses:
        rec.plot("training_loss", loss_figure(losses, val_loss, unigram))
    if not finite.check_finite(rec, "train.finite", ("train_loss", "val_loss"), what=f"{s.train_steps} steps",
                               expect_divergence=s.expect_divergence) or s.expect_divergence:
        why = ("expect_divergence=true: the stress test ends after training" if s.expect_divergence else
               "training diverged (check train.finite)")
        rec.note(f"decoding skipped: {why}; a model with non-finite weights has nothing to decode")
        rec.summary(f"## Training\n\n{len(losses)} steps; held-out loss {val_loss:.4f}. Decoding skipped: {why}.")
        return
    ref32 = copy.deepcopy(model)
    model = model.to(rec.dtype)

    # The strategies on the user's prompt.
    with rec.stage("generate"):
        outputs = generations(rec, model, prompt, s, vocab)

    # The check battery (fixed lengths independent of max_new_tokens).
    n = s.check_tokens
    with rec.stage("checks"):
        sampling_checks.check_greedy_limits(rec, model, prompt, n, s, rec.seed)
        sampling_checks.check_seed_reproducible(rec, model, prompt, n, rec.seed)
        sampling_checks.check_eos_stops(rec, model, prompt, n)
        seq = val[: min(val.numel(), n + prompt.shape[1], s.max_len)][None].to(rec.device)  # held-out (1,T)
        with torch.no_grad():
            ctx_logits = model(seq)[0].float()  # (T,V)
        sampling_checks.check_top_p_sets(rec, torch.softmax(ctx_logits, dim=-1), s.top_p_grid)
        entropy = -(torch.softmax(ctx_logits, -1) * torch.log_softmax(ctx_logits, -1)).sum(-1)  # (T,)
        t_star = int(entropy.argmax())
        rec.metric("chi2_context_entropy", float(entropy[t_star]), position=t_star)
        chi2 = sampling_checks.check_chi2(rec, ctx_logits[t_star], s.chi2_draws, s.chi2_alpha, rec.seed)
        sampling_checks.check_truncated_sampling(rec, ctx_logits[t_star], s.chi2_draws, s.chi2_alpha, rec.seed,
                                                 s.top_k, s.top_p)
        if s.top_k is None or s.top_p is None:
            rec.note("sampled-distribution check skipped for " + " and ".join(
                k for k, v in (("top_k", s.top_k), ("top_p", s.top_p)) if v is None) + " (null: off)")
        tol = None  # fp32 / fp64: logit_tol_eps x eps x scale
        if rec.dtype in (torch.float16, torch.bfloat16):
            tol = cache_checks.low_precision_tol(s, model, ref32, seq)
            rec.note(f"{rec.dtype}: logit tolerance {tol:.3g} = 2 x the {rec.dtype} forward's error vs fp32")
        cache_checks.check_parallel_vs_serial(rec, model, seq, s, rec.dtype, tol)
        cache_checks.check_kv_cache(rec, model, prompt, n, s, rec.dtype, tol)
    if s.own_lm is not None:  # prompts of different lengths: a left-padded batch vs each prompt alone
        with rec.stage("batched"):
            lm_battery.run_own_decode(model, s.own_lm, rec)

    # KV-cache timing as the sequence grows.
    times: dict[str, list[float]] = {"on": [], "off": []}
    if s.timing_lengths:
        times, nbytes = cache_checks.time_decode_steps(rec, model, stream, s.timing_lengths, s.timing_repeats)
        rec.plot("kv_cache_timing", timing_figure(s.timing_lengths, times, nbytes))
        lo, hi = 0, len(s.timing_lengths) - 1
        rec.metric("uncached_time_growth", times["off"][hi] / times["off"][lo])
        rec.metric("cached_time_growth", times["on"][hi] / times["on"][lo])
        rec.metric("cache_speedup_at_longest", times["off"][hi] / times["on"][hi])

    summarize(rec, s, vocab, prompt, outputs, losses, val_loss, unigram, chi2, times)


def generations(rec: Recorder, model: TinyCausalLM, prompt: torch.Tensor, s: Settings,
                vocab: CharVocab) -> dict[str, tuple[str, int, bool, float]]:
    """Each strategy continues the prompt (EOS stops it). name -> (text, new tokens, hit EOS, log-prob)."""
    def gen(**kw: Any) -> sampling.Generation:
        g = torch.Generator(device=prompt.device).manual_seed(rec.seed)
        return sampling.generate(model, prompt, s.max_new_tokens, eos_id=vocab.eos_id, generator=g, **kw)

    runs: dict[str, sampling.Generation] = {
        "greedy": gen(temperature=0.0),
        f"temperature {s.temperature:g}": gen(temperature=s.temperature),
        f"top-k {s.top_k} (T={s.temperature:g})": gen(temperature=s.temperature, top_k=s.top_k),
        f"top-p {s.top_p} (T={s.temperature:g})": gen(temperature=s.temperature, top_p=s.top_p),
    }
    out: dict[str, tuple[str, int, bool, float]] = {}
    for name, g in runs.items():
        toks = g.tokens[0].tolist()
        out[name] = (vocab.decode(toks[g.n_prompt:]), len(toks) - g.n_prompt, bool(g.finished.all()),
                     sampling.sequence_logprob(model, g.tokens, g.n_prompt))
    beam = sampling.beam_search(model, prompt, s.beam_width, s.max_new_tokens, eos_id=vocab.eos_id,
                                length_penalty=s.length_penalty)
    toks = beam.tokens[0].tolist()
    out[f"beam {s.beam_width}"] = (vocab.decode(toks[beam.n_prompt:]), len(toks) - beam.n_prompt, beam.finished,
                                   beam.logprob)
    for name, (_, n_new, eos, lp) in out.items():
        rec.metric("generated_tokens", n_new, strategy=name)
        rec.metric("generated_logprob", lp, strategy=name)
        rec.metric("generated_hit_eos", float(eos), strategy=name)
    continuations_rows(vocab.decode(prompt[0].tolist()), out).print_to(rec.console)
    return out
