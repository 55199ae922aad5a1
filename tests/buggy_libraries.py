"""Bugs planted inside third-party attention layers (torchtune, x-transformers, timm), for test_attn_libraries.py.

Each ``plant_*`` function takes pytest's ``monkeypatch`` and changes ONE step of the library's real class (its
forward, its attention op, its rotary, its kv-head repeat, its causal mask) the way the bug shows up in real code;
the tests then build the layer through the shipped adapter (impl=torchtune:..., x-transformers:..., timm:...) and
expect a named check to fail. monkeypatch undoes every change after the test."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


def plain_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float,
                 softmax_dim: int = -1) -> torch.Tensor:
    """softmax(q kᵀ · scale) v with hidden keys at -inf, in fp32 at least; q (B,H,Tq,Dh), visible broadcastable."""
    s = (q @ k.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s.softmax(dim=softmax_dim).nan_to_num(0.0).to(v.dtype) @ v


# ============================================================================================ torchtune
def _torchtune_call(softmax_dim: int = -1, scale_power: float = 0.5, causal_diagonal: int = 0,
                    ignore_mask: bool = False) -> Callable[[], Callable[..., torch.Tensor]]:
    """A replacement for torchtune's ``_sdpa_or_flex_attention()`` (which MultiHeadAttention calls in __init__)
    whose attention call has one bug; mask (B,Tq,Tk) True = attend, None = torchtune's causal default."""

    def make() -> Callable[..., torch.Tensor]:
        def call(q, k, v, mask, dropout_p, is_causal):
            Tq, Tk = q.shape[-2], k.shape[-2]
            visible = None if mask is None or ignore_mask else mask[:, None]  # ignore_mask: the mask is dropped
            if is_causal:  # torchtune: mask None and the layer causal
                visible = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(causal_diagonal)
            return plain_attend(q, k, v, visible, q.shape[-1] ** -scale_power, softmax_dim)
        return call
    return make


def _patch_torchtune_call(monkeypatch, **bug) -> None:
    from torchtune.modules import attention

    monkeypatch.setattr(attention, "_sdpa_or_flex_attention", _torchtune_call(**bug))


def plant_torchtune_softmax_axis(monkeypatch) -> None:
    _patch_torchtune_call(monkeypatch, softmax_dim=-2)  # normalises over queries


def plant_torchtune_scale(monkeypatch) -> None:
    _patch_torchtune_call(monkeypatch, scale_power=1.0)  # 1/Dh instead of 1/sqrt(Dh)


def plant_torchtune_causal_off_by_one(monkeypatch) -> None:
    _patch_torchtune_call(monkeypatch, causal_diagonal=1)  # each query also sees the next key


def plant_torchtune_padding_ignored(monkeypatch) -> None:
    _patch_torchtune_call(monkeypatch, ignore_mask=True)  # the mask (key padding of a non-causal call) is dropped


def plant_torchtune_rope_half(monkeypatch) -> None:
    """RotaryPositionalEmbeddings rotating (i, i + Dh/2) pairs with the cache built for interleaved pairs."""
    from torchtune.modules import RotaryPositionalEmbeddings

    def forward(self, x, *, input_pos=None):  # x (b, s, n_h, h_d)
        cache = self.cache[: x.size(1)] if input_pos is None else self.cache[input_pos]  # (s, h_d/2, 2)
        cos, sin = cache[None, :, None, :, 0], cache[None, :, None, :, 1]
        a, b = x.float().chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).type_as(x)

    monkeypatch.setattr(RotaryPositionalEmbeddings, "forward", forward)


def plant_torchtune_gqa_tiled(monkeypatch) -> None:
    """MultiHeadAttention.forward (self-attention, no kv cache) tiling the kv heads 0,1,0,1 (``repeat``) where
    torchtune expands them 0,0,1,1."""
    from torchtune.modules import MultiHeadAttention

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        q = self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim)
        k = self.k_proj(y).view(b, y.shape[1], -1, self.head_dim)
        v = self.v_proj(y).view(b, y.shape[1], -1, self.head_dim)
        if self.pos_embeddings is not None:
            q, k = self.pos_embeddings(q, input_pos=input_pos), self.pos_embeddings(k, input_pos=input_pos)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, h, s, h_d)
        r = self.num_heads // self.num_kv_heads
        k, v = k.repeat(1, r, 1, 1), v.repeat(1, r, 1, 1)  # BUG: tiled, not expanded per kv head
        out = self._attention_call(q, k, v, mask=mask, dropout_p=0.0, is_causal=mask is None and self.is_causal)
        return self.output_proj(out.transpose(1, 2).reshape(b, s_x, -1))

    monkeypatch.setattr(MultiHeadAttention, "forward", forward)


# ======================================================================================= x-transformers
def _after_attend_init(monkeypatch, change: Callable) -> None:
    from x_transformers import attend

    original = attend.Attend.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        change(self)

    monkeypatch.setattr(attend.Attend, "__init__", init)


def plant_xt_softmax_axis(monkeypatch) -> None:
    def change(self):
        self.attn_fn = functools.partial(F.softmax, dim=-2, dtype=torch.float32)  # over queries
    _after_attend_init(monkeypatch, change)


def plant_xt_scale(monkeypatch) -> None:
    def change(self):
        self.scale = self.scale ** 2  # 1/Dh instead of 1/sqrt(Dh)
    _after_attend_init(monkeypatch, change)


def plant_xt_rope_half(monkeypatch) -> None:
    """x-transformers' rotate_half rotating (i, i + Dh/2) halves while its freqs are laid out per (2i, 2i+1)."""
    from x_transformers import x_transformers as xt

    def rotate_half(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1)

    monkeypatch.setattr(xt, "rotate_half", rotate_half)


def plant_xt_gqa_interleaved(monkeypatch) -> None:
    """Attend's kv-head repeat as repeat_interleave ('(kvh r)') where x-transformers tiles ('(r kvh)')."""
    from x_transformers import attend

    original = attend.repeat

    def repeat(t, pattern, **axes):
        return original(t, pattern.replace("(r kvh)", "(kvh r)"), **axes)

    monkeypatch.setattr(attend, "repeat", repeat)


def plant_xt_causal_off_by_one(monkeypatch) -> None:
    from x_transformers import attend

    def create_causal_mask(i, j, device):  # True = hidden; each query also sees the next key
        return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 2)

    monkeypatch.setattr(attend, "create_causal_mask", create_causal_mask)


def plant_xt_padding_ignored(monkeypatch) -> None:
    """Attention.forward dropping its ``mask=`` (key padding)."""
    from x_transformers import x_transformers as xt

    original = xt.Attention.forward

    def forward(self, x, *args, mask=None, **kwargs):
        return original(self, x, *args, mask=None, **kwargs)

    monkeypatch.setattr(xt.Attention, "forward", forward)


# ================================================================================================= timm
def _timm_forward(softmax_dim: int = -1, scale_power: float = 0.5, causal_diagonal: int = 0,
                  ignore_mask: bool = False) -> Callable:
    """timm's Attention.forward (both paths) with one bug."""

    def forward(self, x, attn_mask=None, is_causal=False):
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, N, Dh)
        if ignore_mask:
            attn_mask = None
        if is_causal:  # as a bool mask, True = attend
            attn_mask, is_causal = torch.ones(N, N, dtype=torch.bool, device=x.device).tril(causal_diagonal), False
        scale = self.head_dim ** -scale_power
        if self.fused_attn and softmax_dim == -1:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
        else:
            out = plain_attend(q, k, v, attn_mask, scale, softmax_dim)
        return self.proj(out.transpose(1, 2).reshape(B, N, self.attn_dim))

    return forward


def _patch_timm(monkeypatch, **bug) -> None:
    from timm.layers import Attention

    monkeypatch.setattr(Attention, "forward", _timm_forward(**bug))


def plant_timm_softmax_axis(monkeypatch) -> None:
    _patch_timm(monkeypatch, softmax_dim=-2)


def plant_timm_scale(monkeypatch) -> None:
    _patch_timm(monkeypatch, scale_power=1.0)


def plant_timm_causal_off_by_one(monkeypatch) -> None:
    _patch_timm(monkeypatch, causal_diagonal=1)


def plant_timm_padding_ignored(monkeypatch) -> None:
    _patch_timm(monkeypatch, ignore_mask=True)


def plant_timm_correct_rewrite(monkeypatch) -> None:
    """The same rewritten forward with no bug: the control that shows the rewrite itself is right."""
    _patch_timm(monkeypatch)
