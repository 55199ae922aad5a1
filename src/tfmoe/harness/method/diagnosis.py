"""Why a check failed: match the pattern of failed and passed checks against the batteries' planted-bug catalogue.

Each planted bug in ``tests/buggy_attention.py`` (and the shift-labels / decode tests) has a signature — which
checks fail, which pass, what the metrics show (a √d_model scale passes at H=1 and fails at H>1, where
d_head ≠ d_model). A failed run is matched against every signature; each match is printed as the *likely*
cause with its evidence, labelled as an inference: the checks are the proof, this only points where to look.
Pure Python on the recorded checks and metrics (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tfmoe.rules.faults import is_raised

Checks = Mapping[str, Mapping[str, Any]]  # check -> {passed, observed, threshold, detail}


@dataclass(frozen=True)
class Inference:
    cause: str
    evidence: str
    planted: tuple[str, ...]  # the catalogue's planted bugs with this signature

    def line(self) -> str:
        bugs = f" [planted-bug catalogue: {', '.join(self.planted)}]" if self.planted else ""
        return f"likely cause (inferred, not proven): {self.cause} — evidence: {self.evidence}{bugs}"


@dataclass(frozen=True)
class Signature:
    experiment: str
    checks: tuple[str, ...]  # check names the signature reads (they must exist in the experiment)
    match: Callable[[Checks, list[dict[str, Any]], Mapping[str, Any]], str | None]  # evidence, or None
    cause: str
    planted: tuple[str, ...]


def _failed(c: Checks, name: str) -> bool:
    return name in c and not bool(c[name]["passed"])


def _passed_or_absent(c: Checks, *names: str) -> bool:
    return all(bool(c[n]["passed"]) for n in names if n in c)


def _obs(c: Checks, name: str) -> str:
    row = c[name]
    o, t = row.get("observed"), row.get("threshold")
    return f"`{name}` observed {_num(o)} vs threshold {_num(t)}"


def _num(x: Any) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def _metric(metrics: list[dict[str, Any]], name: str) -> float | None:
    for r in metrics:
        if r.get("name") == name:
            return float(r["value"])
    return None


def _nan_rows(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    nonfinite = _metric(m, "fully_masked_nonfinite_values")
    if _failed(c, "fully_masked_rows") and nonfinite is not None and nonfinite > 0:
        return f"{_obs(c, 'fully_masked_rows')}; {nonfinite:g} non-finite values in outputs or gradients"
    return None


def _per_head_errors(metrics: list[dict[str, Any]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in metrics:
        if r.get("name") == "max_abs_err" and r.get("comparison") == "module_vs_sdpa" and r.get("n_heads") is not None:
            try:
                out[int(r["n_heads"])] = float(r["value"])
            except (TypeError, ValueError):
                continue
    return out


def _scale_or_merge(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    """sdpa_match or head_counts fails while the weights are normalised and masked, and the error appears only
    with more than one head."""
    if not (_failed(c, "sdpa_match") or _failed(c, "head_counts")):
        return None
    if not _passed_or_absent(c, "row_sums", "causal_zero", "padding_zero", "shapes"):
        return None
    errs = _per_head_errors(m)
    one, many = errs.get(1), {h: e for h, e in errs.items() if h > 1}
    limit = c.get("head_counts", {}).get("detail", "")
    if one is not None and many and max(many.values()) > 1e3 * max(one, 1e-12):
        shown = ", ".join(f"H={h}: {e:.3g}" for h, e in sorted(errs.items()))
        return (f"error vs SDPA by head count {shown} — right at H=1 (d_head = d_model), wrong at H>1; rows sum to 1 "
                f"and the masks hold{'; ' + limit if limit and _failed(c, 'head_counts') else ''}")
    if _failed(c, "head_counts") and c.get("sdpa_match", {}).get("passed") and int(cfg.get("n_heads", 0) or 0) == 1:
        return f"sdpa_match passes at n_heads=1 but {_obs(c, 'head_counts')}: {c['head_counts'].get('detail', '')}"
    return None


def _weights_error(metrics: list[dict[str, Any]]) -> float | None:
    for r in metrics:
        if r.get("name") == "max_abs_err" and r.get("comparison") == "weights_vs_reference":
            return float(r["value"])
    return None


def _forward_wrong_masks_right(c: Checks) -> bool:
    return _failed(c, "sdpa_match") and _passed_or_absent(c, "row_sums", "causal_zero", "padding_zero", "shapes")


def _scale_only(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    """The output is wrong and so are the weights, yet every row sums to 1 and the masks hold: the scores' scale."""
    w = _weights_error(m)
    limit = c.get("sdpa_match", {}).get("threshold") or 0.0
    if _forward_wrong_masks_right(c) and w is not None and w > 100 * max(limit, 1e-12):
        return (f"{_obs(c, 'sdpa_match')}; the returned weights differ from softmax(QKᵀ/√d_head) by {w:.3g} while "
                "every row sums to 1 and the masks hold")
    return None


def _merge_only(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    """The weights are right but the output is not: what happens after the weights (merge, output projection)."""
    w = _weights_error(m)
    limit = c.get("sdpa_match", {}).get("threshold") or 0.0
    if _forward_wrong_masks_right(c) and w is not None and w <= 10 * max(limit, 1e-12):
        return (f"{_obs(c, 'sdpa_match')}; the returned weights match softmax(QKᵀ/√d_head) (error {w:.3g}), so the "
                "scores, scale and masks are right")
    return None


def _rows_blank(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    if _failed(c, "row_sums") and c["row_sums"].get("observed") is not None \
            and abs(float(c["row_sums"]["observed"]) - 1.0) < 1e-6:
        return f"{_obs(c, 'row_sums')}: whole query rows sum to 0 (every key hidden from them), the pattern of a " \
               "padding mask applied to the query rows"
    return None


def _rows_not_normalised(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    if _failed(c, "row_sums") and _rows_blank(c, m, cfg) is None:
        return f"{_obs(c, 'row_sums')}: the weights over the keys of a query do not sum to 1"
    return None


def _dropout_keep_prob(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    if not _failed(c, "dropout_rate"):
        return None
    for r in m:
        if r.get("name") == "dropout_rate" and r.get("p") is not None:
            p, rate = float(r["p"]), float(r["value"])
            if abs(rate - (1 - p)) < abs(rate - p):
                return f"measured drop rate {rate:.3g} is near 1 − p = {1 - p:.3g}, not p = {p:.3g}"
    return None


def _simple(*fail: str, ok: tuple[str, ...] = (), extra: str = "") -> Callable[..., str | None]:
    def match(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
        if all(_failed(c, f) for f in fail) and all(n in c and bool(c[n]["passed"]) for n in ok):
            parts = [_obs(c, f) for f in fail] + [f"`{n}` passes" for n in ok]
            return "; ".join(parts) + (f" ({extra})" if extra else "")
        return None

    return match


def _shift_left_only(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    bad = [n for n in ("padding_invariance_loss", "padding_invariance_logits", "left_right_same_token_loss")
           if _failed(c, n)]
    if bad and _passed_or_absent(c, "labels_are_next_tokens", "no_label_on_padding", "label_count"):
        return "; ".join(_obs(c, n) for n in bad) + f" with pad_side={cfg.get('pad_side')}, while the labels " \
            "themselves are right (a missing padding mask is invisible with right padding and breaks left padding)"
    return None


def _metric_tagged(metrics: list[dict[str, Any]], name: str, **tags: Any) -> list[float]:
    return [float(r["value"]) for r in metrics if r.get("name") == name
            and all(r.get(k) == v for k, v in tags.items())]


def _loss_counts_padding(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    """The model's loss is the reference times the fraction of positions that have a label."""
    if not _failed(c, "lm.loss_matches_shifted_ce"):
        return None
    for side in ("left", "right", "alone"):
        loss, ref = _metric_tagged(m, "lm.loss", pad_side=side), _metric_tagged(m, "lm.loss_reference", pad_side=side)
        frac = _metric_tagged(m, "lm.label_fraction", pad_side=side)
        if loss and ref and frac and frac[0] < 1 and abs(loss[0] - ref[0] * frac[0]) <= 1e-4 * max(1.0, ref[0]):
            return (f"{_obs(c, 'lm.loss_matches_shifted_ce')}; with {side} padding the model's loss {loss[0]:.4g} = "
                    f"the reference {ref[0]:.4g} x {frac[0]:.3g}, the fraction of positions that have a label")
    return None


def _loss_other(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    if _failed(c, "lm.loss_matches_shifted_ce") and _loss_counts_padding(c, m, cfg) is None:
        return f"{_obs(c, 'lm.loss_matches_shifted_ce')} while the logits themselves pass the padding checks" \
            if _passed_or_absent(c, "lm.batch_invariance.left", "lm.batch_invariance.right") else None
    return None


def _kv_padded_only(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    padded, plain = _metric(m, "lm.kv_cache_padded_rows_max_abs"), _metric(m, "lm.kv_cache_unpadded_rows_max_abs")
    limit = c.get("lm.kv_cache_teacher_forcing", {}).get("threshold")
    if _failed(c, "lm.kv_cache_teacher_forcing") and padded is not None and plain is not None and limit is not None \
            and padded > limit >= plain:
        return (f"{_obs(c, 'lm.kv_cache_teacher_forcing')}; wrong only in the left-padded rows (max |Δ| {padded:.3g}), "
                f"exact in the unpadded one ({plain:.3g})")
    return None


def _kv_from_first_step(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    step, plain = _metric(m, "lm.kv_cache_first_bad_step"), _metric(m, "lm.kv_cache_unpadded_rows_max_abs")
    limit = c.get("lm.kv_cache_teacher_forcing", {}).get("threshold")
    if _failed(c, "lm.kv_cache_teacher_forcing") and step is not None and step <= 1 and plain is not None \
            and limit is not None and plain > limit:
        return (f"{_obs(c, 'lm.kv_cache_teacher_forcing')}; the prefill agrees, the first single-token step already "
                "differs, in the unpadded row too")
    return None


def _kv_window(c: Checks, m: list[dict[str, Any]], cfg: Mapping[str, Any]) -> str | None:
    step, length = _metric(m, "lm.kv_cache_first_bad_step"), _metric(m, "lm.kv_cache_first_bad_length")
    if _failed(c, "lm.kv_cache_teacher_forcing") and step is not None and length is not None and step > 1:
        return (f"{_obs(c, 'lm.kv_cache_teacher_forcing')}; the first {step:g} cached steps agree, then from sequence "
                f"length {length:g} on the cached logits differ")
    return None


CATALOGUE: tuple[Signature, ...] = (
    Signature("attn-check", ("sdpa_match", "head_counts", "row_sums", "causal_zero", "padding_zero", "shapes"),
              _scale_or_merge,
              "scores scaled by 1/√d_model instead of 1/√d_head, or heads merged back without transposing "
              "(B,H,T,Dh)->(B,T,H,Dh): both are invisible at one head", ("ScaleByDModel", "MissingTransposeMerge")),
    Signature("attn-check", ("sdpa_match", "row_sums", "causal_zero", "padding_zero", "shapes"), _scale_only,
              "scores scaled by 1/√d_model instead of 1/√d_head (right only at one head, where they are equal)",
              ("ScaleByDModel",)),
    Signature("attn-check", ("sdpa_match", "row_sums", "causal_zero", "padding_zero", "shapes"), _merge_only,
              "the heads are merged back without transposing (B,H,T,Dh) -> (B,T,H,Dh) first (or the output "
              "projection is wrong): positions and heads get interleaved", ("MissingTransposeMerge",)),
    Signature("attn-check", ("row_sums",), _rows_blank,
              "the padding mask hides padded queries (rows) instead of padded keys (columns)", ("PaddingOnQueries",)),
    Signature("attn-check", ("row_sums",), _rows_not_normalised,
              "softmax taken over the wrong axis (dim=-2, the queries) instead of the keys", ("WrongSoftmaxAxis",)),
    Signature("attn-check", ("causal_zero",), _simple("causal_zero"),
              "the causal mask lets a query see future keys: off by one (triu(diagonal=2)) or missing",
              ("CausalOffByOne",)),
    Signature("attn-check", ("padding_zero",), _simple("padding_zero"),
              "padded keys get weight: the key padding mask is missing or applied to the queries", ("PaddingOnQueries",)),
    Signature("attn-check", ("shapes",), _simple("shapes"),
              "the module returns another layout: weights averaged over heads (B,T,T), or time-major output (T,B,D)",
              ("HeadAveragedWeights", "TimeMajorOutput")),
    Signature("attn-check", ("fully_masked_rows",), _nan_rows,
              "a query with no visible key gets NaN (softmax over all −inf), and the NaN reaches other rows' gradients",
              ("NaiveMHAWrapper",)),
    Signature("attn-check", ("gradcheck", "grad_match", "sdpa_match"),
              _simple("gradcheck", "grad_match", ok=("sdpa_match",), extra="the forward is right"),
              "a hand-written backward (custom autograd.Function) is wrong", ("WrongSoftmaxBackward",)),
    Signature("attn-check", ("gradcheck", "grad_match"), _simple("gradcheck", ok=("grad_match",)),
              "the module computes in lower precision than its input (e.g. a .float() downcast of fp64), so fp64 "
              "finite differences disagree", ("DowncastToFp32",)),
    Signature("attn-check", ("kv_cache_decode", "causal_zero"), _simple("kv_cache_decode", ok=("causal_zero",)),
              "with a KV cache the causal mask ignores the cached length (no position offset)", ("CacheWithoutOffset",)),
    Signature("attn-check", ("batch_independence",), _simple("batch_independence"),
              "a statistic shared across the batch (e.g. the softmax max over the whole batch, not per row)",
              ("GlobalMaxSoftmax",)),
    Signature("attn-check", ("batch_sizes", "batch_independence"),
              _simple("batch_sizes", ok=("batch_independence",)),
              "each batch row gets another row's padding mask (mask tiled with repeat() after flattening (B,H) "
              "instead of repeat_interleave())", ("RepeatMaskBug",)),
    Signature("attn-check", ("dropout_eval_identity",), _simple("dropout_eval_identity"),
              "dropout also runs in eval mode (F.dropout's training flag left at True)", ("DropoutAlwaysOn",)),
    Signature("attn-check", ("dropout_scale", "dropout_rate"), _simple("dropout_scale", ok=("dropout_rate",)),
              "kept weights are not rescaled by 1/(1−p)", ("DropoutNoRescale",)),
    Signature("attn-check", ("dropout_rate",), _dropout_keep_prob,
              "p is used as the keep probability (TF1's keep_prob): a fraction 1−p is dropped", ("DropoutKeepProb",)),
    Signature("attn-check", ("dropout_seed",), _simple("dropout_seed"),
              "the dropout mask comes from an RNG torch.manual_seed does not control (e.g. numpy's)",
              ("DropoutNumpyRNG",)),
    Signature("attn-check", ("chunked_match",), _simple("chunked_match"),
              "the online softmax does not rescale the running sums when the running max grows",
              ("chunked_no_rescale",)),
    Signature("attn-check", ("chunked_memory", "chunked_match"), _simple("chunked_memory", ok=("chunked_match",)),
              "the 'chunked' path materialises the full (T,T) score matrix", ("chunked_materialized",)),
    Signature("route-sim", ("layer.probs_sum_to_one", "layer.batch_independence", "layer.permutation_equivariance"),
              _simple("layer.probs_sum_to_one", "layer.batch_independence", ok=("layer.permutation_equivariance",)),
              "the router's softmax runs over the tokens instead of the experts: a token's routing depends on the "
              "rest of the batch", ("buggy_moe.SoftmaxOverTokens",)),
    Signature("route-sim", ("layer.topk_weights_sum", "layer.routing_selection"),
              _simple("layer.topk_weights_sum", ok=("layer.routing_selection",)),
              "the right experts are chosen but their top-k weights are not renormalised to sum to 1",
              ("buggy_moe.NotRenormalised",)),
    Signature("route-sim", ("layer.routing_selection", "layer.probs_sum_to_one"),
              _simple("layer.routing_selection", ok=("layer.probs_sum_to_one",)),
              "the probabilities are right but the wrong experts are chosen (e.g. topk(largest=False): the "
              "smallest scores)", ("buggy_moe.ArgminRouting",)),
    Signature("route-sim", ("layer.finite.fp16", "layer.output_vs_reference"),
              _simple("layer.finite.fp16", ok=("layer.output_vs_reference",)),
              "exp(z)/Σexp(z) without subtracting the max: fine in fp32, overflows in fp16",
              ("buggy_moe.UnstableSoftmax",)),
    Signature("route-sim", ("layer.permutation_equivariance", "layer.loads_sum"),
              _simple("layer.permutation_equivariance", "layer.loads_sum"),
              "a capacity limit that serves assignments in token order: reordering the tokens changes who is "
              "dropped", ("buggy_moe.FirstComeCapacity",)),
    Signature("route-sim", ("layer.cv_maxvio", "layer.loads_sum"), _simple("layer.cv_maxvio", ok=("layer.loads_sum",)),
              "the loads are right but CV/MaxVio are computed differently (e.g. the sample std, n−1, for CV)", ()),
    Signature("shift-labels", ("labels_are_next_tokens",), _simple("labels_are_next_tokens"),
              "labels are not the inputs shifted by one (labels = inputs, or shifted the wrong way)", ()),
    Signature("shift-labels", ("padding_invariance_loss", "padding_invariance_logits", "left_right_same_token_loss"),
              _shift_left_only,
              "the model does not get (or does not use) the padding mask / mask-derived positions", ()),
    Signature("arch", ("lm.causal",), _simple("lm.causal"),
              "the model is not causal: a position's logits change when a later token changes", ()),
    Signature("arch", ("lm.causal_cached", "lm.causal"), _simple("lm.causal_cached", ok=("lm.causal",)),
              "no causal mask when a cache is requested or given (code written for one-token steps): a prefill or a "
              "multi-token chunk sees its future", ("planted_models.NoCausalMaskWithCache",)),
    Signature("arch", ("lm.left_pad_positions", "lm.causal"), _simple("lm.left_pad_positions", ok=("lm.causal",)),
              "left padding changes the real tokens' logits: positions that ignore the supplied ids and the mask "
              "(numbered from the first pad), or real tokens that see the padding (`tfmoe shift-labels impl=...`'s "
              "lm.padding_content tells which)",
              ("planted_models.PositionsIgnoreIds", "planted_models.PaddingOnQueriesNotKeys")),
    Signature("shift-labels", ("lm.padding_content", "lm.batch_invariance.left"),
              _simple("lm.padding_content", "lm.batch_invariance.left"),
              "real tokens see the padding: the padding mask is applied to the queries instead of the keys (or not "
              "at all); right padding hides it behind the causal mask, left padding does not",
              ("planted_models.PaddingOnQueriesNotKeys",)),
    Signature("shift-labels", ("lm.batch_invariance.left", "lm.padding_content"),
              _simple("lm.batch_invariance.left", ok=("lm.padding_content",)),
              "left padding shifts the positions (pad ids themselves are invisible): the model numbers positions "
              "from the first pad instead of taking them from the mask or the supplied ids",
              ("planted_models.PositionsIgnoreIds",)),
    Signature("shift-labels", ("lm.loss_matches_shifted_ce",), _loss_counts_padding,
              "the loss averages over every position, the ignored ones counted as 0 (reduction='none' then .mean())",
              ("planted_models.LossCountsPadding",)),
    Signature("shift-labels", ("lm.loss_matches_shifted_ce", "lm.batch_invariance.left", "lm.batch_invariance.right"),
              _loss_other, "the loss is not the cross-entropy of logits[t] against labels[t+1]: not shifted (or shifted "
              "twice)", ("planted_models.LossNotShifted",)),
    Signature("decode", ("lm.kv_cache_teacher_forcing",), _kv_padded_only,
              "a cached step ignores the past keys' padding mask (it masks only the new keys), so left padding "
              "becomes visible once decoding starts", ("planted_models.CacheForgetsPastMask",)),
    Signature("decode", ("lm.kv_cache_teacher_forcing",), _kv_from_first_step,
              "the single-token step uses the wrong position: RoPE (or a position embedding) off by one against the "
              "cache's length", ("planted_models.RopeOffByOneInStep",)),
    Signature("decode", ("lm.kv_cache_teacher_forcing",), _kv_window,
              "the cache silently keeps only the most recent keys (a sliding window): right while the sequence fits, "
              "wrong after", ("planted_models.CacheKeepsLastN",)),
    Signature("decode", ("lm.generation_batch_vs_alone", "lm.kv_cache_teacher_forcing"),
              _simple("lm.generation_batch_vs_alone", ok=("lm.kv_cache_teacher_forcing",)),
              "the cache agrees with the full forward, yet a left-padded prompt decodes differently from the same "
              "prompt alone: left padding itself changes the logits (positions from the first pad, or padding "
              "visible to real tokens: arch's lm.left_pad_positions and shift-labels' lm.padding_content tell which)",
              ("planted_models.PositionsIgnoreIds", "planted_models.PaddingOnQueriesNotKeys")),
    Signature("decode", ("parallel_equals_incremental",), _simple("parallel_equals_incremental"),
              "position t sees later tokens in the parallel forward (not causal), or the incremental path loses "
              "positions (a cache without offsets)", ()),
)


def raised(row: Mapping[str, Any]) -> bool:
    return is_raised(row.get("observed"), row.get("detail"))


def common_exception(checks: Checks) -> str | None:
    """The detail ("raised <Type>: <message>") when every failed check raised the one same exception (so no check
    measured anything wrong), else None."""
    failed = [row for row in checks.values() if not bool(row["passed"])]
    details = {str(row.get("detail")) for row in failed}
    if failed and all(raised(row) for row in failed) and len(details) == 1:
        return details.pop()
    return None


def diagnose(experiment: str, checks: Checks, metrics: list[dict[str, Any]], cfg: Mapping[str, Any]) -> list[Inference]:
    """Every catalogue signature the failed run matches (none when every check passed). Only measured checks are
    evidence: a signature that reads a check which raised is never matched."""
    if all(bool(v["passed"]) for v in checks.values()):
        return []
    out = []
    for sig in CATALOGUE:
        if sig.experiment != experiment:
            continue
        if any(name in checks and raised(checks[name]) for name in sig.checks):
            continue
        evidence = sig.match(checks, metrics, cfg)
        if evidence:
            out.append(Inference(sig.cause, evidence, sig.planted))
    return out


def checks_mapping(rows: Any) -> dict[str, dict[str, Any]]:
    """Recorder CheckRows or a checks.parquet frame -> {check: {passed, observed, threshold, detail}}."""
    if hasattr(rows, "to_dict"):
        rows = rows.to_dict("records")
    out = {}
    for r in rows:
        d = r if isinstance(r, Mapping) else vars(r)
        out[str(d["check"])] = {k: d.get(k) for k in ("passed", "observed", "threshold", "detail")}
    return out


def same_exception_line(detail: str) -> str:
    return f"every failed check {detail} (one exception in each; no check measured a wrong value: fix it first)"


def markdown(inferences: list[Inference], same: str | None = None) -> list[str]:
    first = [f"**{same_exception_line(same)}**", ""] if same else []
    if not inferences:
        return first
    return [*first, "### Likely causes (inferred from the failure pattern — the checks above are the proof)", "",
            *[f"- {i.cause}. Evidence: {i.evidence}." + (f" Planted-bug catalogue: {', '.join(i.planted)}."
                                                          if i.planted else "") for i in inferences], ""]
