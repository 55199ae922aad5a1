"""`tfmoe block-stats`: how signals and gradients move through Transformer blocks (course §2.4).

For each variant (default: Pre-Norm ``pre`` vs Post-Norm ``post``) one stack of ``n_layers`` blocks is built
with identical initial weights wherever the variants share parameters, fed the same batch, and for every
layer and stage (input, norm1, attn_out, resid1, norm2, ffn_out, resid2) the activation's mean / std / RMS /
max|x| and the norm of the loss gradient with respect to it are recorded, plus every weight matrix's
gradient norm. A battery of checks proves the block behaves as the course says (shape, position-wise FFN,
per-token normalisation, residual identity, causality, finite statistics in fp16/bf16).

The depth sweep ``tfmoe block-stats -m n_layers=2,6,12,24`` reproduces (or not) Xiong et al. 2020: at
initialisation Post-LN's near-output gradients are large and do not shrink with depth, while Pre-LN's
last-layer gradients shrink like 1/sqrt(L) as the residual stream grows. ``sweep_plots`` draws it.

Variant names: ``<position>[_<norm>][_<ffn>]``, position pre|post, norm ln|rms (default ln),
ffn gelu|swiglu (default gelu); e.g. ``pre``, ``post_rms``, ``pre_rms_swiglu`` (LLaMA's block).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, ListConfig
from rich.table import Table

from tfmoe.components.block import TransformerBlock, make_norm
from tfmoe.components.lm import TransformerStack, xavier_init_
from tfmoe.errors import BadInput
from tfmoe.recorder import Recorder, within
from tfmoe.validate import require_int

STAGES = ("input", "norm1", "attn_out", "resid1", "norm2", "ffn_out", "resid2")
STATS = ("mean", "std", "rms", "max_abs", "grad_norm")
NORM_ALIASES = {"ln": "layernorm", "layernorm": "layernorm", "rms": "rmsnorm", "rmsnorm": "rmsnorm"}
FFN_KINDS = ("gelu", "swiglu")
FFN_OUT_PARAM = {"gelu": "ffn.fc2.weight", "swiglu": "ffn.w2.weight"}  # W^2 of Xiong et al.
INITS = ("xavier", "torch")
LOWP = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


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




def validate(cfg: DictConfig) -> list[Variant]:
    """Check every config key this experiment reads; return the parsed variants."""
    raw = cfg.get("variants")
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, ListConfig | list) or len(raw) == 0:
        raise BadInput(f"variants={raw!r} must be a non-empty list: pass e.g. variants=[pre,post]")
    variants = [parse_variant(v) for v in raw]
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise BadInput(f"variants={names} repeats a name: list each variant once")
    n_layers = cfg.get("n_layers")
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise BadInput(f"n_layers={n_layers!r} must be an integer >= 1: pass e.g. n_layers=6")
    d_model, n_heads = require_int(cfg, "d_model"), require_int(cfg, "n_heads")
    if d_model % n_heads != 0:
        raise BadInput(f"d_model={d_model} is not divisible by n_heads={n_heads}: pick n_heads dividing d_model "
                       f"(e.g. n_heads={max(h for h in range(1, n_heads + 1) if d_model % h == 0)})")
    require_int(cfg, "vocab_size", 2)
    require_int(cfg, "batch_size")
    require_int(cfg, "seq_len", 2)
    eps = cfg.get("eps")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0 or not math.isfinite(eps):
        raise BadInput(f"eps={eps!r} must be a number > 0: pass e.g. eps=1e-5")
    if cfg.get("init") not in INITS:
        raise BadInput(f"init={cfg.get('init')!r} is unknown: use one of {', '.join(INITS)}")
    lowp = cfg.get("lowp_dtypes")
    if not isinstance(lowp, ListConfig | list) or any(str(d) not in LOWP for d in lowp):
        raise BadInput(f"lowp_dtypes={lowp!r} must be a list drawn from {list(LOWP)}: pass e.g. lowp_dtypes=[fp16,bf16]")
    scale = cfg.get("lowp_stress_scale")
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0 or not math.isfinite(scale):
        raise BadInput(f"lowp_stress_scale={scale!r} must be a number > 0: pass e.g. lowp_stress_scale=512")
    return variants


# ---------------------------------------------------------------------------------------------- model
def build_stack(variant: Variant, cfg: DictConfig, causal: bool = True) -> TransformerStack:
    stack = TransformerStack(cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_layers,
                             norm_position=variant.norm_position, norm=variant.norm, ffn=variant.ffn,
                             eps=float(cfg.eps), causal=causal)
    if cfg.init == "xavier":
        xavier_init_(stack)
    return stack


def build_variants(variants: Sequence[Variant], cfg: DictConfig, device: torch.device,
                   dtype: torch.dtype) -> tuple[dict[str, TransformerStack], dict[str, float]]:
    """One stack per variant, each initialised from ``cfg.seed``; every parameter whose name and shape an
    earlier variant already has is copied from it, so shared parameters start identical.
    Returns the stacks and, per variant, the fraction of its parameter elements shared with earlier ones."""
    pool: dict[str, torch.Tensor] = {}
    stacks, shared = {}, {}
    for v in variants:
        torch.manual_seed(cfg.seed)
        stack = build_stack(v, cfg)
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


def make_batch(cfg: DictConfig, device: torch.device, batch_size: int | None = None,
               seq_len: int | None = None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and random next-token targets (B,T), reproducible from ``cfg.seed``."""
    g = torch.Generator().manual_seed(int(cfg.seed) * 1000 + 17 + offset)
    B, T = batch_size or cfg.batch_size, seq_len or cfg.seq_len
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
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
        vals = [row[s] for row in self.activations for s in STATS]
        vals += [row["grad_norm"] for row in self.param_grads]
        return [*vals, self.head_grad_norm, self.loss]


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


# --------------------------------------------------------------------------------------------- checks
@dataclass
class Outcome:
    """A check's result, computed by a pure function and recorded with :meth:`record`."""

    passed: bool
    observed: float
    threshold: float
    detail: str
    evidence: dict[str, torch.Tensor] = field(default_factory=dict)

    def record(self, rec: Recorder, name: str) -> bool:
        return rec.check(name, self.passed, self.observed, self.threshold, self.detail, self.evidence or None)


def dtype_eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _randn(shape: Sequence[int], seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def check_shape_preserved(stack: nn.Module, d_model: int, seed: int = 0,
                          shapes: Sequence[tuple[int, int]] = ((2, 5), (1, 1), (1, 7))) -> Outcome:
    """Every block maps (B,T,D) -> (B,T,D) (every tap too), also for B=1 and T=1."""
    p = next(stack.parameters())
    bad: list[str] = []
    n_tested = 0
    with torch.no_grad():
        for i, (B, T) in enumerate(shapes):
            x = _randn((B, T, d_model), seed + i, p.device, p.dtype)
            for layer, block in enumerate(stack.blocks):
                taps: dict[str, torch.Tensor] = {}
                out = block(x, taps=taps)
                for stage, a in [("output", out), *taps.items()]:
                    n_tested += 1
                    if tuple(a.shape) != (B, T, d_model):
                        bad.append(f"layer {layer} {stage}: {tuple(a.shape)} for input {(B, T, d_model)}")
                if tuple(out.shape) == tuple(x.shape):
                    x = out
    detail = f"{n_tested} (stage, shape) pairs tested over inputs {list(shapes)}"
    if bad:
        detail += "; wrong: " + "; ".join(bad[:3])
    return Outcome(not bad, float(len(bad)), 0.0, detail)


def check_ffn_position_wise(ffn: nn.Module, d_model: int, seq_len: int = 6, seed: int = 0) -> Outcome:
    """Changing token t changes the FFN output at t and nowhere else (t = first, middle, last)."""
    p = next(ffn.parameters())
    x = _randn((2, seq_len, d_model), seed, p.device, p.dtype)
    leak, min_change = 0.0, math.inf
    evidence = {}
    with torch.no_grad():
        y = ffn(x)  # (B,T,D)
        scale = y.abs().max().item()
        for t in sorted({0, seq_len // 2, seq_len - 1}):
            x2 = x.clone()
            x2[:, t] = _randn((2, d_model), seed + 100 + t, p.device, p.dtype)
            y2 = ffn(x2)
            diff = (y2 - y).abs().double()  # (B,T,D)
            others = torch.cat([diff[:, :t], diff[:, t + 1:]], dim=1)
            this_leak = others.max().item() if others.numel() else 0.0
            if this_leak > leak:
                leak, evidence = this_leak, {"x": x, "x_changed": x2, "y": y, "y_changed": y2}
            min_change = min(min_change, diff[:, t].max().item())
    threshold = 8 * dtype_eps(p.dtype) * max(scale, 1e-30)
    changed = min_change > threshold
    passed = within(leak, threshold) and changed
    detail = (f"max change at untouched positions {leak:.3g} (scale {scale:.3g}); smallest change at the "
              f"changed position {min_change:.3g} (must exceed the threshold)")
    return Outcome(passed, leak if changed else math.inf, threshold, detail, {} if passed else evidence)


def check_attention_mixes_tokens(attn: nn.Module, d_model: int, seq_len: int = 6, seed: int = 0) -> Outcome:
    """Attention communicates between tokens: changing token 0 changes the attention output at every later
    position (the counterpart of :func:`check_ffn_position_wise`; a causal attention cannot reach earlier ones)."""
    p = next(attn.parameters())
    x = _randn((2, seq_len, d_model), seed, p.device, p.dtype)
    x2 = x.clone()
    x2[:, 0] = _randn((2, d_model), seed + 100, p.device, p.dtype)
    with torch.no_grad():
        y, y2 = attn(x)[0], attn(x2)[0]  # (B,T,D)
    change = (y2 - y).abs().double().amax(dim=-1)[:, 1:]  # (B,T-1): change at the positions after token 0
    scale = y.abs().max().item()
    threshold = 8 * dtype_eps(p.dtype) * max(scale, 1e-30)
    smallest = change.min().item() if change.numel() else 0.0
    passed = smallest > threshold
    detail = (f"smallest change of the attention output at positions 1..{seq_len - 1} when token 0 changes: "
              f"{smallest:.3g} (must exceed {threshold:.3g}; scale {scale:.3g})")
    evidence = {} if passed else {"x": x, "x_changed": x2, "y": y, "y_changed": y2}
    return Outcome(passed, smallest, threshold, detail, evidence)


def _norm_inputs(kind_seed: int, d_model: int, scale: float, device: torch.device,
                 dtype: torch.dtype) -> torch.Tensor:
    """(3,5,D) tokens with their own offset and spread (so per-token statistics are non-trivial)."""
    z = _randn((3, 5, d_model), kind_seed, device, torch.float64)
    spread = torch.exp(0.5 * _randn((3, 5, 1), kind_seed + 1, device, torch.float64))
    offset = _randn((3, 5, 1), kind_seed + 2, device, torch.float64)
    return ((z * spread + offset) * scale).to(dtype)


def _identity_affine(norm: nn.Module) -> nn.Module:
    """A copy of ``norm`` with gain 1 and bias 0: its output is the normalisation 'before affine'."""
    norm = copy.deepcopy(norm)
    with torch.no_grad():
        for name, p in norm.named_parameters():
            p.fill_(1.0 if name == "weight" else 0.0)
    return norm


def _mean_last(x: torch.Tensor) -> torch.Tensor:
    """Mean over the hidden axis by hand: sum / D (no torch statistics op)."""
    return x.sum(dim=-1) / x.shape[-1]


def _norm_deviation(kind: str, x: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-token deviation of ``y`` from what a normalisation of ``x`` must give (fp64), shape (B,T); every mean
    and variance computed here by hand (sums over the hidden axis / D, biased), none by a torch norm op.
    layernorm: max(|mean(y)|, |std(y) - sqrt(var/(var+eps))|); rmsnorm: |rms(y) - sqrt(ms/(ms+eps))|."""
    x64, y64 = x.double(), y.double()
    if kind == "layernorm":
        var = _mean_last((x64 - _mean_last(x64)[..., None]) ** 2)
        want_std = torch.sqrt(var / (var + eps))
        y_mean = _mean_last(y64)
        y_std = torch.sqrt(_mean_last((y64 - y_mean[..., None]) ** 2))
        return torch.maximum(y_mean.abs(), (y_std - want_std).abs())
    ms = _mean_last(x64 * x64)
    return (torch.sqrt(_mean_last(y64 * y64)) - torch.sqrt(ms / (ms + eps))).abs()


def plain_norm(kind: str, x: torch.Tensor, eps: float) -> torch.Tensor:
    """A plain implementation written here from the definition (sums / D, no torch norm op, so it shares no code
    with LayerNorm32's F.layer_norm), on x upcast to at least fp32 like the module, cast back: the same-dtype
    baseline a norm must match within 2x (FlashAttention's rule)."""
    xu = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if kind == "layernorm":
        centred = xu - _mean_last(xu)[..., None]
        y = centred / torch.sqrt(_mean_last(centred * centred)[..., None] + eps)
    else:
        y = xu / torch.sqrt(_mean_last(xu * xu)[..., None] + eps)
    return y.to(x.dtype)


def check_norm_statistics(kind: str, norm: nn.Module, eps: float, d_model: int,
                          dtypes: Sequence[torch.dtype], scales: Sequence[float],
                          device: torch.device, seed: int = 0) -> Outcome:
    """Before affine, LayerNorm gives per-token mean 0 and std sqrt(var/(var+eps)) (≈1); RMSNorm gives
    per-token RMS sqrt(ms/(ms+eps)) (≈1), the statistics computed by hand in fp64. Tolerance per dtype: 2x the
    deviation of :func:`plain_norm` (the definition written out, upcast like the module) on the same input, at
    least one ulp of the dtype."""
    worst_ratio, worst = -math.inf, (math.nan, math.nan, "")
    evidence: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(dtypes):
        module = _identity_affine(norm).to(device=device, dtype=dtype)
        for j, scale in enumerate(scales):
            x = _norm_inputs(seed + 10 * i + j, d_model, scale, device, dtype)
            with torch.no_grad():
                y = module(x)
                ref = plain_norm(kind, x, eps)
            dev = _norm_deviation(kind, x, y, eps).max().item()
            ref_dev = _norm_deviation(kind, x, ref, eps).max().item()
            tol = max(2 * ref_dev, dtype_eps(dtype)) if math.isfinite(ref_dev) else dtype_eps(dtype)
            ratio = dev / tol if math.isfinite(dev) else math.inf
            if ratio > worst_ratio:
                worst_ratio, worst = ratio, (dev, tol, f"{DTYPE_NAMES.get(dtype, dtype)} scale {scale:g}")
                if not within(dev, tol):
                    evidence = {"x": x, "y": y}
    dev, tol, where = worst
    detail = (f"{kind}: worst per-token deviation {dev:.3g} vs tolerance {tol:.3g} at {where} "
              f"(dtypes {[DTYPE_NAMES.get(d, str(d)) for d in dtypes]}, scales {list(scales)})")
    return Outcome(within(worst_ratio, 1.0), worst_ratio, 1.0, detail + "; observed = deviation / tolerance",
                   evidence)


def check_norm_per_token(norm: nn.Module, d_model: int, device: torch.device, dtype: torch.dtype,
                         seed: int = 0) -> Outcome:
    """Normalisation is over the hidden axis only: a token's output does not change when the other tokens
    (other batch rows, other positions) are changed, nor when it is normalised on its own (B=T=1)."""
    module = copy.deepcopy(norm).to(device=device, dtype=dtype)
    x = _norm_inputs(seed, d_model, 1.0, device, dtype)  # (3,5,D)
    B, T, _ = x.shape
    with torch.no_grad():
        y = module(x)
        x_other = x * 7.0 + 3.0
        x_other[0, 0] = x[0, 0]  # token (0,0) kept, every other token changed
        y_other = module(x_other)
        diff = (y_other[0, 0] - y[0, 0]).abs().max().item()
        for b in range(B):
            for t in range(T):
                alone = module(x[b:b + 1, t:t + 1])  # (1,1,D)
                diff = max(diff, (alone[0, 0] - y[b, t]).abs().double().max().item())
    scale = y.abs().max().item()
    threshold = 4 * dtype_eps(dtype) * max(scale, 1e-30)
    detail = (f"max change of a token's output when other tokens change or it is normalised alone: {diff:.3g} "
              f"(output scale {scale:.3g})")
    passed = within(diff, threshold)
    return Outcome(passed, diff, threshold, detail, {} if passed else {"x": x, "y": y, "y_other": y_other})


def _zero_sublayer(block: TransformerBlock, which: str) -> None:
    """Make the attention or FFN sublayer output exactly 0 by zeroing its output projection."""
    with torch.no_grad():
        if which == "attn":
            block.attn.out.weight.zero_()
            if block.attn.out.bias is not None:
                block.attn.out.bias.zero_()
        else:
            ffn = block.ffn
            last = ffn.fc2 if getattr(ffn, "kind", "gelu") == "gelu" else ffn.w2
            last.weight.zero_()
            if last.bias is not None:
                last.bias.zero_()


def check_residual_identity(block: TransformerBlock, d_model: int, seed: int = 0) -> Outcome:
    """With the sublayer(s) zeroed the residual path carries the input through unchanged.
    Pre-Norm: attention zeroed -> resid1 == input; FFN zeroed -> resid2 == resid1; both -> block == identity.
    Post-Norm (its norms sit on the residual path): attention zeroed -> resid1 == input; FFN zeroed ->
    resid2 == norm1; both -> block == norm2(norm1(input))."""
    p = next(block.parameters())
    x = _randn((2, 5, d_model), seed, p.device, p.dtype) * 3.0 + 1.0
    worst, evidence = 0.0, {}
    pre = block.norm_position == "pre"
    with torch.no_grad():
        for zeroed in (("attn",), ("ffn",), ("attn", "ffn")):
            b = copy.deepcopy(block)
            for which in zeroed:
                _zero_sublayer(b, which)
            taps: dict[str, torch.Tensor] = {}
            out = b(x, taps=taps)
            if zeroed == ("attn",):
                got, want = taps["resid1"], x
            elif zeroed == ("ffn",):
                got, want = taps["resid2"], taps["resid1"] if pre else taps["norm1"]
            else:
                got, want = out, x if pre else b.norm2(b.norm1(x))
            dev = (got - want).abs().double().max().item() if got.shape == want.shape else math.inf
            dev = dev if math.isfinite(dev) else math.inf
            if dev > worst:
                worst, evidence = dev, {"x": x, "got": got, "want": want}
    threshold = dtype_eps(p.dtype) * x.abs().max().item()
    passed = within(worst, threshold)
    detail = (f"{block.norm_position}-norm: max deviation from the residual identity over "
              f"(attn zeroed, ffn zeroed, both zeroed): {worst:.3g}")
    return Outcome(passed, worst, threshold, detail, {} if passed else evidence)


def check_causal_stack(stack: TransformerStack, ids: torch.Tensor) -> Outcome:
    """Changing tokens at positions >= t leaves the logits at positions < t unchanged (t = 1, T/2, T-1),
    through the whole stack; and the logits at t do change (the perturbation is real)."""
    B, T = ids.shape
    vocab = stack.head.out_features
    leak, min_change = 0.0, math.inf
    evidence: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(4242)
    with torch.no_grad():
        logits = stack(ids).double()  # (B,T,V)
        scale = logits.abs().max().item()
        for t in sorted({1, T // 2, T - 1}):
            shift = torch.randint(1, vocab, (B, T - t), generator=g).to(ids.device)
            ids2 = ids.clone()
            ids2[:, t:] = (ids[:, t:] + shift) % vocab
            logits2 = stack(ids2).double()
            this_leak = (logits2[:, :t] - logits[:, :t]).abs().max().item()
            min_change = min(min_change, (logits2[:, t] - logits[:, t]).abs().max().item())
            if not this_leak <= leak:
                leak, evidence = this_leak, {"ids": ids, "ids_changed": ids2}
    p = next(stack.parameters())
    threshold = 8 * dtype_eps(p.dtype) * max(scale, 1e-30)
    changed = min_change > threshold
    passed = within(leak, threshold) and changed
    detail = (f"max change of logits before the changed position: {leak:.3g} (logit scale {scale:.3g}); "
              f"smallest change at the changed position {min_change:.3g}")
    return Outcome(passed, leak if changed else math.inf, threshold, detail, {} if passed else evidence)


def check_stats_finite(stats: Sequence[StackStats], what: str) -> Outcome:
    """Every recorded statistic (activations, gradients, loss) is finite."""
    values = [v for s in stats for v in s.all_values()]
    bad = sum(1 for v in values if not math.isfinite(v))
    return Outcome(bad == 0, float(bad), 0.0, f"{bad} of {len(values)} statistics non-finite ({what})")


# ---------------------------------------------------------------------------------------------- plots
def _figure(n_panels: int, title: str) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * n_panels + 0.6, 3.8), layout="constrained")
    axes = fig.subplots(1, n_panels, sharey=True, squeeze=False)[0]
    fig.suptitle(title)
    return fig, list(axes)


def plot_grad_norm_per_layer(results: dict[str, StackStats]) -> Any:
    fig, axes = _figure(len(results), "gradient norm of each weight matrix per layer (at init)")
    for ax, (name, s) in zip(axes, results.items(), strict=True):
        params = sorted({r["param"] for r in s.param_grads})
        for param in params:
            rows = [r for r in s.param_grads if r["param"] == param]
            ax.plot([r["layer"] for r in rows], [r["grad_norm"] for r in rows], marker="o", ms=3, label=param)
        ax.set_title(name)
        ax.set_xlabel("layer")
        ax.set_yscale("log")
    axes[0].set_ylabel("||dL/dW||")
    axes[-1].legend(fontsize=7)
    return fig


def plot_per_stage(results: dict[str, StackStats], stat: str, title: str) -> Any:
    fig, axes = _figure(len(results), title)
    for ax, (name, s) in zip(axes, results.items(), strict=True):
        for stage in STAGES:
            rows = [r for r in s.activations if r["stage"] == stage]
            ax.plot([r["layer"] for r in rows], [r[stat] for r in rows], marker="o", ms=3, label=stage)
        ax.set_title(name)
        ax.set_xlabel("layer")
        ax.set_yscale("log")
    axes[0].set_ylabel(stat)
    axes[-1].legend(fontsize=7)
    return fig


def _fit_loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return math.nan
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else math.nan


def depth_slopes(df: Any) -> dict[str, float]:
    """From a sweep DataFrame: per variant, the log-log slope of the last layer's ||dL/dW2|| against depth
    (Xiong et al.: about -0.5 for Pre-LN, about 0 for Post-LN)."""
    last = _with_depth(df[df["name"] == "last_layer_grad_norm"], df)
    out = {}
    for variant, g in last.groupby("variant"):
        m = g.groupby("depth")["value"].mean()
        out[str(variant)] = _fit_loglog_slope(list(m.index), list(m.values))
    return out


def _with_depth(rows: Any, df: Any) -> Any:
    """Add a ``depth`` column: the number of layers of each job (max layer index + 1 in its rows)."""
    depth = df[df["layer"].notna()].groupby("job")["layer"].max().astype(int) + 1
    rows = rows.copy()
    rows["depth"] = rows["job"].map(depth)
    return rows


def _per_layer_by_depth(rows: Any, variants: list[str], depths: list[int], color: dict[int, Any], title: str,
                        xlabel: str, ylabel: str, log: bool) -> Any:
    """One panel per variant: the mean value per layer, one line per depth."""
    fig, axes = _figure(len(variants), title)
    for ax, variant in zip(axes, variants, strict=True):
        g = rows[rows["variant"] == variant]
        for depth in depths:
            m = g[g["depth"] == depth].groupby("layer")["value"].mean()
            ax.plot(list(m.index + 1), list(m.values), marker="o", ms=3, color=color[depth], label=f"L={depth}")
        ax.set_title(variant)
        ax.set_xlabel(xlabel)
        if log:
            ax.set_yscale("log")
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(fontsize=7)
    return fig


def sweep_plots(df: Any) -> dict[str, Any]:
    """After ``-m n_layers=...``: per-layer ||dL/dW2|| (pre vs post) across depths, the last layer's
    gradient against depth with a 1/sqrt(L) reference, and the residual stream's std per layer."""
    if "layer" not in df.columns or "variant" not in df.columns:
        return {}
    figs: dict[str, Any] = {}
    w2 = df[(df["name"] == "grad_norm_param") & df["param"].isin(list(FFN_OUT_PARAM.values()))]
    w2 = _with_depth(w2, df)
    variants = [str(v) for v in dict.fromkeys(df["variant"].dropna())]
    depths = sorted(int(d) for d in w2["depth"].dropna().unique())
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    color = {d: cmap(i / max(1, len(depths) - 1)) for i, d in enumerate(depths)}

    figs["sweep_grad_norm_per_layer"] = _per_layer_by_depth(
        w2, variants, depths, color, "||dL/dW2|| per layer at init, across depths (mean over jobs)",
        "layer (1 = nearest the input)", "||dL/dW2||", log=True)

    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(5.5, 4), layout="constrained")
    ax = fig.subplots()
    last = _with_depth(df[df["name"] == "last_layer_grad_norm"], df)
    slopes = depth_slopes(df)
    for variant in variants:
        m = last[last["variant"] == variant].groupby("depth")["value"].mean()
        ax.plot(list(m.index), list(m.values), marker="o", label=f"{variant} (slope {slopes.get(variant, math.nan):.2f})")
    ref = last[last["variant"] == variants[0]].groupby("depth")["value"].mean()
    if len(ref):
        d0, v0 = float(ref.index[0]), float(ref.iloc[0])
        xs = sorted(float(d) for d in ref.index)
        ax.plot(xs, [v0 * math.sqrt(d0 / x) for x in xs], "k--", lw=1, label="1/sqrt(L) reference")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("number of layers L")
    ax.set_ylabel("last layer ||dL/dW2||")
    ax.set_title("Xiong et al. 2020: last-layer gradient vs depth")
    ax.legend(fontsize=8)
    figs["sweep_last_layer_grad_vs_depth"] = fig

    resid = _with_depth(df[df["name"] == "resid_std"], df)
    figs["sweep_std_per_layer"] = _per_layer_by_depth(
        resid, variants, depths, color, "residual stream std per layer at init, across depths", "layer",
        "std of block output", log=False)
    return figs


# ------------------------------------------------------------------------------------------------ run
def stage_rows(s: StackStats, variant: Variant) -> list[list[str]]:
    """One row per (layer, stage), stage names as in metrics.parquet: layer, stage, mean, std, ‖dL/dx‖, and the
    layer's ‖dL/dW2‖ on its first row."""
    rows = []
    for layer in range(len({r["layer"] for r in s.activations})):
        for i, stage in enumerate(STAGES):
            w2 = f"{s.param_grad(layer, FFN_OUT_PARAM[variant.ffn]):.3g}" if i == 0 else ""
            rows.append([str(layer), stage, f"{s.value(layer, stage, 'mean'):.3g}", f"{s.value(layer, stage, 'std'):.3g}",
                         f"{s.value(layer, stage, 'grad_norm'):.3g}", w2])
    return rows


STAGE_COLUMNS = ("layer", "stage", "mean", "std", "‖dL/dx‖", "‖dL/dW2‖")


def _title(name: str, s: StackStats, variant: Variant) -> str:
    return (f"{name}: {variant.norm_position}-norm, {variant.norm}, {variant.ffn} (loss {s.loss:.4f}); the block's "
            f"output is {variant.output_stage}")


def _table(name: str, s: StackStats, variant: Variant) -> Table:
    table = Table(title=_title(name, s, variant))
    for c in STAGE_COLUMNS:
        table.add_column(c, justify="left" if c == "stage" else "right")
    for row in stage_rows(s, variant):
        table.add_row(*row, end_section=row[1] == STAGES[-1])
    return table


def stage_markdown(name: str, s: StackStats, variant: Variant) -> str:
    """The same per-(layer, stage) table as the terminal's, for summary.md."""
    lines = [f"### {_title(name, s, variant)}", "", "| " + " | ".join(STAGE_COLUMNS) + " |",
             "|" + "---|" * len(STAGE_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in stage_rows(s, variant)]
    return "\n".join(lines)


def _record_stats(rec: Recorder, variant: Variant, s: StackStats) -> dict[str, float]:
    for row in s.activations:
        for stat in STATS:
            rec.metric(stat, row[stat], variant=variant.name, layer=row["layer"], stage=row["stage"])
    for row in s.param_grads:
        rec.metric("grad_norm_param", row["grad_norm"], variant=variant.name, layer=row["layer"], param=row["param"])
    n = len(s.activations) // len(STAGES)
    resid = [s.value(layer, variant.output_stage, "std") for layer in range(n)]
    for layer, std in enumerate(resid):
        rec.metric("resid_std", std, variant=variant.name, layer=layer)
    w2 = FFN_OUT_PARAM[variant.ffn]
    summary = {
        "loss": s.loss,
        "grad_norm_head": s.head_grad_norm,
        "last_layer_grad_norm": s.param_grad(n - 1, w2),
        "first_layer_grad_norm": s.param_grad(0, w2),
        "input_std": s.value(0, "input", "std"),
        "resid_std_last": resid[-1],
        "resid_var_slope": residual_var_slope(resid),
    }
    summary["grad_norm_last_over_first"] = summary["last_layer_grad_norm"] / summary["first_layer_grad_norm"]
    for key, value in summary.items():
        rec.metric(key, value, variant=variant.name)
    return summary


def run(cfg: DictConfig, rec: Recorder) -> None:
    variants = validate(cfg)
    device, dtype = rec.device, rec.dtype
    stacks, shared = build_variants(variants, cfg, device, dtype)
    ids, targets = make_batch(cfg, device)
    rec.tensor("input_ids", ids)
    rec.tensor("targets", targets)
    rec.note(f"{len(variants)} variant(s) x {cfg.n_layers} layers, d_model={cfg.d_model}, n_heads={cfg.n_heads}, "
             f"batch {tuple(ids.shape)}, init={cfg.init}, dtype={DTYPE_NAMES.get(dtype, str(dtype))}")

    results: dict[str, StackStats] = {}
    summaries: dict[str, dict[str, float]] = {}
    for v in rec.progress(variants, total=len(variants), description="variants"):
        with rec.stage("forward_backward_stats", variant=v.name):
            s = collect_stats(stacks[v.name], ids, targets)
        results[v.name] = s
        rec.metric("shared_param_fraction", shared[v.name], variant=v.name)
        rec.tensor(f"final_hidden.{v.name}", s.hidden)
        summaries[v.name] = _record_stats(rec, v, s)
        rec.print(_table(v.name, s, v))

    # ---- checks (each has a test in tests/test_block_stats.py that plants a bug and sees it fail)
    seed = int(cfg.seed)
    lowp = [LOWP[str(d)] for d in cfg.lowp_dtypes]
    check_dtypes = list(dict.fromkeys([dtype, *lowp]))
    check_ids, check_targets = make_batch(cfg, device, batch_size=2, seq_len=min(cfg.seq_len, 8), offset=1)
    for v in variants:
        stack = stacks[v.name]
        check_shape_preserved(stack, cfg.d_model, seed).record(rec, f"shape_preserved[{v.name}]")
        check_ffn_position_wise(stack.blocks[0].ffn, cfg.d_model, seed=seed).record(
            rec, f"ffn_position_wise[{v.name}]")
        check_attention_mixes_tokens(stack.blocks[0].attn, cfg.d_model, seed=seed).record(
            rec, f"attention_mixes_tokens[{v.name}]")
        check_residual_identity(stack.blocks[-1], cfg.d_model, seed).record(rec, f"residual_identity[{v.name}]")
        check_causal_stack(stack, check_ids).record(rec, f"causal_stack[{v.name}]")
    for kind in dict.fromkeys(v.norm for v in variants):
        norm = make_norm(kind, cfg.d_model, float(cfg.eps))
        check_norm_statistics(kind, norm, float(cfg.eps), cfg.d_model, check_dtypes,
                              (1e-2, 1.0, float(cfg.lowp_stress_scale)), device, seed).record(
            rec, f"norm_statistics[{kind}]")
        check_norm_per_token(norm, cfg.d_model, device, dtype, seed).record(rec, f"norm_per_token[{kind}]")
    check_stats_finite(list(results.values()), f"main run, {DTYPE_NAMES.get(dtype, dtype)}").record(
        rec, "stats_finite")
    for low in lowp:
        if low == dtype:
            continue
        low_stats = []
        for v in variants:
            low_stack = copy.deepcopy(stacks[v.name]).to(dtype=low)
            for scale in (1.0, float(cfg.lowp_stress_scale)):
                low_stats.append(collect_stats(low_stack, check_ids, check_targets, input_scale=scale))
        check_stats_finite(low_stats, f"{len(variants)} variant(s), input scale 1 and "
                           f"{cfg.lowp_stress_scale:g}, batch {tuple(check_ids.shape)}").record(
            rec, f"stats_finite[{DTYPE_NAMES[low]}]")
    del check_targets

    rec.plot("grad_norm_per_layer", plot_grad_norm_per_layer(results))
    rec.plot("std_per_stage", plot_per_stage(results, "std", "activation std per layer and stage (at init)"))
    rec.plot("act_grad_norm_per_stage",
             plot_per_stage(results, "grad_norm", "||dL/d activation|| per layer and stage (at init)"))
    rec.summary(_summary_markdown(variants, summaries, cfg))
    rec.summary("## Per layer and stage (mean, std and gradient norm of each activation)\n\n"
                + "\n\n".join(stage_markdown(v.name, results[v.name], v) for v in variants))


def _summary_markdown(variants: Sequence[Variant], summaries: dict[str, dict[str, float]],
                      cfg: DictConfig) -> str:
    lines = [f"## block-stats at initialisation, L={cfg.n_layers}", "",
             "| variant | loss | last-layer ‖dL/dW2‖ | first-layer ‖dL/dW2‖ | last/first | input std | "
             "residual std (last) | var slope/layer |",
             "|---|---|---|---|---|---|---|---|"]
    for v in variants:
        s = summaries[v.name]
        lines.append(f"| {v.name} | {s['loss']:.4f} | {s['last_layer_grad_norm']:.4g} | "
                     f"{s['first_layer_grad_norm']:.4g} | {s['grad_norm_last_over_first']:.3g} | "
                     f"{s['input_std']:.3g} | {s['resid_std_last']:.3g} | {s['resid_var_slope']:.3g} |")
    lines += ["", "Xiong et al. 2020 predict, at init: Post-LN's last-layer ‖dL/dW2‖ independent of L; Pre-LN's "
              "shrinking ~1/sqrt(L) as the residual stream's variance grows ~linearly with depth. One run is one "
              "depth: compare depths with `tfmoe block-stats -m n_layers=2,6,12,24` (sweep plots)."]
    return "\n".join(lines)

