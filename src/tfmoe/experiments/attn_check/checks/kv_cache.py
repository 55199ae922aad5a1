"""kv_cache: decoding one token at a time with a KVCache reproduces the layer's own full forward."""

from __future__ import annotations

import torch

from tfmoe.adapters import ContractError
from tfmoe.components.attention import KVCache
from tfmoe.components.comparison import compare, max_abs_err
from tfmoe.components.references import visibility
from tfmoe.experiments.attn_check.layer import LayerUnderTest, projection_tensors


def check_kv_cache(layer: LayerUnderTest) -> None:
    """7. decoding one token at a time with a KVCache reproduces the module's OWN full causal forward.

    Tolerance (dtype-aware): both sides are the module at the run's dtype; each may sit up to the dtype rule's
    limit L = 2·err(plain same-dtype) + rounding away from the higher-precision SDPA reference, so
    |incremental - full| <= 2·L. The incremental output vs SDPA is recorded as an extra metric."""
    s, rec = layer.s, layer.rec
    module = layer.module if s.causal else layer.build(causal=True, state=layer.state())
    x = torch.randn(s.B, s.T, s.d_model, device=layer.device).to(layer.dtype)
    mask = visibility(s.T, s.T, True, None, device=layer.device)
    with torch.no_grad():
        full, _ = layer.call(module, x, None, causal=True)
        cache = KVCache()
        steps = [layer.call(module, x[:, t:t + 1], None, causal=True, cache=cache)[0] for t in range(s.T)]  # (B,1,D)
        inc = torch.cat(steps, dim=1)  # (B,T,D)
        ref = layer.reference(x, mask)
        plain = layer.plain(x, mask)
    if inc.shape != full.shape:
        raise ContractError(f"incremental output {tuple(inc.shape)} != full forward {tuple(full.shape)}")
    tag = str(layer.dtype).removeprefix("torch.")
    c_full = compare(full, ref, plain, layer.dtype)  # the full forward's own noise budget at this dtype
    c_sdpa = compare(inc, ref, plain, layer.dtype)  # extra: incremental vs SDPA
    err = max_abs_err(inc, full)
    limit = 2.0 * c_full.threshold
    rec.metric("max_abs_err", err, comparison="kv_cache_vs_full_forward", dtype=tag)
    rec.metric("threshold", limit, comparison="kv_cache_vs_full_forward", dtype=tag)
    rec.metric("max_abs_err", c_sdpa.err, comparison="kv_cache_vs_sdpa", dtype=tag)
    rec.metric("max_rel_err", c_sdpa.rel_err, comparison="kv_cache_vs_sdpa", dtype=tag)
    rec.metric("threshold", c_sdpa.threshold, comparison="kv_cache_vs_sdpa", dtype=tag)
    if not c_full.passed and err > limit:
        rec.note(f"kv_cache_decode not judged: the module's full causal forward is off SDPA by {c_full.err:.3g} "
                 f"(limit {c_full.threshold:.3g}; incremental decode vs SDPA {c_sdpa.err:.3g}), so the two "
                 f"disagree ({err:.3g}) for a reason outside the cache (sdpa_match / the mask checks judge the "
                 "forward): fix those first")
        return
    blame = "" if c_full.passed else (
        f"; the full causal forward itself is off SDPA by {c_full.err:.3g} (limit {c_full.threshold:.3g}) but the "
        "cache reproduces it")
    rec.check_le("kv_cache_decode", err, limit,
                 f"{s.T} one-token steps with a KVCache vs the module's own full causal forward: max abs diff "
                 f"{err:.3g} (limit 2·(2·plain {tag} {c_full.plain_err:.3g} + {c_full.atol:.2g}) = {limit:.3g}); "
                 f"extra: incremental vs SDPA {c_sdpa.err:.3g} (dtype-rule limit {c_sdpa.threshold:.3g})" + blame,
                 evidence={"x": x, "incremental": inc, "full": full, **projection_tensors(layer.proj())})

