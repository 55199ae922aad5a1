"""A user's attention layer that raises inside its own code on every forward (attn-check's errors-vs-failures
tests): the exception must lead each check's detail, in full, and no likely cause may be inferred from it."""

from __future__ import annotations

import torch
from buggy_attention import PlainMHA


class RaisesInForward(PlainMHA):
    """Builds fine; every forward raises in the user's own code, with a two-line message."""

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None, cache: dict | None = None):
        raise RuntimeError("my attention expects a cache\nbut none was set up (second line)")
