"""First contact: labml-nn's MultiHeadAttention and Switch-Transformer MoE through tfmoe, from the docs only.

impl=fc_labml:MHA (attn-check) and impl=fc_labml:Switch (route-sim); the Bug* classes plant a bug inside labml-nn's
own code path (a monkeypatch of its class, applied when the layer is built) and are otherwise the same adapter.
labml's conventions: sequence first (T, B, D); mask [Tq, Tk, B] True = may attend; biases on q, k, v and out.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from labml import tracker
from labml_nn.transformers import mha as labml_mha
from labml_nn.transformers import switch as labml_switch
from labml_nn.transformers.feed_forward import FeedForward

from tfmoe.adapters import AttentionAdapter, Projections, seeded
from tfmoe.adapters.moe_base import MoEAdapter, MoESemantics
from tfmoe.components.moe_reference import LayerWeights, MlpExpert

if not hasattr(tracker, "debug"):  # labml-nn 0.5.1's MultiHeadAttention calls tracker.debug, gone in labml 0.5.3
    tracker.debug = lambda *args, **kwargs: None


class MHA(AttentionAdapter):
    returns_weights = True  # labml keeps the (post-dropout) weights in module.attn, [Tq, Tk, B, H]
    takes_dropout = True
    supports_gqa = False  # one projection per head: no kv-head sharing

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        self.plant()
        with seeded(seed):
            m = labml_mha.MultiHeadAttention(n_heads, d_model, dropout_prob=dropout, bias=True)
        return m.to(device=device, dtype=dtype).eval()

    def plant(self) -> None:
        """Where a Bug* subclass changes labml's own code."""

    def forward(self, module, x, padding_mask, *, causal, cache=None):
        B, T, _ = x.shape
        mask = torch.ones(T, T, 1, dtype=torch.bool, device=x.device)  # [Tq, Tk, B]
        if causal:
            mask = torch.tril(mask[..., 0])[..., None]
        if padding_mask is not None:
            mask = mask & padding_mask.T[None, :, :]  # key j of batch b
        xs = x.transpose(0, 1)  # (T, B, D)
        out = module(query=xs, key=xs, value=xs, mask=mask)
        return out.transpose(0, 1), module.attn.permute(2, 3, 0, 1)  # (B,T,D), (B,H,Tq,Tk)

    def parameters(self, module):
        return dict(module.named_parameters())

    def projections(self, params, n_heads, n_kv_heads):
        return Projections(params["query.linear.weight"], params["key.linear.weight"], params["value.linear.weight"],
                           params["output.weight"], n_heads, n_kv_heads,
                           b_q=params["query.linear.bias"], b_k=params["key.linear.bias"],
                           b_v=params["value.linear.bias"], b_o=params["output.bias"])


class BugMaskTransposed(MHA):
    """labml's prepare_mask returns the mask with query and key swapped ([Tk, Tq, B] read as [Tq, Tk, B])."""

    def plant(self) -> None:
        orig = labml_mha.MultiHeadAttention.prepare_mask

        def prepare_mask(self, mask, query_shape, key_shape):
            return orig(self, mask.transpose(0, 1), query_shape, key_shape)

        labml_mha.MultiHeadAttention.prepare_mask = prepare_mask


class BugScale(MHA):
    """labml's MultiHeadAttention scales scores by 1/sqrt(d_model) instead of 1/sqrt(d_k)."""

    def plant(self) -> None:
        orig = labml_mha.MultiHeadAttention.__init__

        def __init__(self, heads, d_model, dropout_prob=0.1, bias=True):
            orig(self, heads, d_model, dropout_prob, bias)
            self.scale = d_model ** -0.5

        labml_mha.MultiHeadAttention.__init__ = __init__


class Switch(MoEAdapter):
    """labml's SwitchFeedForward: top-1 softmax routing, output scaled by the chosen probability (is_scale_prob)."""

    def build(self, sizes, seed):
        if sizes.top_k != 1:
            raise ValueError(f"a Switch layer routes each token to one expert: run with top_k=1 (got {sizes.top_k})")
        self.plant()
        with seeded(seed):
            expert = FeedForward(sizes.d_model, sizes.d_hidden, dropout=0.0, activation=nn.ReLU())
            m = labml_switch.SwitchFeedForward(capacity_factor=float(sizes.n_experts), drop_tokens=False,
                                               is_scale_prob=True, n_experts=sizes.n_experts, expert=expert,
                                               d_model=sizes.d_model)
        return m.eval()

    def plant(self) -> None:
        """Where a Bug* subclass changes labml's own code."""

    def forward(self, module, x):
        out = module(x.transpose(0, 1).contiguous())[0]  # labml wants (T, B, D)
        return out.transpose(0, 1)

    def semantics(self, sizes, seq):
        return MoESemantics(score_func="softmax", softmax_after_topk=False, normalize=False)

    def reference_weights(self, module):
        experts = [MlpExpert(e.layer1.weight.double().detach().clone(), e.layer2.weight.double().detach().clone(),
                             "relu", e.layer1.bias.double().detach().clone(), e.layer2.bias.double().detach().clone())
                   for e in module.experts]
        return LayerWeights(router=module.switch.weight.double().detach().clone(), experts=experts,
                            router_bias=module.switch.bias.double().detach().clone())


class BugSwitchSoftmaxTokens(Switch):
    """The router's softmax is taken over the tokens (dim 0) instead of the experts."""

    def plant(self) -> None:
        orig = labml_switch.SwitchFeedForward.__init__

        def __init__(self, **kw):
            orig(self, **kw)
            self.softmax = nn.Softmax(dim=0)

        labml_switch.SwitchFeedForward.__init__ = __init__


class BugSwitchDroppedExpert(Switch):
    """The last expert's outputs are never written back (its tokens come out as zeros)."""

    def plant(self) -> None:
        orig = labml_switch.SwitchFeedForward.forward

        def forward(self, x):
            last = self.experts[-1]
            try:  # the library's own forward, with the last expert's output thrown away
                self.experts[-1] = _Zero(last)
                return orig(self, x)
            finally:
                self.experts[-1] = last

        labml_switch.SwitchFeedForward.forward = forward


class _Zero(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 0
