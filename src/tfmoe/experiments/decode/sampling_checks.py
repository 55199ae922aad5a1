"""decode's sampling checks: the limits that must reproduce greedy decoding, a seed's reproducibility, EOS
stopping generation, the top-p smallest set, and chi-square tests of temperature-1, top-k and top-p sampling against
distributions computed in :mod:`tfmoe.components.sampling_reference` (never with the sampling module judged)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tfmoe.components import sampling
from tfmoe.components import sampling_reference as ref
from tfmoe.components.lm import TinyCausalLM
from tfmoe.contract.recorder import Recorder

if TYPE_CHECKING:
    from tfmoe.experiments.decode.settings import Settings


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Differing positions of two token sequences (length differences count as mismatches)."""
    n = min(a.shape[-1], b.shape[-1])
    return int((a[..., :n] != b[..., :n]).sum()) + abs(a.shape[-1] - b.shape[-1]) * a.shape[0]


def check_greedy_limits(rec: Recorder, model: TinyCausalLM, prompt: torch.Tensor, n: int, s: Settings,
                        seed: int) -> dict[str, torch.Tensor]:
    """top-k k=1, top-p p->0, temperature 0 and ->0, beam width 1: each must reproduce greedy decoding
    (the reference: argmax of a full forward at every step, computed here without the sampling module)."""
    greedy = ref.reference_greedy(model, prompt, n)

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
        wrong = mismatches(tokens, greedy)
        rec.check(name, wrong == 0, wrong, 0, f"tokens differing from greedy over {n} new tokens",
                  evidence={"tokens": tokens, "greedy": greedy})
    return {"greedy": greedy, **runs}


def check_seed_reproducible(rec: Recorder, model: TinyCausalLM, prompt: torch.Tensor, n: int, seed: int) -> None:
    """Same seed -> the same sample at temperature 1 (a run in between must not disturb it)."""
    def sample(sd: int) -> torch.Tensor:
        g = torch.Generator(device=prompt.device).manual_seed(sd)
        return sampling.generate(model, prompt, n, temperature=1.0, generator=g).tokens

    first = sample(seed)
    other = sample(seed + 1)
    again = sample(seed)
    wrong = mismatches(first, again)
    rec.metric("other_seed_differs", float(mismatches(first, other) > 0))
    rec.check("sampling_seed_reproducible", wrong == 0, wrong, 0,
              f"tokens differing between two temperature-1 samples with seed {seed} (another seed ran in between)")


def check_eos_stops(rec: Recorder, model: TinyCausalLM, prompt: torch.Tensor, n: int) -> None:
    """Declare the first greedy token to be EOS: generation must stop right after it."""
    first = int(sampling.generate(model, prompt, 1, temperature=0.0).tokens[0, -1])
    out = sampling.generate(model, prompt, n, temperature=0.0, eos_id=first)
    n_new = out.tokens.shape[1] - prompt.shape[1]
    ok = n_new == 1 and bool(out.finished.all()) and int(out.tokens[0, -1]) == first
    rec.check("eos_stops_generation", ok, n_new, 1,
              f"with eos_id = the first greedy token ({first}), new tokens generated (max {n})")


def check_top_p_sets(rec: Recorder, probs: torch.Tensor, grid: Sequence[float]) -> None:
    """probs (N,V): the model's next-token distributions at N contexts."""
    total = 0
    for p in grid:
        keep = sampling.top_p_keep_mask(probs, p)
        bad = ref.top_p_violations(probs, p, keep)
        rec.metric("top_p_mean_kept", float(keep.sum(dim=-1).double().mean()), top_p=p)
        total += bad
    rec.check("top_p_smallest_set", total == 0, total, 0,
              f"contexts x p values (N={probs.shape[0]}, p in {list(grid)}) whose kept set is not the smallest set "
              "with cumulative probability >= p")


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
        check_sampled_distribution(rec, "top_k_sampling_matches", logits, ref.reference_top_k_probs(logits, top_k), draws,
                                   alpha, seed + 1, f"top-{top_k} softmax", temperature=1.0, top_k=top_k)
    if top_p is not None:
        check_sampled_distribution(rec, "top_p_sampling_matches", logits, ref.reference_top_p_probs(logits, top_p),
                                   draws, alpha, seed + 2, f"top-p {top_p} nucleus", temperature=1.0, top_p=top_p)
