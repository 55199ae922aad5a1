"""One capability model for every battery (attention module, attention kernel, MoE layer).

Every check names the features it needs (:data:`FEATURES`). A layer, adapter or kernel may **declare** what it
lacks and the precision it computes in; every declaration is read here, and nowhere else:

- ``lacks``: an iterable of feature names, as a class attribute of an adapter (``AttentionAdapter.lacks``,
  ``MoEAdapter.lacks``), as ``tfmoe_lacks`` on a user's module class or kernel function, or as the config key
  ``lacks=[...]``. The older flags map onto it (``supports_gqa = False`` -> ``gqa``, ``takes_dropout = False`` ->
  ``dropout``, ``takes_cache = False`` -> ``kv_cache``, ``returns_weights = False`` -> ``attention_weights``).
- a compute precision: ``compute_dtype`` (attention, kernels), ``router_dtype`` / ``expert_dtype`` (MoE), as an
  attribute (``tfmoe_compute_dtype`` etc. on a user's class or function) or a config key of the same name.

The rules, the same in every mode:

1. A declared lack of what the run's *main setting* asks for (``n_kv_heads < n_heads`` with ``gqa`` lacked, ``dtype=
   fp16`` with ``fp16`` lacked, ``causal=false`` with ``non_causal`` lacked) is bad input: exit 2 before any check,
   one line (:func:`refusal`).
2. A check whose feature is declared lacking is *not applicable*: listed with the declaration, never run.
3. An undeclared ``NotImplementedError`` raised by the code under test for such an input makes that check *not
   applicable*, with the exception's message (:func:`not_implemented_detail`). It is listed in the table and the
   verdict, never counted as a failure, never silent. Any other exception keeps its rule (the user's error leads
   the check's detail; tfmoe's or a shipped adapter's error is ``crashed``).
4. Precision: a declared lower compute precision is judged against that precision's yardstick (the plain
   computation at that precision, measured the way the run dtype's plain yardstick is), and the verdict says so.
   An undeclared one is *detected* when the error exceeds the run dtype's limit but is within the limit of a lower
   precision (:func:`explaining_precision`): the check **fails**, and its detail names the cause with both numbers
   and the declaration that would make it pass ("experts compute in bfloat16 (detected, not declared): error
   1.0e-02, plain bfloat16 9.8e-03; declare expert_dtype=bf16 if that is by design"). An undeclared lower precision
   is a failure because from the outside a ``.float()`` downcast in an fp64 layer or a bf16 core "for speed" cannot
   be told from a design choice; the declaration is the layer's word that it is one. Checks that do not depend on
   precision (routing selection, weights, loads, masks read exactly) are judged as they are, whatever the
   precision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tfmoe.contract.errors import BadInput

# feature -> what it is (the words a refusal or an n/a detail uses)
FEATURES: dict[str, str] = {
    "padding_mask": "a key padding mask (B, T), True = real token",
    "left_padding": "a key padding mask whose padded positions come first (left padding)",
    "causal": "causal attention",
    "non_causal": "attention that is not causal (every real key visible)",
    "gqa": "fewer key/value heads than query heads (GQA/MQA)",
    "unequal_lengths": "queries and keys of different lengths (Tq != Tk; kernel mode)",
    "bool_mask": "an arbitrary boolean (Tq, Tk) attention mask",
    "additive_mask": "an additive float attention mask",
    "per_head_mask": "a per-head attention mask (B, Hq, Tq, Tk)",
    "dropout": "attention dropout",
    "kv_cache": "a KV cache",
    "position_ids": "position ids supplied by the caller",
    "loss": "a loss computed from labels",
    "batch_invariant_routing": "outputs that do not depend on the rest of the batch (no expert capacity)",
    "attention_weights": "the attention weights returned beside the output",
    "fp32": "float32 inputs",
    "fp16": "float16 inputs",
    "bf16": "bfloat16 inputs",
    "backward": "a backward pass",
}

# the older single-purpose flags, read as lacks when False
LEGACY_FLAGS: dict[str, str] = {
    "supports_gqa": "gqa",
    "takes_dropout": "dropout",
    "takes_cache": "kv_cache",
    "returns_weights": "attention_weights",
}

PRECISIONS = ("fp64", "fp32", "fp16", "bf16")  # the names a precision declaration takes (as `dtype=`)
# finer first: a lower precision that explains an error is the finest one that does
LOWER_PRECISIONS: dict[str, tuple[str, ...]] = {"fp64": ("fp32", "fp16", "bf16"), "fp32": ("fp16", "bf16"),
                                                 "fp16": ("bf16",), "bf16": ()}


def _names(value: Any, where: str) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        value = [value]
    try:
        names = frozenset(str(v) for v in value)
    except TypeError:
        raise BadInput(f"{where} must be a list of feature names ({', '.join(FEATURES)}), got {value!r}: "
                       f"e.g. lacks=[padding_mask]") from None
    unknown = sorted(names - FEATURES.keys())
    if unknown:
        raise BadInput(f"{where} names unknown feature(s) {', '.join(unknown)}: use any of {', '.join(FEATURES)}, "
                       f"e.g. lacks=[padding_mask]")
    return names


def precision_name(value: Any, where: str) -> str | None:
    """A declared precision as one of :data:`PRECISIONS` (torch dtypes and their usual names accepted), or None."""
    if value is None:
        return None
    text = str(value).removeprefix("torch.")
    aliases = {"float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32", "float16": "fp16",
               "half": "fp16", "bfloat16": "bf16"}
    text = aliases.get(text, text)
    if text not in PRECISIONS:
        raise BadInput(f"{where}={value!r} is not a precision: use one of {', '.join(PRECISIONS)}, e.g. {where}=bf16")
    return text


@dataclass(frozen=True)
class Declared:
    """What one layer declares about itself: features it lacks (and where each declaration came from) and the
    precision of each part that computes (``attention``, ``router``, ``experts``) when it is not the run's."""

    lacks: frozenset[str] = frozenset()
    sources: Mapping[str, str] = field(default_factory=dict)  # feature -> "impl" | "config" | "flag supports_gqa"
    precisions: Mapping[str, str] = field(default_factory=dict)  # part -> precision name

    def why(self, feature: str) -> str:
        """The detail of a check made not applicable by a declaration."""
        source = self.sources.get(feature, "impl")
        if source.startswith("raised "):  # detected: the layer raised NotImplementedError for it (rule 3)
            return (f"not applicable: the layer raised NotImplementedError for {feature} ({FEATURES[feature]}): "
                    f"{source.removeprefix('raised ')}")
        if source.startswith("detected "):  # read from the model's forward signature
            return f"not applicable: {FEATURES[feature]} — {source.removeprefix('detected ')}"
        how = "the config's lacks=" if source == "config" else (
            f"its {source.removeprefix('flag ')} = False" if source.startswith("flag ") else "its lacks")
        return f"not applicable: the layer declares it lacks {feature} ({FEATURES[feature]}; {how})"

    def with_lack(self, feature: str, exc: NotImplementedError) -> Declared:
        """These declarations plus ``feature``, found lacking because the layer raised ``exc`` for it (rule 3)."""
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else "(no message)"
        return Declared(self.lacks | {feature}, {**self.sources, feature: f"raised {message}"}, self.precisions)


def declared(*objects: Any, config_lacks: Iterable[str] | str | None = None,
             config_precisions: Mapping[str, Any] | None = None) -> Declared:
    """Read every declaration of the given objects (an adapter, a user's class, a kernel function) and the config.

    An adapter declares ``lacks``; a user's class or function ``tfmoe_lacks`` (either name is read on any object);
    the legacy boolean flags are read when set to False on the object's class. Precisions: ``compute_dtype`` /
    ``router_dtype`` / ``expert_dtype`` (or with a ``tfmoe_`` prefix), then the config's, which win."""
    lacks: dict[str, str] = {}
    precisions: dict[str, str] = {}
    parts = {"compute_dtype": "attention", "router_dtype": "router", "expert_dtype": "experts"}
    for obj in objects:
        if obj is None:
            continue
        for attr in ("lacks", "tfmoe_lacks"):
            for name in _names(getattr(obj, attr, None), f"{_label(obj)}.{attr}"):
                lacks.setdefault(name, "impl")
        for flag, feature in LEGACY_FLAGS.items():
            if getattr(obj, flag, True) is False:
                lacks.setdefault(feature, f"flag {flag}")
        for attr, part in parts.items():
            for name in (attr, f"tfmoe_{attr}"):
                value = getattr(obj, name, None)
                if value is not None and not callable(value):
                    precisions[part] = precision_name(value, f"{_label(obj)}.{name}")
    for name in _names(config_lacks, "lacks"):
        lacks[name] = "config"
    for attr, value in (config_precisions or {}).items():
        if value is not None:
            precisions[parts.get(attr, attr)] = precision_name(value, attr)
    return Declared(frozenset(lacks), lacks, precisions)


def _label(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def refusal(decl: Declared, needs: Mapping[str, str], spec: str) -> BadInput | None:
    """Rule 1: the BadInput for a main setting that needs a declared-lacking feature (None when nothing does).

    ``needs`` maps each feature the run's main setting needs to the fix that avoids it, e.g.
    ``{"gqa": "set n_kv_heads=null (= n_heads)"}``."""
    for feature, fix in needs.items():
        if feature in decl.lacks:
            return BadInput(f"impl={spec} declares it lacks {feature} ({FEATURES[feature]}), which this run's "
                            f"settings need: {fix}")
    return None


def not_implemented_detail(exc: NotImplementedError, feature: str | None = None) -> str:
    """Rule 3: the detail of a check made not applicable by an undeclared NotImplementedError."""
    what = f" for {feature} ({FEATURES[feature]})" if feature else ""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else "(no message)"
    return f"not applicable: the layer raised NotImplementedError{what}: {message}"


def explaining_precision(error: float, run_precision: str, limits: Mapping[str, float]) -> str | None:
    """Rule 4: the finest lower precision whose limit (measured as the plain yardstick is, at that precision)
    covers ``error``, or None. ``limits`` maps precision names to their limits; missing ones are skipped."""
    if error != error:  # NaN is never explained by a precision
        return None
    for name in LOWER_PRECISIONS.get(run_precision, ()):
        if name in limits and error <= limits[name]:
            return name
    return None


def precision_note(part: str, precision: str, error: float, plain: float, *, detected: bool,
                   declaration: str = "compute_dtype") -> str:
    """The verdict's words for a part that computes in another precision (rule 4); ``declaration`` is the key
    that declares it (``compute_dtype``, ``router_dtype``, ``expert_dtype``)."""
    how = "detected, not declared" if detected else "declared"
    verb = "compute" if part.endswith("s") else "computes"
    text = (f"{part} {verb} in {_long(precision)} ({how}): error {error:.2g}, plain {_long(precision)} "
            f"{plain:.2g}")
    return text + (f"; declare {declaration}={precision} if that is by design" if detected else "")


def _long(precision: str) -> str:
    return {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[precision]


# ------------------------------------------------------------------------------ rows that see no key
# One vocabulary for what a query row that sees no key must give, in module mode (``fully_masked_policy``) and
# kernel mode (``kernel_checks.fully_masked_expect``). What such a row gives is classified as zeros, mean_of_v
# (the uniform average of v), nan (any non-finite value) or other (finite, none of those):
FULLY_MASKED_POLICIES: dict[str, str] = {
    "finite": "any finite value (zeros, the uniform average of v, or another finite value)",
    "zeros": "zeros (after the output projection: its bias)",
    "nan": "NaN (or another non-finite value)",
    "mean_of_v": "the uniform average of v (every key weighted alike)",
    "any": "any value at all, NaN included (reported, never judged)",
}
POLICY_ALIASES = {"uniform": "mean_of_v"}  # kernel mode's older name for mean_of_v
# which classified kinds each policy accepts
_ACCEPTS = {"finite": {"zeros", "mean_of_v", "other"}, "zeros": {"zeros"}, "nan": {"nan"},
            "mean_of_v": {"mean_of_v"}, "any": {"zeros", "mean_of_v", "other", "nan"}}


def policy_name(value: str) -> str:
    """The canonical name of a fully-masked policy (``uniform`` is ``mean_of_v``); ValueError when unknown."""
    name = POLICY_ALIASES.get(value, value)
    if name not in FULLY_MASKED_POLICIES:
        raise ValueError(value)
    return name


def fully_masked_accepts(policies: str | Iterable[str], kind: str) -> bool:
    """Whether rows that see no key and give ``kind`` (zeros | mean_of_v | uniform | nan | other | none, as
    :func:`tfmoe.components.comparison.classify_rows` names them) meet any of ``policies``. No such row ("none")
    meets every policy."""
    kind = POLICY_ALIASES.get(kind, kind)
    if kind == "none":
        return True
    names = [policies] if isinstance(policies, str) else list(policies)
    return any(kind in _ACCEPTS[policy_name(p)] for p in names)


def policy_allows_nan(policies: str | Iterable[str]) -> bool:
    """Whether the policy lets non-finite values from those rows reach the gradients (nan, any)."""
    return fully_masked_accepts(policies, "nan")
