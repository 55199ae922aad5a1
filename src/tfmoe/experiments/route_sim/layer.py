"""route-sim's layer battery: judge one MoE layer (the package's own, a Hugging Face sparse block, or any
class in the course's ToyMoE interface) against the independent float64 reference of
:mod:`tfmoe.components.moe_reference`.

Checks (each named ``layer.<check>`` in checks.parquet):
  output_vs_reference      layer output vs the float64 dense reference, within 2x the error of the same
                           mixture computed plainly in the run's dtype (+ a few ulps of the output's scale)
  expert_internals         each rebuilt expert against the layer's own expert module on the token rows it
                           received (the weight inside the expert fitted per row first); not judged where an
                           expert is run as a black box (no layout describes it), naming the hook that would judge
                           it, or cannot be called as expert(x) (then output_vs_reference is not judged either)
  routing_selection        the experts each token reached (router hook) = the reference's choice
  routing_weights          the combine weights (router hook) = the reference's, within the router's dtype. Read
                           where the layer applies them (:data:`MIXING`): at each expert's output (the probe), along
                           a latent MoE's projection, or off the router through the declared semantics; an
                           undeclared form the probe cannot read is detected and named (not judged, no cause)
  probs_sum_to_one         the layer's full router distribution sums to 1 per token (where it exposes one)
  topk_weights_sum         the k weights sum to 1 (times routed_scaling_factor) where the design normalises
  loads_sum / cv_maxvio    loads from the captured routing sum to tokens*k; CV and MaxVio recomputed
  permutation_equivariance permuting the tokens permutes the output
  batch_independence       each sequence's output alone = its output inside the batch
  finite.fp16 / .bf16      finite outputs in half precision, on tokens scaled so router logits reach ~16
  aux_loss_vs_switch       the model's own load-balancing loss = the Switch formula from captured routing
  bias_exercised           (correction-bias designs) the drawn bias changes some token's selection, so
                           selection-vs-weighting is actually tested
Design probes (metrics ``layer.alt.<name>``): the output error of plausible misreadings of the design
(e.g. DeepSeek-V3 weighting with bias-corrected scores); each must sit far above the tolerance.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from tfmoe.adapters import load_layer
from tfmoe.adapters.moe_layers import (
    EXPERT_HOOK,
    Captured,
    LayerRaised,
    LayerUnderTest,
    OwnLayer,
    ToyInterfaceLayer,
    call_layer,
    inside_weights,
)
from tfmoe.components import moe
from tfmoe.components import moe_reference as ref
from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.contract.tables import Rows
from tfmoe.experiments.route_sim.checks import check_cv_maxvio, check_loads_sum
from tfmoe.experiments.route_sim.settings import LayerSettings
from tfmoe.rules import capabilities as caps
from tfmoe.rules.faults import RAISED, tfmoe_fault

PREFIX = "layer."
LOW_PRECISION = (torch.float16, torch.bfloat16)
MOE_FEATURES = ("fp16", "bf16")  # the capabilities.FEATURES a layer-battery check needs (finite.fp16 / .bf16)
LOGIT_TARGET = 16.0  # half-precision probe: scale tokens until the largest router logit is about this


# ---------------------------------------------------------------------------- utilities
def _ulps(*dtypes: torch.dtype) -> float:
    """Machine epsilon of the coarsest of ``dtypes``."""
    return max(torch.finfo(d).eps for d in dtypes)


def _router_ulps(lut: LayerUnderTest, o: Observation) -> float:
    """Epsilon of the precision the combine weights carry: the run's dtype, the captured weights' dtype, and the
    precision the design routes in (fp32 for HF's and the package's routers, even in an fp64 run)."""
    extra = (lut.router_precision,) if lut.router_precision is not None else ()
    return _ulps(o.x.dtype, o.cap.weights.dtype, *extra)


DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRECISION_OF = {v: k for k, v in DTYPES.items()}
LONG = {k: str(v).removeprefix("torch.") for k, v in DTYPES.items()}


def _coarsest(*dtypes: torch.dtype | None) -> torch.dtype:
    """The dtype with the largest epsilon among those given (None skipped)."""
    return max((d for d in dtypes if d is not None), key=lambda d: torch.finfo(d).eps)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _max_abs(a: torch.Tensor) -> float:
    return float(a.abs().max()) if a.numel() else 0.0


MIXING = {
    "weight_inside_expert": "the combine weight scales the expert's hidden activation before its last projection",
    "post_mixture_projection": "a fixed projection applied after the weighted mixture (a latent MoE projecting back)",
}


def mixing_form(value: object, where: str) -> str | None:
    """A declared mixing form (None: the weight multiplies each expert's output); anything else is bad input."""
    if value is None or str(value) in ("", "expert_output", "None"):
        return None
    if str(value) not in MIXING:
        raise BadInput(f"{where}={value!r} is not a mixing form: use {' or '.join(MIXING)} (or null: the weight "
                       "multiplies each expert's output)")
    return str(value)


def declared_mixing(p: LayerSettings, lut: LayerUnderTest) -> tuple[str | None, str]:
    """(the declared mixing form, who declared it): the config's ``layer.mixing``, else ``mixing`` / ``tfmoe_mixing``
    on the adapter or the course-interface class."""
    if p.mixing:
        return p.mixing, "layer.mixing"
    for obj in lut.declaring:
        for attr in ("mixing", "tfmoe_mixing"):
            value = getattr(obj, attr, None)
            if value is not None:
                return mixing_form(value, f"{lut.label}: {attr}"), attr
    return None, ""


def _low_precision_copy(lut: LayerUnderTest, module: nn.Module, rec: Recorder, dtype: torch.dtype) -> nn.Module:
    """The layer in ``dtype``, made through its factory or adapter, never by deep-copying a layer tfmoe did not
    build (a ProcessGroup, a hook or other state that cannot be copied stays with the original): a fresh build from
    the run's seed, the original's state loaded into it where its keys allow, then cast."""
    low = build_layer(lut, rec)
    try:
        low.load_state_dict(module.state_dict())
    except (RuntimeError, KeyError, TypeError):  # keys that differ per instance: the seeded build's own weights
        pass
    return low.to(rec.device, dtype)


@dataclass
class Observation:
    x: torch.Tensor  # (B,T,D) run dtype
    out: torch.Tensor  # (B,T,D)
    cap: Captured
    ref_out: torch.Tensor  # (N,D) float64
    ref: ref.ReferenceRouting
    clear: torch.Tensor  # (N,) bool: tokens whose decision is not within rounding of a tie
    ref_runs: bool = True  # False: a black-box expert cannot be called as expert(x), so ref_out is not computed
    expert_dtype: torch.dtype | None = None  # the precision the experts compute in (declared or detected), if coarser


def observe(lut: LayerUnderTest, module: nn.Module, weights: ref.LayerWeights, x: torch.Tensor,
            sem: ref.RoutingSemantics | None = None, experts_run: bool = True) -> Observation:
    """The layer's output and routing on x, and the reference's (its output only where ``experts_run``: every
    black-box expert callable as expert(x))."""
    out, cap = lut.run(module, x)
    sem = sem or lut.semantics
    if cap.weights is None and sem.weight_inside_expert and experts_run:  # measured inside the experts
        targets = lut.expert_modules(module)
        inside = None if not targets else call_layer(inside_weights, lambda t: lut.forward(module, t), x, targets,
                                                     weights.experts)
        if inside is not None:
            cap.weights, cap.zero_tol, cap.source = inside, 64 * _ulps(x.dtype), "inside"
    if cap.weights is None:  # no module returns one expert's weighted output: the router's, through the semantics
        cap.weights, cap.zero_tol, cap.source = router_weights(cap, sem, weights), 0.0, "router"
    if experts_run:
        ref_out, r = ref.forward(_flat(x).double(), sem, weights)
    else:  # the routing alone: it needs no expert
        r = ref.route(_flat(x).double(), sem, weights)
        ref_out = torch.full_like(_flat(x), float("nan"), dtype=torch.float64)
    return Observation(x, out, cap, ref_out, r, r.margin > score_rounding(lut, sem, weights, x, r), experts_run)


def router_weights(cap: Captured, sem: ref.RoutingSemantics, weights: ref.LayerWeights) -> torch.Tensor:
    """(N,E) the combine weights the declared semantics give from the layer's own router output (its logits, else
    its probabilities read back as logits), in float64."""
    if cap.logits is not None:
        logits = cap.logits.double()
    elif sem.score_func == "softmax":
        logits = cap.probs.double().clamp_min(1e-300).log()
    else:
        p = cap.probs.double().clamp(1e-300, 1 - 1e-16)
        logits = (p / (1 - p)).log()
    return ref.route_logits(logits, sem, weights).weights


def score_rounding(lut: LayerUnderTest, sem: ref.RoutingSemantics, weights: ref.LayerWeights, x: torch.Tensor,
                   r: ref.ReferenceRouting) -> float:
    """How far the layer's scores can sit from the float64 ones by rounding alone: the same router computed
    plainly (logits in the run's dtype, or fp32 where the design computes them so; scores in fp32), 4x its
    worst score error + 4 fp32 ulps. A decision closer to a tie than this may go either way."""
    ld = torch.float32 if lut.logits_in_fp32 else x.dtype
    logits = (_flat(x).to(ld) @ weights.router.to(ld).T).float()
    if weights.router_bias is not None:
        logits = logits + weights.router_bias.float()
    scores = logits.softmax(dim=-1) if sem.score_func == "softmax" else logits.sigmoid()
    return 4 * _max_abs(scores.double() - r.scores) + 4 * _ulps(torch.float32)


# ------------------------------------------------------------------------------- checks
def check_output(rec: Recorder, lut: LayerUnderTest, o: Observation, weights: ref.LayerWeights,
                 decl: caps.Declared | None = None) -> bool:
    """FlashAttention's rule: error vs the float64 reference <= 2x the error of the same mixture computed
    plainly in the run's dtype (the reference's routing, the layer's weights cast), + 4 ulps of the scale.

    Experts in another precision (capabilities rule 4): a declared ``expert_dtype`` coarser than the run's is judged
    against the plain mixture with its experts computed in that dtype (measured the same way); undeclared, an error
    above the run dtype's limit but within a lower precision's limit (fp16, then bf16) is judged at that precision
    and named, with both numbers. Each limit is 2x its plain error + 4 ulps (of the run's dtype: the output is
    stored in it) of the output's scale. ``o.expert_dtype`` is set to the precision judged at."""
    dtype = o.out.dtype
    x = _flat(o.x)
    keep = o.clear
    err = _max_abs((_flat(o.out).double() - o.ref_out)[keep])
    scale = max(_max_abs(o.ref_out), 1e-30)
    router_term = 4 * _router_ulps(lut, o) * scale if _router_ulps(lut, o) > _ulps(dtype) else 0.0

    def limit(expert_dtype: torch.dtype | None) -> tuple[float, float]:
        """(plain error, limit) of the mixture computed plainly in the run's dtype, experts in ``expert_dtype``."""
        if dtype == torch.float64 and expert_dtype in (None, torch.float64):
            plain = o.ref_out
        else:
            plain = ref.combine(x.to(dtype), o.ref.weights.to(dtype), lut.semantics, weights.to(dtype), expert_dtype)
        plain_err = _max_abs((plain.double() - o.ref_out)[keep])
        # the ulps are the output's, stored in the run's dtype whatever the experts compute in (the experts'
        # own rounding is what plain_err measures); a router that computes its weights coarser than the run
        # (fp32 in fp64) adds its own rounding
        return plain_err, 2 * plain_err + 4 * _ulps(dtype) * scale + router_term

    run_name = PRECISION_OF.get(dtype, "fp32")
    declared = (decl.precisions.get("experts") if decl else None)
    declared_dtype = DTYPES[declared] if declared and torch.finfo(DTYPES[declared]).eps > _ulps(dtype) else None
    plain_err, tol = limit(declared_dtype)
    skipped = int((~keep).sum())
    detail = (f"max |out - float64 reference| over {int(keep.sum())} tokens"
              + (f" ({skipped} within rounding of a routing tie left out)" if skipped else ""))
    note = ""
    if declared_dtype is not None:
        o.expert_dtype = declared_dtype
        note = caps.precision_note("experts", declared, err, plain_err, detected=False)
        rec.metric(f"{PREFIX}output.plain_{declared}_error", plain_err)
    elif not err <= tol:  # NaN never explained
        limits, plains = {}, {}
        for name in caps.LOWER_PRECISIONS.get(run_name, ()):
            plains[name], limits[name] = limit(DTYPES[name])
            rec.metric(f"{PREFIX}output.plain_{name}_error", plains[name])
        found = caps.explaining_precision(err, run_name, limits)
        if found is not None:  # rule 4: undeclared, so it fails at the run's dtype, naming the cause and the fix
            o.expert_dtype = DTYPES[found]  # the invariance limits follow it: one failure for one cause
            note = "CAUSE: " + caps.precision_note("experts", found, err, plains[found], detected=True,
                                                   declaration="layer.expert_dtype")
            detail += f"; plain {str(dtype).removeprefix('torch.')} mixture error {plain_err:.3g}, limit {tol:.3g}"
        elif limits:
            detail += ("; no lower expert precision explains it (" + ", ".join(
                f"plain {LONG[n]} {plains[n]:.2g}, limit {limits[n]:.2g}" for n in limits) + ")")
        inside = inside_reading(lut, o, weights, x)
        if found is None and inside is not None and inside <= tol:  # the weight before the last bias, undeclared
            detail = (f"CAUSE: the layer matches the reference read with the weight inside the expert, before its "
                      f"last projection's bias (error {inside:.3g}, limit {tol:.3g}): declare it (layer.mixing="
                      "weight_inside_expert, `mixing` on the adapter or `tfmoe_mixing` on the class); " + detail)
    if note:
        rec.note(f"precision: {note}")
        detail = f"{note}; " + detail
    else:
        detail += f"; plain {str(dtype).removeprefix('torch.')} mixture error {plain_err:.3g}"
    return rec.check_le(f"{PREFIX}output_vs_reference", err, tol, detail,
                        evidence={"out": o.out, "reference": o.ref_out})


def detect_mixing(o: Observation, same: torch.Tensor, tol: float, output_ok: bool) -> str | None:
    """Why the probe's reading is not the layer's combine weight, from measured evidence only (None: it is):

    - it reads 1 on every chosen assignment while the reference's weights are not all 1: the probe replaced an
      output the weight had already been applied to, inside the expert (or the layer applies no weight at all,
      which output_vs_reference judges);
    - the layer matches the reference and the probe reads every weight times one factor s != 1: a fixed linear map
      after the mixture (a latent MoE's projection back), which moves a constant expert output by s per unit;
    - the layer matches the reference and the probe reads something else: the weight is applied where the probe
      does not look."""
    chosen = o.ref.selected & same[:, None]
    if not bool(chosen.any()):
        return None
    probe, want = o.cap.weights.double()[chosen], o.ref.weights[chosen]
    if _max_abs(probe - 1.0) <= tol < _max_abs(want - 1.0):
        return (f"weight_inside_expert: the probe reads 1 on all {int(chosen.sum())} chosen assignments (reference "
                f"weights {float(want.min()):.3g}..{float(want.max()):.3g}): the weight is applied before the "
                "expert's output is produced, where replacing that output removes it (or not applied at all: "
                "output_vs_reference judges the combine)")
    factor = common_factor(probe, want, tol)
    if not output_ok:
        return None
    if factor is not None:
        return (f"post_mixture_projection: the layer matches the reference while the probe reads every weight x "
                f"{factor:.4g}: a constant expert output moves the layer's output through a fixed map after the "
                "mixture (a latent MoE's projection back)")
    return ("the layer matches the reference while the probe reads other weights: the weight is applied where "
            "replacing each expert's output does not measure it")


def common_factor(probe: torch.Tensor, want: torch.Tensor, tol: float) -> float | None:
    """s != 1 when the probe reads every chosen weight as s x the reference's (within ``tol``), else None."""
    factor = float((probe / want).median())
    if abs(factor - 1.0) > tol and _max_abs(probe - factor * want) <= tol * max(1.0, abs(factor)):
        return factor
    return None


def inside_reading(lut: LayerUnderTest, o: Observation, weights: ref.LayerWeights, x: torch.Tensor) -> float | None:
    """The layer's error against the reference read with the weight applied inside the experts (before the last
    projection's bias), where that reading differs from the declared one (some expert has a last bias); else None."""
    if lut.semantics.weight_inside_expert or all(ex.last_bias is None for ex in weights.experts):
        return None
    alt = ref.combine(x.double(), o.ref.weights, lut.semantics.variant(weight_inside_expert=True), weights)
    return _max_abs((_flat(o.out).double() - alt)[o.clear])


def check_routing(rec: Recorder, lut: LayerUnderTest, o: Observation, weights: ref.LayerWeights,
                  output_ok: bool = False, mixing: str | None = None) -> str:
    """routing_selection and routing_weights. Returns why the weights could not be judged ("" if they were)."""
    keep = o.clear
    wrong = (o.cap.selected != o.ref.selected).any(dim=-1) & keep
    n_wrong = int(wrong.sum())
    first = int(wrong.nonzero()[0]) if n_wrong else None
    detail = f"tokens whose captured experts differ from the reference's: {n_wrong} of {int(keep.sum())}"
    if first is not None:
        detail += (f"; token {first}: layer chose {o.cap.selected[first].nonzero().flatten().tolist()}, reference "
                   f"{o.ref.selected[first].nonzero().flatten().tolist()}")
    rec.check(f"{PREFIX}routing_selection", n_wrong == 0, n_wrong, 0.0, detail,
              evidence={"captured_selected": o.cap.selected, "reference_selected": o.ref.selected})
    same = keep & ~wrong
    dtype = o.x.dtype
    err = _max_abs((o.cap.weights.double() - o.ref.weights)[same])
    # FlashAttention's rule again: the same routing computed plainly in the run's dtype sets the scale
    plain = ref.route(_flat(o.x), lut.semantics, weights.to(dtype)) if dtype != torch.float64 else o.ref
    agree = same & (plain.selected == o.ref.selected).all(dim=-1)
    plain_err = _max_abs((plain.weights.double() - o.ref.weights)[agree])
    tol = 2 * plain_err + 8 * _router_ulps(lut, o) * max(1.0, _max_abs(o.ref.weights))
    combine = ("output_vs_reference judges the combine" if o.ref_runs else
               "the combine is not judged: a black-box expert cannot be called as expert(x)")
    where = {"router": "read off the layer's own router output through the declared semantics"
             + (f" (mixing = {mixing}: {MIXING[mixing]}; {combine})" if mixing else
                f" (no module returns one expert's output; {combine})"),
             "inside": "measured inside the experts: each expert's output on the rows it received against the "
                       "reference's unweighted expert on those rows (mixing = weight_inside_expert)",
             "probe": "measured by replacing each expert's output with a constant"
             + (" and reading the move along the declared projection after the mixture" if
                lut.probe_direction is not None else "")}[o.cap.source]
    detail = (f"max |captured combine weight - reference| over {int(same.sum())} tokens with the same experts "
              f"({where}); plain {str(dtype).removeprefix('torch.')} routing error {plain_err:.3g}")
    if o.cap.source == "probe" and mixing is None and lut.probe_direction is None and not err <= tol:
        form = detect_mixing(o, same, tol, output_ok)
        if form is not None:
            why = (f"mixing detected, {form}; the weights are judged where the layer applies them once it declares "
                   f"its form (layer.mixing=weight_inside_expert|post_mixture_projection, or `mixing` on the adapter "
                   f"/ `tfmoe_mixing` on the class; a latent MoE gives LayerWeights(pre=, post=))")
            rec.metric(f"{PREFIX}routing_weights.probe_error", err)
            rec.note(f"mixing: {form}")
            rec.not_applicable(f"{PREFIX}routing_weights", f"not judged: {why} (probe error {err:.3g}, limit "
                                                           f"{tol:.3g})")
            return why
    if not bool(same.any()):  # never a pass on no case
        rec.not_applicable(f"{PREFIX}routing_weights", "not judged: no token reached the reference's experts (see "
                           "routing_selection), so no combine weight can be compared")
        return "no token reached the reference's experts"
    chosen = o.ref.selected & same[:, None]
    factor = common_factor(o.cap.weights.double()[chosen], o.ref.weights[chosen], tol) \
        if o.cap.source == "probe" and mixing is None and lut.probe_direction is None and not err <= tol else None
    if factor is not None:  # one factor for every token: a scale or a projection, never a missing renormalisation
        detail += (f"; the probe reads every weight x {factor:.4g} (a projection after the mixture reads so: declare "
                   "mixing=post_mixture_projection, or give LayerWeights(pre=, post=))")
    rec.check_le(f"{PREFIX}routing_weights", err, tol, detail,
                 evidence={"captured_weights": o.cap.weights, "reference_weights": o.ref.weights})
    if factor is not None:
        return (f"the probe reads every weight x {factor:.4g}, one factor for every token, so the sum of the k "
                "weights measures that factor, not the renormalisation (routing_weights and output_vs_reference "
                "judge the weights)")
    return ""


def check_sums(rec: Recorder, lut: LayerUnderTest, o: Observation, unjudged: str = "") -> list[str]:
    """Returns the checks that do not apply to this layer (for the conformance table). ``unjudged``: why the
    combine weights could not be read (then their sum is not judged either)."""
    na = []
    if lut.exposes_probs and o.cap.probs is not None:
        probs = o.cap.probs.double()
        err = _max_abs(probs.sum(dim=-1) - 1.0)
        rec.check_le(f"{PREFIX}probs_sum_to_one", err, 8 * _ulps(o.cap.probs.dtype) * probs.shape[-1],
                     f"max over tokens of |sum over {probs.shape[-1]} experts of the router probabilities - 1|",
                     evidence={"probs": o.cap.probs})
    else:
        na.append("probs_sum_to_one")
    sem = lut.semantics
    if sem.normalize and (unjudged or o.cap.source == "router"):
        rec.not_applicable(f"{PREFIX}topk_weights_sum", "not judged: " + (unjudged or (
            "the combine weights are read off the router through the declared semantics, which normalise them by "
            "construction; " + ("output_vs_reference judges the weights the layer applies" if o.ref_runs else
                                "the weights the layer applies are not judged: a black-box expert cannot be called "
                                "as expert(x)"))))
    elif sem.normalize:
        full = o.ref.selected.sum(dim=-1) == sem.top_k  # tokens a capacity dropped nothing of (all, dropless)
        sums = o.cap.weights.double().sum(dim=-1)[full]
        err = _max_abs(sums - sem.scaling)
        tol = 8 * _router_ulps(lut, o) * max(1.0, sem.scaling) + 4 * sem.norm_eps
        dropped = int((~full).sum())
        rec.check_le(f"{PREFIX}topk_weights_sum", err, tol,
                     f"max over tokens of |sum of the k combine weights - {sem.scaling:g}| (the design normalises)"
                     + (f"; {dropped} tokens with an assignment over capacity left out" if dropped else ""),
                     evidence={"captured_weights": o.cap.weights})
    else:
        na.append("topk_weights_sum")
    return na


def check_loads(rec: Recorder, lut: LayerUnderTest, o: Observation) -> None:
    """Loads, CV, MaxVio computed by the package from the captured routing (the experts each token's output
    depends on); recomputed in numpy. The loads must sum to the assignments the design keeps: tokens*k, less
    what a declared capacity drops (the reference's count)."""
    s = lut.sizes
    sel = o.cap.selected
    k_per_token = sel.sum(dim=-1)
    idx = sel.nonzero()[:, 1]
    load = moe.expert_load(idx, s.n_experts)
    cv, maxvio = float(moe.load_cv(load)), float(moe.load_maxvio(load))
    rec.metric(f"{PREFIX}cv", cv)
    rec.metric(f"{PREFIX}maxvio", maxvio)
    rec.tensor(f"{PREFIX}expert_load", load)
    n = sel.shape[0]
    capacity = lut.semantics.capacity is not None
    if capacity:
        kept = int(o.ref.selected.sum())
        total = int(load.sum())
        rec.check(f"{PREFIX}loads_sum", total == kept, abs(total - kept), 0.0,
                  f"sum of per-expert loads = {total}, assignments kept under capacity {lut.semantics.capacity} "
                  f"(reference) = {kept} of tokens*k = {n * s.top_k}", evidence={"expert_load": load})
    else:
        check_loads_sum(rec, f"{PREFIX}loads_sum", load, n, s.top_k)
    if capacity or bool((k_per_token == s.top_k).all()):
        topk_idx = idx.view(-1, 1) if capacity else idx.view(n, s.top_k)
        rec.tensor(f"{PREFIX}topk_idx", topk_idx)
        check_cv_maxvio(rec, f"{PREFIX}cv_maxvio", rec.tensors_saved[f"{PREFIX}topk_idx"], s.n_experts, cv, maxvio)
    else:
        rec.check(f"{PREFIX}cv_maxvio", False, int((k_per_token != s.top_k).sum()), 0.0,
                  f"tokens that reached a number of experts other than top_k={s.top_k}: CV/MaxVio undefined")


def check_permutation(rec: Recorder, lut: LayerUnderTest, module: nn.Module, o: Observation,
                      gen: torch.Generator) -> None:
    b, t, d = o.x.shape
    perm = torch.randperm(b * t, generator=gen)
    x_perm = _flat(o.x)[perm].view(b, t, d)
    out_perm = lut.forward(module, x_perm)
    err = _max_abs(_flat(out_perm).double() - _flat(o.out).double()[perm])
    tol = 8 * _ulps(_coarsest(o.out.dtype, o.expert_dtype)) * max(_max_abs(o.out.double()), 1e-30)
    rec.check_le(f"{PREFIX}permutation_equivariance", err, tol,
                 f"max |layer(permuted tokens) - permuted layer(tokens)| over {b * t} tokens",
                 evidence={"out": o.out, "out_of_permuted": out_perm})


def check_batch(rec: Recorder, lut: LayerUnderTest, module: nn.Module, o: Observation) -> None:
    worst, where = 0.0, 0
    for i in range(o.x.shape[0]):
        alone = lut.forward(module, o.x[i : i + 1])
        err = _max_abs(alone[0].double() - o.out[i].double())
        if err > worst or not math.isfinite(err):
            worst, where = err, i
    tol = 8 * _ulps(_coarsest(o.out.dtype, o.expert_dtype)) * max(_max_abs(o.out.double()), 1e-30)
    rec.check_le(f"{PREFIX}batch_independence", worst, tol,
                 f"max over the {o.x.shape[0]} sequences of |layer(sequence alone) - its row of layer(batch)| "
                 f"(worst: sequence {where})")


def check_low_precision(rec: Recorder, lut: LayerUnderTest, module: nn.Module, weights: ref.LayerWeights,
                        x: torch.Tensor, decl: caps.Declared, experts_run: bool = True) -> None:
    """fp16 and bf16 copies of the layer (rebuilt through its factory or adapter, :func:`_low_precision_copy`) on tokens scaled so the largest router logit is ~LOGIT_TARGET. A dtype
    the layer declares it lacks is not run (n/a, rule 2); a NotImplementedError from a copy makes it n/a (rule 3)."""
    logits = _flat(x).double() @ weights.router.T
    scale = LOGIT_TARGET / max(_max_abs(logits), 1e-30)
    for dtype in LOW_PRECISION:
        name = PRECISION_OF[dtype]
        if name in decl.lacks:
            rec.not_applicable(f"{PREFIX}finite.{name}", lack_detail(decl, name, lut))
            continue
        low = _low_precision_copy(lut, module, rec, dtype)
        xs = (x.double() * scale).to(x.device, dtype)
        try:
            out = lut.forward(low, xs)
        except LayerRaised as exc:
            if isinstance(exc.exc, NotImplementedError):
                rec.not_applicable(f"{PREFIX}finite.{name}", caps.not_implemented_detail(exc.exc, name))
            else:
                rec.check(f"{PREFIX}finite.{name}", False, None, None,
                          f"{RAISED}{exc} (the {name} copy of the layer, on tokens scaled x{scale:.3g})")
            continue
        bad = int((~torch.isfinite(out)).sum())
        error = "no float64 reference (a black-box expert cannot be called as expert(x))"
        if experts_run:
            ref_out, _ = ref.forward(_flat(xs).double(), lut.semantics, weights)
            rel = _max_abs(_flat(out).double() - ref_out) / max(_max_abs(ref_out), 1e-30)
            rec.metric(f"{PREFIX}{name}.rel_error", rel if math.isfinite(rel) else float("nan"))
            error = f"max relative error vs float64 {rel:.3g} (recorded, not judged)"
        rec.check(f"{PREFIX}finite.{name}", bad == 0, bad, 0.0,
                  f"non-finite outputs of a {name} copy on tokens scaled x{scale:.3g} (router logits up to "
                  f"{LOGIT_TARGET:g}); {error}",
                  evidence={"out": out} if bad else None)


def check_aux_loss(rec: Recorder, lut: LayerUnderTest, module: nn.Module, o: Observation) -> bool:
    """The model's own loss vs the Switch formula E * sum_i f_i * P_i recomputed in numpy float64 from the
    captured routing: P_i the mean router probability (the layer's own, else softmax of the captured logits),
    f_i = load_i / tokens for HF (Mixtral's normalisation, balanced value k) and load_i / (tokens*k) for the
    package (balanced value 1)."""
    value = lut.aux_loss(module, o.cap)
    if value is None:
        return False
    source = o.cap.probs if o.cap.probs is not None else o.cap.logits
    if o.cap.probs is not None:
        p = o.cap.probs.double().cpu().numpy()
    else:
        z = o.cap.logits.double().cpu().numpy()
        z = z - z.max(axis=-1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    sel = o.cap.selected.cpu().numpy()
    n, e = sel.shape
    k = lut.sizes.top_k
    per_assignment = isinstance(lut, OwnLayer)
    f = sel.sum(axis=0) / (n * k if per_assignment else n)
    expected = float(e * np.sum(f * p.mean(axis=0)))
    err = abs(value - expected)
    tol = 8 * _ulps(source.dtype, torch.float32) * abs(expected) + 1e-7  # the loss is computed in that dtype
    rec.metric(f"{PREFIX}aux_loss", value)
    rec.check_le(f"{PREFIX}aux_loss_vs_switch", err, tol,
                 f"{lut.aux_loss_name} = {value:.8g} vs E*sum f_i*P_i from the captured routing = {expected:.8g} "
                 f"(f_i = load_i/{'(tokens*k)' if per_assignment else 'tokens'})")
    return True


def check_bias_exercised(rec: Recorder, lut: LayerUnderTest, weights: ref.LayerWeights, o: Observation) -> bool:
    """Where the design has a selection-only bias and the battery drew one (layer.bias_scale > 0)."""
    if not lut.draws_correction_bias or weights.correction_bias is None or lut.sizes.bias_scale == 0:
        return False
    unbiased = ref.route(_flat(o.x).double(), lut.semantics.variant(use_correction_bias=False), weights)
    changed = int((unbiased.selected != o.ref.selected).any(dim=-1).sum())
    rec.metric(f"{PREFIX}tokens_bias_changed", changed)
    rec.check(f"{PREFIX}bias_exercised", changed > 0, changed, 0.0,
              f"tokens whose reference selection changes when the correction bias is dropped ({changed} of "
              f"{o.ref.selected.shape[0]}): >0 means selection and weighting are tested apart")
    return True


def probe_designs(rec: Recorder, lut: LayerUnderTest, weights: ref.LayerWeights, o: Observation) -> None:
    """Each misreading's output error, next to the design's own (it must be far larger)."""
    x = _flat(o.x).double()
    out = _flat(o.out).double()
    rec.metric(f"{PREFIX}design.output_error", _max_abs(out - o.ref_out))
    for name, sem in lut.alternatives().items():
        alt_out, _ = ref.forward(x, sem, weights)
        rec.metric(f"{PREFIX}alt.{name}", _max_abs(out - alt_out))


# ------------------------------------------------------------------------------- battery
ALL_CHECKS = ("output_vs_reference", "expert_internals", "routing_selection", "routing_weights", "probs_sum_to_one", "topk_weights_sum",
              "loads_sum", "cv_maxvio", "permutation_equivariance", "batch_independence", "finite.fp16",
              "finite.bf16", "aux_loss_vs_switch", "bias_exercised")


NOT_DEFINED = {  # why a check does not apply to a layer (its n/a row)
    "probs_sum_to_one": "{label} exposes no full router distribution (router_probs)",
    "topk_weights_sum": "the design does not renormalise the k weights",
    "aux_loss_vs_switch": "{label} defines no load-balancing loss",
    "bias_exercised": "the design draws no selection-only correction bias",
}


def lack_detail(decl: caps.Declared, feature: str, lut: LayerUnderTest) -> str:
    """The n/a detail of a check whose feature the layer declares it lacks."""
    if decl.sources.get(feature) == "half_precision_unsupported":
        return (f"not applicable: the layer declares it lacks {feature} ({caps.FEATURES[feature]}; its "
                f"half_precision_unsupported: {lut.half_precision_unsupported})")
    return decl.why(feature)


def raised_in_run(rec: Recorder, names: tuple[str, ...] | list[str], exc: LayerRaised, suffix: str = "") -> None:
    """Checks the layer's exception left unjudged: n/a for a NotImplementedError (capabilities rule 3), else
    failed with the exception leading their detail."""
    for name in names:
        if isinstance(exc.exc, NotImplementedError):
            rec.not_applicable(f"{PREFIX}{name}", caps.not_implemented_detail(exc.exc))
        else:
            rec.check(f"{PREFIX}{name}", False, None, None, f"{RAISED}{exc}{suffix}")


def guarded(rec: Recorder, names: tuple[str, ...], run: Callable[[], object]) -> LayerRaised | None:
    """Run checks that call the layer; if the layer raises, those not yet recorded fail, the exception leading
    their detail (or are n/a for a NotImplementedError); the battery goes on. Returns the exception, if any."""
    before = {c.check for c in rec.checks_rows}
    try:
        run()
        return None
    except LayerRaised as exc:
        done = {c.check for c in rec.checks_rows} - before
        left = [n for n in names if f"{PREFIX}{n}" not in done]
        raised_in_run(rec, left, exc)
        rec.note(f"{', '.join(left)}: the layer raised {exc}")
        return exc


def observe_dispatch(rec: Recorder, o: Observation) -> None:
    """Whether the experts ran on only the rows routed to them: a named observation, never a routing check (a
    dense layer runs every expert on every token and weights most by exactly 0; its routing is the weights')."""
    rows = o.cap.expert_rows
    if rows is None:
        return
    n, e = o.cap.weights.shape
    assignments = int(o.cap.selected.sum())
    sparse = rows < n * e
    rec.metric(f"{PREFIX}expert_rows", rows)
    rec.metric(f"{PREFIX}dispatch_sparse", float(sparse))
    rec.note(f"dispatch: the experts ran on {rows} rows for {assignments} routed assignments of {n} tokens "
             f"({'sparse' if sparse else 'dense: every expert on every token'}; observed, not judged)")


ROUTING_CHECKS = ("output_vs_reference", "routing_selection", "routing_weights", "probs_sum_to_one",
                  "topk_weights_sum", "loads_sum", "cv_maxvio")


@torch.no_grad()
def build_layer(lut: LayerUnderTest, rec: Recorder) -> nn.Module:
    """The layer under test, built from the run's seed. tfmoe's or a shipped adapter's exception is tfmoe's fault
    (crashed); the user's layer or adapter failing to build for these sizes is bad input, one line (an adapter
    refuses a setting on purpose by raising tfmoe.contract.errors.BadInput), never a crash blamed on tfmoe (F-199)."""
    try:
        return lut.build(rec.seed).to(rec.device, rec.dtype)
    except BadInput:
        raise
    except Exception as exc:
        adapter = getattr(lut, "adapter", None)
        fault = tfmoe_fault(exc, f"impl={lut.label} (building the layer)", getattr(adapter, "library", None),
                            getattr(adapter, "supported", ""))
        if fault is not None:
            raise fault from exc
        message = " ".join(str(exc).split())
        s = lut.sizes
        raise BadInput(f"impl={lut.label}: building the layer (d_model={s.d_model}, n_experts={s.n_experts}, "
                       f"top_k={s.top_k}) raised {type(exc).__name__}{': ' + message if message else ''}: fix the "
                       "adapter's build or change those settings") from None


def run_battery(p: LayerSettings, rec: Recorder) -> LayerUnderTest:
    """Every check on one layer. Checks that do not apply are named in the run's notes ("n/a: ..."). A layer
    that raises fails the checks that called it, with its exception; the others still run."""
    t0 = time.perf_counter()
    lut = load_layer(p.impl, p.sizes, p.seq)
    decl = declarations(p, lut)
    run_name = PRECISION_OF.get(rec.dtype)
    if run_name in decl.lacks:  # rule 1: the run's own dtype is declared lacking
        fix = "run it with dtype=bf16 or dtype=fp64" if run_name == "fp32" else "run it with dtype=fp32 or dtype=fp64"
        if decl.sources.get(run_name) == "half_precision_unsupported":
            raise BadInput(f"impl={lut.label} cannot run in {str(rec.dtype).removeprefix('torch.')} (it declares it "
                           f"lacks {run_name}): {lut.half_precision_unsupported}: {fix}")
        raise caps.refusal(decl, {run_name: fix}, lut.label)
    for feature in sorted(decl.lacks - set(MOE_FEATURES)):  # every declaration is read, and its use said
        rec.note(f"declared: the layer lacks {feature} ({caps.FEATURES[feature]}): no layer-battery check needs it")
    if "router" in decl.precisions:  # the precision the combine weights carry, declared
        lut.router_precision = _coarsest(lut.router_precision, DTYPES[decl.precisions["router"]])
    module = build_layer(lut, rec)
    weights = lut.reference_weights(module)
    mixing = apply_mixing(p, lut, weights, rec)
    gen = torch.Generator().manual_seed(rec.seed + 11)
    s = lut.sizes
    x = torch.randn(p.batch, p.seq, s.d_model, generator=gen).to(rec.device, rec.dtype)  # (B,T,D)
    rec.tensor(f"{PREFIX}x", x)
    na: list[str] = []
    seen: list[Observation] = []
    broken = uncallable_expert(weights, x)
    raised = guarded(rec, ROUTING_CHECKS, lambda: seen.append(observe(lut, module, weights, x,
                                                                      experts_run=broken is None)))
    if raised is None:
        o = seen[0]
        rec.tensor(f"{PREFIX}out", o.out)
        if o.ref_runs:
            rec.tensor(f"{PREFIX}reference_out", o.ref_out)
        rec.tensor(f"{PREFIX}captured_weights", o.cap.weights)
        rec.tensor(f"{PREFIX}reference_weights", o.ref.weights)
        rec.metric(f"{PREFIX}tokens_near_tie", int((~o.clear).sum()))
        if broken is None:
            output_ok = check_output(rec, lut, o, weights, decl)
        else:
            output_ok = False
            rec.not_applicable(f"{PREFIX}output_vs_reference", "not judged: " + broken_detail(lut, *broken))
        note_opaque_experts(rec, lut, weights, broken)
        if broken is None and not weights.opaque:
            guarded(rec, ("expert_internals",), lambda: check_expert_internals(rec, lut, module, weights, o))
        unjudged = check_routing(rec, lut, o, weights, output_ok, mixing)
        na += check_sums(rec, lut, o, unjudged)
        check_loads(rec, lut, o)
        observe_dispatch(rec, o)
        if lut.order_dependent:
            na.append("permutation_equivariance")
            rec.note(f"permutation_equivariance not judged: {lut.order_dependent}")
        else:
            guarded(rec, ("permutation_equivariance",), lambda: check_permutation(rec, lut, module, o, gen))
        if lut.semantics.capacity is not None and lut.semantics.capacity_group is None:
            rec.not_applicable(f"{PREFIX}batch_independence", "not applicable: a capacity counted over the whole "
                               "batch (declared capacity_group='batch') lets one sequence's tokens take another's "
                               "expert slots by design")
        else:
            guarded(rec, ("batch_independence",), lambda: check_batch(rec, lut, module, o))
        def aux() -> None:
            if not check_aux_loss(rec, lut, module, o):
                na.append("aux_loss_vs_switch")

        guarded(rec, ("aux_loss_vs_switch",), aux)
        if not check_bias_exercised(rec, lut, weights, o):
            na.append("bias_exercised")
        if o.ref_runs:
            probe_designs(rec, lut, weights, o)
    else:
        needs = ["permutation_equivariance", "batch_independence"]
        needs += ["aux_loss_vs_switch"] if lut.aux_loss_name else []
        needs += ["bias_exercised"] if lut.draws_correction_bias else []
        raised_in_run(rec, needs, raised, " (the layer, on the run's tokens: not judged)")
        na += [n for n in ("aux_loss_vs_switch", "bias_exercised") if n not in needs]
        if broken is not None:  # the layer raised too: the black box's own failure is still named
            note_opaque_experts(rec, lut, weights, broken)
    check_low_precision(rec, lut, module, weights, x, decl, experts_run=broken is None)
    for note in lut.notes():
        rec.note(note)
    for name in na:  # a row each, so the table and the run's count agree
        why = f"not judged: {lut.order_dependent}" if name == "permutation_equivariance" else \
            "not applicable: " + NOT_DEFINED[name].format(label=lut.label)
        rec.not_applicable(f"{PREFIX}{name}", why)
        rec.note(f"n/a: {PREFIX}{name} ({lut.label})")
    rec.metric(f"{PREFIX}battery_s", time.perf_counter() - t0, measured=True)
    rec.note(f"layer battery on {lut.label}: {p.batch}x{p.seq} tokens, d_model {s.d_model}, {s.n_experts} experts, "
             f"top-{s.top_k}; reference = float64 dense recomputation from the layer's weights ({lut.semantics})")
    return lut


def apply_mixing(p: LayerSettings, lut: LayerUnderTest, weights: ref.LayerWeights, rec: Recorder) -> str | None:
    """Where the combine weights are read, from the declared mixing form (or a latent MoE's projections in the
    reference weights): at the experts' outputs (default), along the projection after the mixture, or off the
    router (weight inside the expert; a projection after the mixture the weights do not give)."""
    mixing, by = declared_mixing(p, lut)
    if mixing is None and weights.post is not None:
        mixing, by = "post_mixture_projection", "reference_weights (LayerWeights.post)"
    if mixing is None:
        return None
    rec.note(f"declared: mixing = {mixing} ({by}): {MIXING[mixing]}")
    if mixing == "weight_inside_expert":
        lut.probe_experts = False
        lut.semantics = lut.semantics.variant(weight_inside_expert=True)
    elif weights.post is not None:
        lut.probe_direction = weights.post.sum(dim=1)  # (D,) = post @ 1: where a constant latent output lands
    else:
        lut.probe_experts = False
    return mixing


def uncallable_expert(weights: ref.LayerWeights, x: torch.Tensor) -> tuple[ref.OpaqueExpert, LayerRaised] | None:
    """The first black-box expert that cannot be called as the reference calls it, ``expert(h)`` -> a tensor shaped
    like h (h: x in float64, or x preᵀ for a latent MoE's routed experts), with its exception; None if every one can.
    Such an expert does not fit the black-box contract (say its forward takes (x, weight)): the reference cannot
    compute the mixture, so what needs it is not judged, naming the exception and the hook."""
    h = _flat(x).double()
    h_routed = h if weights.pre is None else h @ weights.pre.to(h).T
    for inp, experts in ((h_routed, weights.experts), (h, weights.shared_list)):
        for ex in experts:
            if not isinstance(ex, ref.OpaqueExpert):
                continue
            try:
                y = call_layer(ex, inp)
                if not isinstance(y, torch.Tensor) or y.shape != inp.shape:
                    raise TypeError(f"returned {tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}"
                                    f" for an input {tuple(inp.shape)}: expected the input's shape")
            except LayerRaised as exc:
                return ex, exc
            except TypeError as exc:
                return ex, LayerRaised(exc)
    return None


def check_expert_internals(rec: Recorder, lut: LayerUnderTest, module: nn.Module, weights: ref.LayerWeights,
                           o: Observation) -> None:
    """expert_internals, where every expert is rebuilt from its weights and the layer's expert modules receive the
    token rows: each module's output on the rows it received against its rebuilt expert on the same rows (float64).
    With the weight inside the expert, each row's weight is fitted first (as :func:`inside_weights` does) and the
    residual judged. FlashAttention's rule: 2x the rebuilt expert's plain error in the run's dtype (the experts'
    declared or detected precision where coarser) + 4 ulps of the scale. No module receiving token rows (a fused or
    latent layout): no row, the experts are judged through output_vs_reference alone (a note says so)."""
    targets = lut.expert_modules(module)
    if not targets or weights.pre is not None or len(targets) != len(weights.experts):
        return
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def hook(i: int):
        def capture(_m: nn.Module, inputs: tuple, out: object) -> None:
            if inputs and isinstance(inputs[0], torch.Tensor):
                seen.append((i, inputs[0].detach(), ref.expert_output(out).detach()))
        return capture

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(targets)]
    try:
        call_layer(lut.forward, module, o.x)
    finally:
        for h in handles:
            h.remove()
    d, dtype = o.x.shape[-1], o.x.dtype
    def key(row: torch.Tensor) -> bytes:  # exact in float64 for every run dtype (numpy has no bfloat16)
        return row.double().cpu().numpy().tobytes()

    token_of = {key(row): t for t, row in enumerate(_flat(o.x))}
    compute = _coarsest(dtype, o.expert_dtype)

    def compare(inside: bool) -> tuple[float, float, float, int, set[int], float]:
        """(error, plain error, scale, rows, experts seen, max |fitted weight - reference weight|)."""
        err = plain_err = scale = off = 0.0
        n_rows, experts_seen = 0, set()
        for i, rows, y in seen:
            if rows.dtype != dtype or rows.shape[-1] != d or y.shape[-1] != d:
                continue
            rows, y = rows.reshape(-1, d), y.reshape(-1, d).double()
            tok = [token_of.get(key(r), -1) for r in rows]
            keep = torch.tensor([t >= 0 for t in tok], dtype=torch.bool, device=rows.device)
            if not bool(keep.any()):
                continue
            rows, y = rows[keep], y[keep]
            expert = weights.experts[i]
            z = expert(rows.double())  # (n,D) float64
            plain = expert.to(compute)(rows.to(compute)).double()
            if inside:  # y = w (z - b) + b: fit each row's w, judge the residual
                b = 0.0 if expert.last_bias is None else expert.last_bias.to(z)
                zc = z - b
                w = ((y - b) * zc).sum(dim=-1, keepdim=True) / (zc * zc).sum(dim=-1, keepdim=True).clamp_min(1e-300)
                z, plain = w * zc + b, w * (plain - b) + b
                want = o.ref.weights[[t for t in tok if t >= 0], i].to(w)
                off = max(off, _max_abs(w[:, 0] - want))
            err = max(err, _max_abs(y - z))
            plain_err = max(plain_err, _max_abs(plain - z))
            scale = max(scale, _max_abs(z))
            n_rows += rows.shape[0]
            experts_seen.add(i)
        return err, plain_err, scale, n_rows, experts_seen, off

    inside = lut.semantics.weight_inside_expert
    err, plain_err, scale, n_rows, experts_seen, _ = compare(inside)
    if not n_rows:
        rec.note(f"expert_internals: no expert module received token rows ({lut.label}): the experts are judged "
                 "through output_vs_reference alone")
        return
    tol = 2 * plain_err + 4 * _ulps(dtype) * max(scale, 1e-30)
    carried = ""
    if not inside and not err <= tol:  # undeclared: do the modules' outputs carry each row's combine weight?
        alt = compare(True)
        alt_tol = 2 * alt[1] + 4 * _ulps(dtype) * max(alt[2], 1e-30)
        if alt[0] <= alt_tol and alt[5] <= 256 * _ulps(compute):
            err, plain_err, tol, inside = alt[0], alt[1], alt_tol, True
            carried = " (the modules' outputs carry each row's combine weight: the weight inside the expert)"
    kinds = "/".join(sorted({type(ex).__name__ for ex in weights.experts}))
    via = (f"through {EXPERT_HOOK}" if callable(getattr(module, EXPERT_HOOK, None)) else
           "from the course layout" if isinstance(lut, ToyInterfaceLayer) else "from reference_weights")
    detail = (f"max |expert module's output - the expert rebuilt from its weights| over the {n_rows} token rows "
              f"{len(experts_seen)} of {len(targets)} experts received (rebuilt {via} as {kinds})"
              + ("; each row's combine weight fitted first (mixing = weight_inside_expert)" + carried if inside
                 else "")
              + f"; plain {str(compute).removeprefix('torch.')} expert error {plain_err:.3g}")
    rec.check_le(f"{PREFIX}expert_internals", err, tol, detail)


def expert_hook(lut: LayerUnderTest) -> str:
    """How this interface gives the reference an expert's weights."""
    return (f"give the class a method {EXPERT_HOOK}(self, i) returning expert i's weights" if
            isinstance(lut, ToyInterfaceLayer) else "return each expert from reference_weights(module)")


def broken_detail(lut: LayerUnderTest, ex: ref.OpaqueExpert, exc: LayerRaised) -> str:
    """Why the reference could not run a black-box expert: the user's exception first, then the contract and the
    hook that would judge it."""
    return (f"{RAISED}{exc} ({ex.name}, run as a black box, called as expert(x)): a black-box expert must be "
            f"callable as expert(x) -> a tensor shaped like x, so the reference cannot compute the mixture "
            f"(output_vs_reference, expert_internals and the design probes are not judged; the routing, loads, "
            f"invariances and dtypes are); {expert_hook(lut)} as a tfmoe.components.moe_reference.MlpExpert / "
            "GluExpert / ChunkedGluExpert to judge them")


def note_opaque_experts(rec: Recorder, lut: LayerUnderTest, weights: ref.LayerWeights,
                        broken: tuple[ref.OpaqueExpert, LayerRaised] | None = None) -> None:
    """expert_internals: not judged where the reference runs some experts as black boxes, naming the hook (and
    leading with the exception of one that cannot be called as expert(x))."""
    every = [*weights.experts, *weights.shared_list]
    opaque = [ex for ex in every if isinstance(ex, ref.OpaqueExpert)]
    if broken is not None:
        rec.not_applicable(f"{PREFIX}expert_internals", "not judged: " + broken_detail(lut, *broken))
        return
    if not opaque:
        return
    hook = expert_hook(lut)
    names = ", ".join(ex.name for ex in opaque[:3]) + (f" and {len(opaque) - 3} more" if len(opaque) > 3 else "")
    rec.not_applicable(f"{PREFIX}expert_internals",
                       f"not judged: {len(opaque)} of {len(every)} experts ({names}) have no layout the reference "
                       f"rebuilds, so it runs them as black boxes: a bug inside them is not seen (the routing, "
                       f"weights and combine around them are judged); {hook} as a tfmoe.components.moe_reference."
                       "MlpExpert / GluExpert / ChunkedGluExpert to judge them")


def declarations(p: LayerSettings, lut: LayerUnderTest) -> caps.Declared:
    """Everything the layer declares about itself (:mod:`tfmoe.rules.capabilities`): ``lacks`` / ``tfmoe_lacks`` and
    ``router_dtype`` / ``expert_dtype`` on the adapter or the course-interface class, the config's ``lacks`` and
    ``layer.router_dtype`` / ``layer.expert_dtype`` (which win), and ``half_precision_unsupported`` (lacks fp16
    and bf16)."""
    decl = caps.declared(*lut.declaring, config_lacks=p.lacks,
                         config_precisions={"router_dtype": p.router_dtype, "expert_dtype": p.expert_dtype})
    if lut.half_precision_unsupported:
        sources = dict(decl.sources)
        for feature in ("fp16", "bf16"):
            sources.setdefault(feature, "half_precision_unsupported")
        decl = caps.Declared(frozenset(sources), sources, decl.precisions)
    return decl


# ------------------------------------------------------------------------------ reporting
def battery_rows(rec: Recorder, label: str) -> Rows:
    """(check, pass/FAIL/n/a, detail) for every battery check, in ALL_CHECKS order."""
    got = {c.check.removeprefix(PREFIX): c for c in rec.checks_rows if c.check.startswith(PREFIX)}
    na = {n.removeprefix("n/a: " + PREFIX).split(" (")[0]: n for n in rec.notes if n.startswith("n/a: " + PREFIX)}
    rows = Rows(f"layer battery: {label}", ("check", "result", "detail"))
    for name in ALL_CHECKS:
        if name in got and not got[name].applicable:
            judged_not = got[name].detail.startswith("not judged")
            rows.add(name, "not judged" if judged_not else "n/a", got[name].detail.removeprefix("not judged: "))
        elif name in got:
            rows.add(name, "pass" if got[name].passed else "FAIL", got[name].detail)
        elif name in na:
            why = na[name].partition(" (")[2].removesuffix(")")
            rows.add(name, "n/a", why if ": " in why else f"not defined for {label}")
    return rows


def battery_summary(rec: Recorder, lut: LayerUnderTest) -> str:
    lines = [f"## Layer battery: {lut.label}", "", battery_rows(rec, lut.label).markdown()]
    for note in rec.notes:
        if note.startswith("precision: "):  # capabilities rule 4: a precision declared or detected, named
            lines += ["", "Precision: " + note.removeprefix("precision: ") + "."]
    inapplicable = [c for c in rec.checks_rows if c.check.startswith(PREFIX) and not c.applicable]
    if inapplicable:
        lines += ["", f"Not applicable or not judged ({len(inapplicable)}, never failures): "
                  + "; ".join(f"{c.check.removeprefix(PREFIX)}: {c.detail.removeprefix('not applicable: ')}"
                              for c in inapplicable) + "."]
    for note in rec.notes:
        if note.startswith("dispatch: "):  # an observation, not a check
            lines += ["", "Dispatch: " + note.removeprefix("dispatch: ") + "."]
    alts = [(r["name"].removeprefix(PREFIX + "alt."), r["value"]) for r in rec.metrics_rows
            if r["name"].startswith(PREFIX + "alt.")]
    if alts:
        own = next(r["value"] for r in rec.metrics_rows if r["name"] == PREFIX + "design.output_error")
        lines += ["", f"Design probes: max |out - reference| is {own:.3g} for the design as documented; for "
                  "misreadings: " + ", ".join(f"{n} {v:.3g}" for n, v in alts) + "."]
    return "\n".join(lines)
