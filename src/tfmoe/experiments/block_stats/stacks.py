"""block-stats' subject: the stack variants, building them with shared initial weights, and the statistics of
one forward + backward (every stage's activation and gradient, every weight matrix's gradient).

Variant names: ``<position>[_<norm>][_<ffn>]``, position pre|post, norm ln|rms (default ln),
ffn gelu|swiglu (default gelu); e.g. ``pre``, ``post_rms``, ``pre_rms_swiglu`` (LLaMA's block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tfmoe.components.block import TransformerBlock
from tfmoe.components.lm import TransformerStack, xavier_init_
from tfmoe.contract.errors import BadInput

STAGES = ("input", "norm1", "attn_out", "resid1", "norm2", "ffn_out", "resid2")
STATS = ("mean", "std", "rms", "max_abs", "grad_norm")
NORM_ALIASES = {"ln": "layernorm", "layernorm": "layernorm", "rms": "rmsnorm", "rmsnorm": "rmsnorm"}
FFN_KINDS = ("gelu", "swiglu")
FFN_OUT_PARAM = {"gelu": "ffn.fc2.weight", "swiglu": "ffn.w2.weight"}  # W^2 of Xiong et al.
INITS = ("xavier", "torch")


# ------------------------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    name: str
    norm_position: str  # pre | post
    norm: str  # layernorm | rmsnorm
    ffn: str  # gelu | swiglu

    @property
    def output_stage(self) -> str:
        """The stage a block returns: resid2 for Pre-Norm, norm2 for Post-Norm."""
        return "resid2" if self.norm_position == "pre" else "norm2"


def parse_variant(name: str) -> Variant:
    """'pre' | 'post' [_ln|_rms] [_gelu|_swiglu] -> Variant; BadInput for anything else."""
    parts = str(name).strip().lower().split("_")
    hint = "use <pre|post>[_ln|_rms][_gelu|_swiglu], e.g. variants=[pre,post] or variants=[pre_rms_swiglu]"
    if parts[0] not in ("pre", "post"):
        raise BadInput(f"unknown variant {name!r} (must start with pre or post): {hint}")
    norm, ffn = None, None
    for p in parts[1:]:
        if p in NORM_ALIASES and norm is None:
            norm = NORM_ALIASES[p]
        elif p in FFN_KINDS and ffn is None:
            ffn = p
        else:
            raise BadInput(f"unknown variant {name!r} (part {p!r} is not understood or repeated): {hint}")
    return Variant(str(name), parts[0], norm or "layernorm", ffn or "gelu")


# ---------------------------------------------------------------------------------------------- model
class StackShape(Protocol):
    """What building a stack reads (block_stats.Settings has these)."""

    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    eps: float
    init: str  # xavier | torch


def build_stack(variant: Variant, shape: StackShape, causal: bool = True) -> TransformerStack:
    stack = TransformerStack(shape.vocab_size, shape.d_model, shape.n_heads, shape.n_layers,
                             norm_position=variant.norm_position, norm=variant.norm, ffn=variant.ffn,
                             eps=float(shape.eps), causal=causal)
    if shape.init == "xavier":
        xavier_init_(stack)
    return stack


def build_variants(variants: Sequence[Variant], shape: StackShape, device: torch.device, dtype: torch.dtype,
                   seed: int) -> tuple[dict[str, TransformerStack], dict[str, float]]:
    """One stack per variant, each initialised from ``seed``; every parameter whose name and shape an
    earlier variant already has is copied from it, so shared parameters start identical.
    Returns the stacks and, per variant, the fraction of its parameter elements shared with earlier ones."""
    pool: dict[str, torch.Tensor] = {}
    stacks, shared = {}, {}
    for v in variants:
        torch.manual_seed(seed)
        stack = build_stack(v, shape)
        n_shared = n_total = 0
        with torch.no_grad():
            for name, p in stack.named_parameters():
                n_total += p.numel()
                if name in pool and pool[name].shape == p.shape:
                    p.copy_(pool[name])
                    n_shared += p.numel()
                else:
                    pool[name] = p.detach().clone()
        stacks[v.name] = stack.to(device=device, dtype=dtype)
        shared[v.name] = n_shared / n_total
    return stacks, shared


def make_batch(seed: int, vocab_size: int, batch_size: int, seq_len: int, device: torch.device,
               offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and random next-token targets (B,T), reproducible from ``seed``."""
    g = torch.Generator().manual_seed(int(seed) * 1000 + 17 + offset)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    targets = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    return ids.to(device), targets.to(device)


# ---------------------------------------------------------------------------------------------- stats
@dataclass
class StackStats:
    activations: list[dict[str, Any]]  # layer, stage, mean, std, rms, max_abs, grad_norm
    param_grads: list[dict[str, Any]]  # layer, param, grad_norm
    head_grad_norm: float
    loss: float
    hidden: torch.Tensor  # final hidden states (B,T,D), detached

    def value(self, layer: int, stage: str, stat: str) -> float:
        for row in self.activations:
            if row["layer"] == layer and row["stage"] == stage:
                return row[stat]
        raise KeyError((layer, stage, stat))

    def param_grad(self, layer: int, param: str) -> float:
        for row in self.param_grads:
            if row["layer"] == layer and row["param"] == param:
                return row["grad_norm"]
        raise KeyError((layer, param))

    def all_values(self) -> list[float]:
        return [v for _, v in self.named_values()]

    def named_values(self) -> list[tuple[str, float]]:
        """Every statistic with where it was taken ("std at layer 3, stage resid1"), in forward order: the
        activations' statistics layer by layer, then the weights' gradient norms, the head's and the loss."""
        vals = [(f"{s} at layer {row['layer']}, stage {row['stage']}", row[s]) for row in self.activations
                for s in STATS]
        vals += [(f"grad_norm of {row['param']} at layer {row['layer']}", row["grad_norm"]) for row in self.param_grads]
        return [*vals, ("grad_norm of the head", self.head_grad_norm), ("loss", self.loss)]


def block_weight_grads(block: TransformerBlock) -> list[tuple[str, torch.Tensor]]:
    """(name, grad) of every weight matrix of a block; the fused qkv is split into W_Q, W_K, W_V."""
    out = []
    for name, p in block.named_parameters():
        if p.dim() != 2:
            continue
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if name == "attn.qkv.weight":
            for part, g in zip(("q", "k", "v"), grad.split(block.attn.d_model, dim=0), strict=True):
                out.append((f"attn.{part}.weight", g))
        else:
            out.append((name, grad))
    return out


def collect_stats(stack: TransformerStack, ids: torch.Tensor, targets: torch.Tensor,
                  input_scale: float = 1.0) -> StackStats:
    """One forward + backward of the LM loss; statistics of every stage's activation and gradient."""
    stack.zero_grad(set_to_none=True)
    x = stack.embed(ids) * input_scale  # (B,T,D)
    taps: list[dict[str, torch.Tensor]] = []
    hidden = stack.hidden(x, taps)  # (B,T,D)
    logits = stack.head(hidden)  # (B,T,V)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    for t in taps:
        for a in t.values():
            a.retain_grad()
    loss.backward()
    rows = []
    for layer, t in enumerate(taps):
        for stage in STAGES:
            a = t[stage].detach().double()
            g = t[stage].grad
            rows.append({
                "layer": layer, "stage": stage,
                "mean": a.mean().item(), "std": a.std(correction=0).item(),
                "rms": a.pow(2).mean().sqrt().item(), "max_abs": a.abs().max().item(),
                "grad_norm": float("nan") if g is None else g.double().norm().item(),
            })
    grads = [{"layer": layer, "param": name, "grad_norm": g.double().norm().item()}
             for layer, block in enumerate(stack.blocks) for name, g in block_weight_grads(block)]
    head_grad = stack.head.weight.grad
    stack.zero_grad(set_to_none=True)
    return StackStats(rows, grads, head_grad.double().norm().item(), loss.item(), hidden.detach())


def residual_var_slope(resid_std: Sequence[float]) -> float:
    """Least-squares slope of var(residual stream) against layer index (0 for a single layer)."""
    n = len(resid_std)
    if n < 2:
        return 0.0
    xs = list(range(n))
    ys = [s * s for s in resid_std]
    mx, my = sum(xs) / n, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
