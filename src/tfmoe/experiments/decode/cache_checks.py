"""decode's KV-cache checks: one parallel forward's logits = incremental (cached) decoding's, step by step; cached
and uncached greedy decoding agree (tokens identical, logits within a dtype-relative tolerance); the cache's bytes
match 2·layers·B·T·D·bytes. And the measured time per generated token as the sequence grows (recorded, not judged)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tfmoe.components import sampling
from tfmoe.components.attention import KVCache
from tfmoe.components.lm import TinyCausalLM
from tfmoe.components.sampling_reference import cache_bytes_formula
from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.decode.sampling_checks import mismatches

if TYPE_CHECKING:
    from tfmoe.experiments.decode.settings import Settings


def logit_tol(s: Settings, dtype: torch.dtype, logits: torch.Tensor) -> float:
    """Tolerance for two computations of the same logits: logit_tol_eps · eps(dtype) · max(1, max|logit|)."""
    return s.logit_tol_eps * float(torch.finfo(dtype).eps) * max(1.0, float(logits.detach().abs().max()))


def low_precision_tol(s: Settings, model: TinyCausalLM, ref32: TinyCausalLM, seq: torch.Tensor) -> float:
    """fp16/bf16 tolerance: 2x the error of the same-dtype plain forward against the fp32 model, floored at
    the fp32 tolerance (so two low-precision paths may differ as much as low precision itself does)."""
    with torch.no_grad():
        ref = ref32(seq).double()
        err = float((model(seq).double() - ref).abs().max())
    return max(2 * err, logit_tol(s, torch.float32, ref))


def incremental_logits(model: TinyCausalLM, seq: torch.Tensor) -> torch.Tensor:
    """Serial inference: feed seq (1,T) one token at a time through the KV cache; logits (1,T,V)."""
    caches = model.new_caches()
    with torch.no_grad():
        steps = [model(seq[:, t: t + 1], caches=caches)[:, -1] for t in range(seq.shape[1])]
    return torch.stack(steps, dim=1)


def check_parallel_vs_serial(rec: Recorder, model: TinyCausalLM, seq: torch.Tensor, s: Settings,
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


def check_kv_cache(rec: Recorder, model: TinyCausalLM, prompt: torch.Tensor, n: int, s: Settings,
                   dtype: torch.dtype, tol: float | None = None) -> tuple[sampling.Generation, sampling.Generation]:
    cached = sampling.generate(model, prompt, n, temperature=0.0, use_cache=True)
    plain = sampling.generate(model, prompt, n, temperature=0.0, use_cache=False)
    wrong = mismatches(cached.tokens, plain.tokens)
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


def time_decode_steps(rec: Recorder, model: TinyCausalLM, stream: torch.Tensor, lengths: Sequence[int],
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
