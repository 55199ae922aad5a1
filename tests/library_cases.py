"""The third-party attention configurations judged by test_attn_libraries.py and listed by scripts/zoo_libraries.py:
each correct configuration (which must pass) and each bug planted inside a library (which a named check must catch).

A case is (library, spec, overrides, ...): ``library`` is the scheme of impl= (torchtune, x-transformers, timm);
the overrides come after the small main case (SMALL: D=16, 4 heads, T=6) and may name a declared policy."""

from __future__ import annotations

import buggy_libraries as bugs

FAST = ["chunked.probe_T=256", "chunked.probe_block_size=16", "chunked.timing_repeats=1", "dropout_samples=20000",
        "gradcheck_T=2", "chunked.memory_ratio_max=0.35"]
SMALL = ["d_model=16", "n_heads=4", "T=6", *FAST]
FAST_GROUPS = "checks=[masks,sdpa,invariances]"
FULL = "lengths=[6,6]"  # no padded rows: x-transformers zeroes padded query rows (see PADDED_QUERIES)
EXTRAS = {"torchtune": ("torchtune.modules", "torchtune", "torchtune"),
          "x-transformers": ("x_transformers", "xtransformers", "x-transformers"),
          "timm": ("timm.layers", "timm", "timm")}  # scheme -> (module to import, extra, distribution)
POLICIES = ("fully_masked_policy=", "padded_query_policy=")  # overrides that declare a policy

# (spec, overrides, checks that must have been judged); fp32 unless a dtype is named
CORRECT = [
    ("torchtune:mha", [], {"sdpa_match", "grad_match", "batch_sizes", "head_counts", "dropout_rate"}),  # MHA, RoPE, causal, padding
    ("torchtune:mha", ["n_kv_heads=2", FAST_GROUPS], {"sdpa_match", "batch_sizes"}),  # GQA
    ("torchtune:mha", ["n_kv_heads=1", FAST_GROUPS], {"sdpa_match"}),  # MQA
    ("torchtune:mha-nope", ["causal=false", FAST_GROUPS], {"sdpa_match", "head_counts"}),  # key padding
    ("torchtune:mha", ["causal=false", "checks=[sdpa]"], {"sdpa_match"}),  # key padding with RoPE
    ("torchtune:mha", ["dtype=bf16", "n_kv_heads=2", "checks=[sdpa]"], {"sdpa_match"}),
    ("torchtune:mha", ["dtype=fp16", "checks=[sdpa]"], {"sdpa_match"}),
    ("x-transformers:attention", [FULL, "head_counts=[1,2,4]"],
     {"sdpa_match", "row_sums", "causal_zero", "grad_match", "head_counts", "dropout_rate"}),  # MHA, RoPE, causal
    ("x-transformers:attention", ["n_kv_heads=2", FULL, FAST_GROUPS], {"sdpa_match", "row_sums"}),  # GQA (tiled)
    ("x-transformers:attention-flash", ["n_kv_heads=2", FULL, FAST_GROUPS], {"sdpa_match"}),
    ("x-transformers:attention-nope", ["causal=false", FULL, "head_counts=[1,2,4,8]", FAST_GROUPS],
     {"sdpa_match", "head_counts"}),
    ("x-transformers:attention", ["causal=false", "checks=[masks]"], {"padding_zero"}),  # key padding, on the weights
    ("x-transformers:attention", ["dtype=fp16", "n_kv_heads=2", FULL, "checks=[sdpa]"], {"sdpa_match"}),
    ("x-transformers:attention-flash", ["dtype=bf16", FULL, "checks=[sdpa]"], {"sdpa_match"}),
    ("timm:attention", [], {"sdpa_match", "gradcheck", "head_counts", "dropout_rate"}),  # causal, padding
    ("timm:attention-unfused", ["fully_masked_policy=nan"], {"sdpa_match", "gradcheck", "head_counts"}),
    ("timm:attention", ["causal=false", FAST_GROUPS], {"sdpa_match"}),
    ("timm:attention-unfused", ["dtype=bf16", "checks=[sdpa]"], {"sdpa_match"}),
    ("timm:attention", ["dtype=fp16", "checks=[sdpa]"], {"sdpa_match"}),
]
# Key padding is judged where it shows: with right padding and a causal mask no real query sees a padded key, so
# ignoring the padding changes only padded query rows (don't-care). The padding cases are therefore non-causal.
# x-transformers' mask= zeroes padded query rows' output: correct once padded query rows are excluded from
# comparisons by default (issue 22's padded_query_policy)
PADDED_QUERIES = [("x-transformers:attention", ["causal=false", "checks=[masks,sdpa]"], {"sdpa_match", "padding_zero"}),
                  ("x-transformers:attention-flash", ["causal=false", "checks=[sdpa]"], {"sdpa_match"}),
                  ("x-transformers:attention", ["checks=[sdpa]"], {"sdpa_match"})]

# (plant, spec, overrides, the checks that must fail); each run with checks=[masks,sdpa]
PLANTED_GROUPS = "checks=[masks,sdpa]"
PLANTED = [
    (bugs.plant_torchtune_softmax_axis, "torchtune:mha", [], {"sdpa_match"}),
    (bugs.plant_torchtune_scale, "torchtune:mha", [], {"sdpa_match"}),
    (bugs.plant_torchtune_causal_off_by_one, "torchtune:mha", [FULL], {"sdpa_match"}),
    (bugs.plant_torchtune_padding_ignored, "torchtune:mha", ["causal=false"], {"sdpa_match"}),
    (bugs.plant_torchtune_rope_half, "torchtune:mha", [], {"sdpa_match"}),
    (bugs.plant_torchtune_gqa_tiled, "torchtune:mha", ["n_kv_heads=2"], {"sdpa_match"}),
    (bugs.plant_xt_softmax_axis, "x-transformers:attention", [FULL], {"sdpa_match", "row_sums"}),
    (bugs.plant_xt_scale, "x-transformers:attention-flash", [FULL], {"sdpa_match"}),
    (bugs.plant_xt_causal_off_by_one, "x-transformers:attention", [FULL], {"sdpa_match", "causal_zero"}),
    (bugs.plant_xt_padding_ignored, "x-transformers:attention", ["causal=false"], {"padding_zero"}),
    (bugs.plant_xt_rope_half, "x-transformers:attention", [FULL], {"sdpa_match"}),
    (bugs.plant_xt_gqa_interleaved, "x-transformers:attention", ["n_kv_heads=2", FULL], {"sdpa_match"}),
    (bugs.plant_timm_softmax_axis, "timm:attention-unfused", [], {"sdpa_match"}),
    (bugs.plant_timm_scale, "timm:attention", [], {"sdpa_match"}),
    (bugs.plant_timm_causal_off_by_one, "timm:attention", [FULL], {"sdpa_match"}),
    (bugs.plant_timm_padding_ignored, "timm:attention", ["causal=false"], {"sdpa_match"}),
]


def library_of(spec: str) -> str:
    return spec.split(":")[0]


def import_problem(scheme: str) -> str:
    """'' when the library of impl=<scheme>:... imports, else why not (one line)."""
    module = EXTRAS[scheme][0]
    try:
        __import__(module)
    except ImportError as exc:
        return f"the `{EXTRAS[scheme][1]}` extra is not installed ({exc})"
    except RuntimeError as exc:  # timm -> a torchvision whose C ops do not load beside this torch
        return f"`import {module}` fails in torchvision ({exc})"
    return ""


def describe(spec: str, overrides: list[str]) -> str:
    """A configuration in words for tables and test ids (the checks= selection left out)."""
    return " ".join([spec, *(o for o in overrides if not o.startswith("checks="))])
