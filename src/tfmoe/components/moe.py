"""Mixture-of-Experts routing and dispatch in plain PyTorch (course §2.6).

Router: logits = x W_g, computed in fp32; scores = softmax(logits), or sigmoid(logits) as in DeepSeek-V3;
top-k on the scores (plus a selection-only bias for aux-loss-free balancing); the chosen scores become the
combine weights, renormalised to sum to 1 when k > 1 (Mixtral, DeepSeek-V3). At k = 1 the weight is the chosen
score itself, as in Switch Transformer (Fedus et al. 2021: the expert's output is gated by its router
probability): renormalising one weight makes it exactly 1, and the task loss then gives the router no gradient.

Capacity: C = ceil(tokens * k / n_experts * capacity_factor) assignments per expert; ``None`` = dropless.
Overflow assignments are dropped in a fixed priority order: every token's 1st choice in token order, then
every 2nd choice in token order, ... (GShard / Switch). A dropped assignment contributes 0 to the expert
mixture; the layer adds the residual (out = x + mixture), so a token whose every assignment is dropped
comes out equal to its input.

Dispatch, two ways with the same arithmetic order on CPU (so the outputs agree to the last bit):
  loop   - the course's teaching loop: for each expert, torch.where(topk_idx == e) -> gather -> FFN -> index_add_
  sorted - sort-based dispatch: a stable argsort of the assignments by expert, bincount -> offsets, then a Python
           loop of dense per-expert FFN calls, one contiguous slice of the sorted order each, index_add_ back (no
           block-sparse kernel or grouped GEMM as in MegaBlocks: the same per-expert matmuls as the loop).

Balancing: Switch aux loss, ST-MoE router z-loss, noisy top-k (Shazeer et al. 2017) and the aux-loss-free
per-expert selection bias (Wang et al. 2024, DeepSeek-V3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn as nn
import torch.nn.functional as F

from tfmoe.components.block import FeedForward

SCORE_FUNCS = ("softmax", "sigmoid")
STRATEGIES = ("none", "aux_loss", "z_loss", "noisy_topk", "aux_free")
DISPATCHES = ("sorted", "loop")


# ----------------------------------------------------------------------------- router
@dataclass
class Routing:
    """One router decision for N tokens over E experts (k choices each)."""

    logits: torch.Tensor  # (N,E) fp32, noise included for noisy top-k in training
    scores: torch.Tensor  # (N,E) softmax probabilities or sigmoid affinities
    probs: torch.Tensor  # (N,E) scores normalised to sum 1 over experts (= scores for softmax)
    topk_idx: torch.Tensor  # (N,k) int64, chosen experts, best first
    topk_weight: torch.Tensor  # (N,k) fp32 combine weights: chosen scores, renormalised to sum 1 when renormalised


class Router(nn.Module):
    """x (N,D) -> Routing. ``noisy``: H = xW_g + N(0,1)·softplus(xW_noise), in training mode only.
    ``selection_bias`` (E,) is a buffer (not trained by gradients) added to the scores for choosing
    experts only; the combine weights use the unbiased scores. ``renormalize``: divide the k chosen scores by
    their sum; None (default) = only when k > 1 (at k = 1 Switch gates by the raw probability)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, score_func: str = "softmax",
                 noisy: bool = False, renormalize: bool | None = None):
        super().__init__()
        if n_experts < 1:
            raise ValueError(f"n_experts={n_experts} must be >= 1")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"unknown score_func {score_func!r}: choose one of {SCORE_FUNCS}")
        self.n_experts, self.top_k, self.score_func = n_experts, top_k, score_func
        self.renormalize = top_k > 1 if renormalize is None else bool(renormalize)
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.noise_gate = nn.Linear(d_model, n_experts, bias=False) if noisy else None
        if noisy:
            nn.init.zeros_(self.noise_gate.weight)  # noise std starts at softplus(0) = 0.69
        self.register_buffer("selection_bias", torch.zeros(n_experts))

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> Routing:
        x32 = x.float()
        logits = F.linear(x32, self.gate.weight.float())  # (N,E)
        if self.noise_gate is not None and self.training:
            noise_std = F.softplus(F.linear(x32, self.noise_gate.weight.float()))  # (N,E)
            noise = torch.randn(logits.shape, generator=generator, device=logits.device)
            logits = logits + noise * noise_std
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        _, topk_idx = torch.topk(scores.detach() + self.selection_bias, self.top_k, dim=-1)  # (N,k)
        chosen = scores.gather(-1, topk_idx)  # (N,k), gradients flow through the unbiased scores
        topk_weight = chosen / chosen.sum(dim=-1, keepdim=True) if self.renormalize else chosen
        return Routing(logits, scores, probs, topk_idx, topk_weight)


# ------------------------------------------------------------------------ load statistics
def expert_load(topk_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(N,k) -> (E,) int64: assignments routed to each expert, before capacity. Sums to N*k."""
    return torch.bincount(topk_idx.reshape(-1), minlength=n_experts)


def load_cv(load: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation std/mean of the per-expert loads (population std: the E experts are the
    whole population), float64 scalar."""
    load = load.double()
    return load.std(unbiased=False) / load.mean()


def load_maxvio(load: torch.Tensor) -> torch.Tensor:
    """MaxVio = (max load - mean load) / mean load, float64 scalar (0 when perfectly balanced)."""
    load = load.double()
    mean = load.mean()
    return (load.max() - mean) / mean


def router_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the router distribution's entropy -sum p log p (nats); log E when uniform."""
    return -torch.xlogy(probs, probs).sum(dim=-1).mean()


# ------------------------------------------------------------------------------ capacity
def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float | None) -> int | None:
    """ceil(tokens * k / E * capacity_factor), in exact rational arithmetic (1.2 * 25 is 30, not
    30.000000000000004 -> 31). ``None`` capacity_factor -> None (dropless)."""
    if capacity_factor is None:
        return None
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None for dropless)")
    exact = Fraction(tokens * top_k, n_experts) * Fraction(repr(float(capacity_factor)))
    return math.ceil(exact)


def capacity_keep(topk_idx: torch.Tensor, n_experts: int, capacity: int | None) -> torch.Tensor:
    """(N,k) bool: which assignments fit in their expert's capacity. Priority: all 1st choices in token
    order, then all 2nd choices, ...; an expert keeps its first ``capacity`` assignments in that order."""
    N, k = topk_idx.shape
    if capacity is None:
        return torch.ones(N, k, dtype=torch.bool, device=topk_idx.device)
    flat = topk_idx.t().reshape(-1)  # (k*N,) in priority order
    order = torch.argsort(flat, stable=True)  # grouped by expert, priority order kept within a group
    counts = torch.bincount(flat, minlength=n_experts)  # (E,)
    starts = counts.cumsum(0) - counts  # (E,) first slot of each group
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]  # queue position
    return (position < capacity).view(k, N).t()  # (N,k)


# ------------------------------------------------------------------------------ dispatch
def dispatch_loop(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, keep: torch.Tensor,
                  experts: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
    """The course's loop: x (N,D) -> out (N,D) = sum over kept assignments of weight * expert(x).
    Also returns the rows each expert processed (E,) int64."""
    out = torch.zeros_like(x)
    processed = []
    for e, expert in enumerate(experts):
        tok, slot = torch.where((topk_idx == e) & keep)  # tokens (ascending) routed to e, and which choice
        processed.append(tok.numel())
        if tok.numel() == 0:
            continue
        y = expert(x[tok]) * topk_weight[tok, slot, None]  # (n_e,D)
        out.index_add_(0, tok, y)
    return out, torch.tensor(processed, dtype=torch.long)


def dispatch_sorted(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, keep: torch.Tensor,
                    experts: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort-based dispatch: sort the kept assignments by expert (stable argsort), bincount -> offsets, then loop over
    the experts, each a dense FFN call on its one contiguous slice of the sorted order, scattered back with
    index_add_ (no block-sparse grouped GEMM as in MegaBlocks). Same contract as
    :func:`dispatch_loop`. Each slice is gathered and scattered on its own: on a CPU that keeps the
    (n_e,D) working set in cache, which beat one (N*k,D) gather + one scatter by ~20% at E=64, N=16k."""
    N, k = topk_idx.shape
    flat_expert = topk_idx.reshape(-1)  # (N*k,) token-major
    flat_token = torch.arange(N, device=x.device).repeat_interleave(k)  # (N*k,)
    flat_weight = topk_weight.reshape(-1)  # (N*k,)
    kept = keep.reshape(-1)
    flat_expert, flat_token, flat_weight = flat_expert[kept], flat_token[kept], flat_weight[kept]  # (M,)
    order = torch.argsort(flat_expert, stable=True)  # tokens stay ascending within each expert
    token_sorted, weight_sorted = flat_token[order], flat_weight[order]  # (M,)
    counts = torch.bincount(flat_expert, minlength=len(experts))  # (E,)
    ends = counts.cumsum(0).tolist()  # offsets; one host sync for all of them
    out = torch.zeros_like(x)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            tok = token_sorted[start:end]  # (n_e,)
            y = experts[e](x[tok])  # (n_e,D)
            y.mul_(weight_sorted[start:end, None])
            out.index_add_(0, tok, y)
        start = end
    return out, counts.cpu()


DISPATCH = {"loop": dispatch_loop, "sorted": dispatch_sorted}


# ------------------------------------------------------------------------ balancing losses
def switch_aux_loss(probs: torch.Tensor, topk_idx: torch.Tensor, coef: float = 0.01) -> torch.Tensor:
    """Switch Transformer load-balancing loss  coef * E * sum_i f_i * P_i.

    f_i = load_i / (N*k): the fraction of routed assignments (before capacity) going to expert i, so
    sum_i f_i = 1; P_i = mean router probability of expert i. Under perfectly uniform routing the value
    is exactly ``coef`` (Megatron-LM's normalisation). HF's Mixtral form uses f_i = load_i / N (sums to k),
    so its balanced value is k * coef. f carries no gradient; P does."""
    N, E = probs.shape
    k = topk_idx.shape[1]
    f = expert_load(topk_idx, E).to(probs.dtype) / (N * k)  # (E,)
    P = probs.mean(dim=0)  # (E,)
    return coef * E * (f * P).sum()


def router_z_loss(logits: torch.Tensor, coef: float = 1e-3) -> torch.Tensor:
    """ST-MoE router z-loss: coef * mean over tokens of logsumexp(logits)^2."""
    return coef * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


@torch.no_grad()
def update_selection_bias(bias: torch.Tensor, load: torch.Tensor, rate: float = 1e-3) -> None:
    """Aux-loss-free balancing, after each batch: b_i += rate * sign(mean load - load_i) (in place)."""
    load = load.to(bias.device, torch.float32)
    bias.add_(rate * torch.sign(load.mean() - load))


# ----------------------------------------------------------------------------- the layer
@dataclass
class MoEOutput:
    out: torch.Tensor  # (..., D) x + mixture (residual=True) or the mixture alone (residual=False)
    mixture: torch.Tensor  # (..., D) weighted sum of kept expert outputs (0 for fully dropped tokens)
    routing: Routing
    keep: torch.Tensor  # (N,k) bool, assignments that fit the capacity
    processed: torch.Tensor  # (E,) int64, rows each expert actually ran on
    capacity: int | None


class MoELayer(nn.Module):
    """Router + E GELU FFN experts (d -> d_hidden -> d, no bias) + residual:
    out = x + sum_k w_k * expert_k(x) over the kept assignments, so a token whose assignments were all
    dropped by the capacity limit passes through unchanged (out == x exactly). ``residual=False`` returns
    the mixture alone (for a caller that adds its own residual); ``MoEOutput.mixture`` always holds it."""

    def __init__(self, d_model: int, d_hidden: int, n_experts: int, top_k: int,
                 capacity_factor: float | None = None, score_func: str = "softmax", noisy: bool = False,
                 dispatch: str = "sorted", residual: bool = True, renormalize: bool | None = None):
        super().__init__()
        if dispatch not in DISPATCH:
            raise ValueError(f"unknown dispatch {dispatch!r}: choose one of {DISPATCHES}")
        self.router = Router(d_model, n_experts, top_k, score_func, noisy, renormalize)
        self.experts = nn.ModuleList(FeedForward(d_model, d_hidden, "gelu", bias=False) for _ in range(n_experts))
        self.capacity_factor, self.dispatch, self.residual = capacity_factor, dispatch, residual
        self.n_experts, self.top_k = n_experts, top_k

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None,
                dispatch: str | None = None) -> MoEOutput:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N,D)
        routing = self.router(x2, generator)
        capacity = expert_capacity(x2.shape[0], self.top_k, self.n_experts, self.capacity_factor)
        keep = capacity_keep(routing.topk_idx, self.n_experts, capacity)
        fn = DISPATCH[dispatch or self.dispatch]
        mixture, processed = fn(x2, routing.topk_idx, routing.topk_weight.to(x.dtype), keep, self.experts)
        mixture = mixture.view(shape)  # (..., D)
        out = x + mixture if self.residual else mixture
        return MoEOutput(out, mixture, routing, keep, processed, capacity)
