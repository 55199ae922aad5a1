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

This module is the recipe (Settings, settings(cfg), run, the report tables); the parts it orchestrates:
:mod:`~tfmoe.experiments.block_stats.stacks` (variants, stacks, statistics),
:mod:`~tfmoe.experiments.block_stats.checks` (the checks), :mod:`~tfmoe.experiments.block_stats.plots`
(figures, ``sweep_plots``), and the reference norm :mod:`tfmoe.components.norm_reference`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from omegaconf import DictConfig, ListConfig

from tfmoe.components.block import make_norm
from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.contract.tables import Rows
from tfmoe.experiments.block_stats.checks import (
    DTYPE_NAMES,
    check_attention_mixes_tokens,
    check_causal_stack,
    check_ffn_position_wise,
    check_norm_per_token,
    check_norm_statistics,
    check_residual_identity,
    check_shape_preserved,
    check_stats_finite,
)
from tfmoe.experiments.block_stats.plots import plot_grad_norm_per_layer, plot_per_stage, sweep_plots
from tfmoe.experiments.block_stats.settings import Settings
from tfmoe.experiments.block_stats.stacks import (
    FFN_OUT_PARAM,
    INITS,
    STAGES,
    STATS,
    StackStats,
    Variant,
    build_variants,
    collect_stats,
    make_batch,
    parse_variant,
    residual_var_slope,
)
from tfmoe.rules import memory
from tfmoe.rules.memory import (
    DTYPE_BYTES,
    Knob,
    available_memory_bytes,
    block_activation_elements,
    block_params,
)
from tfmoe.rules.validate import require_int

__all__ = ["Settings", "run", "settings", "sweep_plots", "tag_values"]


def tag_values(s: Settings) -> dict[str, tuple[str, ...]]:
    """The tag values a run with these settings records: its variants' names (another is refused before the run)."""
    return {"variant": tuple(v.name for v in s.variants)}

LOWP = {"fp16": torch.float16, "bf16": torch.bfloat16}


# ------------------------------------------------------------------------------------------- settings
def settings(cfg: DictConfig) -> Settings:
    """The run's settings from the composed config; BadInput names the problem and the fix (no device touched)."""
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
                       f"(e.g. n_heads={max(h for h in range(1, min(n_heads, d_model) + 1) if d_model % h == 0)})")
    vocab_size = require_int(cfg, "vocab_size", 2)
    batch_size = require_int(cfg, "batch_size")
    seq_len = require_int(cfg, "seq_len", 2)
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
    s = Settings(variants=tuple(variants), vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
                 n_layers=n_layers, batch_size=batch_size, seq_len=seq_len, eps=float(eps), init=str(cfg.init),
                 lowp_dtypes=tuple(str(d) for d in lowp), lowp_stress_scale=float(scale))
    if str(cfg.get("device")) == "cpu":  # the host's RAM is the device's: refused before anything is allocated
        refuse_oversized(s, str(cfg.get("dtype")), memory.host_available_bytes(), "the host's")
    return s


def estimated_bytes(z: dict[str, int], dtype: str, n_variants: int, n_heads: int) -> int:
    """Peak bytes of a block-stats run with sizes ``z``: every variant's stack (embedding, blocks, head) with its
    gradients and a low-precision copy, and one forward + backward of the statistics batch that keeps every
    stage's activation and gradient (three copies of each block's activations, the V-wide logits)."""
    e = DTYPE_BYTES.get(dtype, 4)
    d, v, n_layers, t = z["d_model"], z["vocab_size"], z["n_layers"], z["seq_len"]
    params = 2 * v * d + n_layers * block_params(d)
    tokens = z["batch_size"] * t
    acts = 3 * n_layers * block_activation_elements(tokens, d, n_heads, t) + 3 * tokens * v
    return n_variants * params * (2 * e + 2) + acts * e


def size_knobs(s: Settings) -> dict[str, Knob]:
    """block-stats' size keys as the guard may lower them (d_model stays a multiple of n_heads)."""
    return {"vocab_size": Knob(s.vocab_size, minimum=2), "d_model": Knob(s.d_model, s.n_heads, s.n_heads),
            "n_layers": Knob(s.n_layers), "batch_size": Knob(s.batch_size), "seq_len": Knob(s.seq_len, minimum=2)}


def refuse_oversized(s: Settings, dtype: str, available: int, where: str) -> None:
    """BadInput (exit 2) naming the size that dominates the estimate and a value of it that fits."""
    memory.refuse_oversized(lambda z: estimated_bytes(z, dtype, len(s.variants), s.n_heads), size_knobs(s),
                            available, where, "block-stats")


# ---------------------------------------------------------------------------------------------- report
STAGE_COLUMNS = ("layer", "stage", "mean", "std", "‖dL/dx‖", "‖dL/dW2‖")


def _title(name: str, s: StackStats, variant: Variant) -> str:
    return (f"{name}: {variant.norm_position}-norm, {variant.norm}, {variant.ffn} (loss {s.loss:.4f}); the block's "
            f"output is {variant.output_stage}")


def stage_rows(name: str, s: StackStats, variant: Variant) -> Rows:
    """One row per (layer, stage), stage names as in metrics.parquet: layer, stage, mean, std, ‖dL/dx‖, and the
    layer's ‖dL/dW2‖ on its first row; the same table in the terminal and in summary.md."""
    table = Rows(_title(name, s, variant), STAGE_COLUMNS)
    for layer in range(len({r["layer"] for r in s.activations})):
        for i, stage in enumerate(STAGES):
            w2 = f"{s.param_grad(layer, FFN_OUT_PARAM[variant.ffn]):.3g}" if i == 0 else ""
            table.add(str(layer), stage, f"{s.value(layer, stage, 'mean'):.3g}", f"{s.value(layer, stage, 'std'):.3g}",
                      f"{s.value(layer, stage, 'grad_norm'):.3g}", w2)
    return table


def stage_markdown(name: str, s: StackStats, variant: Variant) -> str:
    """The per-(layer, stage) table for summary.md, under its title."""
    table = stage_rows(name, s, variant)
    return f"### {table.title}\n\n{table.markdown()}"


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


def _summary_markdown(variants: Sequence[Variant], summaries: dict[str, dict[str, float]], n_layers: int) -> str:
    table = Rows("", ("variant", "loss", "last-layer ‖dL/dW2‖", "first-layer ‖dL/dW2‖", "last/first", "input std",
                      "residual std (last)", "var slope/layer"))
    for v in variants:
        s = summaries[v.name]
        table.add(v.name, f"{s['loss']:.4f}", f"{s['last_layer_grad_norm']:.4g}", f"{s['first_layer_grad_norm']:.4g}",
                  f"{s['grad_norm_last_over_first']:.3g}", f"{s['input_std']:.3g}", f"{s['resid_std_last']:.3g}",
                  f"{s['resid_var_slope']:.3g}")
    lines = [f"## block-stats at initialisation, L={n_layers}", "", table.markdown()]
    lines += ["", "Xiong et al. 2020 predict, at init: Post-LN's last-layer ‖dL/dW2‖ independent of L; Pre-LN's "
              "shrinking ~1/sqrt(L) as the residual stream's variance grows ~linearly with depth. One run is one "
              "depth: compare depths with `tfmoe block-stats -m n_layers=2,6,12,24` (sweep plots)."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ run
def run(s: Settings, rec: Recorder) -> None:
    variants = s.variants
    device, dtype, seed = rec.device, rec.dtype, rec.seed
    if device.type != "cpu":  # a CUDA run's memory is not the host's
        refuse_oversized(s, DTYPE_NAMES.get(dtype, "fp32"), available_memory_bytes(device), f"{device}'s")
    stacks, shared = build_variants(variants, s, device, dtype, seed)
    ids, targets = make_batch(seed, s.vocab_size, s.batch_size, s.seq_len, device)
    rec.tensor("input_ids", ids)
    rec.tensor("targets", targets)
    rec.note(f"{len(variants)} variant(s) x {s.n_layers} layers, d_model={s.d_model}, n_heads={s.n_heads}, "
             f"batch {tuple(ids.shape)}, init={s.init}, dtype={DTYPE_NAMES.get(dtype, str(dtype))}")

    results: dict[str, StackStats] = {}
    summaries: dict[str, dict[str, float]] = {}
    for v in rec.progress(variants, total=len(variants), description="variants"):
        with rec.stage("forward_backward_stats", variant=v.name):
            stats = collect_stats(stacks[v.name], ids, targets)
        results[v.name] = stats
        rec.metric("shared_param_fraction", shared[v.name], variant=v.name)
        rec.tensor(f"final_hidden.{v.name}", stats.hidden)
        summaries[v.name] = _record_stats(rec, v, stats)
        stage_rows(v.name, stats, v).print_to(rec.console)

    # ---- checks (each has a test in tests/test_block_stats.py that plants a bug and sees it fail)
    lowp = [LOWP[d] for d in s.lowp_dtypes]
    check_dtypes = list(dict.fromkeys([dtype, *lowp]))
    check_ids, check_targets = make_batch(seed, s.vocab_size, 2, min(s.seq_len, 8), device, offset=1)
    for v in variants:
        stack = stacks[v.name]
        check_shape_preserved(stack, s.d_model, seed).record(rec, f"shape_preserved[{v.name}]")
        check_ffn_position_wise(stack.blocks[0].ffn, s.d_model, seed=seed).record(
            rec, f"ffn_position_wise[{v.name}]")
        check_attention_mixes_tokens(stack.blocks[0].attn, s.d_model, seed=seed).record(
            rec, f"attention_mixes_tokens[{v.name}]")
        check_residual_identity(stack.blocks[-1], s.d_model, seed).record(rec, f"residual_identity[{v.name}]")
        check_causal_stack(stack, check_ids).record(rec, f"causal_stack[{v.name}]")
    for kind in dict.fromkeys(v.norm for v in variants):
        norm = make_norm(kind, s.d_model, s.eps)
        check_norm_statistics(kind, norm, s.eps, s.d_model, check_dtypes,
                              (1e-2, 1.0, s.lowp_stress_scale), device, seed).record(
            rec, f"norm_statistics[{kind}]")
        check_norm_per_token(norm, s.d_model, device, dtype, seed).record(rec, f"norm_per_token[{kind}]")
    check_stats_finite(list(results.values()), f"main run, {DTYPE_NAMES.get(dtype, dtype)}").record(
        rec, "stats_finite")
    for low in lowp:
        if low == dtype:
            continue
        low_stats = []
        for v in variants:
            low_stack = copy.deepcopy(stacks[v.name]).to(dtype=low)
            for scale in (1.0, s.lowp_stress_scale):
                low_stats.append(collect_stats(low_stack, check_ids, check_targets, input_scale=scale))
        check_stats_finite(low_stats, f"{len(variants)} variant(s), input scale 1 and "
                           f"{s.lowp_stress_scale:g}, batch {tuple(check_ids.shape)}").record(
            rec, f"stats_finite[{DTYPE_NAMES[low]}]")
    del check_targets

    rec.plot("grad_norm_per_layer", plot_grad_norm_per_layer(results))
    rec.plot("std_per_stage", plot_per_stage(results, "std", "activation std per layer and stage (at init)"))
    rec.plot("act_grad_norm_per_stage",
             plot_per_stage(results, "grad_norm", "||dL/d activation|| per layer and stage (at init)"))
    rec.summary(_summary_markdown(variants, summaries, s.n_layers))
    rec.summary("## Per layer and stage (mean, std and gradient norm of each activation)\n\n"
                + "\n\n".join(stage_markdown(v.name, results[v.name], v) for v in variants))
