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
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from omegaconf import DictConfig, ListConfig
from rich.table import Table

from tfmoe.components import sampling
from tfmoe.components.attention import KVCache
from tfmoe.components.lm import TinyCausalLM
from tfmoe.errors import BadInput
from tfmoe.recorder import Recorder
from tfmoe.validate import require_int, require_number

EOS = "<eos>"


# ------------------------------------------------------------------------------------ corpus, vocab


@dataclass
class CharVocab:
    """Characters of the corpus (sorted) plus <eos> as the last id."""

    chars: list[str]

    @property
    def size(self) -> int:
        return len(self.chars) + 1

    @property
    def eos_id(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        index = {c: i for i, c in enumerate(self.chars)}
        missing = sorted({c for c in text if c not in index})
        if missing:
            raise BadInput(f"prompt has characters outside the vocabulary {missing!r}: use only characters of the "
                           f"corpus ({''.join(self.chars)!r})")
        return [index[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(EOS if i == self.eos_id else self.chars[i] for i in ids)


def load_corpus(path: str | None) -> list[str]:
    """Non-empty lines of the named file, or of the packaged corpus when path is null."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise BadInput(f"corpus_path={path!r} is not a file: name a UTF-8 text file, or null for the built-in corpus")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise BadInput(f"corpus_path={path!r} is not UTF-8 text (bad byte at offset {exc.start}): "
                           "convert it to UTF-8") from None
        except OSError as exc:
            raise BadInput(f"corpus_path={path!r} cannot be read ({exc.strerror}): fix its permissions") from None
    else:
        text = resources.files("tfmoe").joinpath("data/decode_corpus.txt").read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise BadInput(f"corpus {path or 'decode_corpus.txt'} has no text: give a file with at least one line")
    return lines


def corpus_stream(lines: list[str], vocab: CharVocab) -> torch.Tensor:
    """All lines as one id stream, each line followed by <eos>."""
    ids: list[int] = []
    for line in lines:
        ids += vocab.encode(line) + [vocab.eos_id]
    return torch.tensor(ids, dtype=torch.long)


# ------------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class DecodeSettings:
    corpus_path: str | None
    d_model: int
    n_heads: int
    n_layers: int
    max_len: int
    train_steps: int
    batch_size: int
    block_size: int
    lr: float
    val_fraction: float
    prompt: str
    prompt_ids: list[int] | None
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    beam_width: int
    length_penalty: float
    check_tokens: int
    tiny_top_p: float
    tiny_temperature: float
    top_p_grid: list[float]
    chi2_draws: int
    chi2_alpha: float
    logit_tol_eps: float
    timing_lengths: list[int]
    timing_repeats: int






def validate(cfg: DictConfig) -> DecodeSettings:
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
        prompt_ids = [int(i) for i in prompt_ids]
    grid = cfg.get("top_p_grid")
    if not isinstance(grid, (list, ListConfig)) or not grid or not all(
            isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1 for p in grid):
        raise BadInput(f"top_p_grid={grid!r} must be a non-empty list of numbers in (0, 1]: e.g. [0.1,0.5,0.9,1.0]")
    lengths = cfg.get("timing_lengths")
    if not isinstance(lengths, (list, ListConfig)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 2 for n in lengths):
        raise BadInput(f"timing_lengths={lengths!r} must be a list of integers >= 2 (or [] to skip timing)")
    s = DecodeSettings(
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
        top_p_grid=[float(p) for p in grid], chi2_draws=require_int(cfg, "chi2_draws", 100),
        chi2_alpha=require_number(cfg, "chi2_alpha"), logit_tol_eps=require_number(cfg, "logit_tol_eps"),
        timing_lengths=[int(n) for n in lengths], timing_repeats=require_int(cfg, "timing_repeats", 1),
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
    return s


def prompt_tensor(s: DecodeSettings, vocab: CharVocab, device: torch.device) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------------- training


def lm_loss(model: TinyCausalLM, window: torch.Tensor) -> torch.Tensor:
    """Shifted-label loss: inputs window[:, :-1], labels window[:, 1:] (next token at every position)."""
    logits = model(window[:, :-1])  # (B,T,V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), window[:, 1:].reshape(-1))


@torch.no_grad()
def eval_loss(model: TinyCausalLM, stream: torch.Tensor, block: int) -> float:
    """Mean next-token loss over consecutive (non-overlapping) windows of a held-out stream."""
    n = (stream.numel() - 1) // block
    if n == 0:
        return float(lm_loss(model, stream[None]))
    windows = torch.stack([stream[i * block: i * block + block + 1] for i in range(n)])  # (n, block+1)
    return float(lm_loss(model, windows))


def unigram_cross_entropy(train: torch.Tensor, val: torch.Tensor, V: int) -> float:
    """Loss of the best context-free model: add-one unigram frequencies of train, scored on val."""
    counts = torch.bincount(train, minlength=V).double() + 1
    return float(-(counts / counts.sum()).log()[val].mean())


def train_lm(rec: Recorder, s: DecodeSettings, train: torch.Tensor, V: int) -> TinyCausalLM:
    """AdamW on random windows of the train stream; the loss of every step is a metrics row."""
    model = TinyCausalLM(V, s.d_model, s.n_heads, s.n_layers, s.max_len).to(rec.device)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(rec.seed)
    block = min(s.block_size, train.numel() - 1)
    model.train()
    for step in rec.progress(range(s.train_steps), total=s.train_steps, description="training the tiny LM"):
        starts = torch.randint(0, train.numel() - block, (s.batch_size,), generator=g)
        window = torch.stack([train[i: i + block + 1] for i in starts.tolist()]).to(rec.device)  # (B, block+1)
        loss = lm_loss(model, window)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rec.metric("train_loss", float(loss.detach()), step=step)
    return model.eval()


# ------------------------------------------------------------------------------------------ checks


def logit_tol(s: DecodeSettings, dtype: torch.dtype, logits: torch.Tensor) -> float:
    """Tolerance for two computations of the same logits: logit_tol_eps · eps(dtype) · max(1, max|logit|)."""
    return s.logit_tol_eps * float(torch.finfo(dtype).eps) * max(1.0, float(logits.detach().abs().max()))


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Differing positions of two token sequences (length differences count as mismatches)."""
    n = min(a.shape[-1], b.shape[-1])
    return int((a[..., :n] != b[..., :n]).sum()) + abs(a.shape[-1] - b.shape[-1]) * a.shape[0]


@torch.no_grad()
def reference_greedy(model: TinyCausalLM, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Plain greedy decoding: re-run the whole sequence, append the argmax, n times. (B, T0+n)."""
    tokens = prompt
    for _ in range(n):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return tokens


def check_greedy_limits(rec: Recorder, model: TinyCausalLM, prompt: torch.Tensor, n: int, s: DecodeSettings,
                        seed: int) -> dict[str, torch.Tensor]:
    """top-k k=1, top-p p->0, temperature 0 and ->0, beam width 1: each must reproduce greedy decoding
    (the reference: argmax of a full forward at every step, computed here without the sampling module)."""
    greedy = reference_greedy(model, prompt, n)

    def sampled(**kw: Any) -> torch.Tensor:
        g = torch.Generator(device=prompt.device).manual_seed(seed)
        return sampling.generate(model, prompt, n, generator=g, **kw).tokens

    runs = {
        "top_k1_equals_greedy": sampled(temperature=1.0, top_k=1),
        "top_p_tiny_equals_greedy": sampled(temperature=1.0, top_p=s.tiny_top_p),
        "temperature_zero_equals_greedy": sampled(temperature=0.0),
        "temperature_tiny_equals_greedy": sampled(temperature=s.tiny_temperature),
        "beam1_equals_greedy": sampling.beam_search(model, prompt, 1, n).tokens,
    }
    for name, tokens in runs.items():
        wrong = _mismatches(tokens, greedy)
        rec.check(name, wrong == 0, wrong, 0, f"tokens differing from greedy over {n} new tokens",
                  evidence={"tokens": tokens, "greedy": greedy})
    return {"greedy": greedy, **runs}


def top_p_violations(probs: torch.Tensor, p: float, keep: torch.Tensor, slack: float = 1e-12) -> int:
    """Rows whose kept set is not the smallest set with mass >= p. Independent of how it was computed:
    (a) kept mass >= p; (b) dropping the least likely kept token leaves mass < p (minimal);
    (c) every kept token is at least as likely as every dropped one (a top set)."""
    q = probs.double()
    q = q / q.sum(dim=-1, keepdim=True)
    mass = (q * keep).sum(dim=-1)
    min_kept = torch.where(keep, q, torch.full_like(q, math.inf)).amin(dim=-1)
    max_dropped = torch.where(keep, torch.full_like(q, -math.inf), q).amax(dim=-1)
    ok = (mass >= p - slack) & (mass - min_kept < p + slack) & (min_kept >= max_dropped) & keep.any(dim=-1)
    return int((~ok).sum())


def check_top_p_sets(rec: Recorder, probs: torch.Tensor, grid: list[float]) -> None:
    """probs (N,V): the model's next-token distributions at N contexts."""
    total = 0
    for p in grid:
        keep = sampling.top_p_keep_mask(probs, p)
        bad = top_p_violations(probs, p, keep)
        rec.metric("top_p_mean_kept", float(keep.sum(dim=-1).double().mean()), top_p=p)
        total += bad
    rec.check("top_p_smallest_set", total == 0, total, 0,
              f"contexts x p values (N={probs.shape[0]}, p in {grid}) whose kept set is not the smallest set "
              "with cumulative probability >= p")


def reference_top_k_probs(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k distribution from first principles, in fp64: softmax over the logits >= the k-th largest
    (ties at the k-th value kept, as a threshold filter does), 0 elsewhere. logits (V,)."""
    x = logits.double()
    kth = torch.sort(x, descending=True).values[min(k, x.numel()) - 1]
    w = torch.where(x >= kth, torch.exp(x - x.max()), torch.zeros_like(x))
    return w / w.sum()


def reference_top_p_probs(logits: torch.Tensor, p: float) -> torch.Tensor:
    """The nucleus distribution from first principles, in fp64: walk the tokens from most to least likely and
    keep each while the mass already kept is < p (the token that crosses p is kept), then renormalise."""
    q = torch.exp(logits.double() - logits.double().max())
    q = q / q.sum()
    out = torch.zeros_like(q)
    kept = 0.0
    for i in sorted(range(q.numel()), key=lambda j: -float(q[j])):
        if kept >= p:
            break
        out[i] = q[i]
        kept += float(q[i])
    return out / out.sum()


def check_sampled_distribution(rec: Recorder, name: str, logits: torch.Tensor, reference: torch.Tensor, draws: int,
                               alpha: float, seed: int, what: str, **sampler: Any) -> sampling.Chi2Result:
    """Draw ``draws`` tokens with ``sampling.sample_next(logits, **sampler)`` from one context's logits (V,) and
    test them against ``reference`` (V,), a distribution computed here without the sampling module."""
    g = torch.Generator(device=logits.device).manual_seed(seed)
    samples = sampling.sample_next(logits[None].expand(draws, -1), generator=g, **sampler)  # (N,)
    res = sampling.chi2_goodness_of_fit(samples, reference, alpha)
    tag = {"distribution": name}
    rec.metric("chi2_stat", res.stat, **tag)
    rec.metric("chi2_df", res.df, **tag)
    rec.metric("chi2_critical", res.critical, **tag)
    rec.metric("chi2_impossible_samples", res.impossible, **tag)
    if res.impossible:
        detail = (f"{res.impossible} of {draws} draws are tokens the {what} gives probability 0 "
                  "(e.g. a filter that keeps too many tokens): the sampler draws outside the distribution")
    else:
        detail = (f"chi-square p-value over {draws} draws vs the {what} ({res.n_bins} bins, df={res.df}, "
                  f"stat={res.stat:.2f}, critical value {res.critical:.2f} at alpha={alpha}); must not be below alpha")
    rec.check(name, res.p_value >= alpha, res.p_value, alpha, detail)
    return res


def check_chi2(rec: Recorder, logits: torch.Tensor, draws: int, alpha: float, seed: int) -> sampling.Chi2Result:
    """Draw ``draws`` tokens at temperature 1 from one context's logits (V,) and test them against softmax."""
    probs = torch.softmax(logits.double(), dim=-1)  # fp64 reference distribution
    return check_sampled_distribution(rec, "temperature1_matches_softmax", logits, probs, draws, alpha, seed,
                                      "fp64 softmax", temperature=1.0)


def check_truncated_sampling(rec: Recorder, logits: torch.Tensor, draws: int, alpha: float, seed: int,
                             top_k: int | None, top_p: float | None) -> None:
    """top-k and top-p sampling at temperature 1 against their first-principles distributions (chi-square)."""
    if top_k is not None:
        check_sampled_distribution(rec, "top_k_sampling_matches", logits, reference_top_k_probs(logits, top_k), draws,
                                   alpha, seed + 1, f"top-{top_k} softmax", temperature=1.0, top_k=top_k)
    if top_p is not None:
        check_sampled_distribution(rec, "top_p_sampling_matches", logits, reference_top_p_probs(logits, top_p),
                                   draws, alpha, seed + 2, f"top-p {top_p} nucleus", temperature=1.0, top_p=top_p)


def incremental_logits(model: TinyCausalLM, seq: torch.Tensor) -> torch.Tensor:
    """Serial inference: feed seq (1,T) one token at a time through the KV cache; logits (1,T,V)."""
    caches = model.new_caches()
    with torch.no_grad():
        steps = [model(seq[:, t: t + 1], caches=caches)[:, -1] for t in range(seq.shape[1])]
    return torch.stack(steps, dim=1)


def check_parallel_vs_serial(rec: Recorder, model: TinyCausalLM, seq: torch.Tensor, s: DecodeSettings,
                             dtype: torch.dtype, tol: float | None = None) -> float:
    with torch.no_grad():
        parallel = model(seq)  # (1,T,V): training-style, all positions at once
    serial = incremental_logits(model, seq)
    diff = float((parallel.double() - serial.double()).abs().max())
    tol = logit_tol(s, dtype, parallel) if tol is None else tol
    rec.check_le("parallel_equals_incremental", diff, tol,
                 f"max |logits(parallel)[t] - logits(incremental step t)| over T={seq.shape[1]} positions",
                 evidence={"parallel": parallel, "serial": serial})
    return diff


def cache_bytes_formula(n_layers: int, B: int, T: int, d_model: int, dtype: torch.dtype) -> int:
    """Keys + values of every layer: 2 · layers · B · T · D · bytes per element."""
    return 2 * n_layers * B * T * d_model * torch.empty(0, dtype=dtype).element_size()


def check_kv_cache(rec: Recorder, model: TinyCausalLM, prompt: torch.Tensor, n: int, s: DecodeSettings,
                   dtype: torch.dtype, tol: float | None = None) -> tuple[sampling.Generation, sampling.Generation]:
    cached = sampling.generate(model, prompt, n, temperature=0.0, use_cache=True)
    plain = sampling.generate(model, prompt, n, temperature=0.0, use_cache=False)
    wrong = _mismatches(cached.tokens, plain.tokens)
    rec.check("kv_cache_tokens_identical", wrong == 0, wrong, 0,
              f"greedy tokens with vs without the KV cache over {n} new tokens",
              evidence={"cached": cached.tokens, "uncached": plain.tokens})
    m = min(cached.step_logits.shape[1], plain.step_logits.shape[1])
    diff = float((cached.step_logits[:, :m].double() - plain.step_logits[:, :m].double()).abs().max()) if m else 0.0
    rec.check_le("kv_cache_logits_close", diff, logit_tol(s, dtype, plain.step_logits) if tol is None else tol,
                 "max |logits with cache - without cache| over the generated steps")
    cached_len = cached.tokens.shape[1] - 1  # the last token is never fed back
    expected = cache_bytes_formula(len(model.blocks), prompt.shape[0], cached_len, model.d_model, dtype)
    rec.metric("kv_cache_bytes", cached.cache_bytes, length=cached_len)
    rec.check("kv_cache_bytes_match_formula", cached.cache_bytes == expected, cached.cache_bytes, expected,
              f"cache bytes after {cached_len} tokens vs 2·layers·B·T·D·bytes")
    return cached, plain


def low_precision_tol(s: DecodeSettings, model: TinyCausalLM, ref32: TinyCausalLM, seq: torch.Tensor) -> float:
    """fp16/bf16 tolerance: 2x the error of the same-dtype plain forward against the fp32 model, floored at
    the fp32 tolerance (so two low-precision paths may differ as much as low precision itself does)."""
    with torch.no_grad():
        ref = ref32(seq).double()
        err = float((model(seq).double() - ref).abs().max())
    return max(2 * err, logit_tol(s, torch.float32, ref))


def check_eos_stops(rec: Recorder, model: TinyCausalLM, prompt: torch.Tensor, n: int) -> None:
    """Declare the first greedy token to be EOS: generation must stop right after it."""
    first = int(sampling.generate(model, prompt, 1, temperature=0.0).tokens[0, -1])
    out = sampling.generate(model, prompt, n, temperature=0.0, eos_id=first)
    n_new = out.tokens.shape[1] - prompt.shape[1]
    ok = n_new == 1 and bool(out.finished.all()) and int(out.tokens[0, -1]) == first
    rec.check("eos_stops_generation", ok, n_new, 1,
              f"with eos_id = the first greedy token ({first}), new tokens generated (max {n})")


def check_seed_reproducible(rec: Recorder, model: TinyCausalLM, prompt: torch.Tensor, n: int, seed: int) -> None:
    """Same seed -> the same sample at temperature 1 (a run in between must not disturb it)."""
    def sample(sd: int) -> torch.Tensor:
        g = torch.Generator(device=prompt.device).manual_seed(sd)
        return sampling.generate(model, prompt, n, temperature=1.0, generator=g).tokens

    first = sample(seed)
    other = sample(seed + 1)
    again = sample(seed)
    wrong = _mismatches(first, again)
    rec.metric("other_seed_differs", float(_mismatches(first, other) > 0))
    rec.check("sampling_seed_reproducible", wrong == 0, wrong, 0,
              f"tokens differing between two temperature-1 samples with seed {seed} (another seed ran in between)")


# ------------------------------------------------------------------------------------------ timing


def time_decode_steps(rec: Recorder, model: TinyCausalLM, stream: torch.Tensor, lengths: list[int],
                      repeats: int) -> tuple[dict[str, list[float]], list[int]]:
    """Wall time to produce the next token when the sequence already holds L-1 tokens:
    without cache one forward over all L tokens; with cache one forward of the newest token."""
    out: dict[str, list[float]] = {"on": [], "off": []}
    cache_bytes: list[int] = []
    seq = stream.repeat(max(lengths) // max(stream.numel(), 1) + 1)[: max(lengths)][None].to(rec.device)
    for L in lengths:
        prefix = seq[:, : L - 1]
        with torch.no_grad():
            filled = model.new_caches()
            model(prefix, caches=filled)

            def step_cached(filled: list[KVCache] = filled, L: int = L) -> torch.Tensor:
                caches = [KVCache(c.k, c.v) for c in filled]  # a fresh view: append makes new tensors
                return model(seq[:, L - 1: L], caches=caches)[:, -1]

            def step_uncached(L: int = L) -> torch.Tensor:
                return model(seq[:, :L])[:, -1]

            out["on"].append(rec.time("next_token", step_cached, repeats=repeats, warmup=1, length=L, cache="on"))
            out["off"].append(rec.time("next_token", step_uncached, repeats=repeats, warmup=1, length=L,
                                       cache="off"))
        cache_bytes.append(sum(c.nbytes() for c in filled))  # the L-1 cached tokens
        rec.metric("kv_cache_bytes", cache_bytes[-1], length=L - 1)
    return out, cache_bytes


def timing_figure(lengths: list[int], times: dict[str, list[float]], bytes_per_len: list[int]) -> Figure:
    fig = Figure(figsize=(9, 3.8))
    ax, ax2 = fig.subplots(1, 2)
    ax.plot(lengths, times["off"], "o-", label="without cache (re-run all L tokens)")
    ax.plot(lengths, times["on"], "s-", label="with KV cache (feed 1 token)")
    ax.set_xlabel("sequence length L when the token is generated")
    ax.set_ylabel("wall time per generated token (ms, median)")
    ax.set_title("time per generated token")
    ax.legend(fontsize=8)
    ax2.plot([L - 1 for L in lengths], [b / 1024 for b in bytes_per_len], "o-", color="tab:green")
    ax2.set_xlabel("cached tokens (L - 1)")
    ax2.set_ylabel("KV cache (KiB, measured)")
    ax2.set_title("cache size = 2·layers·B·T·D·bytes")
    fig.tight_layout()
    return fig


def loss_figure(losses: list[float], val_loss: float, unigram: float) -> Figure:
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(range(len(losses)), losses, lw=1, label="train loss (batch)")
    ax.axhline(val_loss, color="tab:green", ls="--", label=f"held-out loss {val_loss:.3f}")
    ax.axhline(unigram, color="tab:red", ls=":", label=f"unigram baseline {unigram:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / char)")
    ax.legend(fontsize=8)
    return fig


# --------------------------------------------------------------------------------------------- run


def run(cfg: DictConfig, rec: Recorder) -> None:
    s = validate(cfg)
    _run(s, rec)  # `threads` (conf: 1) is applied by the runner


def _run(s: DecodeSettings, rec: Recorder) -> None:
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
    ref32 = copy.deepcopy(model)
    model = model.to(rec.dtype)

    # The strategies on the user's prompt.
    with rec.stage("generate"):
        outputs = generations(rec, model, prompt, s, vocab)

    # The check battery (fixed lengths independent of max_new_tokens).
    n = s.check_tokens
    with rec.stage("checks"):
        check_greedy_limits(rec, model, prompt, n, s, rec.seed)
        check_seed_reproducible(rec, model, prompt, n, rec.seed)
        check_eos_stops(rec, model, prompt, n)
        seq = val[: min(val.numel(), n + prompt.shape[1], s.max_len)][None].to(rec.device)  # held-out (1,T)
        with torch.no_grad():
            ctx_logits = model(seq)[0].float()  # (T,V)
        check_top_p_sets(rec, torch.softmax(ctx_logits, dim=-1), s.top_p_grid)
        entropy = -(torch.softmax(ctx_logits, -1) * torch.log_softmax(ctx_logits, -1)).sum(-1)  # (T,)
        t_star = int(entropy.argmax())
        rec.metric("chi2_context_entropy", float(entropy[t_star]), position=t_star)
        chi2 = check_chi2(rec, ctx_logits[t_star], s.chi2_draws, s.chi2_alpha, rec.seed)
        check_truncated_sampling(rec, ctx_logits[t_star], s.chi2_draws, s.chi2_alpha, rec.seed, s.top_k, s.top_p)
        if s.top_k is None or s.top_p is None:
            rec.note("sampled-distribution check skipped for " + " and ".join(
                k for k, v in (("top_k", s.top_k), ("top_p", s.top_p)) if v is None) + " (null: off)")
        tol = None  # fp32 / fp64: logit_tol_eps x eps x scale
        if rec.dtype in (torch.float16, torch.bfloat16):
            tol = low_precision_tol(s, model, ref32, seq)
            rec.note(f"{rec.dtype}: logit tolerance {tol:.3g} = 2 x the {rec.dtype} forward's error vs fp32")
        check_parallel_vs_serial(rec, model, seq, s, rec.dtype, tol)
        check_kv_cache(rec, model, prompt, n, s, rec.dtype, tol)

    # KV-cache timing as the sequence grows.
    times: dict[str, list[float]] = {"on": [], "off": []}
    if s.timing_lengths:
        times, nbytes = time_decode_steps(rec, model, stream, s.timing_lengths, s.timing_repeats)
        rec.plot("kv_cache_timing", timing_figure(s.timing_lengths, times, nbytes))
        lo, hi = 0, len(s.timing_lengths) - 1
        rec.metric("uncached_time_growth", times["off"][hi] / times["off"][lo])
        rec.metric("cached_time_growth", times["on"][hi] / times["on"][lo])
        rec.metric("cache_speedup_at_longest", times["off"][hi] / times["on"][hi])

    summarize(rec, s, vocab, prompt, outputs, losses, val_loss, unigram, chi2, times)


def generations(rec: Recorder, model: TinyCausalLM, prompt: torch.Tensor, s: DecodeSettings,
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
    table = Table(title=f"continuations of {vocab.decode(prompt[0].tolist())!r}")
    for col in ("strategy", "new tokens", "EOS", "log-prob", "text"):
        table.add_column(col)
    for name, (text, n_new, eos, lp) in out.items():
        rec.metric("generated_tokens", n_new, strategy=name)
        rec.metric("generated_logprob", lp, strategy=name)
        rec.metric("generated_hit_eos", float(eos), strategy=name)
        table.add_row(name, str(n_new), str(eos), f"{lp:.2f}", text)
    rec.print(table)
    return out


def summarize(rec: Recorder, s: DecodeSettings, vocab: CharVocab, prompt: torch.Tensor,
              outputs: dict[str, tuple[str, int, bool, float]], losses: list[float], val_loss: float,
              unigram: float, chi2: sampling.Chi2Result, times: dict[str, list[float]]) -> None:
    rec.note(f"char vocabulary of {vocab.size} ids (eos={vocab.eos_id}); model d={s.d_model}, heads={s.n_heads}, "
             f"layers={s.n_layers}; trained {s.train_steps} steps in fp32, decoded in "
             f"{str(rec.dtype).removeprefix('torch.')}")
    parts = ["## Training", "",
             f"- train loss: {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps" if losses else
             "- no training steps", f"- held-out loss {val_loss:.3f} nats/char vs unigram {unigram:.3f} "
             f"and uniform {math.log(vocab.size):.3f}", "",
             f"## Continuations of `{vocab.decode(prompt[0].tolist())}`", "",
             "| strategy | new tokens | EOS | log-prob | text |", "|---|---|---|---|---|"]
    parts += [f"| {k} | {n} | {e} | {lp:.2f} | `{t}` |" for k, (t, n, e, lp) in outputs.items()]
    parts += ["", "## Chi-square (temperature 1 vs softmax)", "",
              f"stat {chi2.stat:.2f}, df {chi2.df}, p-value {chi2.p_value:.4f}, critical value "
              f"{chi2.critical:.2f} at alpha {s.chi2_alpha} (chi-square survival function = regularised upper "
              "incomplete gamma Q(df/2, x/2), torch.special.gammaincc; critical value by bisection)"]
    if times["on"]:
        parts += ["", "## Time per generated token (ms, median)", "", "| length | no cache | KV cache |",
                  "|---|---|---|"]
        parts += [f"| {L} | {a:.3f} | {b:.3f} |" for L, a, b in zip(s.timing_lengths, times["off"], times["on"],
                                                                     strict=True)]
    rec.summary("\n".join(parts))
