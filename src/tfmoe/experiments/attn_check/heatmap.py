"""The attention heatmap of a module-mode run (weights of one batch row and head, hidden pairs crossed)."""

from __future__ import annotations

from typing import Any

import torch


def attention_heatmap(attn: torch.Tensor, visible: torch.Tensor, b: int, h: int, title: str) -> Any:
    """Weights of batch row b, head h; hidden (query, key) pairs marked with a red x, so a leak shows as
    colour under a cross."""
    from matplotlib.figure import Figure

    w = attn[b, h].detach().double().cpu().numpy()
    vis = visible.cpu().numpy()
    fig = Figure(figsize=(5.5, 4.5))
    ax = fig.subplots()
    im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=max(1e-12, float(abs(w[vis]).max()) if vis.any() else 1.0))
    fig.colorbar(im, ax=ax, label="attention weight")
    qi, kj = (~vis).nonzero()
    ax.scatter(kj, qi, marker="x", color="red", s=30, label="hidden (must be 0)")
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    ax.set_title(title)
    if len(qi):
        ax.legend(loc="upper right", fontsize=7)
    return fig

