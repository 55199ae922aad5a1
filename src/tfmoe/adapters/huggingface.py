"""``impl=hf:<model_type>``: the attention layer of a Hugging Face transformers model, built from a tiny config
with random weights (nothing is downloaded), driven through the model's own code path: its mask builder
(``masking_utils.create_causal_mask`` / ``create_bidirectional_mask``), its rotary embedding class, its
attention interface (``eager`` or ``sdpa``, key ``hf.attn_implementation``).

Only the model types in :data:`VETTED` are accepted. Each row records the layout and the RoPE pairing read from
the model's own modeling file, and ``tests/test_hf_zoo.py`` builds each tiny model and compares it with the
reference (that comparison is the check of the row against the source). Layouts:

- ``llama`` — ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (biases if the model has them, e.g. qwen2's q/k/v) and
  rotary positions passed in as ``position_embeddings``, rotate-half (``half``) or interleaved pairs.
- ``gpt2`` — fused ``c_attn`` (a Conv1D: weight (in, out)) and ``c_proj``; learned positions live outside.
- ``bert`` — ``query``/``key``/``value`` (with biases), no output projection inside ``BertSelfAttention``.

The reference reads only the config and the weights (see ``tfmoe.components.references``: its own RoPE with the
config's rope_theta in the row's pairing, its own kv-head mapping, its own mask). Any other model type exits 2
naming the semantic the reference would need (:func:`needed_semantics`: q/k norm, logit softcapping, a
non-standard scale, partial or scaled RoPE, fused qkv, …), or, when nothing is missing, that it is not vetted yet.
Sliding windows are switched off in the tiny config (a note says so).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from tfmoe.adapters.base import AttentionAdapter, checked_output, copy_linear, refuse, seeded
from tfmoe.adapters.transformers_support import (
    SUPPORTED,
    adapter_error,
    call_compatible,
    require_transformers,
)
from tfmoe.components.references import Projections, Rope
from tfmoe.errors import BadInput

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj")
FUSED_QKV = ("qkv_proj", "qkv", "Wqkv", "query_key_value", "c_attn", "in_proj", "W_pack")
UNMODELLED_CONFIG = {  # config key -> what it means (refused when set to a value that changes attention)
    "attn_logit_softcapping": "attention logit softcapping",
    "query_pre_attn_scalar": "a query scale other than 1/sqrt(head_dim)",
    "attention_multiplier": "a query scale other than 1/sqrt(head_dim)",
    "clip_qkv": "clipping of q/k/v",
    "alibi": "ALiBi position biases",
    "use_alibi": "ALiBi position biases",
    "position_embedding_type": "relative position embeddings inside attention",
}


@dataclass(frozen=True)
class Vetted:
    """One vetted model type: its layout, its RoPE pairing (None: no rotary inside attention) and where its own
    modeling file shows the pairing (``modeling_<type>.<function>``)."""

    layout: str  # llama | gpt2 | bert
    rope: str | None  # half | interleaved | None
    source: str


_HALF = "rotate_half: cat(-x[..., d/2:], x[..., :d/2])"
_INTERLEAVED = "rotate_half: stack(-x[..., 1::2], x[..., ::2]).flatten(-2); cos/sin repeat_interleave(2)"
# Every model type impl=hf: accepts. Add a row only after reading the model's modeling file and seeing the tiny
# model pass the reference (tests/test_hf_zoo.py::test_every_vetted_row_matches_the_reference).
VETTED: dict[str, Vetted] = {
    "arcee": Vetted("llama", "half", _HALF),
    "csm": Vetted("llama", "half", _HALF),
    "falcon_h1": Vetted("llama", "half", _HALF),
    "gemma": Vetted("llama", "half", _HALF),
    "gradium_phonon_tts": Vetted("llama", "half", _HALF),
    "jais2": Vetted("llama", "half", _HALF),
    "llama": Vetted("llama", "half", _HALF),
    "minimax": Vetted("llama", "half", _HALF),
    "ministral": Vetted("llama", "half", _HALF),
    "mistral": Vetted("llama", "half", _HALF),
    "mixtral": Vetted("llama", "half", _HALF),
    "olmo": Vetted("llama", "half", _HALF),
    "phimoe": Vetted("llama", "half", _HALF),
    "pocket_tts": Vetted("llama", "half", _HALF),
    "qwen2": Vetted("llama", "half", _HALF),
    "qwen2_moe": Vetted("llama", "half", _HALF),
    "seed_oss": Vetted("llama", "half", _HALF),
    "smollm3": Vetted("llama", "half", _HALF),
    "solar_open": Vetted("llama", "half", _HALF),
    "starcoder2": Vetted("llama", "half", _HALF),
    "cohere": Vetted("llama", "interleaved", _INTERLEAVED),
    "ernie4_5": Vetted("llama", "interleaved", _INTERLEAVED),
    "ernie4_5_moe": Vetted("llama", "interleaved", _INTERLEAVED),
    "helium": Vetted("llama", "interleaved", _INTERLEAVED),
    "gpt2": Vetted("gpt2", None, "learned positions in GPT2Model, none inside GPT2Attention"),
    "bert": Vetted("bert", None, "absolute positions in BertEmbeddings, none inside BertSelfAttention"),
}
# Model types whose layer passes the static screens (Llama layout, plain RoPE) but whose source shows a semantic the
# reference does not model: refused by name, not as "not vetted".
UNMODELLED_SOURCE: dict[str, str] = {
    "eurobert": "an encoder in the Llama layout (EuroBertAttention: is_causal=False, bidirectional), which this "
                "adapter drives as a decoder (under sdpa, B=1 without padding then attends both ways)",
    "cohere2": "RoPE only on its sliding-window layers and none (NoPE) on full-attention layers "
               "(Cohere2Attention: apply_rotary_pos_emb only when sliding_window is set), with a sliding window",
    "cohere2_moe": "RoPE only on its sliding-window layers and none (NoPE) on full-attention layers, with a "
                   "sliding window",
}


class HuggingFace(AttentionAdapter):
    takes_dropout = True
    library = "transformers"
    supported = SUPPORTED

    def __init__(self, model_type: str, attn_implementation: str = "eager", vetting: Vetted | None = None):
        """``vetting``: judge a model type not in :data:`VETTED` as if it had this row (for vetting a new row;
        the CLI never passes it)."""
        self.spec = f"hf:{model_type}"
        self.model_type = model_type
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise BadInput(f"hf.attn_implementation={attn_implementation!r} is not supported: use one of "
                           f"{list(ATTN_IMPLEMENTATIONS)}")
        self.attn_implementation = attn_implementation
        self.returns_weights = attn_implementation == "eager"
        tf = require_transformers()
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            raise BadInput(f"impl=hf:{model_type}: unknown model type {model_type!r} in transformers "
                           f"{tf.__version__}: use one of the vetted types {sorted(VETTED)}")
        self.config_cls = CONFIG_MAPPING[model_type]
        package = self.config_cls.__module__.rsplit(".", 1)[0]  # a sub-config (gemma3_text) lives in its parent's
        try:
            self.modeling = importlib.import_module(f"{package}.modeling_{package.rsplit('.', 1)[1]}")
        except ImportError:
            raise BadInput(f"impl=hf:{model_type}: transformers has no modeling_{model_type} module to take an "
                           "attention layer from: pick a text model type such as llama or gpt2") from None
        self.vetted = vetting if vetting is not None else VETTED.get(model_type)
        self.layout = ""
        self.notes = ()

    @property
    def name(self) -> str:
        return f"{self.spec} ({self.attn_implementation})"

    # ---------------------------------------------------------------------------------------- building
    def config(self, d_model: int, n_heads: int, n_kv_heads: int, dropout: float) -> Any:
        cfg = self.config_cls()
        values = {"hidden_size": d_model, "num_attention_heads": n_heads, "num_hidden_layers": 1,
                  "intermediate_size": 4 * d_model, "vocab_size": 64, "max_position_embeddings": 64}
        for key, value in values.items():
            setattr(cfg, key, value)
        for key in ("n_positions", "n_ctx"):
            if hasattr(cfg, key):
                setattr(cfg, key, 64)
        if hasattr(cfg, "num_key_value_heads"):
            cfg.num_key_value_heads = n_kv_heads
        elif n_kv_heads != n_heads:
            raise refuse(self.spec, f"its config has no num_key_value_heads (no GQA), n_kv_heads={n_kv_heads}",
                         "drop n_kv_heads")
        if hasattr(cfg, "head_dim"):
            cfg.head_dim = d_model // n_heads
        for key in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
            if hasattr(cfg, key):
                setattr(cfg, key, dropout)
        for key in ("resid_pdrop", "hidden_dropout_prob", "embd_pdrop"):
            if hasattr(cfg, key):
                setattr(cfg, key, 0.0)
        if getattr(cfg, "sliding_window", None) is not None:
            try:
                cfg.sliding_window = None
            except Exception:  # a strict config wants an int: a window as long as any sequence it can take
                cfg.sliding_window = cfg.max_position_embeddings
            self.notes = ("sliding window switched off in the tiny config (the reference does not model it)",)
        if hasattr(cfg, "use_sliding_window"):
            cfg.use_sliding_window = False
        cfg._attn_implementation = self.attn_implementation
        problem = unmodelled_config(cfg)
        if problem:
            raise refuse(self.spec, f"{problem}, which the reference does not model", self._fix())
        return cfg

    def _fix(self) -> str:
        return (f"attn-check cannot judge this model type yet; use one of the {len(VETTED)} vetted types "
                "(tfmoe.adapters.huggingface.VETTED, experiments/zoo.md), e.g. hf:llama, hf:cohere, hf:gpt2")

    def _attention_class(self) -> type[nn.Module]:
        cls = attention_class(self.modeling, self.config_cls)
        if cls is None:
            prefix = self.config_cls.__name__.removesuffix("Config")
            raise refuse(self.spec, f"transformers.models.{self.model_type} has no {prefix}Attention class",
                         "pick a model type with a self-attention layer, e.g. hf:llama")
        return cls

    def build(self, d_model: int, n_heads: int, *, n_kv_heads: int, causal: bool, dropout: float,
              seed: int | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
        cfg = self.config(d_model, n_heads, n_kv_heads, dropout)
        self.cfg = cfg  # the reference reads rope_theta / the scale from it
        cls = self._attention_class()
        kwargs: dict[str, Any] = {}
        params = init_parameters(cls)
        if "layer_idx" in params:
            kwargs["layer_idx"] = 0
        if "is_causal" in params:
            kwargs["is_causal"] = causal
        with seeded(seed):
            module = cls(cfg, **kwargs)
            rotary_cls = rotary_class(self.modeling, cls)
            rotary = rotary_cls(cfg) if rotary_cls is not None else None
        layout, problem = classify_layer(module, rotary, self.model_type)
        if not problem and self.model_type in UNMODELLED_SOURCE and self.vetted is None:
            problem = f"its modeling file shows {UNMODELLED_SOURCE[self.model_type]}"
        if problem:
            raise refuse(self.spec, problem, self._fix())
        if self.vetted is None:
            raise refuse(self.spec, f"not vetted yet: its {type(module).__name__} has the {layout} layout, but its "
                         "RoPE pairing and attention semantics are not recorded in tfmoe's table of vetted model "
                         "types (tfmoe.adapters.huggingface.VETTED)", self._fix())
        if layout != self.vetted.layout:
            raise adapter_error(f"hf:{self.model_type} is vetted as the {self.vetted.layout} layout but its "
                                f"{type(module).__name__} has the {layout} layout")
        self.layout = layout
        if self.layout != "bert" and not causal:
            raise refuse(self.spec, "its attention is a decoder's (the model always builds a causal mask)",
                         "pass causal=true")
        object.__setattr__(module, "_tfmoe_rotary", rotary.to(device) if rotary is not None else None)
        return module.to(device=device, dtype=dtype).eval()

    # ----------------------------------------------------------------------------------------- forward
    def forward(self, module: nn.Module, x: torch.Tensor, padding_mask: torch.Tensor | None, *, causal: bool,
                cache: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        B, T, _ = x.shape
        attention_mask = None if padding_mask is None else padding_mask.to(device=x.device, dtype=torch.long)
        position_ids = torch.arange(T, device=x.device).expand(B, T)
        embeds = {"inputs_embeds|input_embeds": x}  # keyword names that changed within 5.x: whichever is taken
        if causal:
            mask = call_compatible(create_causal_mask, config=module.config, **embeds, attention_mask=attention_mask,
                                   **{"cache|past_key_values": None}, cache_position=torch.arange(T, device=x.device),
                                   position_ids=position_ids)
        else:
            mask = call_compatible(create_bidirectional_mask, config=module.config, **embeds,
                                   attention_mask=attention_mask)
        if self.layout == "llama":
            cos, sin = module._tfmoe_rotary(x, position_ids)
            result = module(x, position_embeddings=(cos, sin), attention_mask=mask)
        else:
            result = module(x, attention_mask=mask)
        return checked_output(tuple(result[:2]), type(module).__name__)

    # ------------------------------------------------------------------------------------- projections
    def parameters(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return dict(module.named_parameters())

    def projections(self, params: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> Projections:
        if self.layout == "llama":
            cfg = self.cfg
            rope = getattr(cfg, "rope_parameters", None) or {}
            theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
            w_q = params["q_proj.weight"]
            d_head = w_q.shape[0] // n_heads
            return Projections(w_q, params["k_proj.weight"], params["v_proj.weight"], params["o_proj.weight"],
                               n_heads, n_kv_heads, params.get("q_proj.bias"), params.get("k_proj.bias"),
                               params.get("v_proj.bias"), params.get("o_proj.bias"), rope=Rope(theta, d_head, self.vetted.rope or 'half'))
        if self.layout == "gpt2":
            w = params["c_attn.weight"].transpose(0, 1)  # Conv1D (in, 3D) -> Linear layout (3D, in)
            w_q, w_k, w_v = w.chunk(3, dim=0)
            b_q, b_k, b_v = params["c_attn.bias"].chunk(3, dim=0)
            scale = None if self.cfg.scale_attn_weights else 1.0
            return Projections(w_q, w_k, w_v, params["c_proj.weight"].transpose(0, 1), n_heads, n_heads,
                               b_q, b_k, b_v, params["c_proj.bias"], scale=scale)
        return Projections(params["query.weight"], params["key.weight"], params["value.weight"], None,
                           n_heads, n_heads, params["query.bias"], params["key.bias"], params["value.bias"])

    def set_projections(self, module: nn.Module, p: Projections) -> None:
        if self.layout == "llama":
            for name, w, b in (("q_proj", p.w_q, p.b_q), ("k_proj", p.w_k, p.b_k), ("v_proj", p.w_v, p.b_v),
                               ("o_proj", p.w_o, p.b_o)):
                copy_linear(getattr(module, name), w, b)
        elif self.layout == "gpt2":
            with torch.no_grad():
                module.c_attn.weight.copy_(torch.cat([p.w_q, p.w_k, p.w_v]).transpose(0, 1))
                module.c_attn.bias.zero_()
                module.c_proj.weight.copy_(p.w_o.transpose(0, 1))
                module.c_proj.bias.zero_()
        else:
            for name, w, b in (("query", p.w_q, p.b_q), ("key", p.w_k, p.b_k), ("value", p.w_v, p.b_v)):
                copy_linear(getattr(module, name), w, b)

    def hooks(self, module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        if self.layout == "llama":
            return None, module.o_proj
        if self.layout == "gpt2":
            return module.c_attn, module.c_proj
        return None, None


# ------------------------------------------------------------------------------ reading a model type's source
def attention_class(modeling: Any, config_cls: type) -> type[nn.Module] | None:
    """``<Prefix>SelfAttention`` or ``<Prefix>Attention`` in the model's modeling module (None if neither)."""
    prefix = config_cls.__name__.removesuffix("Config")
    for name in (f"{prefix}SelfAttention", f"{prefix}Attention"):
        cls = getattr(modeling, name, None)
        if inspect.isclass(cls) and issubclass(cls, nn.Module):
            return cls
    return None


def init_parameters(cls: type) -> Any:
    """The parameters of ``cls.__init__``, looking through a decorator's ``(self, *args, **kwargs)`` wrapper to the
    function it closes over (transformers 5.0's ``use_kernelized_func`` wraps the attention classes' __init__
    without functools.wraps)."""
    fn = cls.__init__
    params = inspect.signature(fn).parameters
    for _ in range(4):
        if not any(p.kind is p.VAR_POSITIONAL for p in params.values()):
            break
        inner = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                 if inspect.isfunction(getattr(c, "cell_contents", None))]
        if not inner:
            break
        fn = inner[0]
        params = inspect.signature(fn).parameters
    return params


def rotary_class(modeling: Any, attention: type) -> type[nn.Module] | None:
    return getattr(modeling, attention.__name__.replace("SelfAttention", "").replace("Attention", "")
                   + "RotaryEmbedding", None)


def unmodelled_config(cfg: Any) -> str:
    """'' or the config setting whose semantics the reference does not model (softcapping, scale, scaled or
    partial RoPE, …)."""
    for key, meaning in UNMODELLED_CONFIG.items():
        value = getattr(cfg, key, None)
        if value in (None, False, 0, "absolute"):
            continue
        if key == "query_pre_attn_scalar" and value == getattr(cfg, "head_dim", None):
            continue
        if key == "attention_multiplier" and value == 1.0:
            continue
        return f"config {key}={value!r} means {meaning}"
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type != "default":
        return f"rope_type={rope_type!r} (scaled RoPE)"
    factor = (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) or getattr(
        cfg, "partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        return f"partial_rotary_factor={factor} (partial RoPE)"
    return ""


def classify_layer(module: nn.Module, rotary: nn.Module | None, model_type: str) -> tuple[str, str]:
    """(layout, '') for a layer the reference can model, or ('', the semantic it would need)."""
    names = {n for n, _ in module.named_parameters()}
    if all(isinstance(getattr(module, n, None), nn.Linear) for n in LLAMA):
        extra = sorted({n.split(".")[0] for n in names if n.split(".")[0] not in LLAMA}
                       | {n for n, _ in module.named_children() if n not in LLAMA and "dropout" not in n})
        if extra:
            what = "q/k norm" if any("norm" in n for n in extra) else "extra parameters"
            return "", f"its attention has parameters {extra} beyond q/k/v/o_proj ({what})"
        if "position_embeddings" not in inspect.signature(module.forward).parameters or rotary is None:
            return "", "its attention takes no rotary position_embeddings (another position scheme)"
        head_dim = getattr(module, "head_dim", None)
        scaling = getattr(module, "scaling", None)
        if head_dim and isinstance(scaling, float) and abs(scaling - head_dim ** -0.5) > 1e-12:
            return "", f"its attention scales scores by {scaling:.4g}, not 1/sqrt(head_dim) (a non-standard scale)"
        return "llama", ""
    if model_type == "gpt2":
        return "gpt2", ""
    if all(isinstance(getattr(module, n, None), nn.Linear) for n in ("query", "key", "value")) and names == {
            f"{n}.{w}" for n in ("query", "key", "value") for w in ("weight", "bias")}:
        return "bert", ""
    fused = sorted({n.split(".")[0] for n in names} & set(FUSED_QKV))
    if fused:
        return "", f"its attention projects q, k, v with one fused layer {fused} (fused qkv)"
    return "", f"{type(module).__name__} has a layout this adapter does not know (parameters {sorted(names)})"
