"""``impl=hf:<model_type>``: the attention layer of a Hugging Face transformers model, built from a tiny config
with random weights (nothing is downloaded), driven through the model's own code path: its mask builder
(``masking_utils.create_causal_mask`` / ``create_bidirectional_mask``), its rotary embedding class, its
attention interface (``eager`` or ``sdpa``, key ``hf.attn_implementation``).

Layouts (found from the built layer, not from a list of names):

- Llama layout — ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (biases if the model has them, e.g. qwen2's q/k/v)
  and rotary positions passed in as ``position_embeddings``: llama, mistral, qwen2, and any other model type
  whose attention layer has exactly these parameters and the standard scale 1/sqrt(head_dim).
- GPT-2 — fused ``c_attn`` (a Conv1D: weight (in, out)) and ``c_proj``; learned positions live outside.
- BERT — ``query``/``key``/``value`` (with biases), no output projection inside ``BertSelfAttention``.

The reference reads only the config and the weights (see ``tfmoe.components.references``: its own RoPE with
the config's rope_theta in the rotate-half layout, its own kv-head mapping, its own mask). Semantics it does not
model are refused by name with exit 2: extra parameters (q/k norms), logit softcapping, a non-standard scale,
partial rotary, rope scaling types other than ``default``. Sliding windows are switched off in the tiny config.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
import torch.nn as nn

from tfmoe.adapters.base import AttentionAdapter, checked_output, copy_linear, refuse, seeded
from tfmoe.components.references import Projections, Rope
from tfmoe.errors import BadInput

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj")
UNMODELLED_CONFIG = {  # config key -> what it means (refused when set to a value that changes attention)
    "attn_logit_softcapping": "attention logit softcapping",
    "query_pre_attn_scalar": "a query scale other than 1/sqrt(head_dim)",
    "attention_multiplier": "a query scale other than 1/sqrt(head_dim)",
    "clip_qkv": "clipping of q/k/v",
    "alibi": "ALiBi position biases",
    "use_alibi": "ALiBi position biases",
    "position_embedding_type": "relative position embeddings inside attention",
}


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise BadInput("impl=hf:... needs the optional extra `hf` (transformers 5.x): "
                       "pip install -e '.[hf]'") from None
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise BadInput(f"impl=hf:... needs transformers 5.x, found {transformers.__version__}: "
                       "pip install -e '.[hf]'")
    return transformers


class HuggingFace(AttentionAdapter):
    takes_dropout = True

    def __init__(self, model_type: str, attn_implementation: str = "eager"):
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
                           f"{tf.__version__}: use e.g. hf:llama, hf:mistral, hf:qwen2, hf:gpt2, hf:bert")
        self.config_cls = CONFIG_MAPPING[model_type]
        try:
            self.modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        except ImportError:
            raise BadInput(f"impl=hf:{model_type}: transformers has no modeling_{model_type} module to take an "
                           "attention layer from: pick a text model type such as llama or gpt2") from None
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
            cfg.sliding_window = None
            self.notes = ("sliding window switched off in the tiny config (the reference does not model it)",)
        if hasattr(cfg, "use_sliding_window"):
            cfg.use_sliding_window = False
        cfg._attn_implementation = self.attn_implementation
        self._refuse_unmodelled(cfg)
        return cfg

    def _refuse_unmodelled(self, cfg: Any) -> None:
        for key, meaning in UNMODELLED_CONFIG.items():
            value = getattr(cfg, key, None)
            if value in (None, False, 0, "absolute"):
                continue
            if key == "query_pre_attn_scalar" and value == getattr(cfg, "head_dim", None):
                continue
            if key == "attention_multiplier" and value == 1.0:
                continue
            raise refuse(self.spec, f"config {key}={value!r} means {meaning}, which the reference does not model",
                         "attn-check cannot judge this model type yet; use hf:llama, hf:mistral, hf:qwen2, hf:gpt2 "
                         "or hf:bert")
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        if rope_type != "default":
            raise refuse(self.spec, f"rope_type={rope_type!r} (scaled RoPE), which the reference does not model",
                         "use a model type with plain RoPE")
        factor = (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) or getattr(
            cfg, "partial_rotary_factor", 1.0)
        if factor not in (None, 1, 1.0):
            raise refuse(self.spec, f"partial_rotary_factor={factor} (partial RoPE), which the reference does not "
                         "model", "use a model type with full RoPE")

    def _attention_class(self) -> type[nn.Module]:
        prefix = self.config_cls.__name__.removesuffix("Config")
        for name in (f"{prefix}SelfAttention", f"{prefix}Attention"):
            cls = getattr(self.modeling, name, None)
            if inspect.isclass(cls):
                return cls
        raise refuse(self.spec, f"transformers.models.{self.model_type} has no {prefix}Attention class",
                     "pick a model type with a self-attention layer, e.g. hf:llama")

    def build(self, d_model: int, n_heads: int, *, n_kv_heads: int, causal: bool, dropout: float,
              seed: int | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
        cfg = self.config(d_model, n_heads, n_kv_heads, dropout)
        self.cfg = cfg  # the reference reads rope_theta / the scale from it
        cls = self._attention_class()
        kwargs: dict[str, Any] = {}
        params = inspect.signature(cls.__init__).parameters
        if "layer_idx" in params:
            kwargs["layer_idx"] = 0
        if "is_causal" in params:
            kwargs["is_causal"] = causal
        with seeded(seed):
            module = cls(cfg, **kwargs)
            rotary_cls = getattr(self.modeling, cls.__name__.replace("SelfAttention", "").replace(
                "Attention", "") + "RotaryEmbedding", None)
            rotary = rotary_cls(cfg) if rotary_cls is not None else None
        self.layout = self._layout(module, rotary)
        if self.layout != "bert" and not causal:
            raise refuse(self.spec, "its attention is a decoder's (the model always builds a causal mask)",
                         "pass causal=true")
        object.__setattr__(module, "_tfmoe_rotary", rotary.to(device) if rotary is not None else None)
        return module.to(device=device, dtype=dtype).eval()

    def _layout(self, module: nn.Module, rotary: nn.Module | None) -> str:
        names = {n for n, _ in module.named_parameters()}
        if all(isinstance(getattr(module, n, None), nn.Linear) for n in LLAMA):
            extra = sorted(n for n in names if n.split(".")[0] not in LLAMA)
            if extra:
                raise refuse(self.spec, f"its attention has parameters {extra} beyond q/k/v/o_proj (e.g. per-head "
                             "q/k norms), which the reference does not model", "use e.g. hf:llama")
            if "position_embeddings" not in inspect.signature(module.forward).parameters or rotary is None:
                raise refuse(self.spec, "its attention takes no rotary position_embeddings",
                             "use a Llama-layout model type with RoPE, e.g. hf:llama")
            if abs(getattr(module, "scaling", module.head_dim ** -0.5) - module.head_dim ** -0.5) > 1e-12:
                raise refuse(self.spec, f"its attention scales scores by {module.scaling}, not 1/sqrt(head_dim)",
                             "use a model type with the standard scale")
            return "llama"
        if self.model_type == "gpt2":
            return "gpt2"
        if all(isinstance(getattr(module, n, None), nn.Linear) for n in ("query", "key", "value")) and names == {
                f"{n}.{w}" for n in ("query", "key", "value") for w in ("weight", "bias")}:
            return "bert"
        raise refuse(self.spec, f"{type(module).__name__} has a layout this adapter does not know (parameters "
                     f"{sorted(names)})", "use hf:llama/mistral/qwen2 (q/k/v/o_proj), hf:gpt2 or hf:bert")

    # ----------------------------------------------------------------------------------------- forward
    def forward(self, module: nn.Module, x: torch.Tensor, padding_mask: torch.Tensor | None, *, causal: bool,
                cache: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        B, T, _ = x.shape
        attention_mask = None if padding_mask is None else padding_mask.to(device=x.device, dtype=torch.long)
        position_ids = torch.arange(T, device=x.device).expand(B, T)
        if causal:
            mask = create_causal_mask(config=module.config, inputs_embeds=x, attention_mask=attention_mask,
                                      cache=None, position_ids=position_ids)
        else:
            mask = create_bidirectional_mask(config=module.config, inputs_embeds=x, attention_mask=attention_mask)
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
                               params.get("v_proj.bias"), params.get("o_proj.bias"), rope=Rope(theta, d_head))
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
