"""tfmoe attn-check — course §2.2: does a multi-head attention module compute softmax(q kᵀ/√Dh) v, exactly as
PyTorch's scaled_dot_product_attention does, with its masks, in every dtype, with and without a KV cache?

The battery runs on the course's module, on any class with the course's interface (``impl=pkg.mod:Class``),
or on any layer an adapter can drive (``impl=torch:mha``, ``impl=hf:<model_type>``, or a user's
``AttentionAdapter``; see ``tfmoe.adapters``). Every check compares the layer with an independent reference
built from the layer's *own* weights (``tfmoe.components.references``: its own masks, head split, RoPE and kv-head
mapping, then PyTorch's SDPA) at a higher precision (fp64 for fp32/fp64 runs, fp32 for fp16/bf16); never with
the helpers the layer under test calls. Tolerances follow FlashAttention's rule: error(layer vs reference) <=
2 x error(a plain PyTorch implementation in the same dtype vs reference) + 2 x the dtype's rounding at the
output's scale.

Each check judges one family (shapes, masks, sdpa, fully_masked, gradients, kv_cache, chunked, invariances,
dropout); a check whose measurement needs another family to be right first (e.g. gradients vs the reference's
need a forward that matches it) is not judged when that prerequisite fails, and a note says which check to fix.

Fully masked query rows (a query that sees no key, e.g. a row of all padding) have no defined output.
Policy (key ``fully_masked_policy``, default ``finite``): they are excluded from every comparison, and
``fully_masked_rows`` judges only what they do: finite values there and in the gradients of a loss over the other
rows (or the declared policy: zeros, nan, mean_of_v, any).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from tfmoe.adapters import AttentionAdapter, ContractError, load_adapter
from tfmoe.components.attention import KVCache
from tfmoe.components.chunked_attention import naive_attention, naive_attention_bytes
from tfmoe.components.references import (
    Projections,
    attention_weights,
    fused_projections,
    lengths_to_key_padding,
    output,
    plain_attention,
    project,
    rows_with_a_key,
    sdpa_attention,
    visibility,
)
from tfmoe.errors import BadInput
from tfmoe.memory import available_memory_bytes, peak_memory_bytes
from tfmoe.recorder import Recorder
from tfmoe.validate import require_int

MODES = ("full", "chunked")
FULLY_MASKED_POLICIES = ("finite", "zeros", "nan", "mean_of_v", "any")
GROUPS = ("masks", "sdpa", "fully_masked", "gradients", "kv_cache", "chunked", "invariances", "dropout")
X_SCALE_OTHER_ROWS = 10.0  # batch-independence probe: the other rows are redrawn at 10x the scale
# Backward rule: a fused kernel's gradients (PyTorch's own SDPA backward, via nn.MultiheadAttention or HF's sdpa)
# reach 2.1-2.6x a plain autograd composition's error on these tiny cases (30 seeds, experiments/attn-check.md),
# so gradients get 4x where outputs get FlashAttention's 2x.
GRAD_FACTOR = 4.0


# ============================================================================================ settings
@dataclass
class Settings:
    impl: str
    B: int
    T: int
    d_model: int
    n_heads: int
    causal: bool
    lengths: list[int]
    dropout: float
    mode: str
    head_counts: list[int]
    gradcheck_T: int
    dropout_samples: int
    chunked_impl: str
    block_size: int
    probe_T: int
    probe_heads: int
    probe_d_head: int
    probe_block_size: int
    memory_ratio_max: float
    timing_repeats: int
    groups: tuple[str, ...] = GROUPS
    n_kv_heads: int = 0  # 0 -> n_heads
    hf_attn_implementation: str = "eager"
    fully_masked_policy: str = "finite"

    def __post_init__(self) -> None:
        self.n_kv_heads = self.n_kv_heads or self.n_heads

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads




def settings_from_cfg(cfg: DictConfig) -> Settings:
    """Validate the config (BadInput names the problem and the fix)."""
    T = OmegaConf.select(cfg, "T")
    if isinstance(T, int) and not isinstance(T, bool) and T <= 0:
        raise BadInput(f"T={T} must be a positive sequence length: pass T=4 or any T >= 1")
    B, T = require_int(cfg, "B", 1), require_int(cfg, "T", 1)
    d_model, n_heads = require_int(cfg, "d_model", 1), require_int(cfg, "n_heads", 1)
    if d_model % n_heads != 0:
        raise BadInput(f"d_model={d_model} is not divisible by n_heads={n_heads}: every head gets d_model/n_heads "
                       f"dims; pick n_heads among {[h for h in range(1, d_model + 1) if d_model % h == 0]}")
    causal = cfg.get("causal")
    if not isinstance(causal, bool):
        raise BadInput(f"causal={causal!r} is not true/false: pass causal=true or causal=false")
    lengths = cfg.get("lengths")
    if lengths is None:
        lengths = [T] * (B - 1) + [max(1, T - T // 4)]
    else:
        lengths = list(OmegaConf.to_container(lengths)) if OmegaConf.is_list(lengths) else lengths
        if not isinstance(lengths, list) or any(isinstance(n, bool) or not isinstance(n, int) for n in lengths):
            raise BadInput(f"lengths={lengths!r} is not a list of integers: pass e.g. lengths=[{T},{max(1, T - 1)}]")
        if len(lengths) != B:
            raise BadInput(f"lengths has {len(lengths)} entries but B={B}: give one valid length per batch row")
        bad = [n for n in lengths if not 0 <= n <= T]
        if bad:
            raise BadInput(f"lengths {bad} lie outside 0..T={T}: a row cannot hold more than T real tokens")
    dropout = cfg.get("dropout")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= float(dropout) < 1.0:
        raise BadInput(f"dropout={dropout!r} is not a probability in [0, 1): pass e.g. dropout=0.1")
    mode = cfg.get("mode")
    if mode not in MODES:
        raise BadInput(f"mode={mode!r} is unknown: use mode=full or mode=chunked")
    head_counts = cfg.get("head_counts")
    if head_counts is None:
        head_counts = sorted({h for h in (1, n_heads, d_model // 2) if h >= 1 and d_model % h == 0})
    else:
        head_counts = list(OmegaConf.to_container(head_counts)) if OmegaConf.is_list(head_counts) else head_counts
        if (not isinstance(head_counts, list) or not head_counts
                or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 or d_model % h for h in head_counts)):
            raise BadInput(f"head_counts={head_counts!r} must be a list of head counts dividing d_model={d_model}")
    for key in ("impl", "chunked.impl"):
        if not isinstance(OmegaConf.select(cfg, key), str):
            raise BadInput(f"{key} must be a string 'python.module:Name', got {OmegaConf.select(cfg, key)!r}")
    ratio = OmegaConf.select(cfg, "chunked.memory_ratio_max")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio:
        raise BadInput(f"chunked.memory_ratio_max={ratio!r} must be a positive fraction, e.g. 0.1")
    samples = require_int(cfg, "dropout_samples", 1000)
    n_kv = OmegaConf.select(cfg, "n_kv_heads")
    if n_kv is not None:
        n_kv = require_int(cfg, "n_kv_heads", 1)
        if n_heads % n_kv:
            raise BadInput(f"n_kv_heads={n_kv} does not divide n_heads={n_heads}: each kv head serves n_heads/n_kv_heads "
                           f"query heads; pick among {[h for h in range(1, n_heads + 1) if n_heads % h == 0]}")
    policy = OmegaConf.select(cfg, "fully_masked_policy", default="finite")
    if isinstance(policy, float) and math.isnan(policy):
        policy = "nan"  # Hydra's grammar reads the bare word nan as a float
    if policy not in FULLY_MASKED_POLICIES:
        raise BadInput(f"fully_masked_policy={policy!r} is unknown: use one of {list(FULLY_MASKED_POLICIES)}")
    hf_impl = OmegaConf.select(cfg, "hf.attn_implementation", default="eager")
    if hf_impl not in ("eager", "sdpa"):
        raise BadInput(f"hf.attn_implementation={hf_impl!r} is not supported: use eager or sdpa")
    groups = cfg.get("checks", "all")
    if groups == "all" or groups is None:
        groups = GROUPS
    else:
        groups = list(OmegaConf.to_container(groups)) if OmegaConf.is_list(groups) else [groups]
        unknown = [g for g in groups if g not in GROUPS]
        if unknown:
            raise BadInput(f"checks={groups} names unknown groups {unknown}: use all or a list from {list(GROUPS)}")
    return Settings(
        impl=cfg.impl, B=B, T=T, d_model=d_model, n_heads=n_heads, causal=causal, lengths=lengths,
        dropout=float(dropout), mode=mode, head_counts=head_counts, gradcheck_T=require_int(cfg, "gradcheck_T", 1),
        dropout_samples=samples, chunked_impl=OmegaConf.select(cfg, "chunked.impl"),
        block_size=require_int(cfg, "chunked.block_size", 1), probe_T=require_int(cfg, "chunked.probe_T", 1),
        probe_heads=require_int(cfg, "chunked.probe_heads", 1), probe_d_head=require_int(cfg, "chunked.probe_d_head", 1),
        probe_block_size=require_int(cfg, "chunked.probe_block_size", 1), memory_ratio_max=float(ratio),
        timing_repeats=require_int(cfg, "chunked.timing_repeats", 1), groups=tuple(groups),
        n_kv_heads=n_kv or 0, hf_attn_implementation=hf_impl, fully_masked_policy=policy,
    )


# ============================================================================= loading the user's code
def load_object(spec: str, what: str) -> Any:
    """'python.module:Name' -> the object (importlib; nothing is instantiated). The current directory is
    importable, as with ``python -m``: a my_attn.py beside the user needs no PYTHONPATH."""
    from tfmoe.experiments.attn_kernels import cwd_importable

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadInput(f"{what}={spec!r} is not 'python.module:Name': write e.g. {what}=mypackage.attn:MyAttention")
    try:
        with cwd_importable():
            module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time error of the user's module is bad input
        raise BadInput(f"{what}={spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}): "
                       "check the module path (the current directory and PYTHONPATH are searched)") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BadInput(f"{what}={spec!r}: module {module_name!r} has no {attr!r}: check the name after ':'")
        obj = getattr(obj, part)
    return obj


ModuleContractError = ContractError  # the layer returned something the protocol does not allow


# ================================================================================== reference maths
def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The independent reference's precision: fp64 for fp32/fp64 runs, fp32 (upcast) for fp16/bf16."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def sdpa_forward(x: torch.Tensor, w_qkv: torch.Tensor, w_out: torch.Tensor, n_heads: int,
                 mask: torch.Tensor | None) -> torch.Tensor:
    """The reference on the course layout's weights (qkv (3D, D), out (D, D)), in x's dtype."""
    return sdpa_attention(x, fused_projections(w_qkv, w_out, n_heads), mask)


COARSER = {torch.float64: (torch.float32, torch.bfloat16, torch.float16),
           torch.float32: (torch.float16, torch.bfloat16), torch.float16: (torch.bfloat16,)}


def max_abs_err(out: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """max |out - ref| over the valid positions (valid (B,T) selects query rows); NaN/inf -> inf."""
    diff = (out.detach().double() - ref.detach().double()).abs()
    if valid is not None:
        diff = diff[valid.to(diff.device)]
    if diff.numel() == 0:
        return 0.0
    if not torch.isfinite(diff).all():
        return math.inf
    return float(diff.max())


def rounding_atol(ref: torch.Tensor, dtype: torch.dtype, valid: torch.Tensor | None = None) -> float:
    """FlashAttention's absolute term: 2·max|(r + 0.3 - 0.3) - r| with r = ref rounded to ``dtype``."""
    r = ref.detach().to(dtype)
    if valid is not None:
        r = r[valid.to(r.device)]
    if r.numel() == 0:
        return 0.0
    return 2.0 * float(((r + 0.3 - 0.3) - r).abs().max().double())


@dataclass
class Comparison:
    """module vs reference, next to a plain same-dtype implementation vs the same reference."""

    err: float
    plain_err: float
    atol: float
    ref_scale: float
    factor: float = 2.0  # FlashAttention's multiple of the plain implementation's error

    @property
    def threshold(self) -> float:
        return self.factor * self.plain_err + self.atol

    @property
    def rel_err(self) -> float:
        return self.err / self.ref_scale if self.ref_scale > 0 else self.err

    @property
    def passed(self) -> bool:
        return math.isfinite(self.err) and self.err <= self.threshold

    @property
    def ratio(self) -> float:
        return self.err / self.threshold if self.threshold > 0 else (0.0 if self.err == 0 else math.inf)


def compare(out: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor, dtype: torch.dtype,
            valid: torch.Tensor | None = None, factor: float = 2.0) -> Comparison:
    """FlashAttention's rule: err(out) <= 2·err(plain) + rounding_atol, errors vs ``ref`` on valid rows."""
    ref_valid = ref.detach().double()
    if valid is not None:
        ref_valid = ref_valid[valid.to(ref_valid.device)]
    scale = float(ref_valid.abs().max()) if ref_valid.numel() else 0.0
    return Comparison(max_abs_err(out, ref, valid), max_abs_err(plain, ref, valid),
                      rounding_atol(ref, dtype, valid), scale, factor)


def precision_diagnosis(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, p: Projections,
                        mask: torch.Tensor | None, valid: torch.Tensor | None, dtype: torch.dtype) -> str:
    """'' or the coarser dtype the layer evidently computes in: its error vs the reference is too large for
    ``dtype``'s rule but within the rule of a plain implementation in that coarser dtype (e.g. a ``.float()``
    softmax in an fp64 run)."""
    for coarse in COARSER.get(dtype, ()):
        plain = plain_attention(x.to(coarse), p.to(coarse), mask)
        if compare(out, ref, plain, coarse, valid).passed:
            return str(coarse).removeprefix("torch.")
    return ""


def row_sum_deviation(weights: torch.Tensor, valid: torch.Tensor) -> float:
    """max |Σ_keys w - 1| over query rows that see at least one key; weights (B,H,T,Tk), valid (B,T)."""
    sums = weights.detach().double().sum(dim=-1)  # (B,H,T)
    dev = (sums - 1.0).abs().permute(0, 2, 1)[valid.to(sums.device)]  # (n_valid, H)
    if dev.numel() == 0:
        return 0.0
    return math.inf if not torch.isfinite(dev).all() else float(dev.max())


def hidden_weight_max(weights: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor) -> float:
    """max |w| over hidden (query, key) pairs of valid query rows; hidden broadcastable to weights."""
    w = weights.detach().double()
    sel = hidden.to(w.device).expand_as(w) & valid.to(w.device)[:, None, :, None]
    picked = w[sel]
    if picked.numel() == 0:
        return 0.0
    return math.inf if not torch.isfinite(picked).all() else float(picked.abs().max())


def classify_rows(rows: torch.Tensor, mean_v_rows: torch.Tensor, dtype: torch.dtype,
                  zero_rows: torch.Tensor | None = None) -> str:
    """How a set of fully masked query outputs behaves: nan | zeros | mean_of_v | other. ``zero_rows``: what a
    zero context gives after the output projection (its bias; 0 when None)."""
    if rows.numel() == 0:
        return "none"
    rows, mean_v_rows = rows.detach().double(), mean_v_rows.detach().double()
    zero = torch.zeros_like(rows) if zero_rows is None else zero_rows.detach().double()
    if not torch.isfinite(rows).all():
        return "nan"
    tol = 8 * torch.finfo(dtype).eps * max(1.0, float(mean_v_rows.abs().max()))
    if float((rows - zero).abs().max()) <= tol:
        return "zeros"
    if float((rows - mean_v_rows).abs().max()) <= tol:
        return "mean_of_v"
    return "other"


# ============================================================================================ memory
def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def refuse_if_too_big(s: Settings, device: torch.device, dtype: torch.dtype) -> None:
    """BadInput before allocating if the naive (B,H,T,T) path cannot fit in the memory available."""
    available = available_memory_bytes(device)
    if s.mode == "full":
        need = naive_attention_bytes(s.B, s.n_heads, s.T, s.T, dtype) * 2  # module + reference side by side
        if need > available:
            raise BadInput(f"the naive attention path needs about {_gib(need)} for B={s.B}, H={s.n_heads}, T={s.T} "
                           f"but {_gib(available)} is available: lower T/B, or check only the chunked path "
                           "with mode=chunked (O(T·block) memory)")
    probe_need = naive_attention_bytes(1, s.probe_heads, s.probe_T, s.probe_T, torch.float32)
    if s.mode == "full" and probe_need > available:
        raise BadInput(f"chunked.probe_T={s.probe_T} needs about {_gib(probe_need)} for the naive side of the memory "
                       f"probe but {_gib(available)} is available: lower chunked.probe_T, or use mode=chunked")


# ============================================================================================ context
@dataclass
class Ctx:
    """Everything the checks share for one run."""

    s: Settings
    rec: Recorder
    adapter: AttentionAdapter
    module: nn.Module
    x: torch.Tensor  # (B,T,D) at the run's dtype
    padding_mask: torch.Tensor  # (B,T) True = real token (all True when nothing is padded)
    mask: torch.Tensor | None  # broadcastable (B|1,1,T,T) True = visible, or None (the reference's own)
    valid: torch.Tensor  # (B,T) queries that see at least one key
    device: torch.device
    dtype: torch.dtype
    chunked_fn: Callable[..., torch.Tensor]
    out: torch.Tensor | None = None
    attn: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def pm_arg(self) -> torch.Tensor | None:
        """What the module gets as padding_mask: None when nothing is padded (the common call)."""
        return None if bool(self.padding_mask.all()) else self.padding_mask

    def build(self, n_heads: int | None = None, causal: bool | None = None, dropout: float | None = None,
              dtype: torch.dtype | None = None, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """A fresh instance of the layer under test (eval mode), optionally with another instance's weights."""
        s = self.s
        h = s.n_heads if n_heads is None else n_heads
        module = self.adapter.build(s.d_model, h, n_kv_heads=s.n_kv_heads if n_heads is None else h,
                                    causal=s.causal if causal is None else causal,
                                    dropout=s.dropout if dropout is None else dropout, seed=None,
                                    dtype=self.dtype if dtype is None else dtype, device=self.device)
        if state is not None:
            module.load_state_dict(state)
        return module

    def call(self, module: nn.Module, x: torch.Tensor, padding_mask: torch.Tensor | None, causal: bool | None = None,
             cache: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.adapter.forward(module, x, padding_mask, causal=self.s.causal if causal is None else causal,
                                    cache=cache)

    def proj(self, module: nn.Module | None = None, n_heads: int | None = None) -> Projections:
        """The layer's projections (detached) as the reference reads them."""
        m = self.module if module is None else module
        h = self.s.n_heads if n_heads is None else n_heads
        params = {k: v.detach() for k, v in self.adapter.parameters(m).items()}
        return self.adapter.projections(params, h, self.s.n_kv_heads if n_heads is None else h)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def reference(self, x: torch.Tensor, mask: torch.Tensor | None, p: Projections | None = None) -> torch.Tensor:
        rd = reference_dtype(self.dtype)
        return sdpa_attention(x.to(rd), (self.proj() if p is None else p).to(rd), mask)

    def plain(self, x: torch.Tensor, mask: torch.Tensor | None, p: Projections | None = None) -> torch.Tensor:
        return plain_attention(x, (self.proj() if p is None else p).to(x.dtype), mask)

    def evidence(self, **more: torch.Tensor) -> dict[str, torch.Tensor]:
        """The failing inputs (saved as failing.<check>.<name> tensors when a check fails)."""
        base: dict[str, Any] = {"x": self.x, "padding_mask": self.padding_mask}
        if self.module is not None:
            base.update(projection_tensors(self.proj()))
        base.update(more)
        return {k: v for k, v in base.items() if isinstance(v, torch.Tensor)}


def projection_tensors(p: Projections) -> dict[str, torch.Tensor]:
    """w_qkv (q, k, v rows stacked), w_out and the biases, as saved in a run."""
    out = {"w_qkv": torch.cat([p.w_q, p.w_k, p.w_v]), "w_out": p.w_o}
    for name in ("b_q", "b_k", "b_v", "b_o"):
        out[name] = getattr(p, name)
    return {k: v for k, v in out.items() if v is not None}


def unmet_prerequisite(ctx: Ctx, fn: Callable[[Ctx], None]) -> str:
    """Why a group cannot judge this module ('' if it can): every group reads the module's output, so a wrong
    output shape stops all but chunked (which reads only the weights); a random eval-mode forward stops all but
    the dropout and chunked groups (dropout_eval_identity names it); wrong-shaped weights stop the mask checks."""
    if fn in (check_shapes, check_chunked):
        return ""
    if ctx.extras.get("bad_output_shape"):
        return f"the module's output has the wrong shape ({ctx.extras['bad_output_shape']}; see shapes)"
    if ctx.extras.get("random_eval_forward") and fn is not check_dropout:
        return (f"the module's eval-mode forward is random (two calls on the same input differ by "
                f"{ctx.extras['random_eval_forward']:.3g}; see dropout_eval_identity)")
    if fn is check_rows_and_masks and ctx.extras.get("bad_weights_shape"):
        return f"the returned weights have the wrong shape ({ctx.extras['bad_weights_shape']}; see shapes)"
    return ""


def guarded(ctx: Ctx, names: list[str], fn: Callable[[Ctx], None]) -> None:
    """Run one group of checks unless a prerequisite fails (then a note says which check to fix first); if the
    module under test raises, its not-yet-recorded checks fail with the error."""
    why = unmet_prerequisite(ctx, fn)
    if why:
        ctx.rec.note(f"{', '.join(names)} not judged: {why}")
        return
    before = {c.check for c in ctx.rec.checks_rows}
    try:
        fn(ctx)
    except (BadInput, KeyboardInterrupt):
        raise
    except Exception as exc:
        detail = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        done = {c.check for c in ctx.rec.checks_rows} - before
        for name in names:
            if name not in done:
                ctx.rec.check(name, False, None, None, detail, evidence=ctx.evidence())
        ctx.rec.note(f"{', '.join(n for n in names if n not in done)}: the module {detail}")


# ============================================================================================= checks
@dataclass
class ShapeRow:
    """One step of the shapes table. ``observed`` None = the module never showed that tensor."""

    step: str
    formula: str
    expected: tuple[int, ...]
    observed: tuple[int, ...] | None
    source: str
    judged: bool  # True: seen in the module under test, so it decides the check; False: derived, shown only


def judge_shapes(rows: list[ShapeRow]) -> tuple[list[str], list[str]]:
    """(wrong, unobserved): observed module shapes that differ from the formula, and judged steps the module
    never showed (a hook that never fired). Derived rows decide nothing."""
    wrong = [f"{r.step}: {r.observed} != {r.expected}" for r in rows
             if r.judged and r.observed is not None and tuple(r.observed) != r.expected]
    unobserved = [r.step for r in rows if r.judged and r.observed is None]
    return wrong, unobserved


def check_shapes(ctx: Ctx) -> None:
    """1. Shapes at every step against the formula, printed like the course's worked example.

    Pass/fail depends only on what the layer under test shows: its input, the output of its fused qkv layer
    (forward hook, when the adapter names one), the weights it returns, the input of its output layer (pre-hook:
    the merged heads) and its output. q/k/v, scores and context live inside forward where no hook reaches: their
    rows are derived from the layer's weights by the checker (marked "derived", never judged). A layer that
    never calls those layers as modules (e.g. it hands their weights to nn.MultiheadAttention) has those rows
    reported as not observed."""
    s = ctx.s
    seen: dict[str, tuple[int, ...]] = {}

    def on_qkv(mod: nn.Module, inputs: Any, output: torch.Tensor) -> None:  # must return None
        seen.setdefault("qkv", tuple(output.shape))

    def on_out(mod: nn.Module, inputs: Any) -> None:
        seen.setdefault("merged", tuple(inputs[0].shape))

    qkv_layer, out_layer = ctx.adapter.hooks(ctx.module)
    hooks = ([qkv_layer.register_forward_hook(on_qkv)] if qkv_layer is not None else []) + (
        [out_layer.register_forward_pre_hook(on_out)] if out_layer is not None else [])
    try:
        with torch.no_grad():
            out, attn = ctx.call(ctx.module, ctx.x, ctx.pm_arg)
    finally:
        for h in hooks:
            h.remove()
    ctx.out, ctx.attn = out, attn
    B, T, D, H, Hkv, Dh = s.B, s.T, s.d_model, s.n_heads, s.n_kv_heads, s.d_head
    if tuple(out.shape) != (B, T, D):
        ctx.extras["bad_output_shape"] = f"{tuple(out.shape)} != {(B, T, D)}"
    if attn is not None and tuple(attn.shape) != (B, H, T, T):
        ctx.extras["bad_weights_shape"] = f"{tuple(attn.shape)} != {(B, H, T, T)}"
    with torch.no_grad():
        again, _ = ctx.call(ctx.module, ctx.x, ctx.pm_arg)
    moved = max_abs_err(again, out) if again.shape == out.shape else math.inf
    if moved > 4 * torch.finfo(out.dtype).eps * max(1.0, float(out.detach().abs().max())):
        ctx.extras["random_eval_forward"] = moved
    rd = reference_dtype(ctx.dtype)
    with torch.no_grad():
        q, k, v = project(ctx.x.to(rd), ctx.proj().to(rd))
        scores = q @ k.transpose(-2, -1)
        context = scores.softmax(-1) @ v
    derived = "derived from the weights (not judged)"
    returns = ctx.adapter.returns_weights
    rows = [
        ShapeRow("x", "(B, T, D)", (B, T, D), tuple(ctx.x.shape), "input", True),
        ShapeRow("qkv = x·W_qkvᵀ", "(B, T, (H+2·Hkv)·Dh)", (B, T, (H + 2 * Hkv) * Dh), seen.get("qkv"),
                 "module: output of its fused qkv layer", True),
        ShapeRow("q, k, v split into heads", "(B, H, T, Dh)", (B, H, T, Dh), tuple(q.shape), derived, False),
        ShapeRow("scores = q·kᵀ/√Dh", "(B, H, T, T)", (B, H, T, T), tuple(scores.shape), derived, False),
        ShapeRow("weights = softmax(scores)", "(B, H, T, T)", (B, H, T, T),
                 None if attn is None else tuple(attn.shape), "module: returned weights", returns),
        ShapeRow("context = weights·v", "(B, H, T, Dh)", (B, H, T, Dh), tuple(context.shape), derived, False),
        ShapeRow("heads merged", "(B, T, H·Dh)", (B, T, H * Dh), seen.get("merged"), "module: input of its output layer",
                 True),
        ShapeRow("output = merged·W_outᵀ", "(B, T, D)", (B, T, D), tuple(out.shape), "module: output", True),
    ]
    wrong, unobserved = judge_shapes(rows)
    table = Table(title=f"attention shapes: B={B}, T={T}, D={D}, H={H} -> Dh=D/H={Dh}"
                        + (f", Hkv={Hkv}" if Hkv != H else ""))
    for col in ("step", "formula", "expected", "observed", "from"):
        table.add_column(col)
    for r in rows:
        ok = r.observed is None or tuple(r.observed) == r.expected
        shown = ("not returned (n/a)" if r.step.startswith("weights") and not returns else
                 "not observed (layer never called)") if r.observed is None else str(r.observed)
        table.add_row(r.step, r.formula, str(r.expected), shown, r.source,
                      style="red" if not ok else ("yellow" if r.observed is None else ("dim" if not r.judged else None)))
    ctx.rec.print(table)
    n_judged = sum(r.judged and r.observed is not None for r in rows)
    ctx.rec.metric("shapes_steps_observed", n_judged)
    detail = "; ".join(wrong) or f"the {n_judged} shapes observed in the module match the formula"
    if unobserved:
        detail += (f"; NOT observed (the module never called the layer, so its shape was not checked): "
                   f"{', '.join(unobserved)}")
        ctx.rec.note(f"shapes: {', '.join(unobserved)} not observed: {ctx.adapter.name} never calls a fused qkv / "
                     "output layer as modules; only its input, returned weights and output shapes were checked")
    if not returns:
        detail += "; weights: the layer returns none (n/a)"
    detail += "; q/k/v, scores, context are derived from the weights (shown, not judged)"
    ctx.rec.check("shapes", not wrong, float(len(wrong)), 0.0, detail, evidence=ctx.evidence(
        out=out, **({} if attn is None else {"attn": attn})))
    for name, t in (("x", ctx.x), ("padding_mask", ctx.padding_mask), *projection_tensors(ctx.proj()).items(),
                    ("attn", attn), ("out", out)):
        if t is not None:
            ctx.rec.tensor(name, t)
    ctx.rec.tensor("lengths", torch.tensor(s.lengths))


def check_rows_and_masks(ctx: Ctx) -> None:
    """2. every row sums to 1; 3. future and padded keys get exactly 0 weight."""
    attn, s = ctx.attn, ctx.s
    if attn is None or tuple(attn.shape) != (s.B, s.n_heads, s.T, s.T):
        raise ModuleContractError(f"attn_weights shape {None if attn is None else tuple(attn.shape)} "
                                  f"is not (B,H,T,T) = {(s.B, s.n_heads, s.T, s.T)}")
    eps = torch.finfo(attn.dtype).eps if attn.is_floating_point() else 0.0
    dev = row_sum_deviation(attn, ctx.valid)
    tol = 4 * eps * (1 + math.log2(s.T))
    ctx.rec.metric("row_sum_max_dev", dev, dtype=str(attn.dtype).removeprefix("torch."))
    cause = ""
    if math.isfinite(dev) and dev > tol:
        for coarse in COARSER.get(attn.dtype, ()):
            if dev <= 4 * torch.finfo(coarse).eps * (1 + math.log2(s.T)):
                cause = (f"; CAUSE: the weights sum to 1 only to {str(coarse).removeprefix('torch.')} precision: the "
                         f"module computes its softmax in {str(coarse).removeprefix('torch.')} (see sdpa_match)")
                break
    ctx.rec.check_le("row_sums", dev, tol, f"max |Σ_k w - 1| over {int(ctx.valid.sum())} query rows x {s.n_heads} heads "
                     f"(rows without a visible key excluded); tolerance 4·eps·(1+log2 T)" + cause,
                     evidence=ctx.evidence(attn=attn))
    if s.causal:
        future = ~torch.ones(s.T, s.T, dtype=torch.bool).tril()  # (T,T) key j > query i
        leak = hidden_weight_max(attn, future[None, None], ctx.valid)
        ctx.rec.metric("future_weight_max", leak)
        ctx.rec.check_le("causal_zero", leak, 0.0, "max |w| on future keys (j > i) must be exactly 0",
                         evidence=ctx.evidence(attn=attn))
    if not bool(ctx.padding_mask.all()):
        padded_keys = (~ctx.padding_mask)[:, None, None, :]  # (B,1,1,T)
        leak = hidden_weight_max(attn, padded_keys, ctx.valid)
        ctx.rec.metric("padded_key_weight_max", leak)
        ctx.rec.check_le("padding_zero", leak, 0.0, "max |w| on padded keys must be exactly 0 "
                         "(padding hides keys; padded queries still attend)", evidence=ctx.evidence(attn=attn))


def _record_comparison(ctx: Ctx, name: str, comparison: str, c: Comparison, detail: str,
                       evidence: dict[str, torch.Tensor]) -> None:
    tag = str(ctx.dtype).removeprefix("torch.")
    ctx.rec.metric("max_abs_err", c.err, comparison=comparison, dtype=tag)
    ctx.rec.metric("max_rel_err", c.rel_err, comparison=comparison, dtype=tag)
    ctx.rec.metric("plain_max_abs_err", c.plain_err, comparison=comparison, dtype=tag)
    ctx.rec.metric("threshold", c.threshold, comparison=comparison, dtype=tag)
    ctx.rec.check(name, c.passed, c.err, c.threshold,
                  f"{detail}; max abs err {c.err:.3g} (rel {c.rel_err:.3g}) vs plain {tag} {c.plain_err:.3g}; "
                  f"threshold 2·plain + {c.atol:.2g}", evidence=evidence)


def _precision_cause(coarse: str, c: Comparison, dtype: torch.dtype) -> str:
    run = str(dtype).removeprefix("torch.")
    return (f"; CAUSE: the module computes in {coarse}, not {run}: its error {c.err:.2g} is {coarse}-sized (within "
            f"a plain {coarse} implementation's limit, {c.err / max(c.threshold, 1e-300):.3g}x the {run} limit); "
            f"cast to the input's dtype (e.g. softmax(..., dtype=torch.promote_types(x.dtype, torch.float32))) "
            f"instead of .float() / a fixed dtype")


def check_sdpa(ctx: Ctx) -> None:
    """4. output == SDPA on the module's own projections, by FlashAttention's dtype rule; outputs finite.
    A failure whose error fits a coarser dtype's rule names that dtype as the cause."""
    with torch.no_grad():
        ref = ctx.reference(ctx.x, ctx.mask)
        plain = ctx.plain(ctx.x, ctx.mask)
        rd = ref.dtype
        ref_w = attention_weights(ctx.x.to(rd), ctx.proj().to(rd), ctx.mask)
    out = ctx.out
    if out is None or out.shape != ref.shape:
        raise ModuleContractError(f"output shape {None if out is None else tuple(out.shape)} != {tuple(ref.shape)}")
    c = compare(out, ref, plain, ctx.dtype, ctx.valid)
    cause = ""
    if not c.passed and math.isfinite(c.err):
        coarse = precision_diagnosis(out, ref, ctx.x.to(rd), ctx.proj(), ctx.mask, ctx.valid, ctx.dtype)
        cause = _precision_cause(coarse, c, ctx.dtype) if coarse else ""
    _record_comparison(ctx, "sdpa_match", "module_vs_sdpa", c,
                       f"module vs SDPA in {str(rd).removeprefix('torch.')} on the module's weights" + cause,
                       ctx.evidence(out=out, ref=ref))
    if ctx.attn is not None and ctx.attn.shape == ref_w.shape:
        valid_w = ctx.valid[:, None, :].expand(-1, ctx.s.n_heads, -1)  # (B,H,T)
        ctx.rec.metric("max_abs_err", max_abs_err(ctx.attn, ref_w, valid_w), comparison="weights_vs_reference",
                       dtype=str(ctx.dtype).removeprefix("torch."))
    ctx.extras["sdpa_ref"] = ref


def _fully_masked_probe(s: Settings) -> torch.Tensor:
    """(2,T) padding mask: row 0 all padding (every query sees nothing); row 1 left-padded when causal (its
    first queries see nothing, the rest do), right-padded otherwise (nothing fully masked there)."""
    pm = torch.ones(2, s.T, dtype=torch.bool)
    pm[0] = False
    half = s.T // 2
    if half:
        if s.causal:
            pm[1, :half] = False
        else:
            pm[1, s.T - half:] = False
    return pm


def _count_nonfinite(t: torch.Tensor | None) -> int:
    return 0 if t is None else int((~torch.isfinite(t.detach())).sum())


def check_fully_masked(ctx: Ctx) -> None:
    """5. fully masked query rows: what the module gives there (nan | zeros | mean_of_v | other), judged against
    ``fully_masked_policy``; the other rows are not re-judged against the reference (sdpa_match does that), only
    kept finite, and so are the gradients of a loss over the other rows (a NaN there reaches every weight)."""
    s, rec = ctx.s, ctx.rec
    policy = s.fully_masked_policy
    pm = _fully_masked_probe(s).to(ctx.device)
    x = torch.randn(2, s.T, s.d_model, device=ctx.device).to(ctx.dtype).requires_grad_(True)
    mask = visibility(s.T, s.T, s.causal, pm, device=ctx.device)
    valid = rows_with_a_key(mask, 2, s.T)  # (2,T)
    n_masked = int((~valid).sum())
    module = ctx.module
    module.zero_grad(set_to_none=True)
    out, _ = ctx.call(module, x, pm)
    g = torch.randn(out.shape, device=ctx.device).to(out.dtype)
    loss = (out * g)[valid.to(ctx.device)].sum()  # only rows with a visible key reach the loss
    loss.backward()
    sel_valid, sel_masked = valid.to(ctx.device), (~valid).to(ctx.device)
    nonfinite_other = _count_nonfinite(out[sel_valid])
    nonfinite_masked = _count_nonfinite(out[sel_masked])
    nonfinite_grads = _count_nonfinite(x.grad) + sum(
        _count_nonfinite(t.grad) for t in ctx.adapter.parameters(module).values())
    with torch.no_grad():
        xd = x.detach()
        ref = ctx.reference(xd, mask)
        rd = ref.dtype
        p = ctx.proj().to(rd)
        _, _, v = project(xd.to(rd), p)
        mean_v = output(v.mean(dim=2, keepdim=True).expand_as(v), p)  # uniform over all keys
        zeros = output(torch.zeros_like(v), p)  # a zero context through the output projection (its bias)
        module_kind = classify_rows(out.detach()[sel_masked], mean_v[sel_masked], ctx.dtype, zeros[sel_masked])
        sdpa_kind = classify_rows(ref[sel_masked], mean_v[sel_masked], rd, zeros[sel_masked])
    rec.metric("fully_masked_query_rows", n_masked)
    rec.metric("fully_masked_nonfinite_values", nonfinite_masked + nonfinite_other + nonfinite_grads)
    rec.note(f"fully masked query rows ({n_masked} in the probe): module -> {module_kind}; "
             f"torch {torch.__version__} SDPA -> {sdpa_kind}. Policy: excluded from every comparison; "
             f"fully_masked_policy={policy}")
    causes = []
    if nonfinite_other:
        causes.append(f"{nonfinite_other} non-finite values in the outputs of rows that DO see a key")
    if policy in ("finite", "zeros", "mean_of_v") and nonfinite_masked:
        causes.append(f"the fully masked rows are {module_kind} ({nonfinite_masked} non-finite values): give them a "
                      "finite value (an additive finfo.min mask, or weights set to 0 where a row sees no key), or "
                      "declare fully_masked_policy=nan")
    if policy in ("zeros", "nan", "mean_of_v") and module_kind != policy and n_masked:
        causes.append(f"the fully masked rows are {module_kind}, the declared policy is {policy}")
    if policy != "nan" and policy != "any" and nonfinite_grads:
        causes.append(f"{nonfinite_grads} non-finite gradient values from a loss over the other rows only "
                      "(the fully masked rows' NaN reaches the backward)")
    bad = nonfinite_other + (nonfinite_masked if policy in ("finite", "zeros", "mean_of_v") else 0) + (
        n_masked if policy in ("zeros", "nan", "mean_of_v") and module_kind != policy else 0) + (
        nonfinite_grads if policy not in ("nan", "any") else 0)
    rec.check("fully_masked_rows", bad == 0, float(bad), 0.0,
              f"{n_masked} fully masked query rows: module gives {module_kind}, SDPA gives {sdpa_kind}; policy "
              f"{policy}; " + ("; ".join(causes) if causes else
                               f"{nonfinite_grads} non-finite gradient values, none in the rows that see a key"),
              evidence={"x": xd, "padding_mask": pm, "out": out.detach(), "ref": ref})
    module.zero_grad(set_to_none=True)


class _Bound(nn.Module):
    """The layer under test as a function of x alone (so torch.func.functional_call can swap its parameters)."""

    def __init__(self, adapter: AttentionAdapter, module: nn.Module, padding_mask: torch.Tensor | None, causal: bool):
        super().__init__()
        self.inner = module
        self._adapter, self._padding_mask, self._causal = adapter, padding_mask, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._adapter.forward(self.inner, x, self._padding_mask, causal=self._causal)[0]


def _functional(ctx: Ctx, module: nn.Module, padding_mask: torch.Tensor | None
                ) -> tuple[Callable[..., torch.Tensor], list[str]]:
    """f(x, *params) through the module's own forward, and the parameter names in that order."""
    names = list(ctx.adapter.parameters(module))
    bound = _Bound(ctx.adapter, module, padding_mask, ctx.s.causal)

    def f(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(bound, {f"inner.{n}": t for n, t in zip(names, tensors, strict=True)}, (x,))
    return f, names


def _reference_fn(ctx: Ctx, names: list[str], mask: torch.Tensor | None,
                  attention: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """f(x, *params) computed by the reference (or the plain yardstick) from the same parameter tensors."""
    s = ctx.s

    def f(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        p = ctx.adapter.projections(dict(zip(names, tensors, strict=True)), s.n_heads, s.n_kv_heads)
        return attention(x, p, mask)
    return f


def check_gradients(ctx: Ctx) -> None:
    """6. torch.autograd.gradcheck in fp64 on a small case (only if the module computes in fp64: a module that
    computes in fp32 internally cannot be judged by fp64 finite differences; a note says so); module gradients vs
    the reference's at the run dtype (only when the module's forward matches the reference on that case: the
    gradients of a different function cannot judge the backward)."""
    s, rec = ctx.s, ctx.rec
    Tg = s.gradcheck_T
    module64 = ctx.build(dtype=torch.float64, state=ctx.state())
    pm_g = lengths_to_key_padding([Tg, max(1, Tg - 1)], Tg, device=ctx.device)
    pm_arg = None if bool(pm_g.all()) else pm_g
    f64, names = _functional(ctx, module64, pm_arg)
    params64 = [t.detach().clone().requires_grad_(True) for t in ctx.adapter.parameters(module64).values()]
    inputs = (torch.randn(2, Tg, s.d_model, dtype=torch.float64, device=ctx.device, requires_grad=True), *params64)
    mask_g = visibility(Tg, Tg, s.causal, pm_arg, device=ctx.device)
    valid_g = rows_with_a_key(mask_g, 2, Tg)
    with torch.no_grad():
        x64 = inputs[0].detach()
        p64 = ctx.adapter.projections(dict(zip(names, (t.detach() for t in params64), strict=True)),
                                      s.n_heads, s.n_kv_heads)
        out64, ref64 = f64(*inputs), sdpa_attention(x64, p64, mask_g)
        c64 = compare(out64, ref64, plain_attention(x64, p64, mask_g), torch.float64, valid_g)
    coarse = "" if c64.passed else precision_diagnosis(out64, ref64, x64, p64, mask_g, valid_g, torch.float64)
    rec.metric("fp64_forward_max_abs_err", c64.err)
    if coarse:
        rec.note(f"gradcheck not run: the module computes in {coarse} when given float64 input (its fp64 output is "
                 f"off the fp64 reference by {c64.err:.2g}, {coarse}-sized), so fp64 finite differences cannot "
                 "judge its gradients; grad_match judges them at the run's dtype"
                 + (" (this fp64 run's sdpa_match names the cause)" if ctx.dtype == torch.float64 else ""))
    else:
        ok = torch.autograd.gradcheck(f64, inputs, eps=1e-6, atol=1e-5, rtol=1e-3, fast_mode=True,
                                      raise_exception=False)
        # A module whose forward is wrong escapes the precision probe above; if its gradients then agree with
        # finite differences at a coarse step, the fine-step failure is rounding (it computes in reduced
        # precision), not a wrong backward: not judged. A wrong backward disagrees at any step.
        coarse_ok = not ok and not c64.passed and torch.autograd.gradcheck(f64, inputs, eps=1e-3, atol=1e-3, rtol=1e-2,
                                                        fast_mode=True, raise_exception=False)
    if not coarse and coarse_ok:
        rec.note("gradcheck not judged: at fp64's finite-difference step (1e-6) the gradients disagree, at a coarse "
                 "step (1e-3) they agree: the module computes in reduced precision (its forward is also off the "
                 "reference, see sdpa_match), so fp64 gradcheck cannot judge its backward")
    elif not coarse:
        rec.check("gradcheck", ok, None, None,
                  f"torch.autograd.gradcheck (fp64, fast_mode) of output w.r.t. x and {', '.join(names)} at B=2, "
                  f"T={Tg}, D={s.d_model}, H={s.n_heads}: {'analytic = numerical' if ok else 'analytic != numerical gradient'}",
                  evidence={"x": x64, "padding_mask": pm_g,
                            **{f"param.{n}": t.detach() for n, t in zip(names, params64, strict=True)}})

    rows_ok = ctx.valid.all(dim=1)  # batch rows without fully masked queries
    if not bool(rows_ok.any()):
        rec.note("grad_match skipped: every batch row has a fully masked query")
        return
    x0 = ctx.x[rows_ok.to(ctx.device)]
    pm0 = ctx.padding_mask[rows_ok.to(ctx.device)]
    pm0_arg = None if bool(pm0.all()) else pm0
    mask0 = visibility(s.T, s.T, s.causal, pm0_arg, device=ctx.device)
    valid0 = rows_with_a_key(mask0, x0.shape[0], s.T)
    f_mod, names = _functional(ctx, ctx.module, pm0_arg)
    params = [t.detach() for t in ctx.adapter.parameters(ctx.module).values()]
    with torch.no_grad():
        c0 = compare(f_mod(x0, *params), ctx.reference(x0, mask0), ctx.plain(x0, mask0), ctx.dtype, valid0)
    if not c0.passed:
        rec.note(f"grad_match not judged: the module's forward is off the reference on its case (err {c0.err:.3g} > "
                 f"limit {c0.threshold:.3g}; sdpa_match judges that), so its gradients cannot be compared with the "
                 "reference's; fix the forward first (gradcheck judges the backward against the module's own forward)")
        return
    g = torch.randn(x0.shape, device=ctx.device)

    def grads(forward: Callable[..., torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor | None]:
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x0, *params)]
        out = forward(*leaves)
        (out * g.to(dtype)).sum().backward()
        return [leaf.grad for leaf in leaves]

    rd = reference_dtype(ctx.dtype)
    ref = grads(_reference_fn(ctx, names, mask0, sdpa_attention), rd)
    plain = grads(_reference_fn(ctx, names, mask0, plain_attention), ctx.dtype)
    mod = grads(f_mod, ctx.dtype)
    worst, parts, evidence = 0.0, [], {"x": x0, "padding_mask": pm0}
    for name, gm, gr, gp in zip(("x", *names), mod, ref, plain, strict=True):
        c = Comparison(math.inf, 0.0, 0.0, 1.0) if gm is None else compare(gm, gr, gp, ctx.dtype, factor=GRAD_FACTOR)
        rec.metric("max_abs_err", c.err, comparison=f"grad_{name}_vs_sdpa", dtype=str(ctx.dtype).removeprefix("torch."))
        rec.metric("plain_max_abs_err", c.plain_err, comparison=f"grad_{name}_vs_sdpa",
                   dtype=str(ctx.dtype).removeprefix("torch."))
        parts.append(f"d{name}: {c.err:.3g} (limit {c.threshold:.3g})")
        worst = max(worst, c.ratio)
        if gm is not None:
            evidence[f"grad_{name}"] = gm
    rec.check_le("grad_match", worst, 1.0, f"max over dx, {', '.join('d' + n for n in names)} of err/limit, "
                 f"limit = {GRAD_FACTOR:g}·plain + rounding: " + "; ".join(parts), evidence=evidence)


def check_kv_cache(ctx: Ctx) -> None:
    """7. decoding one token at a time with a KVCache reproduces the module's OWN full causal forward.

    Tolerance (dtype-aware): both sides are the module at the run's dtype; each may sit up to the dtype rule's
    limit L = 2·err(plain same-dtype) + rounding away from the higher-precision SDPA reference, so
    |incremental - full| <= 2·L. The incremental output vs SDPA is recorded as an extra metric."""
    s, rec = ctx.s, ctx.rec
    module = ctx.module if s.causal else ctx.build(causal=True, state=ctx.state())
    x = torch.randn(s.B, s.T, s.d_model, device=ctx.device).to(ctx.dtype)
    mask = visibility(s.T, s.T, True, None, device=ctx.device)
    with torch.no_grad():
        full, _ = ctx.call(module, x, None, causal=True)
        cache = KVCache()
        steps = [ctx.call(module, x[:, t:t + 1], None, causal=True, cache=cache)[0] for t in range(s.T)]  # (B,1,D)
        inc = torch.cat(steps, dim=1)  # (B,T,D)
        ref = ctx.reference(x, mask)
        plain = ctx.plain(x, mask)
    if inc.shape != full.shape:
        raise ModuleContractError(f"incremental output {tuple(inc.shape)} != full forward {tuple(full.shape)}")
    tag = str(ctx.dtype).removeprefix("torch.")
    c_full = compare(full, ref, plain, ctx.dtype)  # the full forward's own noise budget at this dtype
    c_sdpa = compare(inc, ref, plain, ctx.dtype)  # extra: incremental vs SDPA
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
                 evidence={"x": x, "incremental": inc, "full": full, **projection_tensors(ctx.proj())})


def _probe_qkv(B: int, H: int, T: int, Dh: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cpu").manual_seed(1234)
    return tuple(torch.randn(B, H, T, Dh, generator=gen).to(device=device, dtype=dtype) for _ in range(3))


def chunked_probe(ctx: Ctx, B: int, H: int, T: int, Dh: int, dtype: torch.dtype, block_size: int,
                  measure_naive: bool) -> None:
    """8b. chunked vs SDPA (rel <= 1e-5 in fp32) at a size where memory matters; peak memory and time of
    naive, chunked and SDPA."""
    s, rec = ctx.s, ctx.rec
    q, k, v = _probe_qkv(B, H, T, Dh, ctx.device, dtype)
    causal = s.causal

    def run_chunked() -> torch.Tensor:
        return ctx.chunked_fn(q, k, v, causal=causal, key_padding_mask=None, block_size=block_size)

    def run_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def run_naive() -> torch.Tensor:
        return naive_attention(q, k, v, causal=causal)

    with torch.no_grad():
        out_chunked, out_sdpa = run_chunked(), run_sdpa()
        variants = [("chunked", run_chunked), ("sdpa", run_sdpa)] + ([("naive", run_naive)] if measure_naive else [])
        peaks, times = {}, {}
        for name, fn in variants:
            peaks[name] = peak_memory_bytes(fn, ctx.device)
            times[name] = rec.time(f"attention_{name}", fn, repeats=s.timing_repeats, warmup=1, variant=name, T=T)
            rec.metric("peak_mem_bytes", peaks[name], variant=name, T=T)
            rec.metric("time_ms", times[name], variant=name, T=T)
    naive_bytes = peaks.get("naive") or naive_attention_bytes(B, H, T, T, dtype)
    if not measure_naive:
        rec.note(f"naive peak memory at T={T} is the estimate 3·B·H·T²·4 bytes = {_gib(naive_bytes)} (not run)")
    for name in ("chunked", "naive"):
        if name in times:
            rec.metric("time_ratio_vs_sdpa", times[name] / max(times["sdpa"], 1e-9), variant=name, T=T)
    err = max_abs_err(out_chunked, out_sdpa)
    scale = float(out_sdpa.detach().double().abs().max())
    rel = err / scale if scale > 0 else err
    rec.metric("max_rel_err", rel, comparison=f"chunked_vs_sdpa_T{T}", dtype=str(dtype).removeprefix("torch."))
    rel_limit = 1e-5 if dtype in (torch.float32, torch.float64) else 4 * torch.finfo(dtype).eps
    rec.check_le("chunked_match_large", rel, rel_limit,
                 f"chunked (block {block_size}) vs SDPA at B={B}, H={H}, T={T}, Dh={Dh}, "
                 f"{str(dtype).removeprefix('torch.')}, causal={causal}: max rel err {rel:.3g}",
                 evidence={"q": q, "k": k, "v": v} if q.numel() <= 1_000_000 else None)
    ratio = peaks["chunked"] / max(naive_bytes, 1)
    rec.metric("memory_ratio_chunked_vs_naive", ratio, T=T)
    how = "torch.cuda.max_memory_allocated" if ctx.device.type == "cuda" else "torch.profiler(profile_memory=True)"
    rec.check_le("chunked_memory", ratio, s.memory_ratio_max,
                 f"peak memory ({how}) at T={T}: chunked {_gib(peaks['chunked'])}, naive {_gib(naive_bytes)}"
                 f"{'' if measure_naive else ' (estimate)'}, SDPA {_gib(peaks['sdpa'])}",
                 evidence={"q": q, "k": k, "v": v, "probe_B_H_T_Dh_block": torch.tensor([B, H, T, Dh, block_size])})


def check_chunked(ctx: Ctx) -> None:
    """8a. chunked exact attention on the module's own q, k, v (several key blocks) vs SDPA, dtype rule."""
    s = ctx.s
    with torch.no_grad():
        q, k, v = project(ctx.x, ctx.proj().to(ctx.dtype))  # (B,H,T,Dh) at the run dtype (RoPE, kv heads mapped)
        out = ctx.chunked_fn(q, k, v, causal=s.causal, key_padding_mask=ctx.pm_arg, block_size=s.block_size)
        rd = reference_dtype(ctx.dtype)
        ref = F.scaled_dot_product_attention(q.to(rd), k.to(rd), v.to(rd), attn_mask=ctx.mask)
        plain = naive_attention(q, k, v, causal=s.causal, key_padding_mask=ctx.pm_arg)
    if out.shape != ref.shape:
        raise ModuleContractError(f"chunked output shape {tuple(out.shape)} != {tuple(ref.shape)}")
    valid = ctx.valid[:, None, :].expand(-1, s.n_heads, -1)  # (B,H,T)
    c = compare(out, ref, plain, ctx.dtype, valid)
    _record_comparison(ctx, "chunked_match", "chunked_vs_sdpa", c,
                       f"{s.chunked_impl} with block_size={s.block_size} ({math.ceil(s.T / s.block_size)} key blocks) "
                       "on the module's q, k, v", {"q": q, "k": k, "v": v, "out": out, "ref": ref})
    chunked_probe(ctx, 1, s.probe_heads, s.probe_T, s.probe_d_head,
                  ctx.dtype if ctx.device.type == "cuda" else torch.float32, s.probe_block_size, measure_naive=True)


def check_invariances(ctx: Ctx) -> None:
    """9. batch independence, batch sizes, head counts."""
    s, rec = ctx.s, ctx.rec
    x, pm = ctx.x, ctx.padding_mask
    if s.B == 1:  # pair the row with a second one (fully real)
        x = torch.cat([x, torch.randn_like(x.float()).to(x.dtype)])
        pm = torch.cat([pm, torch.ones_like(pm)])
    B = x.shape[0]
    pm_arg = None if bool(pm.all()) else pm
    mask = visibility(s.T, s.T, s.causal, pm_arg, device=ctx.device)
    valid = rows_with_a_key(mask, B, s.T)
    with torch.no_grad():
        out_a, _ = ctx.call(ctx.module, x, pm_arg)
        x_b = x.clone()
        x_b[1:] = (X_SCALE_OTHER_ROWS * torch.randn(x_b[1:].shape, device=ctx.device)).to(x.dtype)
        out_b, _ = ctx.call(ctx.module, x_b, pm_arg)
        ref0 = ctx.reference(x[:1], None if mask is None else mask[:1])
        plain0 = ctx.plain(x[:1], None if mask is None else mask[:1])
        c0 = compare(out_a[:1], ref0, plain0, ctx.dtype, valid[:1])
        diff = max_abs_err(out_b[:1], out_a[:1], valid[:1])
    limit = c0.threshold
    rec.metric("batch_independence_max_diff", diff)
    rec.check_le("batch_independence", diff, limit,
                 f"row 0's output moved by {diff:.3g} when rows 1..{B - 1} were redrawn at {X_SCALE_OTHER_ROWS:g}x scale "
                 f"(limit = row 0's same-dtype noise 2·plain + rounding = {limit:.3g})",
                 evidence={"x": x, "x_other_rows_changed": x_b, "padding_mask": pm})

    worst = 0.0
    with torch.no_grad():
        ref_all = ctx.reference(x, mask)
        plain_all = ctx.plain(x, mask)
        for b in range(B):
            pm_b = None if pm_arg is None else pm_arg[b:b + 1]
            alone, _ = ctx.call(ctx.module, x[b:b + 1], pm_b)
            c = compare(out_a[b:b + 1], ref_all[b:b + 1], plain_all[b:b + 1], ctx.dtype, valid[b:b + 1])
            d = max_abs_err(alone, out_a[b:b + 1], valid[b:b + 1])
            worst = max(worst, d / c.threshold if c.threshold > 0 else (0.0 if d == 0 else math.inf))
    rec.metric("batch_sizes_worst_ratio", worst)
    rec.check_le("batch_sizes", worst, 1.0, f"each of the {B} rows run alone (B=1) vs inside the batch (B={B}): "
                 "max diff / same-dtype noise limit", evidence={"x": x, "padding_mask": pm})

    if s.n_kv_heads != s.n_heads:
        rec.note(f"head_counts not run: with n_kv_heads={s.n_kv_heads} other head counts change the k/v weight shapes")
        return
    with torch.no_grad():
        c_main = compare(ctx.call(ctx.module, ctx.x, ctx.pm_arg)[0], ctx.reference(ctx.x, ctx.mask),
                         ctx.plain(ctx.x, ctx.mask), ctx.dtype, ctx.valid)
    if not c_main.passed:
        rec.note(f"head_counts not judged: the module is already off the reference at its own n_heads={s.n_heads} "
                 f"(err {c_main.err:.3g} > limit {c_main.threshold:.3g}; sdpa_match judges that); head_counts judges "
                 "a module right at one head count and wrong at another")
        return
    worst, parts, shaped = 0.0, [], []
    for h in s.head_counts:
        try:
            module_h = ctx.build(n_heads=h, state=ctx.state())
        except RuntimeError as exc:  # load_state_dict: the parameter shapes depend on n_heads
            if "size mismatch" not in str(exc):
                raise
            shaped.append(h)
            continue
        with torch.no_grad():
            out_h, _ = ctx.call(module_h, ctx.x, ctx.pm_arg)
            p_h = ctx.proj(module_h, n_heads=h)
            c = compare(out_h, ctx.reference(ctx.x, ctx.mask, p_h), ctx.plain(ctx.x, ctx.mask, p_h), ctx.dtype,
                        ctx.valid)
        rec.metric("max_abs_err", c.err, comparison="module_vs_sdpa", n_heads=h,
                   dtype=str(ctx.dtype).removeprefix("torch."))
        parts.append(f"H={h}: {c.err:.3g} (limit {c.threshold:.3g})")
        worst = max(worst, c.ratio)
    if shaped:
        rec.note(f"head_counts: H={shaped} not run: {ctx.adapter.name}'s parameter shapes depend on n_heads, so the "
                 "same weights cannot be read with that many heads")
    if not parts:
        return
    rec.check_le("head_counts", worst, 1.0, "the same weights with other head counts vs SDPA with that many heads "
                 "(err/limit): " + "; ".join(parts), evidence=ctx.evidence())


@dataclass
class DropoutReadout:
    """A train-mode forward whose output reveals each attention weight after dropout (see dropout_readout)."""

    values: torch.Tensor  # (n,) train-mode readout at every entry the no-dropout readout makes non-zero
    expected_kept: torch.Tensor  # (n,) no-dropout readout / (1-p): what a kept weight must read
    n_expected: int  # visible (query, key) pairs the readout should show (B · #visible pairs per row)
    evidence: dict[str, torch.Tensor]  # what reproduces the measurement (x, weights, both outputs, kept mask)
    resolution: float = 0.0  # relative rounding of the no-dropout weights vs the exact 1/n: the module's precision


def _readout_projections(d_model: int, device: torch.device, dtype: torch.dtype) -> Projections:
    zeros = torch.zeros(d_model, d_model, device=device, dtype=dtype)
    eye = torch.eye(d_model, device=device, dtype=dtype)
    return Projections(zeros, zeros, eye, eye, 1, 1)  # biases None -> written as 0


def dropout_readout(module: nn.Module, no_dropout: nn.Module, p: float, causal: bool, d_model: int, samples: int,
                    device: torch.device, dtype: torch.dtype, adapter: AttentionAdapter | None = None) -> DropoutReadout:
    """Make the module's output spell out its dropout mask: W_q = W_k = 0 (every visible key gets the same
    weight; RoPE of 0 is 0), W_v = W_out = I, biases 0, and token j = one-hot e_j, so every output entry carries
    exactly one attention weight (query i, key j) times its dropout factor (0 or 1/(1-p)).

    The expected value of each entry is read from ``no_dropout`` (the same class built with dropout=0, eval mode,
    same readout weights), not from the formula: a bug elsewhere in the module (a wrong merge of heads that
    permutes entries, a wrong scale, an off-by-one mask) moves entries around the same way in both forwards,
    so train/no-dropout at the non-zero entries measures dropout alone."""
    if adapter is None:
        from tfmoe.adapters.course import CourseInterface

        adapter = CourseInterface(type(module), type(module).__name__)
    T = min(d_model, 64)
    readout_p = _readout_projections(d_model, device, dtype)
    adapter.set_projections(module, readout_p)
    adapter.set_projections(no_dropout, readout_p)
    visible = torch.ones(T, T, dtype=torch.bool).tril() if causal else torch.ones(T, T, dtype=torch.bool)
    per_row = int(visible.sum())
    B = max(1, math.ceil(samples / per_row))
    x = torch.zeros(B, T, d_model, device=device, dtype=dtype)
    x[:, torch.arange(T), torch.arange(T)] = 1.0  # token j = e_j
    module.train()
    try:
        with torch.no_grad():
            out_train, _ = adapter.forward(module, x, None, causal=causal)  # (B,T,D)
            out_ref, _ = adapter.forward(no_dropout.eval(), x, None, causal=causal)  # (B,T,D)
    finally:
        module.eval()
    train, ref = out_train.detach().double().cpu(), out_ref.detach().double().cpu()
    carries = torch.isfinite(ref) & (ref != 0)  # entries that carry one attention weight
    values = train[carries]
    expected = ref[carries] / (1 - p)
    evidence = {"x": x, "padding_mask": torch.ones(B, T, dtype=torch.bool),  # the readout passes None
                **projection_tensors(readout_p), "out_train": out_train, "out_no_dropout": out_ref,
                "kept_mask": carries & (train != 0)}  # (B,T,D) True = a weight-carrying entry dropout kept
    # every readout weight is 1/n (n visible keys): how far the no-dropout values sit from the nearest 1/n is
    # the precision the module computes in (an fp64 run of a module that computes in fp32 shows fp32 rounding)
    n = torch.arange(1, T + 2, dtype=torch.float64)
    resolution = float((ref[carries][:, None] * n[None, :] - 1).abs().min(dim=1).values.max()) if bool(
        carries.any()) else 0.0
    return DropoutReadout(values, expected, B * per_row, evidence, resolution)


def _readout_prerequisite(r: DropoutReadout) -> str:
    """'' if the no-dropout readout shows every visible (query, key) pair once, else what went wrong."""
    n = r.expected_kept.numel()
    if n == r.n_expected:
        return ""
    return (f"; PREREQUISITE: the no-dropout readout shows {n} non-zero entries where {r.n_expected} visible "
            "(query, key) pairs were expected, so a bug outside dropout (masking / projection) also enters this "
            "measurement: fix the module's other failed checks first")


def check_dropout(ctx: Ctx) -> None:
    """10. attention dropout: eval = no dropout exactly; train drops a fraction p (±0.01), scales kept by
    1/(1-p); the same seed gives the same mask, the next call a new one."""
    s, rec = ctx.s, ctx.rec
    p = s.dropout
    no_drop = ctx.build(dropout=0.0, state=ctx.state())
    with torch.no_grad():
        out_p, _ = ctx.call(ctx.module, ctx.x, ctx.pm_arg)  # ctx.module has dropout p, eval mode
        out_0, _ = ctx.call(no_drop, ctx.x, ctx.pm_arg)
    diff = max_abs_err(out_p, out_0, ctx.valid)
    rec.check_le("dropout_eval_identity", diff, 0.0, f"eval-mode output with dropout={p} vs dropout=0: max diff "
                 f"{diff:.3g} (must be exactly 0)", evidence=ctx.evidence(out_dropout=out_p, out_no_dropout=out_0))

    probe = ctx.build(dropout=p)
    probe_ref = ctx.build(dropout=0.0)

    def readout() -> DropoutReadout:
        return dropout_readout(probe, probe_ref, p, s.causal, s.d_model, s.dropout_samples, ctx.device, ctx.dtype,
                               ctx.adapter)

    torch.manual_seed(s.dropout_samples + 7)
    r1 = readout()
    prereq = _readout_prerequisite(r1)
    if prereq:
        rec.note("dropout checks" + prereq.removeprefix(";"))
    dropped = r1.values == 0
    rate = float(dropped.double().mean()) if r1.values.numel() else math.nan
    rec.metric("dropout_rate", rate, p=p)
    rec.check_le("dropout_rate", abs(rate - p), 0.01,
                 f"dropped fraction {rate:.4f} of {r1.values.numel()} attention weights vs p={p} (|diff| <= 0.01)"
                 + prereq, evidence=r1.evidence)
    kept = ~dropped
    if bool(kept.any()):
        scale_err = float(((r1.values[kept] - r1.expected_kept[kept]).abs() / r1.expected_kept[kept]).max())
    else:
        scale_err = math.inf
    eps = torch.finfo(ctx.dtype).eps
    limit = 4 * eps + 4 * r1.resolution  # the scaling is judged at the precision the module computes in
    rec.metric("dropout_kept_scale_rel_err", scale_err)
    mean_ratio = float((r1.values / (r1.expected_kept * (1 - p))).mean()) if r1.values.numel() else math.nan
    rec.metric("dropout_mean_weight_ratio", mean_ratio)  # E[w_dropped]/w: 1 if unbiased
    rec.check_le("dropout_scale", scale_err, limit,
                 f"kept weights vs w/(1-p) (w read from the same readout with dropout=0): max rel deviation "
                 f"{scale_err:.3g} (limit 4·eps + 4·the readout's own rounding {r1.resolution:.2g} = {limit:.3g}); mean of the dropped-out weights / w = {mean_ratio:.4f} "
                 "(1 = expectation preserved)" + prereq, evidence=r1.evidence)
    torch.manual_seed(rec.seed + 1)
    r_seed = readout()
    r_next = readout()
    torch.manual_seed(rec.seed + 1)
    r_again = readout()
    m1, m_next, m2 = r_seed.values == 0, r_next.values == 0, r_again.values == 0
    differ_same_seed = float((m1 != m2).double().mean()) if m1.numel() else math.nan
    differ_next_call = float((m1 != m_next).double().mean()) if m1.numel() else math.nan
    rec.metric("dropout_mask_diff_same_seed", differ_same_seed)
    rec.metric("dropout_mask_diff_next_call", differ_next_call)
    rec.check("dropout_seed", differ_same_seed == 0.0 and differ_next_call > 0.0, differ_same_seed, 0.0,
              f"torch.manual_seed({rec.seed + 1}) twice -> masks differ in {differ_same_seed:.4f} of entries "
              f"(must be 0); the next call without reseeding differs in {differ_next_call:.4f} (must be > 0)" + prereq,
              evidence={**{k: v for k, v in r_seed.evidence.items() if k not in ("out_train", "kept_mask")},
                        "kept_mask_seeded": r_seed.evidence["kept_mask"],
                        "kept_mask_reseeded": r_again.evidence["kept_mask"],
                        "seed": torch.tensor(rec.seed + 1)})


# ============================================================================================== plot
def attention_heatmap(attn: torch.Tensor, visible: torch.Tensor, b: int, h: int, title: str) -> Any:
    """Weights of batch row b, head h; hidden (query, key) pairs marked with a red x, so a leak shows as
    colour under a cross."""
    from matplotlib.figure import Figure

    w = attn[b, h].detach().double().cpu().numpy()
    vis = visible.cpu().numpy()
    fig = Figure(figsize=(5.5, 4.5))
    ax = fig.subplots()
    im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=max(1e-12, float(abs(w[vis]).max()) if vis.any() else 1.0))
    fig.colorbar(im, ax=ax, label="attention weight")
    qi, kj = (~vis).nonzero()
    ax.scatter(kj, qi, marker="x", color="red", s=30, label="hidden (must be 0)")
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    ax.set_title(title)
    if len(qi):
        ax.legend(loc="upper right", fontsize=7)
    return fig


# =============================================================================================== run
def dropout_not_applicable(s: Settings, adapter: AttentionAdapter) -> str:
    """'' when the dropout checks can run, else why not."""
    if s.dropout == 0:
        return "dropout=0"
    if not adapter.takes_dropout:
        return f"{adapter.name} takes no `dropout`"
    if not adapter.can_set_projections:
        return f"{adapter.name}'s adapter cannot write the readout weights (no set_projections)"
    if s.n_kv_heads != s.n_heads:
        return f"the readout needs W_v = I, impossible with n_kv_heads={s.n_kv_heads} < n_heads"
    return ""


def _padded_row(pm: torch.Tensor) -> int:
    rows = (~pm).any(dim=1).nonzero()
    return int(rows[0]) if len(rows) else 0


def run(cfg: DictConfig, rec: Recorder) -> None:
    if cfg.get("kernel"):  # kernel mode: an attention function with SDPA's signature (attn_kernels.py)
        from tfmoe.experiments.attn_kernels import run_kernel_battery

        return run_kernel_battery(cfg, rec)
    s = settings_from_cfg(cfg)
    device, dtype = rec.device, rec.dtype
    chunked_fn = load_object(s.chunked_impl, "chunked.impl")
    if not callable(chunked_fn):
        raise BadInput(f"chunked.impl={s.chunked_impl!r} is not callable: point it at a function "
                       "(q, k, v, *, causal, key_padding_mask, block_size) -> out")
    refuse_if_too_big(s, device, dtype)
    rec.note(f"mode={s.mode}; impl={s.impl}; reference = SDPA in {str(reference_dtype(dtype)).removeprefix('torch.')}")
    if device.type == "cpu":
        rec.note("peak memory measured with torch.profiler(profile_memory=True): CPU allocator allocations/frees")
    if s.mode == "chunked":
        ctx = Ctx(s, rec, None, None, None, None, None, None, device, dtype, chunked_fn)  # type: ignore[arg-type]
        guarded(ctx, ["chunked_match_large", "chunked_memory"],
                lambda c: chunked_probe(c, s.B, s.n_heads, s.T, s.d_head, dtype, s.probe_block_size,
                                        measure_naive=False))
        _summary(rec, s, dtype)
        return

    adapter = load_adapter(s.impl, load_object, s.hf_attn_implementation)
    module = adapter.build(s.d_model, s.n_heads, n_kv_heads=s.n_kv_heads, causal=s.causal, dropout=s.dropout,
                           seed=None, dtype=dtype, device=device)
    for text in adapter.notes:
        rec.note(f"{adapter.name}: {text}")
    x = torch.randn(s.B, s.T, s.d_model, device=device).to(dtype)  # (B,T,D)
    padding_mask = lengths_to_key_padding(s.lengths, s.T, device=device)  # (B,T)
    pm_arg = None if bool(padding_mask.all()) else padding_mask
    mask = visibility(s.T, s.T, s.causal, pm_arg, device=device)  # the reference's own mask
    valid = rows_with_a_key(mask, s.B, s.T)
    if not bool(valid.all()):
        rec.note(f"{int((~valid).sum())} query rows of the main case see no key (length 0 rows): excluded from "
                 "comparisons (policy)")
    ctx = Ctx(s, rec, adapter, module, x, padding_mask, mask, valid, device, dtype, chunked_fn)

    guarded(ctx, ["shapes"], check_shapes)  # always: it runs the main forward the other checks read
    run_group = set(s.groups)
    if "masks" in run_group and not adapter.returns_weights:
        rec.note(f"row_sums, causal_zero, padding_zero not applicable: {adapter.name} returns no attention weights")
    elif "masks" in run_group:
        guarded(ctx, ["row_sums"] + (["causal_zero"] if s.causal else [])
                + (["padding_zero"] if not bool(padding_mask.all()) else []), check_rows_and_masks)
    if "sdpa" in run_group:
        guarded(ctx, ["sdpa_match"], check_sdpa)
    if "fully_masked" in run_group:
        guarded(ctx, ["fully_masked_rows"], check_fully_masked)
    if "gradients" in run_group:
        guarded(ctx, ["gradcheck", "grad_match"], check_gradients)
    if "kv_cache" in run_group:
        if adapter.takes_cache:
            guarded(ctx, ["kv_cache_decode"], check_kv_cache)
        else:
            rec.note(f"kv_cache_decode not run: {adapter.name}'s forward takes no tfmoe KVCache (`cache` argument)")
    if "chunked" in run_group:
        guarded(ctx, ["chunked_match", "chunked_match_large", "chunked_memory"], check_chunked)
    if "invariances" in run_group:
        guarded(ctx, ["batch_independence", "batch_sizes", "head_counts"], check_invariances)
    if "dropout" in run_group:
        why = dropout_not_applicable(s, adapter)
        if why:
            rec.note(f"dropout checks not run: {why}")
        else:
            guarded(ctx, ["dropout_eval_identity", "dropout_rate", "dropout_scale", "dropout_seed"], check_dropout)
    skipped = [g for g in GROUPS if g not in run_group]
    if skipped:
        rec.note(f"check groups not run (checks=...): {', '.join(skipped)}")

    if ctx.attn is not None and ctx.attn.dim() == 4:
        b = _padded_row(padding_mask)
        vis = torch.ones(s.T, s.T, dtype=torch.bool) if mask is None else mask.expand(s.B, 1, s.T, s.T)[b, 0].cpu()
        rec.plot("attention_heatmap", attention_heatmap(
            ctx.attn, vis, b, 0, f"{adapter.name}: batch row {b} (length {s.lengths[b]}), head 0"))
    _summary(rec, s, dtype)


def _summary(rec: Recorder, s: Settings, dtype: torch.dtype) -> None:
    table = Table(title=f"attn-check: {s.impl if s.mode == 'full' else 'chunked path'} "
                        f"({str(dtype).removeprefix('torch.')})")
    for col in ("check", "passed", "observed", "threshold"):
        table.add_column(col)
    lines = ["| check | passed | observed | threshold | detail |", "|---|---|---|---|---|"]
    for c in rec.checks_rows:
        obs = "" if c.observed is None else f"{c.observed:.3g}"
        thr = "" if c.threshold is None else f"{c.threshold:.3g}"
        table.add_row(c.check, "yes" if c.passed else "NO", obs, thr, style=None if c.passed else "red")
        lines.append(f"| {c.check} | {'yes' if c.passed else '**NO**'} | {obs} | {thr} | {c.detail} |")
    rec.print(table)
    rec.summary(f"### attn-check: `{s.impl}`, mode={s.mode}, {str(dtype).removeprefix('torch.')}, B={s.B}, T={s.T}, "
                f"D={s.d_model}, H={s.n_heads}, causal={s.causal}, lengths={s.lengths}, dropout={s.dropout}\n\n"
                + "\n".join(lines))
