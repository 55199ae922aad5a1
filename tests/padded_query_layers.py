"""Layers that zero the output of padded query positions (as x-transformers' Attention does with ``mask=``), in
the course's interface, for ``tfmoe attn-check impl=padded_query_layers:<Class>`` (tests put tests/ on sys.path).
``ZeroesPaddedQueries`` is correct (a padded query's output is don't-care in every loss); the others plant a bug
in the rows that are NOT padded."""

from __future__ import annotations

import torch
from buggy_attention import PlainMHA


class ZeroesPaddedQueries(PlainMHA):
    """Correct: attention over the real keys, then the output of every padded query position set to 0."""

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        out, w = super().forward(x, padding_mask, cache)  # (B,T,D), (B,H,T,Tk)
        if padding_mask is not None and cache is None:
            out = out * padding_mask[..., None].to(out.dtype)  # (B,T,1): 0 on padded queries
        return out, w


class ZeroesTheLastRealQueryToo(PlainMHA):
    """Bug: the query mask is shifted by one (padding_mask[t + 1]), so the last real token of a padded row is
    zeroed as well: a row that is not padded loses its output."""

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        out, w = super().forward(x, padding_mask, cache)
        if padding_mask is not None and cache is None:
            shifted = torch.cat([padding_mask[:, 1:], padding_mask[:, -1:]], dim=1)  # (B,T) off by one
            out = out * (padding_mask & shifted)[..., None].to(out.dtype)
        return out, w


class HalvesPaddedQueries(PlainMHA):
    """Correct attention on every real query, padded query outputs halved (neither attended nor zero): passes
    the default (any), fails padded_query_policy=zeros."""

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        out, w = super().forward(x, padding_mask, cache)
        if padding_mask is not None and cache is None:
            out = torch.where(padding_mask[..., None], out, 0.5 * out)
        return out, w


class OutGainAboveOneHead(PlainMHA):
    """Correct, but its structure depends on the head count, as x-transformers' Attention (whose ``to_out``
    exists only for heads > 1): a learnable output gain (1 at init) exists only with more than one head, so a
    multi-head layer's weights cannot be loaded at one head (head_counts is not applicable there)."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, dropout: float = 0.0):
        super().__init__(d_model, n_heads, causal, dropout)
        self.out_gain = torch.nn.Parameter(torch.ones(())) if n_heads > 1 else None

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        out, w = super().forward(x, padding_mask, cache)
        return (out if self.out_gain is None else out * self.out_gain), w
