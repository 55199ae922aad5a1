"""Independent references for decoding, written from first principles without :mod:`tfmoe.components.sampling`
(which they judge): greedy decoding by re-running the whole sequence, the smallest-set property of a top-p kept
set, the top-k and nucleus distributions in fp64, and the KV cache's size formula."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Plain greedy decoding: re-run the whole sequence, append the argmax, n times. (B, T0+n)."""
    tokens = prompt
    for _ in range(n):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return tokens


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


def cache_bytes_formula(n_layers: int, B: int, T: int, d_model: int, dtype: torch.dtype) -> int:
    """Keys + values of every layer: 2 · layers · B · T · D · bytes per element."""
    return 2 * n_layers * B * T * d_model * torch.empty(0, dtype=dtype).element_size()
