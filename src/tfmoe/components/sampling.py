"""Next-token decoding (course §2.5, §2.8): greedy, temperature, top-k, top-p (nucleus), beam search.

Order of the sampling transforms (as in Hugging Face ``generate``): logits / temperature -> top-k -> top-p
-> softmax -> one multinomial draw. ``temperature == 0`` means greedy (argmax). All probabilities are
computed in fp32 (the top-p cumulative sum in fp64). Sampling draws only from the ``generator`` it is
given, so a seed makes it reproducible.

A model for ``generate`` / ``beam_search`` is any ``model(idx (B,T), caches=...) -> logits (B,T,V)``
with ``new_caches()`` (see :class:`tfmoe.components.lm.TinyCausalLM`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tfmoe.components.attention import KVCache


def validate_sampling(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> None:
    """Raise ValueError (problem and fix) for settings outside their domain."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature} is negative or not finite: pass temperature >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} is below 1: pass top_k >= 1 (or null to disable it)")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p={top_p} is outside (0, 1]: pass 0 < top_p <= 1 (or null to disable it)")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row, set the rest to -inf. logits (..., V)."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_keep_mask(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Boolean mask (..., V) of the nucleus: the smallest set of most likely tokens whose total
    probability is >= p. A token is kept when the mass of the tokens ranked above it is still < p,
    so the token that crosses p is included and the top token is always kept."""
    probs64 = probs.double()
    probs64 = probs64 / probs64.sum(dim=-1, keepdim=True)
    sorted_p, order = torch.sort(probs64, dim=-1, descending=True)  # (..., V)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of higher-ranked tokens
    keep_sorted = mass_before < p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Set the logits outside the top-p nucleus to -inf."""
    keep = top_p_keep_mask(torch.softmax(logits.float(), dim=-1), p)
    return logits.masked_fill(~keep, float("-inf"))


def next_token_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                     top_p: float | None = None) -> torch.Tensor:
    """logits (B,V) -> the fp32 distribution (B,V) that a sampler draws from. temperature 0 -> one-hot argmax."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    return torch.softmax(logits, dim=-1)


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B,V) -> next token ids (B,). temperature 0 is greedy (no random draw)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = next_token_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, T0 + n) prompt followed by the generated ids (pad after a row's EOS)
    step_logits: torch.Tensor  # (B, n, V) fp32 logits each new token was chosen from
    finished: torch.Tensor  # (B,) True where the row emitted EOS
    n_prompt: int
    cache_bytes: int = 0  # KV-cache size at the end (0 without cache)
    caches: list[KVCache] = field(default_factory=list)

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.n_prompt:]  # (B, n)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             pad_id: int | None = None, use_cache: bool = True,
             generator: torch.Generator | None = None) -> Generation:
    """Autoregressive decoding, one token per step. prompt (B,T0) of real tokens (no padding).

    With ``use_cache`` the prompt is run once (prefill) and each later step feeds only the newest token,
    reusing the keys/values stored per block; without it every step re-runs the whole sequence.
    A row that emits ``eos_id`` is finished: it gets ``pad_id`` (default: eos_id) afterwards, and
    decoding stops when every row is finished or after ``max_new_tokens``.
    """
    validate_sampling(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} is negative: pass max_new_tokens >= 0")
    B = prompt.shape[0]
    pad = eos_id if pad_id is None else pad_id
    tokens = prompt
    caches = model.new_caches() if use_cache else []
    finished = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    step_logits: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        if use_cache:
            feed = tokens if step == 0 else tokens[:, -1:]  # prefill, then only the newest token
            logits = model(feed, caches=caches)[:, -1, :]  # (B,V)
        else:
            logits = model(tokens)[:, -1, :]  # (B,V)
        nxt = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
        if eos_id is not None:
            nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
            finished = finished | (nxt == eos_id)
        step_logits.append(logits.float())
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)  # (B,T+1)
        if eos_id is not None and bool(finished.all()):
            break
    V = step_logits[0].shape[-1] if step_logits else 0
    logits_t = torch.stack(step_logits, dim=1) if step_logits else torch.zeros(B, 0, V, device=prompt.device)
    return Generation(tokens, logits_t, finished, prompt.shape[1],
                      sum(c.nbytes() for c in caches), caches)


@dataclass
class BeamResult:
    tokens: torch.Tensor  # (1, T0 + n) the best hypothesis, prompt included
    score: float  # its sum of log-probabilities (length-normalised when length_penalty > 0)
    logprob: float  # its plain sum of log-probabilities
    finished: bool  # ended with EOS
    n_prompt: int


@torch.no_grad()
def beam_search(model: torch.nn.Module, prompt: torch.Tensor, beam_width: int, max_new_tokens: int,
                eos_id: int | None = None, length_penalty: float = 0.0) -> BeamResult:
    """Beam search for one prompt (1,T0), in the Hugging Face layout. Each step expands every live beam by
    every token and ranks the candidates by total log-probability; an EOS candidate ranked within the top
    ``beam_width`` becomes a finished hypothesis, and the best ``beam_width`` non-EOS candidates stay live
    (so the beam stays full). Stops after ``max_new_tokens``, or (length_penalty 0) as soon as the best
    finished score is >= every live score (log-probs only decrease, so it can no longer be beaten).
    Final ranking uses logprob / n_new**length_penalty. With width 1 and length_penalty 0 this is greedy.
    Beams are re-run without a cache each step (simple, and cheap at this size)."""
    if beam_width < 1:
        raise ValueError(f"beam_width={beam_width} is below 1: pass beam_width >= 1")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} is negative: pass max_new_tokens >= 0")
    if prompt.shape[0] != 1:
        raise ValueError(f"beam_search takes one prompt, got a batch of {prompt.shape[0]}: pass prompt[:1]")

    def norm(lp: float, n: int) -> float:
        return lp / (max(n, 1) ** length_penalty)

    n0 = prompt.shape[1]
    beams = prompt  # (W_live, T)
    beam_lp = torch.zeros(1, dtype=torch.float64, device=prompt.device)  # (W_live,)
    finished: list[tuple[float, float, torch.Tensor]] = []  # (score, logprob, tokens (T,))
    for step in range(max_new_tokens):
        logits = model(beams)[:, -1, :].float()  # (W_live,V)
        logp = torch.log_softmax(logits, dim=-1).double()
        V = logp.shape[-1]
        cand = (beam_lp[:, None] + logp).reshape(-1)  # (W_live*V,)
        top = torch.topk(cand, min(2 * beam_width, cand.numel()))  # enough to refill the beam past EOS
        next_beams, next_lp = [], []
        for rank, (score, flat) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
            b, tok = divmod(flat, V)
            seq = torch.cat([beams[b], torch.tensor([tok], device=beams.device)])
            if eos_id is not None and tok == eos_id:
                if rank < beam_width:
                    finished.append((norm(score, step + 1), score, seq))
            elif len(next_beams) < beam_width:
                next_beams.append(seq)
                next_lp.append(score)
        if not next_beams:
            beams = prompt[:0]
            break
        beams = torch.stack(next_beams)
        beam_lp = torch.tensor(next_lp, dtype=torch.float64, device=prompt.device)
        if finished and length_penalty == 0 and max(f[0] for f in finished) >= float(beam_lp.max()):
            break
    n_new = beams.shape[1] - n0 if beams.shape[0] else 0
    live = [(norm(lp, n_new), lp, seq) for lp, seq in zip(beam_lp.tolist(), beams, strict=False)]
    best_score, best_lp, best_seq = max(finished + live, key=lambda h: h[0]) if finished or live else \
        (0.0, 0.0, prompt[0])
    is_finished = eos_id is not None and best_seq.shape[0] > n0 and int(best_seq[-1]) == eos_id
    return BeamResult(best_seq[None], best_score, best_lp, is_finished, n0)


def sequence_logprob(model: torch.nn.Module, tokens: torch.Tensor, n_prompt: int) -> float:
    """Sum of log p(token_t | tokens_<t) over the generated part of one sequence (1,T)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).float(), dim=-1)[0]  # (T,V)
    targets = tokens[0, n_prompt:]  # (n,)
    if targets.numel() == 0:
        return 0.0
    return float(logp[n_prompt - 1:-1].gather(-1, targets[:, None]).double().sum())


# ------------------------------------------------------------------ chi-square goodness of fit


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, stat/2),
    computed with ``torch.special.gammaincc`` in fp64 (scipy is not a dependency)."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_critical(alpha: float, df: int) -> float:
    """The x with P(X >= x) = alpha for chi-square(df), by bisection on :func:`chi2_sf` (monotone)."""
    lo, hi = 0.0, float(df)
    while chi2_sf(hi, df) > alpha:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


@dataclass
class Chi2Result:
    stat: float
    df: int
    p_value: float
    critical: float  # the statistic's critical value at ``alpha``
    n_bins: int
    observed: torch.Tensor  # (n_bins,) counts
    expected: torch.Tensor  # (n_bins,) N * p
    impossible: int = 0  # samples of categories whose probability is exactly 0 (any one fails the test)


def chi2_goodness_of_fit(samples: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3,
                         min_expected: float = 5.0) -> Chi2Result:
    """Pearson's chi-square test of ``samples`` (N,) ids against ``probs`` (V,). Categories whose expected
    count N·p is below ``min_expected`` are pooled into one bin (the usual validity rule).

    A sample of a category with probability exactly 0 is impossible under ``probs``: it is never pooled away
    (pooling would dilute it, or drop it when the pooled bin expects nothing); the test fails at once
    (statistic inf, p-value 0). A distribution with one possible category passes when every sample is it."""
    n = samples.numel()
    p = probs.double().cpu()
    p = p / p.sum()
    counts = torch.bincount(samples.cpu(), minlength=p.numel()).double()
    possible = p > 0
    impossible = int(counts[~possible].sum())
    expected = n * p
    big = (expected >= min_expected) & possible
    small = ~big & possible
    obs_bins, exp_bins = counts[big], expected[big]
    if small.any():
        obs_bins = torch.cat([obs_bins, counts[small].sum()[None]])
        exp_bins = torch.cat([exp_bins, expected[small].sum()[None]])
    df = obs_bins.numel() - 1
    if impossible:
        return Chi2Result(math.inf, max(df, 1), 0.0, chi2_critical(alpha, max(df, 1)), obs_bins.numel(), obs_bins,
                          exp_bins, impossible)
    if df < 1:
        return Chi2Result(0.0, 0, 1.0, 0.0, obs_bins.numel(), obs_bins, exp_bins, 0)
    stat = float(((obs_bins - exp_bins) ** 2 / exp_bins).sum())
    return Chi2Result(stat, df, chi2_sf(stat, df), chi2_critical(alpha, df), obs_bins.numel(), obs_bins, exp_bins)
