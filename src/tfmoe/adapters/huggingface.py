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
- ``bert`` — ``query``/``key``/``value`` (with biases), no output projection inside ``BertSelfAttention``; RoPE
  where the row records it (roformer: interleaved pairs, handed in as ``sinusoidal_pos`` from the model's own
  ``RoFormerSinusoidalPositionalEmbedding``).

The reference reads only the config and the weights (see ``tfmoe.components.references``: its own RoPE with the
config's rope_theta in the row's pairing, its own kv-head mapping, its own mask). Any other model type exits 2
naming the semantic the reference would need (:func:`classify_layer` / :func:`unmodelled_config`: q/k norm, logit
softcapping, a non-standard scale, partial or scaled RoPE, fused qkv, …; :data:`UNMODELLED_SOURCE`, read from the
modeling file: approximate or block-sparse attention, positions or biases handed to the layer beyond the mask,
M-RoPE, sinks, …), or, when nothing is missing, that it is not vetted yet.

Each row also records which ``causal`` settings its class is built for: an encoder (``is_causal = False``, e.g.
gte, eurobert) run with causal=true exits 2, as does a decoder run with causal=false, since under sdpa a batch
with nothing padded gets no mask and the class's own is_causal decides. A model whose ``_supports_sdpa`` is False
(transformers refuses sdpa for it) exits 2 under ``hf.attn_implementation=sdpa``. Sliding windows are switched
off in the tiny config (a note says so).
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
from tfmoe.contract.errors import BadInput

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
    "rotary_value": "RoPE applied to v as well",
}


@dataclass(frozen=True)
class Vetted:
    """One vetted model type, as its modeling file shows it: the layout, the RoPE pairing (None: no rotary inside
    attention), where the source shows them, the ``causal`` settings its attention class is built for (a decoder:
    ``(True,)``, its ``is_causal = True``; an encoder: ``(False,)``, ``is_causal = False``; a class taking an
    ``is_causal`` argument, or one that only follows the mask it is given: both) and the mask its model hands the
    layer (``masking_utils``: ``create_causal_mask`` / ``create_bidirectional_mask``, None when nothing is hidden;
    ``extended``: the legacy additive (B,1,1,T) mask ``(1 - mask) * finfo.min``, built even when nothing is
    padded). Any other causal setting exits 2 (an encoder run as a decoder, or the reverse, is never judged)."""

    layout: str  # llama | gpt2 | bert
    rope: str | None  # half | interleaved | None
    source: str
    causal: tuple[bool, ...] = (True,)
    mask: str = "masking_utils"  # masking_utils | extended


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
    "EvollaModel": Vetted("llama", "half", _HALF + " (EvollaAttention, the text decoder's)"),
    "aria_text": Vetted("llama", "half", _HALF),
    "cosmos3_edge_text": Vetted("llama", "half", _HALF),
    "deepseek_ocr2_text": Vetted("llama", "half", _HALF),
    "evolla": Vetted("llama", "half", _HALF + " (EvollaAttention, the text decoder's)"),
    "mimi": Vetted("llama", "half", _HALF + "; its sliding window is switched off (a note says so)"),
    "pocket_tts_audio_tokenizer": Vetted("llama", "half", _HALF + "; Mimi's attention, sliding window switched off"),
    # Llama-layout ENCODERS: is_causal = False in the attention class, bidirectional masks in the model
    "eurobert": Vetted("llama", "half", _HALF + "; EuroBertAttention.is_causal = False", causal=(False,)),
    "gte": Vetted("llama", "half", _HALF + "; GteAttention.is_causal = False", causal=(False,)),
    "jina_embeddings_v3": Vetted("llama", "half", _HALF + "; JinaEmbeddingsV3Attention.is_causal = False",
                                 causal=(False,)),
    "lasr_encoder": Vetted("llama", "half", _HALF + "; LasrEncoderAttention.is_causal = False", causal=(False,)),
    "nomic_bert": Vetted("llama", "half", _HALF + "; NomicBertAttention.is_causal = False", causal=(False,)),
    "gpt2": Vetted("gpt2", None, "learned positions in GPT2Model, none inside GPT2Attention"),
    # the bert layout: absolute positions in the embeddings, none inside the self-attention class
    **{t: Vetted("bert", None, f"none inside {cls}SelfAttention, which takes is_causal", causal=(True, False))
       for t, cls in (("bert", "Bert"), ("bert-generation", "BertGeneration"), ("camembert", "Camembert"),
                      ("electra", "Electra"), ("ernie", "Ernie"), ("roberta", "Roberta"),
                      ("roberta-prelayernorm", "RobertaPreLayerNorm"), ("roc_bert", "RoCBert"),
                      ("xlm-roberta", "XLMRoberta"), ("xlm-roberta-xl", "XLMRobertaXL"), ("xmod", "Xmod"))},
    "chinese_clip_text_model": Vetted("bert", None, "none inside ChineseCLIPTextSelfAttention (is_causal = False)",
                                      causal=(False,)),
    "esm": Vetted("bert", None, "none with the default position_embedding_type='absolute' (EsmSelfAttention: q "
                  "scaled before the product, is_causal = config.is_decoder, False)", causal=(False,)),
    "layoutlm": Vetted("bert", None, "none inside LayoutLMSelfAttention; LayoutLMModel passes the additive extended "
                       "mask, never None", causal=(False,), mask="extended"),
    # _supports_sdpa = False in these models: judged under eager only (sdpa exits 2); the class follows the mask
    "align_text_model": Vetted("bert", None, "none inside AlignTextSelfAttention (an encoder)", causal=(False,)),
    "clap_text_model": Vetted("bert", None, "none inside ClapTextSelfAttention (an encoder)", causal=(False,)),
    "splinter": Vetted("bert", None, "none inside SplinterSelfAttention (an encoder)", causal=(False,)),
    "markuplm": Vetted("bert", None, "none inside MarkupLMSelfAttention; MarkupLMModel passes the additive "
                       "extended mask ((1 - mask) * -10000), never None", causal=(False,), mask="extended"),
    "superglue": Vetted("bert", None, "none inside SuperGlueSelfAttention (keypoint positions are encoded "
                        "outside; self-attention over keypoints)", causal=(False,)),
    "tapas": Vetted("bert", None, "none inside TapasSelfAttention (an encoder)", causal=(False,)),
    "vilt": Vetted("bert", None, "none inside ViltSelfAttention (an encoder)", causal=(False,)),
    "visual_bert": Vetted("bert", None, "none inside VisualBertSelfAttention (an encoder)", causal=(False,)),
    "git": Vetted("bert", None, "none inside GitSelfAttention, which follows the mask GitModel builds",
                  causal=(True, False)),
    "megatron-bert": Vetted("bert", None, "none inside MegatronBertSelfAttention, which follows the mask",
                            causal=(True, False)),
    "rembert": Vetted("bert", None, "none inside RemBertSelfAttention, which follows the mask", causal=(True, False)),
    "roformer": Vetted("bert", "interleaved", "RoFormerSelfAttention.apply_rotary_position_embeddings: "
                       "stack(-x[..., 1::2], x[..., ::2]); sin/cos repeated pairwise from the sinusoidal_pos "
                       "RoFormerEncoder hands every layer (RoFormerSinusoidalPositionalEmbedding, 10000^(2i/d))",
                       causal=(True, False)),
}
# Model types whose layer passes the static screens (Llama layout, plain RoPE) but whose source shows a semantic the
# reference does not model: refused by name, not as "not vetted".
UNMODELLED_SOURCE: dict[str, str] = {
    # approximations of softmax attention
    "yoso": "approximate attention (YOSO: LSH-based Bernoulli sampling, the collision probability "
            "(1 - arccos(q.k)/pi)^tau in place of softmax)",
    "mra": "approximate attention (MRA: a multi-resolution block approximation of softmax attention, mra2_attention)",
    "big_bird": "block-sparse attention by default (attention_type='block_sparse': BigBirdBlockSparseAttention; "
                "BigBirdSelfAttention is only its original_full fallback)",
    # positions or biases handed to the layer beyond the mask
    "bros": "bounding-box position scores inside attention (BrosSelfAttention: bbox_pos_emb)",
    "layoutlmv3": "relative 1-D and 2-D (spatial) position biases added to the scores (LayoutLMv3SelfAttention: "
                  "position_bias; has_relative_attention_bias / has_spatial_attention_bias default True)",
    "dpt": "no attention mask (DPTSelfAttention.forward takes none: a vision encoder over patches), so neither "
           "padding nor a causal mask can reach it",
    "yolos": "no attention mask (YolosSelfAttention.forward takes none: a vision encoder over patches), so neither "
             "padding nor a causal mask can reach it",
    "vitpose_backbone": "no attention mask (VitPoseBackboneSelfAttention.forward takes none: a vision encoder), so "
                        "neither padding nor a causal mask can reach it",
    # the class is not a plain self-attention call
    "mobilebert": "separate query/key/value inputs (MobileBertSelfAttention.forward(query_tensor, key_tensor, "
                  "value_tensor): q/k from the bottleneck, v from the layer input)",
    "canine": "separate from/to inputs (CanineSelfAttention.forward(from_tensor, to_tensor)), also run as local "
              "attention over blocks",
    "lxmert": "a cross-attention signature (LxmertAttention.forward(hidden_states, context); its self-attention "
              "layer passes context=hidden_states)",
    # RoPE the reference does not model
    "eomt_dinov3": "2-D RoPE over image patches (EomtDinov3RotaryEmbedding.forward(pixel_values): patch "
                   "coordinates, not token positions)",
    "glm4v_text": "multimodal RoPE (M-RoPE: mrope_section splits the rotary frequencies over 3 position streams, "
                  "temporal/height/width)",
    "glm_image_text": "multimodal RoPE (M-RoPE: mrope_section splits the rotary frequencies over 3 position streams)",
    "glm_ocr_text": "multimodal RoPE (M-RoPE: mrope_section splits the rotary frequencies over 3 position streams)",
    "neucodec": "RoPE over attention heads instead of token positions (NeuCodecAttention: position_ids of shape "
                "(1, num_attention_heads), apply_rotary_pos_emb(..., unsqueeze_dim=2))",
    "xcodec2": "RoPE over attention heads instead of token positions (Xcodec2Attention: position_ids of shape "
               "(1, num_attention_heads), apply_rotary_pos_emb(..., unsqueeze_dim=2))",
    "ultrabert": "per-layer-type RoPE (UltrabertRotaryEmbedding.forward(x, position_ids, layer_type): its own "
                 "rope_theta for sliding and full layers) with a sliding window on sliding layers",
    "mimo_v2_flash": "attention sinks and more kv heads on its sliding-window layers, a v head dim of its own "
                     "(v_head_dim) and per-layer-type RoPE on a third of each head (MiMoV2FlashAttention: s_aux=self.sinks; "
                     "MiMoV2FlashRotaryEmbedding(layer_type), partial_rotary_factor 0.334)",
    "unlimited_ocr_text": "an eager path that does not repeat kv heads (unlimited_ocr.eager_attention_forward has no "
                          "repeat_kv: GQA under eager raises; sdpa passes)",
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
        sinusoid = self.vetted is not None and layout == "bert" and self.vetted.rope is not None
        if not problem:
            problem = unsupplied_inputs(module, layout, {"sinusoidal_pos"} if sinusoid else set())
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
        if causal not in self.vetted.causal:
            if causal:
                raise refuse(self.spec, f"its {type(module).__name__} is an encoder's (is_causal=False: "
                             "bidirectional attention), so it is judged with causal=false only", "pass causal=false")
            raise refuse(self.spec, "its attention is a decoder's (the model always builds a causal mask)",
                         "pass causal=true")
        if self.attn_implementation == "sdpa":
            declared = sdpa_declared_false(self.modeling, self.config_cls)
            if declared:
                raise refuse(self.spec, f"its model declares _supports_sdpa=False ({declared}: transformers "
                             "itself refuses attn_implementation='sdpa' for it)", "pass hf.attn_implementation=eager")
        object.__setattr__(module, "_tfmoe_rotary", rotary.to(device) if rotary is not None else None)
        object.__setattr__(module, "_tfmoe_sinusoid", self._sinusoid(cls, cfg, d_model // n_heads, device)
                           if sinusoid else None)
        return module.to(device=device, dtype=dtype).eval()

    def _sinusoid(self, cls: type, cfg: Any, d_head: int, device: torch.device) -> nn.Module:
        """RoFormer's way: the model builds ``<Prefix>SinusoidalPositionalEmbedding(max_positions, head_dim)``
        once, fills it with its own ``create_weight()`` (its _init_weights) and hands every layer
        ``sinusoidal_pos`` = its rows for positions 0..T-1, shape (1, 1, T, head_dim)."""
        name = cls.__name__.removesuffix("SelfAttention") + "SinusoidalPositionalEmbedding"
        positions_cls = getattr(self.modeling, name, None)
        if positions_cls is None:
            raise adapter_error(f"hf:{self.model_type} is vetted with RoPE in the bert layout but its modeling file "
                                f"has no {name}")
        positions = positions_cls(cfg.max_position_embeddings, d_head)
        with torch.no_grad():
            positions.weight.copy_(positions.create_weight())
        return positions.to(device)

    # ----------------------------------------------------------------------------------------- forward
    def forward(self, module: nn.Module, x: torch.Tensor, padding_mask: torch.Tensor | None, *, causal: bool,
                cache: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        B, T, _ = x.shape
        attention_mask = None if padding_mask is None else padding_mask.to(device=x.device, dtype=torch.long)
        position_ids = torch.arange(T, device=x.device).expand(B, T)
        embeds = {"inputs_embeds|input_embeds": x}  # keyword names that changed within 5.x: whichever is taken
        if self.vetted.mask == "extended":  # e.g. LayoutLMModel.forward: ones when no mask is given, never None
            mask = extended_mask(torch.ones(B, T, device=x.device) if attention_mask is None else attention_mask,
                                 causal, x.dtype)
        elif causal:
            mask = call_compatible(create_causal_mask, config=self.cfg, **embeds, attention_mask=attention_mask,
                                   **{"cache|past_key_values": None}, cache_position=torch.arange(T, device=x.device),
                                   position_ids=position_ids)
        else:
            mask = call_compatible(create_bidirectional_mask, config=self.cfg, **embeds,
                                   attention_mask=attention_mask)
        if self.layout == "llama":
            cos, sin = module._tfmoe_rotary(x, position_ids)
            result = module(x, position_embeddings=(cos, sin), attention_mask=mask)
        else:
            extra = {} if module._tfmoe_sinusoid is None else {
                "sinusoidal_pos": module._tfmoe_sinusoid((B, T)).to(x.dtype)[None, None]}  # (1,1,T,Dh)
            if "output_attentions" in inspect.signature(module.forward).parameters:  # the legacy tuple API
                result = module(x, attention_mask=mask, output_attentions=self.returns_weights, **extra)
                result = (result[0], result[1] if self.returns_weights else None)
            else:
                result = module(x, attention_mask=mask, **extra)
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
        d_head = params["query.weight"].shape[0] // n_heads
        rope = None if self.vetted.rope is None else Rope(10000.0, d_head, self.vetted.rope)  # RoFormer's sinusoid:
        # pos / 10000^(2i/d_head), a constant in its create_weight, not a config key
        return Projections(params["query.weight"], params["key.weight"], params["value.weight"], None,
                           n_heads, n_heads, params["query.bias"], params["key.bias"], params["value.bias"], rope=rope)

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


SUPPLIED = {"hidden_states", "attention_mask", "output_attentions"}
ABSENT_MEANS_SELF_ATTENTION = {"cache", "past_key_values", "cache_position", "encoder_hidden_states",
                               "encoder_attention_mask", "head_mask", "position_ids"}


def unsupplied_inputs(module: nn.Module, layout: str, supplied: frozenset[str] | set[str] = frozenset()) -> str:
    """'' or the semantic behind the forward's inputs that this adapter does not supply: a layer that takes
    positions or biases beside the mask (layoutlmv3's position_bias, roformer's sinusoidal_pos) would run without
    them and could pass while judging a layer its model never runs."""
    params = {n for n, p in inspect.signature(module.forward).parameters.items()
              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    extra = params - SUPPLIED - supplied - ABSENT_MEANS_SELF_ATTENTION - (
        {"position_embeddings"} if layout == "llama" else set())
    if getattr(module, "position_embedding_type", None) == "absolute":  # ESM reads them only when 'rotary'
        extra.discard("position_embeddings")
    if not extra:
        return ""
    return (f"its {type(module).__name__}.forward takes {sorted(extra)}, inputs beyond the mask that this adapter "
            "does not supply (positions, biases or separate q/k/v tensors)")


def takes_kv_heads(model_type: str) -> bool:
    """Whether the model type's config has ``num_key_value_heads`` (GQA can be judged; gte, nomic_bert: no)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return hasattr(CONFIG_MAPPING[model_type](), "num_key_value_heads")


def sdpa_declared_false(modeling: Any, config_cls: type) -> str:
    """'' or the name of the model class (of ``config_cls``, in the modeling module) whose ``_supports_sdpa`` is
    False: transformers refuses ``attn_implementation='sdpa'`` for it, so sdpa is not a path its model runs (some of
    these classes write the softmax out, others dispatch but have no ``is_causal``, causal under sdpa without a
    mask)."""
    from transformers import PreTrainedModel

    for name, cls in sorted(vars(modeling).items()):
        if (inspect.isclass(cls) and issubclass(cls, PreTrainedModel) and cls.__module__ == modeling.__name__
                and getattr(cls, "config_class", None) is config_cls and cls._supports_sdpa is False):
            return name
    return ""


def extended_mask(attention_mask: torch.Tensor, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """The legacy additive mask older transformers models build in their own forward: (B,1,1,T) from the (B,T)
    0/1 padding mask, (1 - mask) * finfo(dtype).min, and for a decoder also the lower triangle, (B,1,T,T)."""
    keep = attention_mask[:, None, None, :].to(dtype)  # (B,1,1,T)
    if causal:
        T = attention_mask.shape[-1]
        keep = keep * torch.ones(T, T, device=keep.device, dtype=dtype).tril()[None, None]  # (B,1,T,T)
    return (1.0 - keep) * torch.finfo(dtype).min


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
