"""Every planted MoE bug, as data: the layer (``impl=``), how the bug is planted (a course-interface class in
tests/buggy_moe.py, a user's adapter in tests/adapted_moe.py, or a monkeypatch inside a library's own code) and the
checks it must fail (and must pass). tests/test_moe_planted.py runs each under route-sim's default config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import buggy_moe
import pytest
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Planted:
    name: str
    impl: str | None  # None = the package's own layer (route-sim's default)
    must_fail: frozenset[str]
    must_pass: frozenset[str] = frozenset()
    patch: Callable[[pytest.MonkeyPatch], None] | None = None
    needs: str | None = None  # the module the bug is planted in (skipped where absent)


def _scale_forward(cls: type, factor: float = 1.5) -> Callable[[pytest.MonkeyPatch], None]:
    """A bug inside an expert's own module: its forward's output times ``factor``."""
    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        real = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, *a, **kw: factor * real(self, *a, **kw))
    return patch


def _lib(module: str) -> object:
    return pytest.importorskip(module)


def st_expert_scaled(monkeypatch):
    _scale_forward(_lib("st_moe_pytorch.st_moe_pytorch").Expert)(monkeypatch)


def st_topk_smallest(monkeypatch):
    m = _lib("st_moe_pytorch.st_moe_pytorch")
    real = m.maybe_differentiable_topk

    def smallest(x, k, **kw):
        r = real(-x, k=k, **kw)
        return r._replace(values=-r.values)

    monkeypatch.setattr(m, "maybe_differentiable_topk", smallest)


def st_capacity_ignored(monkeypatch):
    monkeypatch.setattr(_lib("st_moe_pytorch.st_moe_pytorch"), "MIN_EXPERT_CAPACITY", 1000)


def st_gates_not_renormalised(monkeypatch):
    m = _lib("st_moe_pytorch.st_moe_pytorch")
    real = m.reduce

    def reduce(t, pattern, op):  # the top-n gates' denominator: 1 instead of their sum
        out = real(t, pattern, op)
        return out.new_ones(out.shape) if pattern == "k ... -> 1 ..." else out

    monkeypatch.setattr(m, "reduce", reduce)


def moe_lib_gates_eps_one(monkeypatch):
    m = _lib("mixture_of_experts.mixture_of_experts")
    real_init = m.Top2Gating.__init__

    def init(self, *args, **kwargs):  # eps=1: gates divided by g1 + g2 + 1, not g1 + g2
        real_init(self, *args, **kwargs)
        self.eps = 1.0

    monkeypatch.setattr(m.Top2Gating, "__init__", init)


def moe_lib_capacity_ignored(monkeypatch):
    monkeypatch.setattr(_lib("mixture_of_experts.mixture_of_experts"), "MIN_EXPERT_CAPACITY", 1000)


def moe_lib_experts_scaled(monkeypatch):
    _scale_forward(_lib("mixture_of_experts.mixture_of_experts").Experts)(monkeypatch)


def moe_lib_top1_smallest(monkeypatch):
    def top1(t):
        values, index = t.topk(k=1, dim=-1, largest=False)
        return values.squeeze(-1), index.squeeze(-1)

    monkeypatch.setattr(_lib("mixture_of_experts.mixture_of_experts"), "top1", top1)


def mixtral_experts_scaled(monkeypatch):
    _scale_forward(_lib("transformers.models.mixtral.modeling_mixtral").MixtralExperts)(monkeypatch)


def mixtral_router_not_renormalised(monkeypatch):
    m = _lib("transformers.models.mixtral.modeling_mixtral")

    def forward(self, hidden_states):  # MixtralTopKRouter.forward without the renormalisation
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        return router_logits, router_top_value, router_indices

    monkeypatch.setattr(m.MixtralTopKRouter, "forward", forward)


def mixtral_loss_without_expert_factor(monkeypatch):
    m = _lib("transformers.models.mixtral.modeling_mixtral")
    real = m.load_balancing_loss_func
    monkeypatch.setattr(m, "load_balancing_loss_func", lambda g, n=None, k=2, mask=None: real(g, n, k, mask) / n)


def qwen_shared_expert_ungated(monkeypatch):
    m = _lib("transformers.models.qwen2_moe.modeling_qwen2_moe")

    def forward(self, hidden_states):  # Qwen2MoeSparseMoeBlock.forward without sigmoid(shared_expert_gate)
        b, t, d = hidden_states.shape
        flat = hidden_states.view(-1, d)
        shared = self.shared_expert(flat)
        _, routing_weights, selected_experts = self.gate(flat)
        out = self.experts(flat, selected_experts, routing_weights) + shared
        return out.reshape(b, t, d)

    monkeypatch.setattr(m.Qwen2MoeSparseMoeBlock, "forward", forward)


def deepseek_router(weight_with_bias: bool, select_with_bias: bool) -> Callable[[pytest.MonkeyPatch], None]:
    """A patch of DeepseekV3TopkRouter.forward with one semantic changed (both False/True: the real one)."""
    forward = deepseek_router_forward(weight_with_bias, select_with_bias)

    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        m = _lib("transformers.models.deepseek_v3.modeling_deepseek_v3")
        monkeypatch.setattr(m.DeepseekV3TopkRouter, "forward", forward)

    return patch


def deepseek_router_forward(weight_with_bias: bool, select_with_bias: bool) -> Callable[..., tuple]:
    """DeepseekV3TopkRouter.forward with one semantic changed (both False/True: the real one)."""
    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = router_logits.sigmoid()
        corrected = scores + self.e_score_correction_bias
        scores_for_choice = corrected if select_with_bias else scores
        group_scores = scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(
            2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(
            -1, self.num_experts)
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = (corrected if weight_with_bias else scores).gather(1, topk_indices)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return router_logits, topk_weights * self.routed_scaling_factor, topk_indices

    return forward


def own_cv_sample_std(monkeypatch):
    from tfmoe.components import moe

    monkeypatch.setattr(moe, "load_cv", lambda load: load.double().std() / load.double().mean())


def own_aux_loss_without_expert_factor(monkeypatch):
    from tfmoe.components import moe

    real = moe.switch_aux_loss
    monkeypatch.setattr(moe, "switch_aux_loss", lambda p, i, coef=0.01: real(p, i, coef) / p.shape[1])


def qwen_shared_expert_scaled(monkeypatch):
    _scale_forward(_lib("transformers.models.qwen2_moe.modeling_qwen2_moe").Qwen2MoeMLP)(monkeypatch)


def own_load_first_choice(monkeypatch):
    from tfmoe.components import moe

    real = moe.expert_load
    monkeypatch.setattr(moe, "expert_load", lambda idx, n: real(idx[: idx.numel() // 2], n))


def own_expert_scaled(monkeypatch):
    from tfmoe.components import moe

    _scale_forward(moe.FeedForward)(monkeypatch)  # the class every MoELayer expert is


OUT = "output_vs_reference"
PLANTED: list[Planted] = [
    *(Planted(f"buggy_moe:{cls}", f"buggy_moe:{cls}", fails) for cls, fails in buggy_moe.PLANTED.items()),
    Planted("adapted_moe:RawLogitWeightsAdapter", "adapted_moe:RawLogitWeightsAdapter",
            frozenset({"routing_weights", "topk_weights_sum", OUT}), frozenset({"routing_selection"})),
    Planted("st-moe-pytorch: Expert output x1.5", "lib:st_moe_pytorch", frozenset({OUT}),
            frozenset({"routing_selection", "routing_weights"}), st_expert_scaled, "st_moe_pytorch"),
    Planted("st-moe-pytorch: top-n of the smallest", "lib:st_moe_pytorch", frozenset({"routing_selection", OUT}),
            patch=st_topk_smallest, needs="st_moe_pytorch"),
    Planted("st-moe-pytorch: capacity overflow not dropped", "lib:st_moe_pytorch",
            frozenset({"routing_selection", "loads_sum", OUT}), patch=st_capacity_ignored, needs="st_moe_pytorch"),
    Planted("st-moe-pytorch: gates not renormalised", "lib:st_moe_pytorch",
            frozenset({"routing_weights", "topk_weights_sum", OUT}), frozenset({"routing_selection"}),
            st_gates_not_renormalised, "st_moe_pytorch"),
    Planted("mixture-of-experts: gates divided by g1 + g2 + 1", "lib:mixture_of_experts",
            frozenset({"routing_weights", "topk_weights_sum", OUT}), patch=moe_lib_gates_eps_one,
            needs="mixture_of_experts"),
    Planted("mixture-of-experts: capacity overflow not dropped", "lib:mixture_of_experts",
            frozenset({"routing_selection", "loads_sum", OUT}), patch=moe_lib_capacity_ignored,
            needs="mixture_of_experts"),
    Planted("mixture-of-experts: Experts output x1.5", "lib:mixture_of_experts", frozenset({OUT}),
            frozenset({"routing_selection", "routing_weights"}), moe_lib_experts_scaled, "mixture_of_experts"),
    Planted("mixture-of-experts: top-1 of the smallest", "lib:mixture_of_experts",
            frozenset({"routing_selection", OUT}), patch=moe_lib_top1_smallest, needs="mixture_of_experts"),
    Planted("transformers Mixtral: MixtralExperts output x1.5", "hf:mixtral", frozenset({OUT}),
            frozenset({"routing_selection", "routing_weights"}), mixtral_experts_scaled, "transformers"),
    Planted("transformers Mixtral: router not renormalised", "hf:mixtral",
            frozenset({"routing_weights", "topk_weights_sum", OUT}), frozenset({"routing_selection"}),
            mixtral_router_not_renormalised, "transformers"),
    Planted("transformers Mixtral: aux loss without the expert factor", "hf:mixtral",
            frozenset({"aux_loss_vs_switch"}), frozenset({OUT, "routing_selection", "routing_weights"}),
            mixtral_loss_without_expert_factor, "transformers"),
    Planted("transformers Qwen2-MoE: shared expert ungated", "hf:qwen2_moe", frozenset({OUT}),
            frozenset({"routing_selection", "routing_weights"}), qwen_shared_expert_ungated, "transformers"),
    Planted("transformers DeepSeek-V3: weights from bias-corrected scores", "hf:deepseek_v3",
            frozenset({"routing_weights", OUT}), frozenset({"topk_weights_sum", "permutation_equivariance"}),
            deepseek_router(True, True), "transformers"),
    Planted("transformers DeepSeek-V3: bias ignored in selection", "hf:deepseek_v3",
            frozenset({"routing_selection", OUT}), frozenset({"topk_weights_sum", "permutation_equivariance"}),
            deepseek_router(False, False), "transformers"),
    Planted("transformers Qwen2-MoE: shared expert's MLP output x1.5", "hf:qwen2_moe", frozenset({OUT}),
            frozenset({"routing_selection", "routing_weights"}), qwen_shared_expert_scaled, "transformers"),
    Planted("tfmoe MoELayer: expert output x1.5", None, frozenset({OUT}),
            frozenset({"routing_selection", "routing_weights"}), own_expert_scaled),
    Planted("tfmoe MoELayer: load counts the first choice only", None, frozenset({"loads_sum", "cv_maxvio"}),
            patch=own_load_first_choice),
    Planted("tfmoe MoELayer: CV with the sample std", None, frozenset({"cv_maxvio"}), frozenset({"loads_sum"}),
            own_cv_sample_std),
    Planted("tfmoe MoELayer: aux loss without the expert factor", None, frozenset({"aux_loss_vs_switch"}),
            patch=own_aux_loss_without_expert_factor),
    Planted("course interface, experts read through tfmoe_expert_ffn: GatedFFN output x1.5",
            "buggy_moe:OwnExpertLayout", frozenset({OUT, "expert_internals"}),
            frozenset({"routing_selection", "routing_weights"}), _scale_forward(buggy_moe.GatedFFN)),
]
