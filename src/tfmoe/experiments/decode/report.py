"""decode's report: the continuations and timing tables (terminal and summary.md from one
:class:`tfmoe.contract.tables.Rows`), summary.md, and the figures (training loss; KV-cache timing)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from matplotlib.figure import Figure

from tfmoe.components import sampling
from tfmoe.contract.recorder import Recorder
from tfmoe.contract.tables import Rows
from tfmoe.experiments.decode.lm import CharVocab

if TYPE_CHECKING:
    from tfmoe.experiments.decode.settings import Settings


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


def continuations_rows(prompt: str, outputs: dict[str, tuple[str, int, bool, float]]) -> Rows:
    """One row per strategy; the text in backticks (its spaces, and <eos>, stay visible in markdown too)."""
    rows = Rows(f"continuations of {prompt!r}", ("strategy", "new tokens", "EOS", "log-prob", "text"))
    for name, (text, n_new, eos, lp) in outputs.items():
        rows.add(name, n_new, eos, f"{lp:.2f}", f"`{text}`")
    return rows


def timing_rows(lengths: tuple[int, ...], times: dict[str, list[float]]) -> Rows:
    rows = Rows("time per generated token (ms, median)", ("length", "no cache", "KV cache"))
    for length, off, on in zip(lengths, times["off"], times["on"], strict=True):
        rows.add(length, f"{off:.3f}", f"{on:.3f}")
    return rows


def summarize(rec: Recorder, s: Settings, vocab: CharVocab, prompt: torch.Tensor,
              outputs: dict[str, tuple[str, int, bool, float]], losses: list[float], val_loss: float,
              unigram: float, chi2: sampling.Chi2Result, times: dict[str, list[float]]) -> None:
    rec.note(f"char vocabulary of {vocab.size} ids (eos={vocab.eos_id}); model d={s.d_model}, heads={s.n_heads}, "
             f"layers={s.n_layers}; trained {s.train_steps} steps in fp32, decoded in "
             f"{str(rec.dtype).removeprefix('torch.')}")
    parts = ["## Training", "",
             f"- train loss: {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps" if losses else
             "- no training steps", f"- held-out loss {val_loss:.3f} nats/char vs unigram {unigram:.3f} "
             f"and uniform {math.log(vocab.size):.3f}", "",
             f"## Continuations of `{vocab.decode(prompt[0].tolist())}`", "",
             continuations_rows(vocab.decode(prompt[0].tolist()), outputs).markdown()]
    parts += ["", "## Chi-square (temperature 1 vs softmax)", "",
              f"stat {chi2.stat:.2f}, df {chi2.df}, p-value {chi2.p_value:.4f}, critical value "
              f"{chi2.critical:.2f} at alpha {s.chi2_alpha} (chi-square survival function = regularised upper "
              "incomplete gamma Q(df/2, x/2), torch.special.gammaincc; critical value by bisection)"]
    if times["on"]:
        parts += ["", "## Time per generated token (ms, median)", "", timing_rows(s.timing_lengths, times).markdown()]
    rec.summary("\n".join(parts))
