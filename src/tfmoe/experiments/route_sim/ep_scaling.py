"""Expert parallelism beyond this machine, by a stated model fed with one EP run's measurements.

Kept fixed from the run: T tokens per rank, D, the itemsize, top-k, L = E/W experts per rank (experts are added
with ranks: E = W*L), and two measurements: the experts' relative popularity (the loads each expert computed,
over all steps) and the compute cost of one expert row (the ranks' compute time / the rows they computed, pooled).

At W ranks (``ep_sim_ranks``): every expert's popularity is drawn from the measured ones (a bootstrap, seeded),
the W*T*k assignments fall on the experts multinomially (dropless), and each rank's load is the sum over its block.
A token's expert is on another rank with probability (W-1)/W, so in a forward each rank sends T*k*(W-1)/W rows and
receives load*(W-1)/W, twice (dispatch and combine). With link bandwidth B and per-message latency a
(``ep_link_gbps``, ``ep_link_latency_us``; W-1 messages per All-to-All, sent one after another):
  a2a    = 2 * ((W-1)*a + max(sent, received) * D * itemsize / B)   (the busiest rank)
  step   = slowest rank's compute (its rows * cost per row) + a2a
  tokens/s per rank = T / step;  bytes per token = 2*k*(W-1)/W * D * itemsize;  straggler = max load / mean load
Not modelled: topology (one flat link per rank), overlap of compute and communication, capacity drops, the
router's and the combine's own cost beyond the per-row figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure


@dataclass(frozen=True)
class Measured:
    """What the model takes from one EP run."""

    world: int  # the run's W
    tokens_per_rank: int  # T
    experts_per_rank: int  # L
    d_model: int
    itemsize: int
    top_k: int
    popularity: np.ndarray  # (E_run,) each expert's share of the computed rows
    ms_per_row: float  # compute time per expert row (routing and combine included)
    bytes_per_token: float | None  # measured All-to-All payload per token in a forward (None: no counter)


@dataclass(frozen=True)
class Point:
    world: int
    experts: int
    compute_ms: float
    a2a_ms: float
    step_ms: float
    tokens_per_s_per_rank: float
    bytes_per_token: float
    straggler: float  # max rank load / mean rank load


def simulate(m: Measured, worlds: tuple[int, ...], link_gbps: float, latency_us: float, seed: int) -> list[Point]:
    """The model of the module docstring at each W in ``worlds``."""
    rng = np.random.default_rng(seed)
    bandwidth = link_gbps * 1e9 / 8  # bytes/s
    row_bytes = m.d_model * m.itemsize
    points = []
    for w in worlds:
        e = w * m.experts_per_rank
        share = rng.choice(m.popularity, size=e, replace=True)
        share = share / share.sum() if share.sum() > 0 else np.full(e, 1.0 / e)
        rows = rng.multinomial(w * m.tokens_per_rank * m.top_k, share)  # (E,)
        per_rank = rows.reshape(w, m.experts_per_rank).sum(1)  # (W,)
        off = (w - 1) / w
        sent = m.tokens_per_rank * m.top_k * off
        received = per_rank.max() * off
        a2a_s = 2 * ((w - 1) * latency_us * 1e-6 + max(sent, received) * row_bytes / bandwidth)
        compute_s = per_rank.max() * m.ms_per_row * 1e-3
        step_s = compute_s + a2a_s
        points.append(Point(w, e, compute_s * 1e3, a2a_s * 1e3, step_s * 1e3, m.tokens_per_rank / step_s,
                            2 * m.top_k * off * row_bytes, float(per_rank.max() / per_rank.mean())))
    return points


def scaling_plot(m: Measured, points: list[Point], link_gbps: float, latency_us: float) -> Figure:
    """Tokens/s per rank and All-to-All bytes per token against W (the run's measured point marked)."""
    fig = Figure(figsize=(9, 3.6))
    ax1, ax2 = fig.subplots(1, 2)
    ws = [p.world for p in points]
    ax1.plot(ws, [p.tokens_per_s_per_rank for p in points], "o-", label="model")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel(f"ranks W (experts = W x {m.experts_per_rank})")
    ax1.set_ylabel("tokens/s per rank")
    ax1.set_title(f"{m.tokens_per_rank} tokens/rank, {link_gbps:g} Gbit/s, {latency_us:g} us", fontsize=9)
    ax2.plot(ws, [p.bytes_per_token for p in points], "o-", label="2k(W-1)/W x D x itemsize")
    if m.bytes_per_token is not None:
        ax2.plot([m.world], [m.bytes_per_token], "r*", ms=12, label=f"measured at W={m.world}")
    ax2.axhline(2 * m.top_k * m.d_model * m.itemsize, color="k", ls="--", lw=1, label="limit 2k x D x itemsize")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("ranks W")
    ax2.set_ylabel("All-to-All bytes per token (forward)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig
