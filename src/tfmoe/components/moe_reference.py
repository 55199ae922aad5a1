"""An independent float64 reference for a routed MoE layer, written from the published semantics.

It never calls the layer under test: it takes the layer's weights (copied to float64) and a statement of
the design's semantics (:class:`RoutingSemantics`, read from the model's config and documentation) and
computes, densely, for every token:

  logits = x W_r^T (+ router bias)                                  (N,E)
  scores = softmax(logits) | sigmoid(logits)                        (N,E)
  choice = scores + correction_bias (DeepSeek-V3; zeros otherwise)  (N,E), used for selection only
  groups: each group of E/G experts is scored by the sum of its two best choice scores; the best
          topk_group groups stay eligible (G = 1: every expert eligible)
  top-k  = the k eligible experts with the largest choice scores
  weight = scores of the chosen experts (uncorrected), / (their sum + norm_eps) if normalised,
           * routed_scaling_factor
  capacity (GShard / Switch, where the design declares one): within each group of ``capacity_group``
           consecutive tokens, every token's 1st choice in token order, then every 2nd choice, ...; an
           assignment past its expert's ``capacity`` is dropped (weight 0, the others not renormalised)
  out    = sum_e weight_e * expert_e(x)  (+ [sigmoid(x g)] * sum of the shared experts(x))  (+ x if residual)
  mixing forms: a weight applied inside the expert before its last projection (``weight_inside_expert``) scales
           everything but that projection's bias; a latent MoE (``LayerWeights.pre`` / ``post``) runs its experts
           on x preᵀ and projects the weighted mixture back with postᵀ (+ post_bias)

Selection uses a descending sort, not topk, and every expert runs on every token (no dispatch). Every expert
(routed and shared) is rebuilt from its weights (:class:`MlpExpert`, :class:`GluExpert`, :class:`ChunkedGluExpert`,
with the activation its layer documents): the layer's own expert modules never run here, except an expert no
layout describes, run as a black box (:class:`OpaqueExpert`: its module with float64 copies of its parameters; a
bug inside it is then not judged, and the battery says so).

The course case's bookkeeping is recomputed here too, without the package's statistics: loads, CV and MaxVio and
the Switch aux loss in numpy float64 from saved assignments (:func:`recompute_cv_maxvio`,
:func:`aux_loss_reference`), and the dispatched mixture as a dense (N,E) gate matrix times every expert
(:func:`dense_mixture`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call


@dataclass(frozen=True)
class RoutingSemantics:
    """What a design says its router and combine do (from its config and documentation)."""

    score_func: str  # "softmax" | "sigmoid"
    top_k: int
    normalize: bool  # renormalise the chosen weights to sum 1 (Mixtral always, others norm_topk_prob)
    scaling: float = 1.0  # routed_scaling_factor, applied after normalisation
    n_group: int = 1  # DeepSeek-V3 group-limited routing: G groups of E/G experts...
    topk_group: int = 1  # ...of which the best topk_group stay eligible
    use_correction_bias: bool = True  # False: a deliberately wrong variant that ignores the bias
    weight_from_corrected: bool = False  # True: a deliberately wrong variant weighting with scores + bias
    shared_gated: bool = True  # False: a deliberately wrong variant ignoring the shared expert's gate
    residual: bool = False  # the layer returns x + mixture
    norm_eps: float = 0.0  # renormalisation divides by (sum + norm_eps) (tensor2tensor-style gates: 1e-9)
    capacity: int | None = None  # assignments each expert takes per group; None = dropless
    capacity_group: int | None = None  # tokens per capacity group (consecutive; None = all tokens)
    weight_inside_expert: bool = False  # the weight scales the hidden activation before the expert's last projection

    def variant(self, **changes: object) -> RoutingSemantics:
        return replace(self, **changes)

    def __str__(self) -> str:
        """The semantics as reports state them: the score function, k and the renormalisation, then only what
        differs from the defaults (a deliberately wrong variant's switch is named only when it is set)."""
        shown = [f"score_func={self.score_func!r}", f"top_k={self.top_k}", f"normalize={self.normalize}"]
        for f in fields(self)[3:]:
            value = getattr(self, f.name)
            if value != f.default:
                shown.append(f"{f.name}={value!r}")
        return f"RoutingSemantics({', '.join(shown)})"


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def _to(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


@dataclass
class GluExpert:
    """down(act(x gate^T) * x up^T): gate, up (H,D); down (D,H), each in nn.Linear's (out, in) layout, bias-free
    (Mixtral, Qwen2-MoE, DeepSeek-V3 experts). A GLU with biases is ``ChunkedGluExpert(cat([up, gate]), down, act,
    b_in=cat([b_up, b_gate]), b_down=b_down)``."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    act: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (ACTIVATIONS[self.act](x @ self.gate.T) * (x @ self.up.T)) @ self.down.T

    def to(self, dtype: torch.dtype) -> GluExpert:
        return GluExpert(self.gate.to(dtype), self.up.to(dtype), self.down.to(dtype), self.act)

    @property
    def last_bias(self) -> torch.Tensor | None:
        return None


@dataclass
class MlpExpert:
    """act(x w1^T + b1) w2^T + b2: w1 (H,D), w2 (D,H) (the package's and the course's experts)."""

    w1: torch.Tensor
    w2: torch.Tensor
    act: str
    b1: torch.Tensor | None = None
    b2: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = ACTIVATIONS[self.act](x @ self.w1.T + (0 if self.b1 is None else self.b1))
        return h @ self.w2.T + (0 if self.b2 is None else self.b2)

    def to(self, dtype: torch.dtype) -> MlpExpert:
        return MlpExpert(self.w1.to(dtype), self.w2.to(dtype), self.act, _to(self.b1, dtype), _to(self.b2, dtype))

    @property
    def last_bias(self) -> torch.Tensor | None:
        return self.b2


@dataclass
class ChunkedGluExpert:
    """down(act(gate) * value * mult) + b_down, where [value; gate] = x w_in^T + b_in is one (2H, D) projection split
    in halves, value first (st-moe-pytorch's ``Expert``: Linear(D, 2H), GEGLU with its learned ``mult_bias`` (H,),
    Linear(H, D))."""

    w_in: torch.Tensor  # (2H,D)
    w_down: torch.Tensor  # (D,H)
    act: str
    b_in: torch.Tensor | None = None  # (2H,)
    mult: torch.Tensor | None = None  # (H,)
    b_down: torch.Tensor | None = None  # (D,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w_in.T + (0 if self.b_in is None else self.b_in)  # (N,2H)
        value, gate = h.chunk(2, dim=-1)
        h = ACTIVATIONS[self.act](gate) * value * (1 if self.mult is None else self.mult)
        return h @ self.w_down.T + (0 if self.b_down is None else self.b_down)

    def to(self, dtype: torch.dtype) -> ChunkedGluExpert:
        return ChunkedGluExpert(self.w_in.to(dtype), self.w_down.to(dtype), self.act, _to(self.b_in, dtype),
                                _to(self.mult, dtype), _to(self.b_down, dtype))

    @property
    def last_bias(self) -> torch.Tensor | None:
        return self.b_down


def expert_output(out: object) -> torch.Tensor:
    """An expert's output as one tensor: a tensor as is; a tuple ``(out, bias)`` (Megatron-style experts that return
    their last bias apart) as ``out + bias`` (a None bias skipped)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        rest = [t for t in out[1:] if t is not None]
        if all(isinstance(t, torch.Tensor) for t in rest) and len(rest) <= 1:
            return out[0] + rest[0] if rest else out[0]
    raise TypeError(f"an expert returned {type(out).__name__}: expected a tensor or a tuple (out, bias)")


class OpaqueExpert:
    """An expert no documented layout describes, run as a black box: its own module, called through
    ``torch.func.functional_call`` with its parameters and buffers cast to the input's dtype (float64 for the
    reference), so the module itself is never copied nor changed. A bug inside it is not judged (the battery says
    so); the routing, weights and combine around it are."""

    opaque = True
    last_bias = None

    def __init__(self, module: nn.Module, name: str = ""):
        self.module, self.name = module, name or type(module).__name__

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        state = {k: (v.to(x.dtype) if v.is_floating_point() else v)
                 for k, v in [*self.module.named_parameters(), *self.module.named_buffers()]}
        with torch.no_grad():
            return expert_output(functional_call(self.module, state, (x,))).to(x.dtype)

    def to(self, dtype: torch.dtype) -> OpaqueExpert:
        return self


# Every expert is rebuilt from its weights: the reference never runs the layer's own expert modules, so a bug
# inside an expert's code (its activation, a scale, a dropped bias) shows in layer.output_vs_reference.
Expert = GluExpert | MlpExpert | ChunkedGluExpert | OpaqueExpert
REBUILT = (GluExpert, MlpExpert, ChunkedGluExpert)


@dataclass
class LayerWeights:
    """The layer's weights in float64, detached copies."""

    router: torch.Tensor  # (E,D)
    experts: list[Expert]
    router_bias: torch.Tensor | None = None  # (E,)
    correction_bias: torch.Tensor | None = None  # (E,) selection-only bias (DeepSeek-V3)
    shared: Expert | list[Expert] | None = None  # shared expert(s), each added to every token's output
    shared_gate: torch.Tensor | None = None  # (1,D): the shared experts' sum scaled by sigmoid(x g^T) (Qwen2-MoE)
    pre: torch.Tensor | None = None  # (r,D) latent MoE: the experts run on x pre^T (bias-free)
    post: torch.Tensor | None = None  # (D,r) latent MoE: the weighted mixture projected back, mixture post^T ...
    post_bias: torch.Tensor | None = None  # (D,) ... + post_bias

    @property
    def shared_list(self) -> list[Expert]:
        return [] if self.shared is None else list(self.shared) if isinstance(self.shared, (list, tuple)) \
            else [self.shared]

    @property
    def opaque(self) -> list[int]:
        """Indices of the routed experts run as black boxes (then shared ones, numbered after them)."""
        return [i for i, ex in enumerate([*self.experts, *self.shared_list]) if isinstance(ex, OpaqueExpert)]

    def to(self, dtype: torch.dtype) -> LayerWeights:
        """The same weights in ``dtype`` (the plain same-dtype baseline of the tolerance rule)."""
        shared = None if self.shared is None else [ex.to(dtype) for ex in self.shared_list]
        return LayerWeights(self.router.to(dtype), [ex.to(dtype) for ex in self.experts],
                            _to(self.router_bias, dtype), _to(self.correction_bias, dtype), shared,
                            _to(self.shared_gate, dtype), _to(self.pre, dtype), _to(self.post, dtype),
                            _to(self.post_bias, dtype))


@dataclass
class ReferenceRouting:
    logits: torch.Tensor  # (N,E)
    scores: torch.Tensor  # (N,E)
    selected: torch.Tensor  # (N,E) bool, k per token
    weights: torch.Tensor  # (N,E) combine weight, 0 where not selected
    margin: torch.Tensor  # (N,) how far the decision is from a tie (choice and group scores)


def _descending(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, order = torch.sort(t, dim=-1, descending=True, stable=True)
    return values, order


def route(x: torch.Tensor, sem: RoutingSemantics, w: LayerWeights) -> ReferenceRouting:
    """x (N,D) float64 -> the design's routing decision."""
    logits = x @ w.router.T  # (N,E)
    if w.router_bias is not None:
        logits = logits + w.router_bias
    return route_logits(logits, sem, w)


def route_logits(logits: torch.Tensor, sem: RoutingSemantics, w: LayerWeights) -> ReferenceRouting:
    """Router logits (N,E) -> the design's routing decision (the scores, top-k, weights and capacity of
    :func:`route`); with the layer's own captured logits, the combine weights its documented semantics give."""
    if sem.score_func == "softmax":
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        scores = shifted.exp() / shifted.exp().sum(dim=-1, keepdim=True)
    elif sem.score_func == "sigmoid":
        scores = 1.0 / (1.0 + torch.exp(-logits))
    else:
        raise ValueError(f"unknown score_func {sem.score_func!r}")
    n, e = scores.shape
    choice = scores
    if w.correction_bias is not None and sem.use_correction_bias:
        choice = scores + w.correction_bias
    margin = torch.full((n,), float("inf"), dtype=logits.dtype, device=logits.device)
    eligible = torch.ones_like(scores, dtype=torch.bool)
    if sem.n_group > 1:
        per_group, _ = _descending(choice.view(n, sem.n_group, e // sem.n_group))
        group_score = per_group[..., :2].sum(dim=-1)  # (N,G) sum of each group's two best
        g_sorted, g_order = _descending(group_score)
        if sem.topk_group < sem.n_group:
            margin = torch.minimum(margin, g_sorted[:, sem.topk_group - 1] - g_sorted[:, sem.topk_group])
        keep_group = torch.zeros_like(group_score, dtype=torch.bool)
        keep_group.scatter_(1, g_order[:, : sem.topk_group], True)
        eligible = keep_group.repeat_interleave(e // sem.n_group, dim=1)  # (N,E)
    masked = choice.masked_fill(~eligible, float("-inf"))
    c_sorted, c_order = _descending(masked)
    k = sem.top_k
    if k < int(eligible[0].sum()):
        margin = torch.minimum(margin, c_sorted[:, k - 1] - c_sorted[:, k])
    selected = torch.zeros_like(scores, dtype=torch.bool)
    selected.scatter_(1, c_order[:, :k], True)
    weight_source = scores + w.correction_bias if (sem.weight_from_corrected and w.correction_bias is not None) \
        else scores
    weights = torch.where(selected, weight_source, torch.zeros_like(scores))
    if sem.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + sem.norm_eps)
    weights = weights * sem.scaling
    if sem.capacity is not None:
        selected = within_capacity(c_order[:, :k], e, sem.capacity, sem.capacity_group or n)
        weights = torch.where(selected, weights, torch.zeros_like(weights))
    return ReferenceRouting(logits, scores, selected, weights, margin)


def within_capacity(order: torch.Tensor, n_experts: int, capacity: int, group: int) -> torch.Tensor:
    """order (N,k): each token's experts, best first -> (N,E) bool of the assignments kept: per group of ``group``
    consecutive tokens, 1st choices in token order, then 2nd choices, ..., each expert keeping ``capacity``."""
    n, k = order.shape
    kept = torch.zeros(n, n_experts, dtype=torch.bool, device=order.device)
    for start in range(0, n, group):
        taken = [0] * n_experts
        for rank in range(k):
            for t in range(start, min(start + group, n)):
                e = int(order[t, rank])
                if taken[e] < capacity:
                    kept[t, e] = True
                    taken[e] += 1
    return kept


def combine(x: torch.Tensor, weights: torch.Tensor, sem: RoutingSemantics, w: LayerWeights,
            expert_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense combine: every expert on every token, out = sum_e weights[:, e] * expert_e(x) (+ shared, + x).
    Runs in x's dtype (float64 for the reference; the run's dtype for a plain same-dtype baseline); with
    ``expert_dtype`` every expert (routed and shared) computes in that dtype, its output cast back to x's (the
    plain yardstick of a layer whose experts compute in a fixed lower precision)."""

    def run(expert: Expert, inp: torch.Tensor) -> torch.Tensor:
        if expert_dtype is None or expert_dtype == inp.dtype:
            return expert(inp)
        return expert.to(expert_dtype)(inp.to(expert_dtype)).to(inp.dtype)

    h = x if w.pre is None else x @ w.pre.to(x.dtype).T  # (N,D) or latent (N,r)
    mix = torch.zeros(h.shape[0], w.post.shape[1] if w.post is not None else x.shape[1], dtype=x.dtype,
                      device=x.device)
    for e, expert in enumerate(w.experts):
        we = weights[:, e, None].to(x.dtype)
        y = run(expert, h)
        bias = expert.last_bias if sem.weight_inside_expert else None
        if bias is None:
            mix = mix + we * y
        else:  # down(w * hidden) + b: the weight scales all but the last projection's bias
            b = bias.to(x.dtype)
            mix = mix + we * (y - b) + (we != 0).to(x.dtype) * b
    out = mix if w.post is None else mix @ w.post.to(x.dtype).T + (0 if w.post_bias is None else w.post_bias)
    if w.shared is not None:
        shared = sum(run(ex, x) for ex in w.shared_list)
        if w.shared_gate is not None and sem.shared_gated:
            shared = torch.sigmoid(x @ w.shared_gate.T) * shared  # (N,1) * (N,D)
        out = out + shared
    if sem.residual:
        out = out + x
    return out


def forward(x: torch.Tensor, sem: RoutingSemantics, w: LayerWeights) -> tuple[torch.Tensor, ReferenceRouting]:
    """x (N,D) float64 -> (out (N,D), routing)."""
    r = route(x, sem, w)
    return combine(x, r.weights, sem, w), r


# ------------------------------------------------------------ the course case's bookkeeping
def recompute_cv_maxvio(topk_idx: torch.Tensor, n_experts: int) -> tuple[float, float]:
    """CV (population std / mean) and MaxVio from saved assignments (N,k), in numpy float64."""
    load = np.bincount(topk_idx.cpu().numpy().reshape(-1), minlength=n_experts).astype(np.float64)
    mean = load.mean()
    return float(load.std() / mean), float((load.max() - mean) / mean)


def aux_loss_reference(probs: torch.Tensor, topk_idx: torch.Tensor, coef: float) -> float:
    """coef * E * sum_i f_i * P_i from saved probabilities (N,E) and assignments (N,k), in numpy float64."""
    p = probs.cpu().double().numpy()
    idx = topk_idx.cpu().numpy()
    n, e = p.shape
    f = np.bincount(idx.reshape(-1), minlength=e) / (n * idx.shape[1])
    return float(coef * e * np.sum(f * p.mean(axis=0)))


def uniform_routing(n_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A perfectly uniform routing: probs all 1/E, token t -> experts t, t+1, ..., t+k-1 (mod E), so every
    expert gets exactly k of the E*k assignments. Returns probs (E,E) and topk_idx (E,k)."""
    probs = torch.full((n_experts, n_experts), 1.0 / n_experts)
    topk_idx = (torch.arange(n_experts)[:, None] + torch.arange(top_k)[None, :]) % n_experts
    return probs, topk_idx


def dense_mixture(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, keep: torch.Tensor,
                  experts: Sequence[torch.nn.Module], dtype: torch.dtype) -> torch.Tensor:
    """The mixture without gather/scatter: every expert (a copy in ``dtype``) on every token, combined with the
    (N,E) matrix of kept weights; float64 for the reference, the run's dtype for the plain baseline."""
    n, e = x.shape[0], len(experts)
    gate = torch.zeros(n, e, dtype=dtype, device=x.device)
    gate.scatter_(1, topk_idx, topk_weight.to(dtype) * keep.to(dtype))  # (N,E)
    xd = x.to(dtype)
    out = torch.zeros(xd.shape, dtype=dtype, device=x.device)
    for i, expert in enumerate(experts):
        ex = copy.deepcopy(expert).to(dtype)
        out += gate[:, i, None] * ex(xd)
    return out
