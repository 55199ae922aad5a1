"""tfmoe attn-check — course §2.2: does a multi-head attention module compute softmax(q kᵀ/√Dh) v, exactly as
PyTorch's scaled_dot_product_attention does, with its masks, in every dtype, with and without a KV cache?

The battery runs on the course's module, on any class with the course's interface (``impl=pkg.mod:Class``),
or on any layer an adapter can drive (``impl=torch:mha``, ``impl=hf:<model_type>``, or a user's
``AttentionAdapter``; see ``tfmoe.adapters``). Every check compares the layer with an independent reference
built from the layer's *own* weights (``tfmoe.components.references``: its own masks, head split, RoPE and kv-head
mapping, then PyTorch's SDPA) at a higher precision (fp64 for fp32/fp64 runs, fp32 for fp16/bf16); never with
the functions the layer under test calls. Tolerances follow FlashAttention's rule: error(layer vs reference) <=
2 x error(a plain PyTorch implementation in the same dtype vs reference) + 2 x the dtype's rounding at the
output's scale.

Each check judges one family (shapes, masks, sdpa, fully_masked, gradients, kv_cache, chunked, invariances,
dropout); a check whose measurement needs another family to be right first (e.g. gradients vs the reference's
need a forward that matches it) is not judged when that prerequisite fails, and a note says which check to fix.

Fully masked query rows (a query that sees no key, e.g. a row of all padding) have no defined output.
Policy (key ``fully_masked_policy``, default ``finite``): they are excluded from every comparison, and
``fully_masked_rows`` judges only what they do: finite values there and in the gradients of a loss over the other
rows (or the declared policy: zeros, nan, mean_of_v, any).

Kernel mode (``kernel=SPEC``): an attention *function* with SDPA's signature on a FlashAttention-style case matrix
(:mod:`tfmoe.experiments.attn_check.kernel_battery`).

This module is the recipe: :class:`Settings` (holding one battery's settings, defined in
``attn/settings.py``), :func:`settings` and :func:`run`. The batteries live in
:mod:`tfmoe.experiments.attn_check` (one module per check group, e.g. ``checks=[kv_cache]`` is
``attn/checks/kv_cache.py``); the reference maths in :mod:`tfmoe.components.references` (layers),
:mod:`tfmoe.components.reference_attention` (kernels) and :mod:`tfmoe.components.comparison` (the dtype rule).
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tfmoe.components.reference_attention import CAUSAL_ALIGNS
from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.attn_check.checks import GROUPS
from tfmoe.experiments.attn_check.kernel_cases import MASKS, ROW_KINDS, build_cases
from tfmoe.experiments.attn_check.settings import KernelSettings, ModuleSettings, Settings
from tfmoe.rules import capabilities
from tfmoe.rules.capabilities import declared, precision_name
from tfmoe.rules.validate import require_int, require_number

MODES = ("full", "chunked")
FULLY_MASKED_POLICIES = (*capabilities.FULLY_MASKED_POLICIES, *capabilities.POLICY_ALIASES)
PADDED_QUERY_POLICIES = ("any", "attend", "zeros")


# ============================================================================================ settings
def settings(cfg: DictConfig) -> Settings:
    """Validate the config (BadInput names the key, the value and the fix). Imports no user code."""
    if cfg.get("kernel"):
        return Settings(kernel_settings(cfg))
    kernel_limits(cfg)  # read only in kernel mode, but a negative limit is refused in every mode
    return Settings(module_settings(cfg))


DTYPE_BYTES = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2}


def layer_bytes(z: dict[str, int], itemsize: int) -> int:
    """An upper estimate of module mode's peak at sizes ``z``: the layer's 4·D² projection weights at the run's dtype,
    their fp64 copy for gradcheck and the gradients of both (×2 for the reference's copies); a few (B,T,D) tensors and
    (B,H,T,T) score/weight tensors in fp64; gradcheck's (2,Tg,D) and (2,H,Tg,Tg) in fp64; the dropout readout's
    sampled weights; the chunked memory probe's naive (1,H,T,T) path and its q, k, v (fp32)."""
    D, B, T, H = z["d_model"], z["B"], z["T"], z["n_heads"]
    Tg, samples = z["gradcheck_T"], z["dropout_samples"]
    pT, pH, pD = z["chunked.probe_T"], z["chunked.probe_heads"], z["chunked.probe_d_head"]
    weights = 4 * D * D * (itemsize + 8) * 2 * 2
    main = 16 * B * T * D * 8 + 6 * B * H * T * T * 8
    gradcheck = 16 * 2 * Tg * D * 8 + 6 * 2 * H * Tg * Tg * 8
    dropout = 24 * samples * 8
    probe = 3 * pH * pT * pT * 4 + 8 * pH * pT * pD * 4
    return weights + main + gradcheck + dropout + probe


def refuse_oversized_layer(cfg: DictConfig, B: int, T: int, d_model: int, n_heads: int) -> None:
    """Exit 2 before anything is built (or a per-row list is made) when a full run cannot fit, naming the knob that
    dominates the estimate and a value of it that fits."""
    from tfmoe.rules import memory

    if cfg.get("mode") != "full":
        return
    knobs = {"d_model": memory.Knob(d_model, minimum=n_heads, multiple=n_heads), "B": memory.Knob(B),
             "T": memory.Knob(T), "gradcheck_T": memory.Knob(require_int(cfg, "gradcheck_T", 1)),
             "dropout_samples": memory.Knob(require_int(cfg, "dropout_samples", 1000), minimum=1000)}
    for key in ("chunked.probe_T", "chunked.probe_heads", "chunked.probe_d_head"):
        knobs[key] = memory.Knob(require_int(cfg, key, 1))
    try:
        memory.refuse_oversized(lambda z: layer_bytes({**z, "n_heads": n_heads},
                                                      DTYPE_BYTES.get(str(cfg.get("dtype")), 4)),
                                knobs, memory.host_available_bytes(), "the host's", "attn-check")
    except BadInput as exc:
        if str(exc).startswith("T="):  # the naive path's (B,H,T,T) dominates: the chunked path alone avoids it
            raise BadInput(str(exc).replace(": lower T (", " (mode=chunked checks only the chunked path at this T, in "
                                            "O(T·block) memory): lower T (")) from None
        raise


def kernel_limits(cfg: DictConfig) -> None:
    """The kernel mode's numeric limits (negative limits are refused, whichever mode reads them)."""
    require_int(cfg, "cases.batch", 1)
    require_int(cfg, "cases.q_heads", 1)
    require_number(cfg, "cases.scale", positive=True)
    require_number(cfg, "kernel_checks.grad_factor", positive=True)
    require_int(cfg, "kernel_checks.dropout_seeds", 2)
    p = OmegaConf.select(cfg, "kernel_checks.dropout_p", default=0.0)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise BadInput(f"kernel_checks.dropout_p={p!r} is not a probability in [0, 1): pass e.g. "
                       "kernel_checks.dropout_p=0.2 (0 skips the dropout family)")


def _list(value: Any) -> Any:
    return list(OmegaConf.to_container(value)) if OmegaConf.is_list(value) else value


def module_settings(cfg: DictConfig) -> ModuleSettings:
    """The module-mode keys."""
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
    refuse_oversized_layer(cfg, B, T, d_model, n_heads)
    lengths = cfg.get("lengths")
    lengths_given = lengths is not None
    if lengths is None:
        lengths = [T] * (B - 1) + [max(1, T - T // 4)]
    else:
        lengths = _list(lengths)
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
        head_counts = _list(head_counts)
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
    policy = capabilities.policy_name(policy)
    padded = OmegaConf.select(cfg, "padded_query_policy", default="any")
    if padded not in PADDED_QUERY_POLICIES:
        raise BadInput(f"padded_query_policy={padded!r} is unknown: use any (padded query rows are don't-care), "
                       "attend (they must attend like real queries) or zeros (the layer zeroes them)")
    hf_impl = OmegaConf.select(cfg, "hf.attn_implementation", default="eager")
    if hf_impl not in ("eager", "sdpa"):
        raise BadInput(f"hf.attn_implementation={hf_impl!r} is not supported: use eager or sdpa")
    groups = cfg.get("checks", "all")
    if groups == "all" or groups is None:
        groups = GROUPS
    else:
        groups = _list(groups) if OmegaConf.is_list(groups) else [groups]
        unknown = [g for g in groups if g not in GROUPS]
        if unknown:
            raise BadInput(f"checks={groups} names unknown groups {unknown}: use all or a list from {list(GROUPS)}")
    return ModuleSettings(
        impl=cfg.impl, B=B, T=T, d_model=d_model, n_heads=n_heads, causal=causal, lengths=tuple(lengths),
        dropout=float(dropout), mode=mode, head_counts=tuple(head_counts),
        gradcheck_T=require_int(cfg, "gradcheck_T", 1), dropout_samples=samples,
        chunked_impl=OmegaConf.select(cfg, "chunked.impl"), block_size=require_int(cfg, "chunked.block_size", 1),
        probe_T=require_int(cfg, "chunked.probe_T", 1), probe_heads=require_int(cfg, "chunked.probe_heads", 1),
        probe_d_head=require_int(cfg, "chunked.probe_d_head", 1),
        probe_block_size=require_int(cfg, "chunked.probe_block_size", 1), memory_ratio_max=float(ratio),
        timing_repeats=require_int(cfg, "chunked.timing_repeats", 1), groups=tuple(groups),
        n_kv_heads=n_kv or n_heads, hf_attn_implementation=hf_impl, fully_masked_policy=policy,
        padded_query_policy=padded, lacks=config_lacks(cfg), compute_dtype=precision_name(
            OmegaConf.select(cfg, "compute_dtype", default=None), "compute_dtype"), lengths_given=lengths_given,
    )


def config_lacks(cfg: DictConfig) -> tuple[str, ...]:
    """The config's ``lacks=[...]``, validated against tfmoe.rules.capabilities.FEATURES (shared by both batteries)."""
    value = _list(OmegaConf.select(cfg, "lacks", default=None))
    return tuple(sorted(declared(config_lacks=[] if value is None else value).lacks))


def _int_list(value: Any, key: str) -> list[int]:
    value = _list(value)
    if not isinstance(value, list) or not value or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                                       for n in value):
        raise BadInput(f"{key}={value!r} must be a non-empty list of positive integers, e.g. {key}=[6,2,1]")
    return value


def kernel_settings(cfg: DictConfig) -> KernelSettings:
    """The kernel-mode keys (the module-mode keys are not read)."""
    spec = cfg.kernel
    if not isinstance(spec, str) or not spec:
        from tfmoe.experiments.attn_check.kernels import BUILTINS

        raise BadInput(f"kernel={spec!r} must be a string: one of {', '.join(BUILTINS)} or 'python.module:function'")
    align = cfg.get("causal_align")
    if align is not None and align not in CAUSAL_ALIGNS:
        raise BadInput(f"causal_align={align!r} is unknown: use causal_align=top_left (SDPA's is_causal) or "
                       "causal_align=bottom_right (FlashAttention >= 2.1, decoding)")
    B, Hq = require_int(cfg, "cases.batch", 1), require_int(cfg, "cases.q_heads", 1)
    kv_heads = _int_list(OmegaConf.select(cfg, "cases.kv_heads"), "cases.kv_heads")
    bad = [h for h in kv_heads if Hq % h]
    if bad:
        raise BadInput(f"cases.kv_heads {bad} do not divide cases.q_heads={Hq}: each key/value head serves "
                       f"Hq/Hkv query heads; pick among {[h for h in range(1, Hq + 1) if Hq % h == 0]}")
    raw = _list(OmegaConf.select(cfg, "cases.shapes"))
    if (not isinstance(raw, list) or not raw or any(
            not isinstance(s, list) or len(s) != 3 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                                          for n in s) for s in raw)):
        raise BadInput(f"cases.shapes={raw!r} must be a list of [Tq, Tk, D] positive integers, "
                       "e.g. cases.shapes=[[17,17,64],[1,239,128]]")
    masks = _list(OmegaConf.select(cfg, "cases.masks"))
    if not isinstance(masks, list) or not masks or any(m not in MASKS for m in masks):
        raise BadInput(f"cases.masks={masks!r} must be a non-empty list from {list(MASKS)}")
    scale = require_number(cfg, "cases.scale", positive=True)
    expect = fully_masked_expect(OmegaConf.select(cfg, "kernel_checks.fully_masked_expect"))
    dropout_p = OmegaConf.select(cfg, "kernel_checks.dropout_p", default=0.0)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise BadInput(f"kernel_checks.dropout_p={dropout_p!r} is not a probability in [0, 1): pass e.g. "
                       "kernel_checks.dropout_p=0.2 (0 skips the dropout family)")
    shape = _list(OmegaConf.select(cfg, "kernel_checks.dropout_shape", default=[48, 32, 32]))
    if (not isinstance(shape, list) or len(shape) != 3
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape) or shape[1] > shape[2]):
        raise BadInput(f"kernel_checks.dropout_shape={shape!r} must be [Tq, Tk, D] positive integers with Tk <= D "
                       "(the probe reads each weight through a one-hot v), e.g. [48,32,32]")
    seeds = require_int(cfg, "kernel_checks.dropout_seeds", 2)
    backward = OmegaConf.select(cfg, "kernel_checks.backward")
    if not isinstance(backward, bool):
        raise BadInput(f"kernel_checks.backward={backward!r} is not true/false")
    factor = require_number(cfg, "kernel_checks.grad_factor", positive=True)
    long_row = _list(OmegaConf.select(cfg, "kernel_checks.long_row", default=None))
    if long_row is not None and (not isinstance(long_row, list) or len(long_row) != 3 or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in long_row)):
        raise BadInput(f"kernel_checks.long_row={long_row!r} must be [Tq, Tk, D] positive integers (or null to "
                       "skip the long_rows family), e.g. kernel_checks.long_row=[2,2048,32]")
    lacks = config_lacks(cfg)  # BadInput for a typo
    cases = build_cases(raw, Hq, kv_heads, masks, scale, float(dropout_p), tuple(shape),
                        None if long_row is None else tuple(long_row))
    return KernelSettings(spec, align, B, Hq, tuple(cases), expect, backward, factor,
                          module_keys_set=cfg.get("impl") is not None, threads=cfg.get("threads"),
                          dropout_seeds=seeds, lacks=lacks)


def _policy_name(p: Any) -> Any:  # Hydra's grammar reads the bare word nan as a float
    return "nan" if isinstance(p, float) and math.isnan(p) else p


def _policies(value: Any, key: str) -> tuple[str, ...]:
    """One kind's policies: a name or a list of names (tfmoe.rules.capabilities.FULLY_MASKED_POLICIES, the same
    vocabulary as module mode's fully_masked_policy; uniform = mean_of_v)."""
    value = _list(value)
    names = [_policy_name(p) for p in value] if isinstance(value, list) else [_policy_name(value)]
    if not names or any(not isinstance(p, str) or p not in FULLY_MASKED_POLICIES for p in names):
        shown = value if not isinstance(value, float) else _policy_name(value)
        raise BadInput(f"{key}={shown!r} is unknown: use one of {', '.join(FULLY_MASKED_POLICIES)}, a list of them "
                       f"(e.g. {key}=[zeros,nan]), or one per kind of row, e.g. "
                       "kernel_checks.fully_masked_expect={bool:zeros,additive:nan,causal:uniform}")
    return tuple(dict.fromkeys(names))


def fully_masked_expect(value: Any) -> dict[str, tuple[str, ...]]:
    """The policy for rows that see no key, per kind of row (ROW_KINDS: bool, additive, causal): one policy
    (or list, or any) for every kind, or a mapping {kind: policy} whose missing kinds expect zeros."""
    key = "kernel_checks.fully_masked_expect"
    if OmegaConf.is_dict(value) or isinstance(value, dict):
        given = dict(OmegaConf.to_container(value)) if OmegaConf.is_dict(value) else dict(value)
        unknown = [k for k in given if k not in ROW_KINDS]
        if unknown:
            raise BadInput(f"{key} names unknown kinds of row {unknown}: use {list(ROW_KINDS)} (a row that sees no "
                           "key because of a boolean mask, an all -inf additive mask, or a causal mask)")
        return {kind: _policies(given.get(kind, "zeros"), f"{key}.{kind}") for kind in ROW_KINDS}
    one = _policies(value, key)
    return dict.fromkeys(ROW_KINDS, one)


# ================================================================================================= run
def run(s: Settings, rec: Recorder) -> None:
    """The module battery on ``impl`` (or only its chunked path, mode=chunked), or the kernel battery."""
    if isinstance(s.battery, KernelSettings):
        from tfmoe.experiments.attn_check.kernel_battery import run_kernel_battery

        run_kernel_battery(s.battery, rec)
    else:
        from tfmoe.experiments.attn_check.module_battery import run_module_battery

        run_module_battery(s.battery, rec)
