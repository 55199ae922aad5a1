"""``impl=`` on decode, shift-labels and arch: a whole causal language model, driven through one calling convention.

**Native** (no adapter): Hugging Face's causal-LM convention,
``forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False, labels=None)``
returning an object (or mapping) with ``.logits`` (B, T, V) — or the logits themselves, or nanoGPT's
``(logits, loss)`` — ``.past_key_values`` (whatever cache the model keeps;
``.cache`` is read too) and ``.loss``. The mask covers past and new positions (1 = real token). The past may also be
called ``cache`` (transformers 5.25's name) or ``past``. ``labels`` are the input ids with ``ignore_index`` (-100)
where there is no target; the model shifts them itself, as HF's models do.

What the signature lacks is *detected* (no ``attention_mask`` parameter: ``padding_mask``; no past parameter:
``kv_cache``; no ``position_ids``: ``position_ids``, the model then derives positions itself; no ``labels``:
``loss``), and a class may declare more with ``tfmoe_lacks``; both go through :mod:`tfmoe.rules.capabilities`.

**Inputs** (:func:`load_model`): ``pkg.mod:Class`` (built with no arguments), a zero-argument factory, an
``nn.Module`` instance, a :class:`CausalLMAdapter` (class or instance) for another layout, or ``hf:<model_type>``
(``AutoModelForCausalLM`` from a tiny random config, nothing downloaded; the types in :data:`HF_MODELS`).

**Other layouts**: subclass :class:`CausalLMAdapter` (e.g. nanoGPT's ``forward(idx) -> logits``: declare
``lacks = ("padding_mask", "kv_cache", "position_ids")`` and return :class:`LMOutput`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from tfmoe.contract.errors import BadInput, ContractError
from tfmoe.rules import capabilities as caps

PAST_NAMES = ("cache", "past_key_values", "past")  # the names a forward may give its cache parameter
MODEL_FEATURES = ("padding_mask", "kv_cache", "position_ids", "loss", "batch_invariant_routing", "fp16", "bf16")


@dataclass
class LMOutput:
    """What one forward returns: logits (B, T, V), the model's cache (any object; None without one), the loss."""

    logits: torch.Tensor
    past: Any = None
    loss: torch.Tensor | None = None


class CausalLMAdapter:
    """Drive a causal LM of another layout. Override :meth:`build` and :meth:`forward`; declare ``lacks``.

    ``build(seed)`` returns the model (eval mode is set by tfmoe); ``forward`` gets the ids (B, T), the mask over
    past and new positions (B, T_past + T) or None, the position ids (B, T) or None (derive them), the past the
    model returned last (or None), ``use_cache`` and the labels (ids with -100 where no target; unshifted), and
    returns :class:`LMOutput`. Raising ``NotImplementedError`` for an input makes the checks that need it n/a."""

    lacks: tuple[str, ...] = ()
    library: str | None = None  # a shipped adapter sets the library it drives (its errors are then tfmoe's)
    spec: str = "?"

    def build(self, seed: int) -> nn.Module:  # pragma: no cover - the protocol
        raise NotImplementedError

    def forward(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, past: Any, use_cache: bool,
                labels: torch.Tensor | None) -> LMOutput:  # pragma: no cover - the protocol
        raise NotImplementedError

    def design(self, model: nn.Module) -> str | None:
        """Why the model's outputs depend on the rest of the batch by design (None: they must not)."""
        return capacity_design(model)


# ------------------------------------------------------------------------------------------- native
def _output(result: Any, who: str) -> LMOutput:
    """A native forward's result -> LMOutput (ContractError, the model's fault, for anything without logits)."""
    if isinstance(result, torch.Tensor):
        return LMOutput(result)
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor) and result[0].dim() == 3:
        return LMOutput(result[0])  # nanoGPT's (logits, loss): a loss is read only where the forward takes labels
    get = result.get if isinstance(result, Mapping) else (lambda k, d=None: getattr(result, k, d))
    logits = get("logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ContractError(f"{who} must return an object with .logits (B, T, V) (Hugging Face's causal-LM output), "
                            f"got {type(result).__name__}: wrap the model in a tfmoe.adapters.causal_lm."
                            "CausalLMAdapter for another layout")
    fields = getattr(type(result), "__dataclass_fields__", None)  # a dataclass output names its cache field
    names = [n for n in ("cache", "past_key_values") if fields is None or n in fields]  # transformers 5.24's first
    past = next((v for n in names if (v := get(n, None)) is not None), None)  # (its old name only warns)
    return LMOutput(logits, past, get("loss", None))


class NativeLM(CausalLMAdapter):
    """A model in Hugging Face's calling convention (the user's own class, or a transformers model)."""

    def __init__(self, make: Any, spec: str, library: str | None = None) -> None:
        self.make, self.spec, self.library = make, spec, library
        self.params: Mapping[str, inspect.Parameter] = {}

    def build(self, seed: int) -> nn.Module:
        model = self.make() if not isinstance(self.make, nn.Module) else self.make
        if not isinstance(model, nn.Module):
            raise BadInput(f"impl={self.spec!r} built a {type(model).__name__}, not a torch.nn.Module: point impl at "
                           "your model class, a zero-argument factory returning it, or a CausalLMAdapter")
        self.params = inspect.signature(model.forward).parameters
        return model

    def detected_lacks(self) -> dict[str, str]:
        p = self.params
        out = {}
        if "attention_mask" not in p:
            out["padding_mask"] = "its forward has no attention_mask parameter"
        if not any(n in p for n in PAST_NAMES):
            out["kv_cache"] = "its forward has no past_key_values / cache parameter"
        if "position_ids" not in p:
            out["position_ids"] = "its forward has no position_ids parameter (it derives positions itself)"
        if "labels" not in p:
            out["loss"] = "its forward has no labels parameter"
        return out

    def forward(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, past: Any, use_cache: bool,
                labels: torch.Tensor | None) -> LMOutput:
        p = self.params
        kw: dict[str, Any] = {}
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask
        if position_ids is not None and "position_ids" in p:
            kw["position_ids"] = position_ids
        name = next((n for n in PAST_NAMES if n in p), None)
        if name is not None and past is not None:
            kw[name] = past
        if use_cache and "use_cache" in p:
            kw["use_cache"] = True
        elif "use_cache" in p:
            kw["use_cache"] = False
        if labels is not None:
            kw["labels"] = labels
        return _output(model(input_ids, **kw), f"{self.spec}.forward")


# ------------------------------------------------------------------------------------------- hf:
# model_type -> the tiny config's keys (random weights; nothing downloaded). Absolute (gpt2) and rotary positions,
# dense and sparse-MoE feed-forwards.
_DENSE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=4096)
HF_MODELS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=4096),  # the battery's longest sequence (MAX_TOKENS)
    "llama": _DENSE,
    "mistral": _DENSE,
    "qwen2": _DENSE,
    "qwen2_moe": {**_DENSE, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
                  "num_experts_per_tok": 2},
    "mixtral": {**_DENSE, "num_local_experts": 4, "num_experts_per_tok": 2},
}
HF_VOCAB = 96


class HFCausalLM(NativeLM):
    """``impl=hf:<model_type>``: ``AutoModelForCausalLM.from_config`` of a tiny config (sdpa attention, HF's
    default), driven natively; errors raised inside transformers are tfmoe's (the adapter drove it wrongly)."""

    def __init__(self, model_type: str) -> None:
        super().__init__(None, f"hf:{model_type}", library="transformers")
        if model_type not in HF_MODELS:
            raise BadInput(f"impl=hf:{model_type}: no tiny config for model type {model_type!r} yet: use one of "
                           f"{', '.join('hf:' + t for t in HF_MODELS)}")
        self.model_type = model_type

    def build(self, seed: int) -> nn.Module:
        from tfmoe.adapters.transformers_support import require_transformers

        transformers = require_transformers()
        cfg = transformers.AutoConfig.for_model(self.model_type, vocab_size=HF_VOCAB, bos_token_id=1, eos_token_id=2,
                                                pad_token_id=0, **HF_MODELS[self.model_type])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        if getattr(model, "loss_type", "") is None:  # gpt2's: the loss falls back to ForCausalLM with a warning
            model.loss_type = "ForCausalLM"  # that fallback, said
        self.params = inspect.signature(model.forward).parameters
        return model


def capacity_design(model: nn.Module) -> str | None:
    """A capacity limit (tokens dropped when an expert is full) found on the model or its config: routing that
    depends on the rest of the batch by design. None when there is none."""
    for name, mod in [("", model), *model.named_modules()]:
        for obj, where in ((mod, name or type(model).__name__), (getattr(mod, "config", None), "config")):
            for attr in ("capacity_factor", "expert_capacity"):
                value = getattr(obj, attr, None) if obj is not None else None
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    return f"{where}.{attr}={value:g}: an expert capacity drops tokens by what else is in the batch"
    return None


# ------------------------------------------------------------------------------------------- loading
@dataclass
class ModelUnderTest:
    """The user's model, built, with everything the battery reads about it."""

    adapter: CausalLMAdapter
    model: nn.Module
    declared: caps.Declared
    spec: str
    vocab_size: int
    design: str | None  # batch-dependent by design (declared or detected), or None

    @property
    def who(self) -> str:
        return f"impl={self.spec}"

    def lacks(self, feature: str) -> bool:
        return feature in self.declared.lacks

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past: Any = None, use_cache: bool = False,
                labels: torch.Tensor | None = None, model: nn.Module | None = None) -> LMOutput:
        with torch.no_grad():
            out = self.adapter.forward(model or self.model, input_ids, attention_mask,
                                       None if self.lacks("position_ids") else position_ids, past, use_cache, labels)
        if not isinstance(out, LMOutput):
            out = _output(out, self.who)
        B, T = input_ids.shape
        if tuple(out.logits.shape[:2]) != (B, T):
            raise ContractError(f"{self.who} returned logits of shape {tuple(out.logits.shape)} for ids of shape "
                                f"{(B, T)}: logits must be (B, T, V), one row per input token")
        return out

    def copy_as(self, dtype: torch.dtype) -> nn.Module:
        return copy.deepcopy(self.model).to(dtype).eval()


def load_model(spec: str, seed: int, device: torch.device, dtype: torch.dtype,
               config_lacks: Any = None) -> ModelUnderTest:
    """The model ``impl=spec`` names, built on ``device`` in ``dtype`` (BadInput, one line, for anything unusable)."""
    from tfmoe.rules.user_code import built_adapter, load_object

    adapter: CausalLMAdapter
    if spec.startswith("hf:"):
        adapter = HFCausalLM(spec.removeprefix("hf:"))
    else:
        obj = load_object(spec, "impl", bad_form=f"impl={spec!r} is not 'pkg.module:Class' nor 'hf:<model type>': "
                          "write e.g. impl=my_lm:MyLM or impl=hf:llama")
        obj = built_adapter(obj, CausalLMAdapter, spec)
        if isinstance(obj, CausalLMAdapter):
            adapter = obj
            if adapter.spec == "?":
                adapter.spec = spec
        elif isinstance(obj, nn.Module) or callable(obj):
            adapter = NativeLM(obj, spec)
        else:
            raise BadInput(f"impl={spec!r} is {type(obj).__name__}, not a model class, a factory, a module or a "
                           "CausalLMAdapter: point impl at your causal LM")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = adapter.build(seed)
    except BadInput:
        raise
    except Exception as exc:
        from tfmoe.rules.faults import tfmoe_fault

        err = tfmoe_fault(exc, adapter.spec, adapter.library)
        if err is not None:
            raise err from exc
        raise BadInput(f"impl={spec!r}: building the model raised {type(exc).__name__}: {exc}: a model class must "
                       "build with no arguments (or point impl at a zero-argument factory)") from None
    model = model.to(device=device, dtype=dtype).eval()
    lacks = dict(adapter.detected_lacks()) if isinstance(adapter, NativeLM) else {}
    decl = caps.declared(adapter, model, type(model), config_lacks=config_lacks)
    merged = {f: decl.sources.get(f, "impl") for f in decl.lacks}
    for feature, why in lacks.items():
        merged.setdefault(feature, f"detected {why}")
    declared = caps.Declared(frozenset(merged), merged, decl.precisions)
    design = None
    if "batch_invariant_routing" in declared.lacks:
        design = "declared: " + declared.why("batch_invariant_routing").removeprefix("not applicable: ")
    else:
        design = adapter.design(model)
    probe = torch.tensor([[1, 2]], device=device)
    mut = ModelUnderTest(adapter, model, declared, spec, 0, design)
    try:
        vocab = mut.forward(probe).logits.shape[-1]
    except Exception as exc:
        from tfmoe.rules.faults import raised_detail, tfmoe_fault

        err = tfmoe_fault(exc, adapter.spec, adapter.library)
        if err is not None:
            raise err from exc
        raise BadInput(f"impl={spec!r}: a forward of ids [[1, 2]] {raised_detail(exc)}: the model must run "
                       "forward(input_ids) on a (B, T) tensor of token ids") from None
    mut.vocab_size = int(vocab)
    if vocab < 8:
        raise BadInput(f"impl={spec!r} has a vocabulary of {vocab} tokens: the battery needs at least 8 distinct ids")
    return mut
