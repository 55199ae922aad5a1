"""Hugging Face transformers 5.x sparse MoE blocks as layers under test (``impl=hf:<model type>``).

Each block is built on its own from a tiny config (nothing downloaded) and initialised explicitly from the
seed: a block made by its constructor has uninitialised expert tensors, and Qwen2-MoE's and DeepSeek-V3's
routers start at zeros (every expert ties); DeepSeek-V3's correction bias starts at zeros too, which would
leave selection and weighting indistinguishable, so it is drawn non-zero.

Three layouts, with the semantics their model cards / papers / config docs state (never read from the
block's forward):

- ``mixtral``  : softmax router, top-k, the k weights renormalised to sum 1 (Mixtral's top-2), no shared
  expert. Model types whose config has ``norm_topk_prob`` renormalise only when it is true.
- ``qwen2_moe``: softmax router, top-k, renormalised iff ``norm_topk_prob``; plus one shared expert whose
  output is scaled per token by sigmoid(x · shared_expert_gate).
- ``deepseek_v3``: sigmoid affinities; selection on affinities + ``e_score_correction_bias`` within the
  ``topk_group`` best of ``n_group`` groups (a group scores the sum of its two best corrected affinities);
  weights = the *uncorrected* affinities of the chosen experts, renormalised iff ``norm_topk_prob``, times
  ``routed_scaling_factor``; plus ``n_shared_experts`` ungated shared experts.

Experts are stored as (E, 2H, D) ``gate_up_proj`` ([gate; up], concatenated) and (E, D, H) ``down_proj``.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from tfmoe.adapters.moe_layers import Captured, LayerSizes, LayerUnderTest, dense_from_topk, forward_capturing
from tfmoe.adapters.transformers_support import require_transformers
from tfmoe.components import moe_reference as ref
from tfmoe.contract.errors import BadInput


@dataclass(frozen=True)
class ModelType:
    layout: str  # mixtral | qwen2_moe | deepseek_v3
    block: str  # the sparse block's class in transformers.models.<type>.modeling_<type>
    router: str = "gate"  # the block's router attribute, returning (logits, top-k weights, top-k indices)
    renormalise: bool | None = None  # declared where the config has no norm_topk_prob (None: the layout's rule)
    evidence: str = ""  # how it was vetted (scripts/zoo_moe.py)


# Model types whose sparse block follows one of the three layouts. Each was run through the battery here
# (experiments/route-sim.md names the runs); add a type only after it passes.
MODEL_TYPES: dict[str, ModelType] = {
    "mixtral": ModelType("mixtral", "MixtralSparseMoeBlock"),
    "qwen2_moe": ModelType("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "deepseek_v3": ModelType("deepseek_v3", "DeepseekV3MoE"),
    "qwen3_moe": ModelType("mixtral", "Qwen3MoeSparseMoeBlock"),
    "olmoe": ModelType("mixtral", "OlmoeSparseMoeBlock"),
    "glm4_moe": ModelType("deepseek_v3", "Glm4MoeMoE"),
    # the MoE zoo (scripts/zoo_moe.py --explore): each derives, in its modular_<type>.py, from a block above
    # (or, "own code", was tried under the layout) and passes the whole battery at its tiny config's defaults.
    **{t: ModelType("deepseek_v3", b, evidence=e) for t, b, e in (
        ("bailing_hybrid", "BailingHybridMoE", "modular: DeepseekV3MoE"), ("dots1", "Dots1MoE", "modular: DeepseekV3MoE"),
        ("glm4_moe_lite", "Glm4MoeLiteMoE", "modular: Glm4MoeMoE"), ("glm4v_moe", "Glm4vMoeTextMoE", "modular: Glm4MoeMoE"),
        ("glm5_next", "Glm5NextTextMoE", "modular: DeepseekV3MoE"), ("hy_v4", "HYV4MoE", "modular: Glm4MoeLiteMoE"),
        ("kimi_linear", "KimiLinearMoE", "modular: DeepseekV3MoE"), ("mimo_v2_flash", "MiMoV2FlashMoE",
                                                                       "modular: DeepseekV3MoE"),
        ("solar_open", "SolarOpenMoE", "modular: Glm4MoeMoE"), ("axk2", "AXK2MoE", "modular: DeepseekV32MoE"),
        ("deepseek_v32", "DeepseekV32MoE", "own code, DeepSeek-V3 layout"),
        ("dots3_note", "Dots3NoteTextMoE", "modular: DeepseekV32MoE"),
        ("glm_moe_dsa", "GlmMoeDsaMoE", "own code, DeepSeek-V3 layout"), ("hy_v4_vl", "HYV4VLMoE",
                                                                          "own code, DeepSeek-V3 layout"))},
    **{t: ModelType("mixtral", b, evidence=e) for t, b, e in (
        ("flex_olmo", "FlexOlmoSparseMoeBlock", "modular: OlmoeSparseMoeBlock"),
        ("lara_mini", "LaraMiniSparseMoeBlock", "modular: FlintSparseMoeBlock <- Qwen3MoeSparseMoeBlock"),
        ("mellum", "MellumSparseMoeBlock", "modular: Qwen3MoeSparseMoeBlock"),
        ("minimax", "MiniMaxSparseMoeBlock", "modular: MixtralSparseMoeBlock"),
        ("qwen3_vl_moe", "Qwen3VLMoeTextSparseMoeBlock", "modular: Qwen3MoeSparseMoeBlock"),
        ("cohere2_moe", "Cohere2MoeSparseMoeBlock", "own code, Mixtral layout"))},
    **{t: ModelType("qwen2_moe", b, evidence=e) for t, b, e in (
        ("qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock", "modular: Qwen3NextSparseMoeBlock"),
        ("qwen3_next", "Qwen3NextSparseMoeBlock", "modular: Qwen2MoeSparseMoeBlock"),
        ("qwen4_exp", "Qwen4ExpTextSparseMoeBlock", "modular: Qwen3NextSparseMoeBlock"))},
    # Jamba: JambaTopKRouter (block.router) = softmax over all experts, top-k, NOT renormalised (its source)
    "jamba": ModelType("mixtral", "JambaSparseMoeBlock", router="router", renormalise=False,
                       evidence="own code: JambaTopKRouter read (softmax, top-k, no renormalisation)"),
}
LAYOUTS = ("mixtral", "qwen2_moe", "deepseek_v3")

# Sparse-MoE blocks of transformers 5.24 refused by name: the semantic each needs that the reference does not model
# (read from its modeling file). scripts/zoo_moe.py lists every block, vetted, refused or not vetted.
REFUSED: dict[str, str] = {  # model type (or type.Block where a type has two blocks) -> why
    'dbrx': 'DbrxFFN keeps its sizes in a nested ffn_config and divides the top-k weights by their p-norm '
            '(ffn_config.moe_normalize_expert_weights; p=1 is renormalising): needs a DBRX config reader and the '
            'p-norm semantic',
    'afmoe': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: raised AttributeError; qwen2_moe: raised AttributeError; deepseek_v3: raised AttributeError; its modeling file uses sigmoid scores, a selection bias, a routed scaling factor, shared experts',
    'axk1': 'derives from DeepseekV3MoE (deepseek_v3) but routes differently (fails output_vs_reference under that layout); its modeling file uses sigmoid scores, a selection bias, a routed scaling factor, shared experts, group-limited routing',
    'beam': 'derives from Qwen3MoeSparseMoeBlock (mixtral) but routes differently (fails output_vs_reference, routing_selection, routing_weights under that layout); its modeling file uses sigmoid scores, a selection bias, a routed scaling factor, group-limited routing',
    'deepseek_ocr2': 'not derived from a vetted block (DeepseekV2Moe); under the three layouts mixtral: fails output_vs_reference, routing_weights, topk_weights_sum; qwen2_moe: fails output_vs_reference, routing_weights, topk_weights_sum; deepseek_v3: fails output_vs_reference, routing_selection, routing_weights, topk_weights_sum; its modeling file uses a routed scaling factor, shared experts, group-limited routing',
    'deepseek_v2': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: fails output_vs_reference, routing_weights, topk_weights_sum; qwen2_moe: fails output_vs_reference, routing_weights, topk_weights_sum; deepseek_v3: fails output_vs_reference, routing_selection, routing_weights, topk_weights_sum; its modeling file uses a routed scaling factor, shared experts, group-limited routing',
    'deepseek_v4': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: refused its config or constructor refuse the tiny sizes; qwen2_moe: refused its config or constructor refuse the tiny sizes; deepseek_v3: raised AttributeError; its modeling file uses sigmoid scores, a selection bias, a routed scaling factor, shared experts, group-limited routing',
    'doge': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: raised AttributeError; qwen2_moe: raised AttributeError; deepseek_v3: raised AttributeError; its modeling file uses its own router and combine',
    'dots3_note.Dots3NoteVisionMoE': "derives from DeepseekV3MoE (deepseek_v3) but its block or config differ (hf:dots3_note refuses these sizes (TypeError: Dots3NoteVisionMoE.__init__() missing 1 required positional argument: 'lay); its modeling file uses sigmoid scores, a selection bias, a routed scaling factor, shared experts, group-limited routing",
    'ernie4_5_moe': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: fails output_vs_reference, routing_selection, aux_loss_vs_switch; qwen2_moe: fails output_vs_reference, routing_selection, aux_loss_vs_switch; deepseek_v3: raised AttributeError; its modeling file uses a selection bias, shared experts',
    'ernie4_5_vl_moe.Ernie4_5_VLMoeSparseMoeBlock': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: refused its config or constructor refuse the tiny sizes; qwen2_moe: refused its config or constructor refuse the tiny sizes; deepseek_v3: refused its config or constructor refuse the tiny sizes; its modeling file uses a selection bias, shared experts',
    'ernie4_5_vl_moe.Ernie4_5_VLMoeMoeBlock': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: refused its config or constructor refuse the tiny sizes; qwen2_moe: refused its config or constructor refuse the tiny sizes; deepseek_v3: refused its config or constructor refuse the tiny sizes; its modeling file uses a selection bias, shared experts',
    'flint': 'derives from Qwen3MoeSparseMoeBlock (mixtral) but routes differently (fails output_vs_reference, routing_weights under that layout); its modeling file uses sigmoid scores, shared experts',
    'granitemoe': 'experts stored as input_linear/output_linear (parallel experts) behind block.router, a layout the HF readers do not parse: needs a Granite layout reader',
    'granitemoe_swa': 'not derived from a vetted block (GraniteMoeMoE); under the three layouts mixtral: raised AttributeError; qwen2_moe: raised AttributeError; deepseek_v3: raised AttributeError; its modeling file uses sigmoid scores, shared experts',
    'granitemoehybrid': 'not derived from a vetted block (GraniteMoeSharedMoE); under the three layouts mixtral: refused its config or constructor refuse the tiny sizes; qwen2_moe: refused its config or constructor refuse the tiny sizes; deepseek_v3: refused its config or constructor refuse the tiny sizes; its modeling file uses shared experts, group-limited routing',
    'granitemoeshared': 'not derived from a vetted block (no modular file); under the three layouts mixtral: raised AttributeError; qwen2_moe: raised AttributeError; deepseek_v3: raised AttributeError; its modeling file uses shared experts',
    'hunyuan_v1_moe': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: raised AttributeError; qwen2_moe: raised AttributeError; deepseek_v3: raised AttributeError; its modeling file uses shared experts',
    'hy_v3': 'derives from MixtralSparseMoeBlock (mixtral) but routes differently (fails output_vs_reference, routing_weights, topk_weights_sum under that layout); its modeling file uses sigmoid scores, a selection bias, shared experts',
    'inkling': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: raised KeyError; qwen2_moe: raised KeyError; deepseek_v3: raised KeyError; its modeling file uses sigmoid scores, a selection bias, a routed scaling factor, shared experts',
    'inkling2': 'derives from Qwen3MoeSparseMoeBlock (mixtral) but routes differently (fails output_vs_reference, routing_selection, routing_weights, topk_weights_sum, finite.fp16, finite.bf16 under that layout); its modeling file uses sigmoid scores, a selection bias, a routed scaling factor',
    'inkling2_loop': 'not derived from a vetted block (no modular file); under the three layouts mixtral: fails output_vs_reference, routing_selection, routing_weights, topk_weights_sum, finite.fp16, finite.bf16; qwen2_moe: fails output_vs_reference, routing_selection, routing_weights, topk_weights_sum, finite.fp16, finite.bf16; deepseek_v3: raised AttributeError; its modeling file uses sigmoid scores, a selection bias, a routed scaling factor',
    'jetmoe': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: raised AttributeError; qwen2_moe: raised AttributeError; deepseek_v3: raised AttributeError; its modeling file uses its own router and combine',
    'kolibri1': "derives from DeepseekV3MoE (deepseek_v3) but its block or config differ (AttributeError: 'Kolibri1Config' object has no attribute 'routed_scaling_factor'); its modeling file uses sigmoid scores, a selection bias, shared experts",
    'laguna': 'derives from Qwen3MoeSparseMoeBlock (mixtral) but routes differently (fails output_vs_reference, routing_selection, routing_weights, aux_loss_vs_switch under that layout); its modeling file uses sigmoid scores, a selection bias, a routed scaling factor, shared experts',
    'lfm2_moe': "derives from Qwen3MoeSparseMoeBlock (mixtral) but its block or config differ (AttributeError: 'Lfm2MoeConfig' object has no attribute 'hidden_act'); its modeling file uses sigmoid scores, a selection bias, a routed scaling factor",
    'llama4': 'router scores multiply the expert *input* (sigmoid of the top-k logits, applied before the experts), plus a shared expert: not the weight-after-the-expert combine the reference models',
    'longcat_flash': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: raised AttributeError; qwen2_moe: raised AttributeError; deepseek_v3: raised AttributeError; its modeling file uses a selection bias, a routed scaling factor, zero/identity experts',
    'minimax_m2': 'derives from MixtralSparseMoeBlock (mixtral) but routes differently (fails output_vs_reference, routing_weights under that layout); its modeling file uses sigmoid scores, a selection bias, router jitter, noise in the router',
    'minimax_m3_vl': "derives from Qwen3MoeSparseMoeBlock (mixtral) but its block or config differ (AttributeError: 'MiniMaxM3VLDenseMLP' object has no attribute 'gate_proj'); its modeling file uses sigmoid scores, a selection bias, a routed scaling factor, shared experts",
    'mistral4': 'derives from DeepseekV3MoE (deepseek_v3) but routes differently (fails output_vs_reference, routing_selection, routing_weights under that layout); its modeling file uses a routed scaling factor, shared experts, group-limited routing',
    'mistral_large4': 'derives from DeepseekV3MoE (deepseek_v3) but routes differently (fails output_vs_reference, routing_selection, routing_weights under that layout); its modeling file uses a routed scaling factor, shared experts, group-limited routing',
    'muse_spark': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: raised RuntimeError; qwen2_moe: raised RuntimeError; deepseek_v3: raised AttributeError; its modeling file uses sigmoid scores, a selection bias, a routed scaling factor',
    'nemotron_h': "derives from DeepseekV3MoE (deepseek_v3) but its block or config differ (AttributeError: 'NemotronHConfig' object has no attribute 'hidden_act'); its modeling file uses sigmoid scores, a selection bias, a routed scaling factor, shared experts, group-limited routing",
    'phimoe': 'SparseMixer routing (PhiMoE: the top-2 chosen through jitter-masked scores, each weight from its own masked softmax; block.router): a router the reference does not model',
    'qwen3_omni_moe.Qwen3OmniMoeThinkerTextSparseMoeBlock': "derives from Qwen3MoeSparseMoeBlock (mixtral) but its block or config differ (AttributeError: 'Qwen3OmniMoeConfig' object has no attribute 'hidden_act'); its modeling file uses sigmoid scores, shared experts",
    'qwen3_omni_moe.Qwen3OmniMoeTalkerTextSparseMoeBlock': "derives from Qwen2MoeSparseMoeBlock (qwen2_moe) but its block or config differ (AttributeError: 'Qwen3OmniMoeConfig' object has no attribute 'hidden_act'); its modeling file uses sigmoid scores, shared experts",
    'step3p7': "derives from Qwen3MoeSparseMoeBlock (mixtral) but its block or config differ (hf:step3p7 refuses these sizes (TypeError: Step3p7SparseMoeBlock.__init__() missing 1 required positional argument: 'lay); its modeling file uses sigmoid scores, a selection bias, a routed scaling factor, shared experts",
    'unlimited_ocr': 'not derived from a vetted block (no modular file); under the three layouts mixtral: fails output_vs_reference, routing_weights, topk_weights_sum; qwen2_moe: fails output_vs_reference, routing_weights, topk_weights_sum; deepseek_v3: fails output_vs_reference, routing_selection, routing_weights, topk_weights_sum; its modeling file uses a routed scaling factor, shared experts, group-limited routing',
    'vitpose_backbone': 'not derived from a vetted block (no modular file); under the three layouts mixtral: raised AttributeError; qwen2_moe: raised AttributeError; deepseek_v3: raised AttributeError; its modeling file uses its own router and combine',
    'zaya': 'not derived from a vetted block (nn.Module); under the three layouts mixtral: refused its config or constructor refuse the tiny sizes; qwen2_moe: refused its config or constructor refuse the tiny sizes; deepseek_v3: refused its config or constructor refuse the tiny sizes; its modeling file uses its own router and combine',
}


def _transformers() -> Any:
    return require_transformers()  # the one supported range (tfmoe.adapters.transformers_support)


def _fields(config_cls: type) -> set[str]:
    names: set[str] = set(getattr(config_cls, "attribute_map", {}) or {})
    for klass in config_cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
    # transformers < 5.24's configs are not dataclasses: their fields are __init__'s keyword arguments
    names |= {n for n in inspect.signature(config_cls.__init__).parameters if n not in ("self", "kwargs")}
    return names


def check_sizes(model_type: str, layout: str, s: LayerSizes) -> None:
    """Sizes the layout refuses -> BadInput naming the rule."""
    where = f"hf:{model_type}"
    if not 1 <= s.top_k <= s.n_experts:
        raise BadInput(f"{where}: top_k={s.top_k} must be between 1 and n_experts={s.n_experts}")
    if layout == "deepseek_v3":
        if s.n_experts % s.n_group:
            raise BadInput(f"{where}: n_experts={s.n_experts} is not divisible by layer.n_group={s.n_group}: "
                           "pass a group count that divides the experts")
        per_group = s.n_experts // s.n_group
        if per_group < 2:
            raise BadInput(f"{where}: {per_group} expert per group; a group scores the sum of its two best "
                           "experts: pass layer.n_group <= n_experts/2")
        if not 1 <= s.topk_group <= s.n_group:
            raise BadInput(f"{where}: layer.topk_group={s.topk_group} must be between 1 and layer.n_group={s.n_group}")
        if s.top_k > s.topk_group * per_group:
            raise BadInput(f"{where}: top_k={s.top_k} exceeds the {s.topk_group * per_group} experts in "
                           f"layer.topk_group={s.topk_group} groups: raise topk_group or lower top_k")


def tiny_config(model_type: str, s: LayerSizes) -> Any:
    """The model type's config class with tiny sizes (every size key the class has)."""
    transformers = _transformers()
    config_cls = transformers.CONFIG_MAPPING[model_type]
    text_cls = (getattr(config_cls, "sub_configs", None) or {}).get("text_config")
    if text_cls is not None:  # a composite (vision-language, omni) config: the MoE block reads its text config
        config_cls = text_cls
    fields = _fields(config_cls)
    wanted: dict[str, Any] = {
        "hidden_size": s.d_model, "intermediate_size": s.d_hidden, "moe_intermediate_size": s.d_hidden,
        "num_experts_per_tok": s.top_k, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": max(1, s.d_model // 2),
        "shared_expert_intermediate_size": s.shared_hidden, "n_shared_experts": 1,
        "n_group": s.n_group, "topk_group": s.topk_group, "routed_scaling_factor": s.routed_scaling_factor,
        "norm_topk_prob": s.norm_topk_prob, "first_k_dense_replace": 0, "router_jitter_noise": 0.0,
        "mlp_only_layers": [], "decoder_sparse_step": 1,
    }
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if key in fields:
            wanted[key] = s.n_experts
            break
    kwargs = {k: v for k, v in wanted.items() if k in fields}
    try:
        config = config_cls(**kwargs)
        config._experts_implementation = "eager"  # the experts' own loop (the block as written in the file)
        return config
    except Exception as exc:
        raise BadInput(f"hf:{model_type} refuses these sizes ({type(exc).__name__}: {exc}): change d_model, "
                       "d_hidden, n_experts, top_k or layer.*") from None


class HFBlock(LayerUnderTest):
    """One HF sparse block; routing captured by a forward hook on its router (``block.gate``), whose output
    is (router_logits, top-k weights, top-k indices)."""

    def __init__(self, model_type: str, sizes: LayerSizes, entry: ModelType | None = None):
        transformers = _transformers()
        refused = [why for key, why in REFUSED.items() if key == model_type or key.startswith(model_type + ".")]
        if entry is None and model_type not in MODEL_TYPES and refused:
            raise BadInput(f"impl=hf:{model_type}: refused: {'; '.join(refused)}: use one of the vetted types "
                           "(scripts/zoo_moe.py lists them)")
        if entry is None and model_type not in MODEL_TYPES:
            known = "a transformers model type" if model_type in transformers.CONFIG_MAPPING else "unknown"
            raise BadInput(f"impl=hf:{model_type}: {known}, not one whose sparse block is known to follow the "
                           f"{'/'.join(LAYOUTS)} layouts: use one of {', '.join('hf:' + t for t in MODEL_TYPES)}")
        self.model_type, self.sizes, self.label = model_type, sizes, f"hf:{model_type}"
        entry = entry or MODEL_TYPES[model_type]
        self.layout, self.router = entry.layout, entry.router
        self.draws_correction_bias = self.layout == "deepseek_v3"
        self.logits_in_fp32 = self.layout == "deepseek_v3"  # its router weight is kept in fp32 and cast to it
        check_sizes(model_type, self.layout, sizes)
        self.config = tiny_config(model_type, sizes)
        self.modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        self.block_cls = getattr(self.modeling, entry.block)
        self.act = self.config.hidden_act
        if self.act not in ref.ACTIVATIONS:
            raise BadInput(f"hf:{model_type}: hidden_act={self.act!r} has no reference activation: use one of "
                           f"{', '.join(ref.ACTIVATIONS)}")
        cfg = self.config
        norm = bool(getattr(cfg, "norm_topk_prob", True)) if "norm_topk_prob" in _fields(type(cfg)) else True
        if entry.renormalise is not None:
            norm = entry.renormalise
        if self.layout == "deepseek_v3":
            self.semantics = ref.RoutingSemantics("sigmoid", sizes.top_k, norm, float(cfg.routed_scaling_factor),
                                                  int(cfg.n_group), int(cfg.topk_group))
        else:
            self.semantics = ref.RoutingSemantics("softmax", sizes.top_k, norm)
        loss = getattr(self.modeling, "load_balancing_loss_func", None)
        self._loss_fn = loss
        self.aux_loss_name = f"transformers.models.{model_type}.modeling_{model_type}.load_balancing_loss_func" \
            if loss is not None else None

    # ------------------------------------------------------------------ build
    def build(self, seed: int) -> nn.Module:
        try:
            block = self.block_cls(self.config)
        except Exception as exc:
            raise BadInput(f"hf:{self.model_type} refuses these sizes ({type(exc).__name__}: {exc}): change "
                           "d_model, d_hidden, n_experts, top_k or layer.*") from None
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in block.named_parameters():
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
            bias = getattr(getattr(block, self.router), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(self.sizes.bias_scale * torch.randn(bias.shape, generator=gen))
        return block.eval()

    # -------------------------------------------------------------------- run
    def run(self, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Captured]:
        out, (logits, weights, idx) = forward_capturing(module, getattr(module, self.router), x)
        return out, Captured(dense_from_topk(idx, weights, self.sizes.n_experts), None, logits.detach())

    # -------------------------------------------------------------- reference
    def reference_weights(self, module: nn.Module) -> ref.LayerWeights:
        def d(t: torch.Tensor) -> torch.Tensor:
            return t.detach().double().clone()

        ex = module.experts
        if getattr(ex, "is_transposed", False) or not getattr(ex, "is_concatenated", True) \
                or getattr(ex, "has_bias", False):
            raise BadInput(f"hf:{self.model_type}: experts stored transposed, interleaved or with biases are not a "
                           "layout this reference reads")
        h = ex.down_proj.shape[-1]
        experts = [ref.GluExpert(d(ex.gate_up_proj[e, :h]), d(ex.gate_up_proj[e, h:]), d(ex.down_proj[e]), self.act)
                   for e in range(self.sizes.n_experts)]
        router = getattr(module, self.router)
        w = ref.LayerWeights(d(router.weight), experts)
        shared = getattr(module, "shared_expert", None) or getattr(module, "shared_experts", None)
        if shared is not None:
            w.shared = ref.GluExpert(d(shared.gate_proj.weight), d(shared.up_proj.weight), d(shared.down_proj.weight),
                                     self.act)
        gate = getattr(module, "shared_expert_gate", None)
        if gate is not None:
            w.shared_gate = d(gate.weight)
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            w.correction_bias = d(bias)
        return w

    def aux_loss(self, module: nn.Module, captured: Captured) -> float | None:
        if self._loss_fn is None or self.layout == "deepseek_v3":
            return None
        return float(self._loss_fn((captured.logits,), self.sizes.n_experts, self.sizes.top_k))

    def alternatives(self) -> dict[str, ref.RoutingSemantics]:
        sem = self.semantics
        alts = {"renormalised" if not sem.normalize else "not renormalised": sem.variant(normalize=not sem.normalize)}
        if self.layout == "qwen2_moe":
            alts["shared expert ungated"] = sem.variant(shared_gated=False)
        if self.layout == "deepseek_v3":
            alts["weights from bias-corrected scores"] = sem.variant(weight_from_corrected=True)
            alts["bias ignored in selection"] = sem.variant(use_correction_bias=False)
            alts["no group limit"] = sem.variant(n_group=1, topk_group=1)
            alts["no routed_scaling_factor"] = sem.variant(scaling=1.0)
        return alts

    def notes(self) -> list[str]:
        import transformers

        return [f"{self.label}: {self.block_cls.__name__} from transformers {transformers.__version__}, layout "
                f"{self.layout}, config {type(self.config).__name__} "
                f"(experts implementation {getattr(self.config, '_experts_implementation', None) or 'eager'})"]
