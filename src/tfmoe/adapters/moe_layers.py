"""MoE layers under test for route-sim's layer battery: what the battery needs from any layer.

A :class:`LayerUnderTest` builds the layer (from the seed), runs it on (B,T,D) tokens while forward hooks
capture its routing, and hands the battery the layer's weights in float64 plus the design's semantics
(:class:`~tfmoe.components.moe_reference.RoutingSemantics`), from which the independent reference
recomputes everything. Two kinds live here: the package's own :class:`~tfmoe.components.moe.MoELayer`, and
any class in the course's ToyMoE interface (``impl=pkg.module:Class``); Hugging Face blocks are in
:mod:`tfmoe.adapters.moe_hf`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from tfmoe.components import moe
from tfmoe.components import moe_reference as ref
from tfmoe.contract.errors import BadInput
from tfmoe.rules.user_code import load_object


@dataclass(frozen=True)
class LayerSizes:
    d_model: int
    d_hidden: int
    n_experts: int
    top_k: int
    score_func: str = "softmax"  # the package's own layer
    n_group: int = 4  # DeepSeek-V3 layouts
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True  # Qwen2-MoE / DeepSeek-V3 layouts
    shared_hidden: int = 32  # Qwen2-MoE shared expert width
    bias_scale: float = 0.1  # std of DeepSeek-V3's correction bias, set non-zero from the seed
    capacity_factor: float | None = None  # capacity layers (lib:*): None = the library's eval default
    straight_through: bool = True  # st-moe-pytorch's straight-through dispatch tensor (its default)


@dataclass
class Captured:
    """The routing the layer applied, as dense (N,E) matrices. A token's experts are those with a nonzero combine
    weight (above ``zero_tol``, the measurement's own rounding: 0 where the weights are read off the router),
    never which rows reached an expert: a layer may run every expert on every token and weight most by 0."""

    weights: torch.Tensor  # (N,E) float, 0 where not selected
    probs: torch.Tensor | None = None  # (N,E) the layer's full router distribution, where it exposes one
    logits: torch.Tensor | None = None  # (N,E) router logits, where the router exposes them
    expert_rows: int | None = None  # rows the experts ran on in the forward (N*E: dense dispatch), where hooks see it
    zero_tol: torch.Tensor | float = 0.0  # (N,1) or scalar: |weight| <= this counts as not selected
    source: str = "probe"  # "probe": measured at the experts' outputs; "router": the router's output through the
    #                        declared semantics (set by the battery where no module returns one expert's output)

    @property
    def selected(self) -> torch.Tensor:
        """(N,E) bool: the experts each token's output depends on."""
        return self.weights.abs() > self.zero_tol


class LayerRaised(Exception):
    """The layer under test (its own forward, or the library a shipped adapter drives) raised: a failure of the
    checks that needed that call, never a crash of the battery. ``str()`` is the exception's type and message."""

    def __init__(self, exc: BaseException):
        self.exc = exc
        message = " ".join(str(exc).split())
        super().__init__(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)


def call_layer(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args) without grad; any exception but bad input becomes :class:`LayerRaised`."""
    try:
        with torch.no_grad():
            return fn(*args, **kwargs)
    except (BadInput, LayerRaised, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise LayerRaised(exc) from exc


def forward_capturing(module: nn.Module, hooked: nn.Module, x: torch.Tensor) -> tuple[Any, Any]:
    """(module(x) without grad, the last output of ``hooked`` during it), read through a forward hook."""
    seen: list[Any] = []
    handle = hooked.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        out = call_layer(module, x)
    finally:
        handle.remove()
    return out, seen[-1]


def dense_from_topk(idx: torch.Tensor, weight: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(N,k) indices and weights -> (N,E) weights, 0 off the top-k."""
    weights = torch.zeros(idx.shape[0], n_experts, dtype=weight.dtype, device=idx.device)
    weights.scatter_(1, idx.long(), weight)
    return weights


Filler = Callable[[int, torch.Tensor, "int | None", float], torch.Tensor]
"""``fill(target, out, probe, c) -> tensor shaped like out``: what probe target number ``target`` returns instead of
its output ``out`` while expert ``probe`` (None: the base pass) is probed with the constant ``c``."""


def per_expert_fill(target: int, y: torch.Tensor, probe: int | None, c: float) -> torch.Tensor:
    """Targets are the experts themselves, in expert order: the probed one returns c everywhere, every other one 0."""
    return torch.full_like(y, c) if target == probe else torch.zeros_like(y)


def stacked_fill(target: int, y: torch.Tensor, probe: int | None, c: float) -> torch.Tensor:
    """One target computing every expert at once, experts on dim 0 (E, ..., D)."""
    z = torch.zeros_like(y)
    if probe is not None:
        z[probe] = c
    return z


PROBE_HOOK = ("probe_targets(module) must return a list of modules whose outputs are the experts' outputs, in "
              "expert order (each is then replaced by a constant or 0), or (modules, filler) with filler "
              "tfmoe.adapters.stacked_fill (one module computing every expert, experts on dim 0) or "
              "per_expert_fill, or [] when no module returns one expert's output (the weights are then derived from "
              "router_logits / router_probs)")


def probe_plan(targets: object, label: str) -> tuple[list[nn.Module], Filler]:
    """An adapter's ``probe_targets`` answer as (modules, filler); a wrong type is bad input naming the hook."""
    filler: object = per_expert_fill
    if isinstance(targets, tuple) and len(targets) == 2 and callable(targets[1]) \
            and isinstance(targets[0], (list, tuple, nn.ModuleList)):
        targets, filler = targets
    if isinstance(targets, nn.Module) and not isinstance(targets, nn.ModuleList):
        targets = [targets]
    if not isinstance(targets, (list, tuple, nn.ModuleList)) or not all(isinstance(m, nn.Module) for m in targets):
        raise BadInput(f"impl={label}: probe_targets(module) returned {type(targets).__name__}"
                       f"{'' if not isinstance(targets, (list, tuple)) else ' of ' + ', '.join(sorted({type(m).__name__ for m in targets}))}"
                       f": {PROBE_HOOK}")
    return list(targets), filler  # type: ignore[return-value]


def probe_combine_weights(call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, targets: list[nn.Module],
                          n_experts: int, fill: Filler = per_expert_fill, direction: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The combine weights a layer applies, measured: with every expert's output replaced by 0 (the base pass),
    then, expert by expert, that expert's by a constant c, out_t moves by w_te * c * u (a combine is linear in the
    experts' outputs, however it dispatches: sparse, dense with zero gates, straight-through x*((1+c)-c)); u is
    ``direction`` (D,), where a constant expert output lands in the layer's output: all ones, or post @ 1 for a
    latent MoE that projects the mixture back (weights = <move, u> / (c |u|^2)). An expert returning a tuple
    ``(out, bias)`` has out replaced and every other tensor zeroed.

    Returns (weights (N,E) float64, zero_tol (N,1): the rounding of the base a zero weight can show, rows the
    experts ran on in the base pass)."""
    state: dict[str, Any] = {"probe": None, "c": 0.0, "rows": 0}

    def hook(target: int):
        def replace(_m: nn.Module, _i: Any, out: Any) -> Any:
            if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
                first = replace(_m, _i, out[0])
                return (first, *(torch.zeros_like(t) if isinstance(t, torch.Tensor) else t for t in out[1:]))
            if not isinstance(out, torch.Tensor):
                raise BadInput(f"an expert returned {type(out).__name__}, not a tensor nor a tuple (out, bias): the "
                               "combine weights are measured by replacing each expert's output")
            if fill is stacked_fill and (out.dim() < 2 or out.shape[0] != n_experts):
                raise BadInput(f"probe_targets: the module given with stacked_fill returned shape {tuple(out.shape)}, "
                               f"not ({n_experts}, ..., D) with the experts on dim 0: {PROBE_HOOK}")
            state["rows"] += out.numel() // out.shape[-1] if out.dim() else 0
            return fill(target, out, state["probe"], state["c"])
        return replace

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(targets)]
    try:
        with torch.no_grad():
            base = call(x).reshape(-1, x.shape[-1])  # (N,D) every expert 0
            rows = state["rows"]
            scale = max(1.0, float(base.double().abs().max())) if base.numel() else 1.0
            cap = torch.finfo(x.dtype).max / (64 * max(n_experts, 1)) if x.dtype.is_floating_point else 1024.0
            state["c"] = c = 2.0 ** math.floor(math.log2(min(1024.0 * scale, cap)))
            weights = torch.zeros(base.shape[0], n_experts, dtype=torch.float64, device=x.device)
            u = torch.ones(base.shape[-1], dtype=torch.float64, device=x.device) if direction is None \
                else direction.to(x.device, torch.float64)
            for e in range(n_experts):
                state["probe"] = e
                moved = call(x).reshape(base.shape).double() - base.double()  # (N,D) = w_te * c * u
                weights[:, e] = (moved @ u) / (c * float(u @ u))
    finally:
        for h in handles:
            h.remove()
    eps = torch.finfo(x.dtype).eps if x.dtype.is_floating_point else 0.0
    zero_tol = 8 * eps * base.double().abs().amax(dim=-1, keepdim=True) / c  # (N,1)
    if direction is not None:  # a move along u reads |u|_1/|u|^2 times larger per unit of base rounding
        zero_tol = zero_tol * float(u.abs().sum()) / float(u @ u)
    return weights, zero_tol, rows


def inside_weights(call: Callable[[torch.Tensor], Any], x: torch.Tensor, targets: list[nn.Module],
                   experts: list[ref.Expert]) -> torch.Tensor | None:
    """The combine weights of a layer that applies them inside its experts (before the last projection), measured
    where they are applied: each expert module's output on the rows it received, y = w · (expert(rows) - b) + b, is
    compared with the reference's unweighted expert on the same rows (float64, b its last bias), w = <y - b, z - b> /
    |z - b|², and each row is matched to its token by value. Returns (N,E) float64, or None when no row matches a
    token (the experts do not receive the token rows)."""
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def hook(i: int):
        def capture(_m: nn.Module, inputs: Any, out: Any) -> None:
            if inputs and isinstance(inputs[0], torch.Tensor):
                seen.append((i, inputs[0].detach(), ref.expert_output(out).detach()))
        return capture

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(targets)]
    try:
        call(x)
    finally:
        for h in handles:
            h.remove()
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    token_of = {row.double().cpu().numpy().tobytes(): t for t, row in enumerate(flat)}  # exact; numpy has no bf16
    weights = torch.zeros(flat.shape[0], len(experts), dtype=torch.float64, device=x.device)
    matched = 0
    for i, rows, y in seen:
        rows, y = rows.reshape(-1, d), y.reshape(-1, d)
        if not rows.shape[0] or rows.dtype != x.dtype:
            continue
        bias = experts[i].last_bias
        b = 0.0 if bias is None else bias.to(x.device, torch.float64)
        z = experts[i](rows.double()) - b  # (n,D) unweighted, without the last bias
        w = ((y.double() - b) * z).sum(dim=-1) / (z * z).sum(dim=-1).clamp_min(1e-300)  # (n,)
        for r in range(rows.shape[0]):
            t = token_of.get(rows[r].double().cpu().numpy().tobytes())
            if t is not None:
                weights[t, i] = w[r]
                matched += 1
    return weights if matched else None


class LayerUnderTest:
    """Base: subclasses set the attributes below and implement build / run / reference_weights."""

    label: str  # how reports name it
    sizes: LayerSizes
    semantics: ref.RoutingSemantics
    exposes_probs: bool = False  # the layer returns/exposes a full router distribution that must sum to 1
    aux_loss_name: str | None = None  # the model's own load-balancing loss, where it defines one
    draws_correction_bias: bool = False  # build() draws a selection-only bias from the seed (DeepSeek-V3)
    # the precision the combine weights carry at least (HF's and the package's routers take softmax/sigmoid in fp32
    # whatever the run's dtype); None = the run's dtype (the course's listing)
    router_precision: torch.dtype | None = torch.float32
    logits_in_fp32: bool = True  # router logits computed in fp32 (the package, DeepSeek-V3) or in the run's dtype
    probe_direction: torch.Tensor | None = None  # (D,) where a constant expert output lands (latent MoE: post @ 1)
    probe_experts: bool = True  # False: read the combine weights off the router (weight_inside_expert declared)

    @property
    def declaring(self) -> tuple[object, ...]:
        """The objects whose declarations (``lacks`` / ``tfmoe_lacks``, ``router_dtype`` / ``expert_dtype``, with or
        without ``tfmoe_``) :func:`tfmoe.rules.capabilities.declared` reads: a user's class or adapter; none for the
        package's own layer and transformers' blocks."""
        return ()

    def build(self, seed: int) -> nn.Module:
        raise NotImplementedError

    def run(self, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Captured]:
        """x (B,T,D) -> out (B,T,D) and the routing captured by hooks during that call."""
        raise NotImplementedError

    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (B,T,D) -> out (B,T,D) alone (the invariance and precision checks need no routing)."""
        return self.run(module, x)[0]

    def reference_weights(self, module: nn.Module) -> ref.LayerWeights:
        raise NotImplementedError

    def expert_modules(self, module: nn.Module) -> list[nn.Module] | None:
        """The layer's expert modules, one per expert in order, each called on the token rows routed to it (None
        where no such modules exist): where a weight applied inside the expert is measured."""
        return None

    def aux_loss(self, module: nn.Module, captured: Captured) -> float | None:
        """The model's own load-balancing loss on the captured routing (None where it defines none)."""
        return None

    def alternatives(self) -> dict[str, ref.RoutingSemantics]:
        """Plausible misreadings of the design: each must be told apart from the design by the run."""
        return {}

    def notes(self) -> list[str]:
        return []

    # Declared, not measured: why fp16/bf16 copies cannot run (their checks are then n/a, with the exception),
    # "" = they must run (a copy that raises fails finite.<dtype> with the exception).
    half_precision_unsupported: str = ""

    @property
    def order_dependent(self) -> str:
        """Why permuting the tokens may change the output by design ("" if it may not): capacity drops by position."""
        if self.semantics.capacity is None:
            return ""
        return (f"capacity {self.semantics.capacity} per expert drops assignments by their position in the "
                "sequence (declared)")


def _linear64(layer: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = layer.weight.detach().double().clone()
    b = None if layer.bias is None else layer.bias.detach().double().clone()
    return w, b


# ----------------------------------------------------------------- the package's own layer
class OwnLayer(LayerUnderTest):
    """tfmoe.components.moe.MoELayer, dropless: out = x + sum_k w_k expert_k(x), weights renormalised when k > 1
    (at k = 1 the raw probability, as in Switch Transformer: the layer's documented rule, not read from the layer)."""

    exposes_probs = True
    aux_loss_name = "tfmoe.components.moe.switch_aux_loss"

    def __init__(self, sizes: LayerSizes):
        self.sizes, self.label = sizes, "tfmoe MoELayer"
        self.semantics = ref.RoutingSemantics(sizes.score_func, sizes.top_k, normalize=sizes.top_k > 1,
                                              residual=True)

    def build(self, seed: int) -> nn.Module:
        s = self.sizes
        torch.manual_seed(seed)
        return moe.MoELayer(s.d_model, s.d_hidden, s.n_experts, s.top_k, None, s.score_func).eval()

    def run(self, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Captured]:
        res, r = forward_capturing(module, module.router, x)
        weights = dense_from_topk(r.topk_idx, r.topk_weight, self.sizes.n_experts)
        return res.out, Captured(weights, r.probs, r.logits)

    def reference_weights(self, module: nn.Module) -> ref.LayerWeights:
        experts = []
        for ex in module.experts:
            (w1, b1), (w2, b2) = _linear64(ex.fc1), _linear64(ex.fc2)
            experts.append(ref.MlpExpert(w1, w2, "gelu", b1, b2))
        return ref.LayerWeights(module.router.gate.weight.detach().double().clone(), experts,
                                correction_bias=module.router.selection_bias.detach().double().clone())

    def aux_loss(self, module: nn.Module, captured: Captured) -> float | None:
        idx = captured.selected.nonzero()[:, 1].view(captured.selected.shape[0], -1)
        return float(moe.switch_aux_loss(captured.probs, idx, coef=1.0))

    def alternatives(self) -> dict[str, ref.RoutingSemantics]:
        flip = "renormalised" if not self.semantics.normalize else "not renormalised"
        return {flip: self.semantics.variant(normalize=not self.semantics.normalize),
                "no residual": self.semantics.variant(residual=False)}


# ------------------------------------------------------------------ the course's interface
INTERFACE = ("Class(d_model, hidden, n_experts, top_k) with `router` (nn.Linear d_model -> n_experts), "
             "`experts` (nn.ModuleList of n_experts), `top_k`, and forward(x) -> (out, probs)")


def load_class(spec: str) -> Any:
    """'pkg.module:Class' -> the class (or a factory with its signature). The current directory is importable, as with ``python -m``."""
    obj = load_object(spec, "impl", bad_form=f"impl={spec!r} is not 'pkg.module:Class' nor 'hf:<model type>': "
                      "write e.g. impl=my_moe:ToyMoE or impl=hf:mixtral")
    factory = callable(obj) and not inspect.isclass(obj) and not isinstance(obj, nn.Module)  # tfmoe.api.checking
    if not (inspect.isclass(obj) and issubclass(obj, nn.Module)) and not factory:
        raise BadInput(f"impl={spec!r} is {type(obj).__name__}, not a torch.nn.Module subclass or a factory: point "
                       f"impl at a class in the course's ToyMoE interface: {INTERFACE}")
    return obj


# the activation modules an expert may use, read as the reference's own functions (never the module's forward)
ACTIVATION_MODULES: dict[type[nn.Module], Callable[[nn.Module], str]] = {
    nn.GELU: lambda m: "gelu_pytorch_tanh" if m.approximate == "tanh" else "gelu",
    nn.ReLU: lambda m: "relu", nn.SiLU: lambda m: "silu",
}
EXPERT_LAYOUT = ("nn.Sequential(nn.Linear(d_model, hidden), an activation (nn.GELU, nn.ReLU, nn.SiLU), "
                 "nn.Linear(hidden, d_model))")
EXPERT_HOOK = "tfmoe_expert_ffn"
SHARED_HOOK = "tfmoe_shared_experts"  # () -> the shared expert(s) added, ungated, to every token's output


def course_expert(module: nn.Module, index: int, label: str) -> ref.Expert:
    """Expert ``index`` of a course-interface layer rebuilt from its weights, so the reference never runs the
    layer's own expert module (a bug inside it, say its output scaled, shows in output_vs_reference).

    The course's layout, :data:`EXPERT_LAYOUT` (nn.Dropout / nn.Identity between are skipped: identities in eval),
    is read from the module's children; any other expert is read through the layer's ``tfmoe_expert_ffn(i)``,
    which returns that expert's FFN as weights (``tfmoe.components.moe_reference.MlpExpert``, ``GluExpert`` or
    ``ChunkedGluExpert``); without the hook it is run as a black box (:class:`~tfmoe.components.moe_reference.
    OpaqueExpert`: every other check still judges, ``layer.expert_internals`` is not judged, naming the hook)."""
    hook = getattr(module, EXPERT_HOOK, None)
    if callable(hook):
        expert = hook(index)
        if not isinstance(expert, (ref.MlpExpert, ref.GluExpert, ref.ChunkedGluExpert)):
            raise BadInput(f"impl {label}: {EXPERT_HOOK}({index}) returned {type(expert).__name__}: return the "
                           "expert's FFN as weights, a tfmoe.components.moe_reference.MlpExpert, GluExpert or "
                           "ChunkedGluExpert")
        return expert.to(torch.float64)
    ex = module.experts[index]
    parts = [m for m in ex.children() if not isinstance(m, (nn.Dropout, nn.Identity))] \
        if isinstance(ex, nn.Sequential) else []
    if len(parts) == 3 and isinstance(parts[0], nn.Linear) and isinstance(parts[2], nn.Linear) \
            and type(parts[1]) in ACTIVATION_MODULES:
        (w1, b1), (w2, b2) = _linear64(parts[0]), _linear64(parts[2])
        return ref.MlpExpert(w1, w2, ACTIVATION_MODULES[type(parts[1])](parts[1]), b1, b2)
    return ref.OpaqueExpert(ex, f"experts[{index}] ({type(ex).__name__})")


def reference_expert(ex: object, where: str, label: str) -> ref.Expert:
    """One expert of an adapter's ``reference_weights`` in float64: a rebuilt FFN (MlpExpert, GluExpert,
    ChunkedGluExpert) as is, an nn.Module as a black box; anything else is bad input naming the hook."""
    if isinstance(ex, ref.REBUILT):
        return ex.to(torch.float64)
    if isinstance(ex, ref.OpaqueExpert):
        return ex
    if isinstance(ex, nn.Module):
        return ref.OpaqueExpert(ex, f"{where} ({type(ex).__name__})")
    raise BadInput(f"impl={label}: reference_weights(module) gave {where} as {type(ex).__name__}: give each expert "
                   "as a tfmoe.components.moe_reference.MlpExpert / GluExpert / ChunkedGluExpert (rebuilt from its "
                   "weights), or its nn.Module (run as a black box: a bug inside it is then not judged)")


class ToyInterfaceLayer(LayerUnderTest):
    """Any class in the course's ToyMoE interface. The course's semantics: softmax router, top-k,
    weights renormalised over the k, out = sum_k w_k expert_k(x) (no residual), + the shared experts the class
    gives through ``tfmoe_shared_experts()`` (ungated; none without the hook).

    Hooks: the router's output gives the logits; the combine weights are measured by replacing the experts'
    outputs (:func:`probe_combine_weights`), so a token's experts are those its output depends on, whatever
    rows reached which expert (a dense layer runs all of them; a straight-through dispatch perturbs the rows)."""

    exposes_probs = True
    router_precision = None
    logits_in_fp32 = False

    def __init__(self, spec: str, sizes: LayerSizes):
        self.cls, self.sizes, self.label = load_class(spec), sizes, spec
        self.semantics = ref.RoutingSemantics("softmax", sizes.top_k, normalize=True)

    @property
    def declaring(self) -> tuple[object, ...]:
        return (self.cls,)

    def build(self, seed: int) -> nn.Module:
        s = self.sizes
        torch.manual_seed(seed)
        try:
            module = self.cls(s.d_model, s.d_hidden, s.n_experts, s.top_k)
        except Exception as exc:
            raise BadInput(f"impl {self.label}: {self.cls.__name__}({s.d_model}, {s.d_hidden}, {s.n_experts}, "
                           f"{s.top_k}) raised {type(exc).__name__}: {exc}: the interface is {INTERFACE}") from None
        missing = [a for a in ("router", "experts", "top_k") if not hasattr(module, a)]
        if missing:
            raise BadInput(f"impl {self.label} lacks {', '.join(f'`{m}`' for m in missing)}: the interface is "
                           f"{INTERFACE}")
        router, experts = module.router, module.experts
        if not isinstance(router, nn.Linear) or (router.in_features, router.out_features) != (s.d_model, s.n_experts):
            raise BadInput(f"impl {self.label}: `router` is {router!r}, not nn.Linear({s.d_model}, {s.n_experts}): "
                           f"the interface is {INTERFACE}")
        if not isinstance(experts, nn.ModuleList) or len(experts) != s.n_experts:
            raise BadInput(f"impl {self.label}: `experts` is not an nn.ModuleList of {s.n_experts} experts: "
                           f"the interface is {INTERFACE}")
        if module.top_k != s.top_k:
            raise BadInput(f"impl {self.label}: `top_k` is {module.top_k!r} after {self.cls.__name__}(..., "
                           f"top_k={s.top_k}): the interface is {INTERFACE}")
        return module.eval()

    def _call(self, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        result = call_layer(module, x)
        if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
            raise BadInput(f"impl {self.label}: forward(x) returned {type(result).__name__}, not (out, probs): "
                           f"the interface is {INTERFACE}")
        out, probs = result
        n, e = x.numel() // x.shape[-1], self.sizes.n_experts
        if out.shape != x.shape or probs.shape[-1] != e or probs.numel() != n * e:
            raise BadInput(f"impl {self.label}: forward(x {tuple(x.shape)}) returned out {tuple(out.shape)}, probs "
                           f"{tuple(probs.shape)}; the interface wants out shaped like x and probs (tokens, "
                           f"{e}): {INTERFACE}")
        return out, probs

    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self._call(module, x)[0]

    def run(self, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Captured]:
        """The layer's own forward (its output, probs, and the router's logits through a hook); then the combine
        weights it applies, measured by :func:`probe_combine_weights` on its ``experts``."""
        logits: list[torch.Tensor] = []
        handle = module.router.register_forward_hook(lambda _m, _i, out: logits.append(out.detach()))
        try:
            out, probs = self._call(module, x)
        finally:
            handle.remove()
        n, e = x.numel() // x.shape[-1], self.sizes.n_experts
        if self.probe_experts:
            weights, zero_tol, rows = probe_combine_weights(lambda t: self._call(module, t)[0], x,
                                                            list(module.experts), e, direction=self.probe_direction)
        else:
            weights, zero_tol, rows = None, 0.0, None
        return out, Captured(weights, probs.reshape(n, e), logits[-1].reshape(n, e) if logits else None, rows,
                             zero_tol)

    def expert_modules(self, module: nn.Module) -> list[nn.Module] | None:
        return list(module.experts)

    def reference_weights(self, module: nn.Module) -> ref.LayerWeights:
        """The router's weights and every expert rebuilt from its weights (:func:`course_expert`)."""
        w, b = _linear64(module.router)
        experts = [course_expert(module, i, self.label) for i in range(len(module.experts))]
        return ref.LayerWeights(w, experts, b, shared=self.shared_experts(module))

    def shared_experts(self, module: nn.Module) -> list[ref.Expert] | None:
        """The layer's ``tfmoe_shared_experts()``: one expert or a list, each added ungated to every token's output
        (an MlpExpert / GluExpert / ChunkedGluExpert, or an nn.Module run as a black box); None without the hook."""
        hook = getattr(module, SHARED_HOOK, None)
        if not callable(hook):
            return None
        got = hook()
        items = list(got) if isinstance(got, (list, tuple, nn.ModuleList)) else [got]
        return [reference_expert(ex, f"{SHARED_HOOK}()[{i}]", self.label) for i, ex in enumerate(items)] or None

    def alternatives(self) -> dict[str, ref.RoutingSemantics]:
        return {"not renormalised": self.semantics.variant(normalize=False)}
