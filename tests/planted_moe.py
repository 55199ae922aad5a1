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
    Planted("mixture-of-experts: Experts output x1.5", "lib:mixture_of_experts", frozenset({OUT}),
            frozenset({"routing_selection", "routing_weights"}), moe_lib_experts_scaled, "mixture_of_experts"),
    Planted("mixture-of-experts: top-1 of the smallest", "lib:mixture_of_experts",
            frozenset({"routing_selection", OUT}), patch=moe_lib_top1_smallest, needs="mixture_of_experts"),
    Planted("transformers Mixtral: MixtralExperts output x1.5", "hf:mixtral", frozenset({OUT}),
            frozenset({"routing_selection", "routing_weights"}), mixtral_experts_scaled, "transformers"),
    Planted("transformers Mixtral: router not renormalised", "hf:mixtral",
            frozenset({"routing_weights", "topk_weights_sum", OUT}), frozenset({"routing_selection"}),
            mixtral_router_not_renormalised, "transformers"),
    Planted("transformers Qwen2-MoE: shared expert's MLP output x1.5", "hf:qwen2_moe", frozenset({OUT}),
            frozenset({"routing_selection", "routing_weights"}), qwen_shared_expert_scaled, "transformers"),
    Planted("tfmoe MoELayer: expert output x1.5", None, frozenset({OUT}),
            frozenset({"routing_selection", "routing_weights"}), own_expert_scaled),
    Planted("tfmoe MoELayer: load counts the first choice only", None, frozenset({"loads_sum", "cv_maxvio"}),
            patch=own_load_first_choice),
]
