"""decode's figures: the training loss against the held-out and unigram losses, and the KV-cache timing."""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure


def loss_figure(losses: list[float], val_loss: float, unigram: float) -> Figure:
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(range(len(losses)), losses, lw=1, label="train loss (batch)")
    ax.axhline(val_loss, color="tab:green", ls="--", label=f"held-out loss {val_loss:.3f}")
    ax.axhline(unigram, color="tab:red", ls=":", label=f"unigram baseline {unigram:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / char)")
    ax.legend(fontsize=8)
    return fig


def timing_figure(lengths: Sequence[int], times: dict[str, list[float]], bytes_per_len: list[int]) -> Figure:
    fig = Figure(figsize=(9, 3.8))
    ax, ax2 = fig.subplots(1, 2)
    ax.plot(lengths, times["off"], "o-", label="without cache (re-run all L tokens)")
    ax.plot(lengths, times["on"], "s-", label="with KV cache (feed 1 token)")
    ax.set_xlabel("sequence length L when the token is generated")
    ax.set_ylabel("wall time per generated token (ms, median)")
    ax.set_title("time per generated token")
    ax.legend(fontsize=8)
    ax2.plot([L - 1 for L in lengths], [b / 1024 for b in bytes_per_len], "o-", color="tab:green")
    ax2.set_xlabel("cached tokens (L - 1)")
    ax2.set_ylabel("KV cache (KiB, measured)")
    ax2.set_title("cache size = 2·layers·B·T·D·bytes")
    fig.tight_layout()
    return fig
