"""Reference attention written from first principles, for judging other attention code.

Nothing here imports the code it judges (tfmoe's masks, attention or chunked kernels, a library's rotary or
kv-repeat functions): masks are explicit boolean matrices built here, heads are split and merged here, RoPE and
the kv-head mapping are written here from their papers' definitions, and the attention itself is PyTorch's
``scaled_dot_product_attention`` (an independent library op) or a plain softmax written out below.

Conventions: boolean masks are True = the query may attend to the key; weights are in ``nn.Linear`` layout
(out_features, in_features); q is (B, Hq, T, Dh), k and v (B, Hkv, T, Dh).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# the kernel battery's reference (also first principles) holds the masks by index arithmetic and the GQA
# head mapping; this module adds what a whole layer needs (projections, head split/merge, RoPE)
from tfmoe.components.reference_attention import key_padding_visibility, kv_head_index, lower_triangle


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The independent reference's precision: fp64 for fp32/fp64 runs, fp32 (upcast) for fp16/bf16."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


# ============================================================================================== masks
def visibility(T_q: int, T_k: int, causal: bool, key_padding: torch.Tensor | None = None,
               device: torch.device | str | None = None, offset: int = 0) -> torch.Tensor | None:
    """(B|1, 1, T_q, T_k) boolean mask, True = visible, or None when nothing is hidden.

    Causal: query i sits at absolute position offset + i and sees keys j <= offset + i: the lower-triangular
    matrix (:func:`lower_triangle`). key_padding (B, T_k): True = real key; padded keys are hidden from every
    query (queries are never masked)."""
    mask = None
    if causal:
        mask = lower_triangle(T_q, T_k, offset, device)[None, None]
    if key_padding is not None:
        if key_padding.shape[-1] != T_k:
            raise ValueError(f"key padding covers {key_padding.shape[-1]} keys, the attention has T_k={T_k}")
        keys = key_padding.to(device=device, dtype=torch.bool).reshape(-1, 1, 1, T_k)  # (B,1,1,Tk)
        mask = keys if mask is None else mask & keys
    return mask


def rows_with_a_key(mask: torch.Tensor | None, B: int, T_q: int) -> torch.Tensor:
    """(B, T_q) on CPU: True where the query sees at least one key (False = a fully masked row)."""
    if mask is None:
        return torch.ones(B, T_q, dtype=torch.bool)
    return mask.any(dim=-1).expand(B, 1, T_q)[:, 0].cpu()


def lengths_to_key_padding(lengths: list[int] | tuple[int, ...], T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(B, T) True = real token for right-padded rows: row b has its first lengths[b] tokens real."""
    return key_padding_visibility(list(lengths), T, device)[:, 0, 0, :]


# ====================================================================================== projections
ROPE_PAIRINGS = ("half", "interleaved")


@dataclass
class Rope:
    """Rotary positions (Su et al. 2021): pair i of a head's first ``rotary_dim`` dims is rotated by the angle
    pos · theta^(-2i/rotary_dim). Which dims form pair i is the ``pairing``:

    - ``half`` ("rotate half", GPT-NeoX, Llama, most of Hugging Face): dims (i, i + rotary_dim/2);
    - ``interleaved`` (the paper's and GPT-J's, Cohere, Helium, ERNIE 4.5 in Hugging Face): dims (2i, 2i + 1)."""

    theta: float
    rotary_dim: int  # = Dh (full rotary); the adapters refuse partial rotary
    pairing: str = "half"

    def __post_init__(self) -> None:
        if self.pairing not in ROPE_PAIRINGS:
            raise ValueError(f"RoPE pairing {self.pairing!r} is not one of {ROPE_PAIRINGS}")


@dataclass
class Projections:
    """An attention layer's parameters in nn.Linear layout, as the reference reads them."""

    w_q: torch.Tensor  # (Hq·Dh, D)
    w_k: torch.Tensor  # (Hkv·Dh, D)
    w_v: torch.Tensor  # (Hkv·Dh, D)
    w_o: torch.Tensor | None  # (D, Hq·Dh); None = the layer returns the merged heads (no output projection)
    n_heads: int
    n_kv_heads: int
    b_q: torch.Tensor | None = None
    b_k: torch.Tensor | None = None
    b_v: torch.Tensor | None = None
    b_o: torch.Tensor | None = None
    rope: Rope | None = None
    scale: float | None = None  # None = 1/sqrt(Dh)

    @property
    def d_head(self) -> int:
        return self.w_q.shape[0] // self.n_heads

    def to(self, dtype: torch.dtype) -> Projections:
        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to(dtype)
        return Projections(cast(self.w_q), cast(self.w_k), cast(self.w_v), cast(self.w_o), self.n_heads,
                           self.n_kv_heads, cast(self.b_q), cast(self.b_k), cast(self.b_v), cast(self.b_o),
                           self.rope, self.scale)


def fused_projections(w_qkv: torch.Tensor, w_out: torch.Tensor, n_heads: int) -> Projections:
    """The course layout: qkv = Linear(D, 3D) (rows q, then k, then v), out = Linear(D, D), no biases."""
    w_q, w_k, w_v = w_qkv.chunk(3, dim=0)
    return Projections(w_q, w_k, w_v, w_out, n_heads, n_heads)


def split_heads(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, H·Dh) -> (B, H, T, Dh)."""
    B, T, HD = t.shape
    return t.reshape(B, T, n_heads, HD // n_heads).permute(0, 2, 1, 3)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, Dh) -> (B, T, H·Dh)."""
    B, H, T, Dh = t.shape
    return t.permute(0, 2, 1, 3).reshape(B, T, H * Dh)


def _pairs(t: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """The (first, second) members of each rotated pair of t (..., Dh): (..., rotary_dim/2) each."""
    d = rope.rotary_dim
    if rope.pairing == "half":
        return t[..., : d // 2], t[..., d // 2 : d]
    return t[..., 0:d:2], t[..., 1:d:2]


def _unpairs(a: torch.Tensor, b: torch.Tensor, rest: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Inverse of :func:`_pairs`: the rotated pairs back in their dims, then the unrotated rest."""
    if rope.pairing == "half":
        return torch.cat([a, b, rest], dim=-1)
    return torch.cat([torch.stack([a, b], dim=-1).flatten(-2), rest], dim=-1)  # a0 b0 a1 b1 ...


def rotate(t: torch.Tensor, rope: Rope, positions: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """RoPE on (B, H, T, Dh) at integer positions (T,): each pair (a_i, b_i) (see :class:`Rope` for which dims)
    is the complex number a_i + j·b_i, multiplied by e^{j·pos·theta^(-2i/rotary_dim)}.

    exact=True (the reference): angles and the rotation in float64 whatever t's dtype. exact=False (the plain
    same-dtype yardstick): angles in float32 at least, cos/sin rounded to t's dtype and the rotation done there,
    as a plain implementation in that dtype would."""
    d = rope.rotary_dim
    half = d // 2
    a, b = _pairs(t, rope)  # (..., half) each
    if exact:
        inv_freq = rope.theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / d)  # (half,)
        angle = positions.to(torch.float64).cpu()[:, None] * inv_freq[None, :]  # (T, half)
        rot = torch.polar(torch.ones_like(angle), angle).to(t.device)  # (T, half) e^{j·angle}
        z = torch.complex(a.to(torch.float64), b.to(torch.float64)) * rot
        return _unpairs(z.real, z.imag, t[..., d:].to(torch.float64), rope).to(t.dtype)
    acc = torch.promote_types(t.dtype, torch.float32)
    inv_freq = rope.theta ** (-torch.arange(half, dtype=acc) * 2.0 / d)
    angle = positions.to(device=t.device, dtype=acc)[:, None] * inv_freq.to(t.device)[None, :]  # (T, half)
    cos, sin = angle.cos().to(t.dtype), angle.sin().to(t.dtype)
    return _unpairs(a * cos - b * sin, b * cos + a * sin, t[..., d:], rope)


def project(x: torch.Tensor, p: Projections, positions: torch.Tensor | None = None,
            exact: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (B,T,D) -> q (B,Hq,T,Dh), and k, v already mapped to the query heads (B,Hq,T,Dh); RoPE applied
    (exact: see :func:`rotate`)."""
    q = split_heads(F.linear(x, p.w_q, p.b_q), p.n_heads)
    k = split_heads(F.linear(x, p.w_k, p.b_k), p.n_kv_heads)
    v = split_heads(F.linear(x, p.w_v, p.b_v), p.n_kv_heads)
    if p.rope is not None:
        pos = torch.arange(x.shape[1]) if positions is None else positions
        q, k = rotate(q, p.rope, pos, exact), rotate(k, p.rope, pos, exact)
    heads = kv_head_index(p.n_heads, p.n_kv_heads, device=x.device)  # GQA: query head h reads kv head h // (Hq/Hkv)
    return q, k.index_select(1, heads), v.index_select(1, heads)


def output(ctx: torch.Tensor, p: Projections) -> torch.Tensor:
    """(B,Hq,T,Dh) context -> (B,T,D) through the output projection (if any)."""
    merged = merge_heads(ctx)
    return merged if p.w_o is None else F.linear(merged, p.w_o, p.b_o)


def scale_of(p: Projections) -> float:
    return 1.0 / math.sqrt(p.d_head) if p.scale is None else p.scale


# ====================================================================================== attention
def sdpa_attention(x: torch.Tensor, p: Projections, mask: torch.Tensor | None) -> torch.Tensor:
    """The reference: PyTorch's scaled_dot_product_attention on the layer's projections, in x's dtype."""
    q, k, v = project(x, p)
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale_of(p))  # (B,Hq,T,Dh)
    return output(ctx, p)


def plain_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale) over keys in q's dtype; hidden keys -> 0; fully masked rows -> 0: (B,H,Tq,Tk)."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if mask is None:
        return scores.softmax(dim=-1)
    w = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.where(mask.any(dim=-1, keepdim=True), w, torch.zeros_like(w))


def plain_attention(x: torch.Tensor, p: Projections, mask: torch.Tensor | None) -> torch.Tensor:
    """A plain implementation with every op in x's dtype (FlashAttention's yardstick for the dtype's noise)."""
    q, k, v = project(x, p, exact=False)
    return output(plain_weights(q, k, mask, scale_of(p)) @ v, p)


def attention_weights(x: torch.Tensor, p: Projections, mask: torch.Tensor | None) -> torch.Tensor:
    """The reference's attention weights in x's dtype: (B,Hq,T,T)."""
    q, k, _ = project(x, p)
    return plain_weights(q, k, mask, scale_of(p))


def sdpa_forward(x: torch.Tensor, w_qkv: torch.Tensor, w_out: torch.Tensor, n_heads: int,
                 mask: torch.Tensor | None) -> torch.Tensor:
    """The reference on the course layout's weights (qkv (3D, D), out (D, D)), in x's dtype."""
    return sdpa_attention(x, fused_projections(w_qkv, w_out, n_heads), mask)
