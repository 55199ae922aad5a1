"""block-stats' checks: each a pure function returning an :class:`Outcome`; each has a test in
tests/test_block_stats.py that plants a bug and sees it fail.

- the block's data flow: shape preserved, FFN position-wise, attention mixes tokens, residual identity, causal stack;
- normalisation: per-token statistics against :mod:`tfmoe.components.norm_reference` (written from the definition,
  sharing no code with the norms judged), normalisation over the hidden axis only;
- finite statistics (also in fp16/bf16).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from tfmoe.components.block import TransformerBlock
from tfmoe.components.lm import TransformerStack
from tfmoe.components.norm_reference import norm_deviation, plain_norm
from tfmoe.contract.recorder import Recorder, within
from tfmoe.experiments.block_stats.stacks import StackStats

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


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


# ----------------------------------------------------------------------------------- the block's data flow
def _leak_outcome(leak: float, min_change: float, scale: float, dtype: torch.dtype, detail: str,
                  evidence: dict[str, torch.Tensor]) -> Outcome:
    """A perturbation check's verdict: what must not change moved by at most 8 ulps of the output ``scale``
    (``leak``), and what must change moved by more (``min_change``; else observed is inf: no real perturbation)."""
    threshold = 8 * dtype_eps(dtype) * max(scale, 1e-30)
    changed = min_change > threshold
    passed = within(leak, threshold) and changed
    return Outcome(passed, leak if changed else math.inf, threshold, detail, {} if passed else evidence)


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
    detail = (f"max change at untouched positions {leak:.3g} (scale {scale:.3g}); smallest change at the "
              f"changed position {min_change:.3g} (must exceed the threshold)")
    return _leak_outcome(leak, min_change, scale, p.dtype, detail, evidence)


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
    detail = (f"max change of logits before the changed position: {leak:.3g} (logit scale {scale:.3g}); "
              f"smallest change at the changed position {min_change:.3g}")
    return _leak_outcome(leak, min_change, scale, next(stack.parameters()).dtype, detail, evidence)


# ------------------------------------------------------------------------------------------ normalisation
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
            dev = norm_deviation(kind, x, y, eps).max().item()
            ref_dev = norm_deviation(kind, x, ref, eps).max().item()
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


# ------------------------------------------------------------------------------------------ finite statistics
def check_stats_finite(stats: Sequence[StackStats], what: str) -> Outcome:
    """Every recorded statistic (activations, gradients, loss) is finite."""
    values = [(i, label, v) for i, s in enumerate(stats) for label, v in s.named_values()]
    bad = [(i, label, v) for i, label, v in values if not math.isfinite(v)]
    first = (f"; first non-finite: {bad[0][1]} = {bad[0][2]}" + (f" (stack {bad[0][0]} of {len(stats)})"
                                                                  if len(stats) > 1 else "")) if bad else ""
    return Outcome(not bad, float(len(bad)), 0.0, f"{len(bad)} of {len(values)} statistics non-finite ({what}){first}")
