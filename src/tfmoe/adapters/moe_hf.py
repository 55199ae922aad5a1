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
from tfmoe.errors import BadInput


@dataclass(frozen=True)
class ModelType:
    layout: str  # mixtral | qwen2_moe | deepseek_v3
    block: str  # the sparse block's class in transformers.models.<type>.modeling_<type>


# Model types whose sparse block follows one of the three layouts. Each was run through the battery here
# (experiments/route-sim.md names the runs); add a type only after it passes.
MODEL_TYPES: dict[str, ModelType] = {
    "mixtral": ModelType("mixtral", "MixtralSparseMoeBlock"),
    "qwen2_moe": ModelType("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "deepseek_v3": ModelType("deepseek_v3", "DeepseekV3MoE"),
    "qwen3_moe": ModelType("mixtral", "Qwen3MoeSparseMoeBlock"),
    "olmoe": ModelType("mixtral", "OlmoeSparseMoeBlock"),
    "glm4_moe": ModelType("deepseek_v3", "Glm4MoeMoE"),
}
LAYOUTS = ("mixtral", "qwen2_moe", "deepseek_v3")


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

    def __init__(self, model_type: str, sizes: LayerSizes):
        transformers = _transformers()
        if model_type not in MODEL_TYPES:
            known = "a transformers model type" if model_type in transformers.CONFIG_MAPPING else "unknown"
            raise BadInput(f"impl=hf:{model_type}: {known}, not one whose sparse block is known to follow the "
                           f"{'/'.join(LAYOUTS)} layouts: use one of {', '.join('hf:' + t for t in MODEL_TYPES)}")
        self.model_type, self.sizes, self.label = model_type, sizes, f"hf:{model_type}"
        self.layout = MODEL_TYPES[model_type].layout
        self.draws_correction_bias = self.layout == "deepseek_v3"
        self.logits_in_fp32 = self.layout == "deepseek_v3"  # its router weight is kept in fp32 and cast to it
        check_sizes(model_type, self.layout, sizes)
        self.config = tiny_config(model_type, sizes)
        self.modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        self.block_cls = getattr(self.modeling, MODEL_TYPES[model_type].block)
        self.act = self.config.hidden_act
        if self.act not in ref.ACTIVATIONS:
            raise BadInput(f"hf:{model_type}: hidden_act={self.act!r} has no reference activation: use one of "
                           f"{', '.join(ref.ACTIVATIONS)}")
        cfg = self.config
        norm = bool(getattr(cfg, "norm_topk_prob", True)) if "norm_topk_prob" in _fields(type(cfg)) else True
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
            bias = getattr(block.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(self.sizes.bias_scale * torch.randn(bias.shape, generator=gen))
        return block.eval()

    # -------------------------------------------------------------------- run
    def run(self, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Captured]:
        out, (logits, weights, idx) = forward_capturing(module, module.gate, x)
        selected, dense = dense_from_topk(idx, weights, self.sizes.n_experts)
        return out, Captured(selected, dense, None, logits.detach())

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
        w = ref.LayerWeights(d(module.gate.weight), experts)
        shared = getattr(module, "shared_expert", None) or getattr(module, "shared_experts", None)
        if shared is not None:
            w.shared = ref.GluExpert(d(shared.gate_proj.weight), d(shared.up_proj.weight), d(shared.down_proj.weight),
                                     self.act)
        gate = getattr(module, "shared_expert_gate", None)
        if gate is not None:
            w.shared_gate = d(gate.weight)
        bias = getattr(module.gate, "e_score_correction_bias", None)
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
