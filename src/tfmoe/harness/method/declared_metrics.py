"""The metrics each experiment records (name -> its tag columns), so an expectation on a metric or tag that
does not exist is refused before the run starts. Light on purpose: no torch, no experiment module imported.

``DECLARED`` is taken from each experiment's default run (names built at run time, e.g. route-sim's, and every
tag column). :func:`declared_for` adds the names an experiment module writes literally in ``rec.metric("name",
…, tag=…)`` calls, read from its source with :mod:`ast` (no import), so a metric added to an experiment is
accepted at once; a call that passes ``**tags`` leaves that metric's tags open (not validated).
``tests/test_expectations.py`` checks that a real run records only declared names and tags.

``MEASURED`` names, per experiment, the metrics that measure this machine rather than the code (load, peak
FLOP/s, times and throughputs, their plausibility flags, memory peaks read from the allocator): ``tfmoe diff`` and
``tfmoe replay`` list them as context and never count them as a difference. :func:`measured_for` adds the names an
experiment writes literally with ``rec.metric(..., measured=True)``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tfmoe.contract.errors import BadInput
from tfmoe.contract.paths import PACKAGE_ROOT

DECLARED: dict[str, dict[str, tuple[str, ...]]] = {
    "tokenize": {
        "chars": ("category", "sample"),
        "bytes": ("category", "sample"),
        "tokens": ("category", "ids", "pieces", "sample", "tokenizer"),
        "chars_total": ("category",),
        "bytes_total": ("category",),
        "vocab_size": ("tokenizer",),
        "tokens_total": ("category", "tokenizer"),
        "tokens_per_char": ("category", "tokenizer"),
        "bytes_per_token": ("category", "tokenizer"),
        "unk_rate": ("category", "tokenizer"),
        "round_trip_exact": ("category", "tokenizer"),
        "fertility": ("category", "tokenizer"),
        "digit_run_tokens": ("tokenizer",),
        "digits_per_token_max": ("tokenizer",),
        "premium": ("denominator", "numerator", "tokenizer"),
    },
    "attn-check": {
        "shapes_steps_observed": (),
        "row_sum_max_dev": ("dtype",),
        "future_weight_max": (),
        "padded_key_weight_max": (),
        "max_abs_err": ("comparison", "dtype", "n_heads"),
        "max_rel_err": ("comparison", "dtype"),
        "plain_max_abs_err": ("comparison", "dtype"),
        "threshold": ("comparison", "dtype"),
        "fully_masked_query_rows": (),
        "fully_masked_nonfinite_values": (),
        "peak_mem_bytes": ("T", "variant"),
        "time_ms": ("T", "variant"),
        "time_ratio_vs_sdpa": ("T", "variant"),
        "memory_ratio_chunked_vs_naive": ("T",),
        "batch_independence_max_diff": (),
        "batch_sizes_worst_ratio": (),
        "dropout_rate": ("p",),
        "dropout_kept_scale_rel_err": (),
        "dropout_mean_weight_ratio": (),
        "dropout_mask_diff_same_seed": (),
        "dropout_mask_diff_next_call": (),
    },
    "arch": {
        "permutation_relative_diff": ("positions",),
        "trace_out_numel": ("arch", "in_shapes", "kind", "module", "out_shapes"),
        "visibility_tol": ("arch",),
        "visibility_min_visible_change": ("arch",),
        "visibility_max_invisible_change": ("arch",),
    },
    "block-stats": {
        "shared_param_fraction": ("variant",),
        "mean": ("layer", "stage", "variant"),
        "std": ("layer", "stage", "variant"),
        "rms": ("layer", "stage", "variant"),
        "max_abs": ("layer", "stage", "variant"),
        "grad_norm": ("layer", "stage", "variant"),
        "grad_norm_param": ("layer", "param", "variant"),
        "resid_std": ("layer", "variant"),
        "loss": ("variant",),
        "grad_norm_head": ("variant",),
        "last_layer_grad_norm": ("variant",),
        "first_layer_grad_norm": ("variant",),
        "input_std": ("variant",),
        "resid_std_last": ("variant",),
        "resid_var_slope": ("variant",),
        "grad_norm_last_over_first": ("variant",),
    },
    "shift-labels": {
        "loss": (),
        "loss_manual_fp64": (),
        "valid_labels": (),
        "padding_invariance_max_abs": (),
        "padding_invariance_logits_max_abs": (),
        "left_right_max_abs": (),
        "sequence_loss": ("sequence",),
    },
    "decode": {
        "train_loss": (),
        "val_loss": (),
        "unigram_val_loss": (),
        "uniform_loss": (),
        "generated_tokens": ("strategy",),
        "generated_logprob": ("strategy",),
        "generated_hit_eos": ("strategy",),
        "other_seed_differs": (),
        "top_p_mean_kept": ("top_p",),
        "chi2_context_entropy": ("position",),
        "chi2_stat": (),
        "chi2_df": (),
        "chi2_critical": (),
        "kv_cache_bytes": ("length",),
        "uncached_time_growth": (),
        "cached_time_growth": (),
        "cache_speedup_at_longest": (),
    },
    "route-sim": {
        "cv": ("strategy",),
        "maxvio": ("strategy",),
        "dropped_fraction": ("strategy",),
        "balance_loss": ("strategy",),
        "z_loss": ("strategy",),
        "router_entropy": ("strategy",),
        "tokens_dropped_fraction": ("strategy",),
        "applied_loss": ("strategy",),
        "task_loss": ("strategy",),
    },
    "complexity": {
        "flops_sdpa_probe_default_forward": ("D", "T"),
        "flops_sdpa_probe_default_backward": ("D", "T"),
        "flops_sdpa_probe_mapped_forward": ("D", "T"),
        "flops_sdpa_probe_mapped_backward": ("D", "T"),
        "flops_sdpa_probe_analytic": ("D", "T"),
        "flops_forward": ("D", "T", "component", "growth"),
        "flops_forward_block": ("D", "T"),
        "flops_backward_block": ("D", "T"),
        "flops_softmax_block": ("D", "T"),
        "flops_bias_block": ("D", "T"),
        "params_block": ("D", "T"),
        "params_block_weights": ("D", "T"),
        "crossover_T": ("D", "T"),
        "crossover_T_all_linear": ("D", "T"),
        "score_elements": ("D", "T"),
        "score_bytes": ("D", "T", "dtype"),
        "kv_cache_bytes_per_token": ("D", "T", "n_layers"),
        "params_model": ("D", "T", "n_layers"),
        "params_model_bytes": ("D", "T", "n_layers"),
        "kv_cache_bytes_model": ("D", "T", "n_layers"),
        "flops_forward_per_token_model": ("D", "T", "n_layers"),
        "flops_forward_per_token_kaplan": ("D", "T", "n_layers"),
        "params_moe_total": ("D", "T", "n_experts", "top_k"),
        "params_moe_active": ("D", "T", "n_experts", "top_k"),
        "flops_counted_forward_block": ("D", "T"),
        "flops_counted_fwd_bwd_block": ("D", "T"),
        "kv_cache_bytes": ("D", "T"),
        "activation_bytes_saved_measured": ("D", "T"),
        "activation_bytes_analytic": ("D", "T"),
        "memory_peak_step_measured_bytes": ("D", "T"),
        "memory_peak_step_estimate_bytes": ("D", "T"),
        "params_bytes": ("D", "T"),
        "matmul_peak_flops": ("D", "T", "n", "stat"),
        "time_ms": ("D", "T", "component", "stat"),
        "flops_per_s": ("D", "T", "component", "stat"),
        "peak_fraction": ("D", "T", "component", "stat"),
        "peak_fraction_max": ("D", "T"),
        "timings_plausible": ("D", "T", "limit"),
        "time_per_token_ms": ("D", "T", "cache_len", "mode"),
        "load_average_1min": ("D", "T", "when"),
    },
}

# Machine measurements (see the module docstring): reported by diff/replay, never judged.
MEASURED: dict[str, frozenset[str]] = {
    "attn-check": frozenset({"peak_mem_bytes", "time_ms", "time_ratio_vs_sdpa", "memory_ratio_chunked_vs_naive",
                             "matrix_wall_s"}),
    "decode": frozenset({"uncached_time_growth", "cached_time_growth", "cache_speedup_at_longest"}),
    "route-sim": frozenset({"layer.battery_s"}),
    "complexity": frozenset({"load_average_1min", "matmul_peak_flops", "time_ms", "flops_per_s", "peak_fraction",
                             "peak_fraction_max", "timings_plausible", "time_per_token_ms",
                             "memory_peak_step_measured_bytes"}),
}


def _experiment_sources(module: str) -> list[Path]:
    """Every module of the experiment's package ``tfmoe/experiments/<module>/`` (a single-file experiment:
    ``<module>.py``)."""
    root = PACKAGE_ROOT / "experiments"
    package = root / module
    return sorted(package.rglob("*.py")) if package.is_dir() else [p for p in [root / f"{module}.py"] if p.exists()]


@functools.lru_cache(maxsize=16)
def literal_metrics(module: str) -> dict[str, tuple[str, ...] | None]:
    """Metric names written literally in the experiment's package ``tfmoe/experiments/<module>/`` -> their literal tag keywords (None when a call also passes ``**tags``)."""
    out: dict[str, tuple[str, ...] | None] = {}
    for n in (n for path in _experiment_sources(module) for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "metric" and n.args
                and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)):
            continue
        name = n.args[0].value
        if any(k.arg is None for k in n.keywords) or out.get(name, ()) is None and name in out:
            out[name] = None
            continue
        tags = {k.arg for k in n.keywords if k.arg not in (None, "step", "measured")}
        out[name] = tuple(sorted(set(out.get(name) or ()) | tags))
    return out


@functools.lru_cache(maxsize=16)
def literal_measured(module: str) -> frozenset[str]:
    """Metric names written literally as ``rec.metric("name", ..., measured=True)`` in the experiment's package."""
    out: set[str] = set()
    for n in (n for path in _experiment_sources(module) for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "metric" and n.args
                and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)
                and any(k.arg == "measured" and isinstance(k.value, ast.Constant) and k.value.value is True
                        for k in n.keywords)):
            out.add(n.args[0].value)
    return frozenset(out)


def measured_for(experiment: str) -> frozenset[str]:
    """The metric names of ``experiment`` that measure the machine (``MEASURED`` and literal ``measured=True``)."""
    from tfmoe.contract.registry import EXPERIMENTS

    exp = EXPERIMENTS.get(experiment)
    return MEASURED.get(experiment, frozenset()) | (literal_measured(exp.module) if exp else frozenset())


def declared_for(experiment: str) -> dict[str, tuple[str, ...] | None]:
    """The metric names (and their tags; None = not validated) ``experiment`` records; BadInput when none."""
    from tfmoe.contract.registry import EXPERIMENTS

    declared: dict[str, tuple[str, ...] | None] = dict(DECLARED.get(experiment, {}))
    exp = EXPERIMENTS.get(experiment)
    for name, tags in (literal_metrics(exp.module) if exp else {}).items():
        if name not in declared:
            declared[name] = tags
        elif tags is not None and declared[name] is not None:
            declared[name] = tuple(sorted(set(declared[name]) | set(tags)))
    if not declared:
        raise BadInput(f"experiment {experiment!r} declares no metrics (tfmoe/harness/method/declared_metrics.py): it cannot judge "
                       "an expectation; drop expect=")
    return declared
