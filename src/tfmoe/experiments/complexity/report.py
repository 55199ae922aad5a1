"""complexity's report: the per-group tables (terminal and summary.md, as tables.Rows) and the figures."""

from __future__ import annotations

import math
from typing import Any

import torch

from tfmoe.components import complexity_model as cm
from tfmoe.contract.tables import Rows
from tfmoe.experiments.complexity.checks import PLAUSIBLE_PEAK_FRACTION
from tfmoe.experiments.complexity.measure import TIMED


def _attn_sq(f: dict[str, int]) -> int:
    return f["scores"] + f["attn_v"]


def _fraction(r: dict[str, Any], comp: str, stat: int = 0) -> float:
    """Achieved FLOP/s of ``comp`` over the matmul peak: wall median (0), wall best (1), CPU-clock median (2)."""
    return r["flops_of"][comp] / (r["times"][comp][stat] / 1e3) / r["peak"][stat]


def terminal_rows(rows: list[dict[str, Any]]) -> Rows:
    """The terminal's one-line-per-group table."""
    table = Rows("complexity: one block per (T, D) group",
                 ("T", "D", "params", "fwd GFLOP", "T² share", "xover T", "prefill ms/tok", "decode ms/tok",
                  "FFN %peak wall/cpu", "peak MiB (est)"))
    for r in rows:
        f = r["flops"]
        table.add(r["T"], r["D"], f"{r['params']:,}", f"{f['matmul'] / 1e9:.2f}", f"{_attn_sq(f) / f['matmul']:.0%}",
                  f"{cm.crossover_T(r['shape']):.0f}", f"{r['times']['prefill'][0] / r['T']:.3f}",
                  f"{r['times']['decode'][0]:.3f}", f"{_fraction(r, 'ffn'):.0%}/{_fraction(r, 'ffn', 2):.0%}",
                  f"{r['peak_mem'] / 2**20:.0f} ({r['estimate'] / 2**20:.0f})")
    return table


def group_rows(rows: list[dict[str, Any]]) -> Rows:
    """summary.md's per-group table: every analytic, counted and measured number of a group."""
    table = Rows("", ("T", "D", "params", "fwd matmul FLOPs (analytic = counted)", "T² attn share", "crossover T",
                      "softmax FLOPs", "bias FLOPs", "score elems", "KV B/token (L layers)", "prefill ms/token",
                      "decode ms/token", "saved act. MiB", "step peak MiB (estimate)"))
    for r in rows:
        f = r["flops"]
        same = "=" if r["counted"] == f["matmul"] else f"≠ {r['counted']:,}"
        table.add(r["T"], r["D"], f"{r['params']:,}", f"{f['matmul']:,} {same}", f"{_attn_sq(f) / f['matmul']:.1%}",
                  f"{cm.crossover_T(r['shape']):.0f}", f"{f['softmax']:,}", f"{f['bias']:,}",
                  f"{cm.score_elements(r['shape']):,}", f"{r['kv_per_token']:,}",
                  f"{r['times']['prefill'][0] / r['T']:.4f}", f"{r['times']['decode'][0]:.3f}",
                  f"{r['saved'] / 2**20:.2f}", f"{r['peak_mem'] / 2**20:.1f} ({r['estimate'] / 2**20:.1f})")
    return table


def component_rows(rows: list[dict[str, Any]]) -> Rows:
    """summary.md's per-component timings: median wall ms [fraction of the peak: wall median / best / CPU]."""
    comps = [c for c in TIMED if c != "block"] + ["prefill", "decode"]
    table = Rows("", ("T", "D", "peak GFLOP/s (median / best / CPU)", *comps))
    for r in rows:
        cells = []
        for comp in comps:
            med = r["times"][comp][0]
            frac = "" if r["flops_of"].get(comp) is None else \
                f" [{_fraction(r, comp):.0%} / {_fraction(r, comp, 1):.0%} / {_fraction(r, comp, 2):.0%}]"
            cells.append(f"{med:.3f}{frac}")
        table.add(r["T"], r["D"], " / ".join(f"{p / 1e9:.0f}" for p in r["peak"]), *cells)
    return table


def summary_markdown(rows: list[dict[str, Any]], block: str, timing: str, sdpa: dict[str, Any],
                     load: tuple[float, float]) -> str:
    """summary.md's part: ``block`` describes the block (B, H, d_ff, dtype), ``timing`` how it was timed."""
    lines = [
        f"Block: {block}; timings ({timing}): wall median, wall best and CPU-clock median of the per-call time per "
        f"block; 1-min load average {load[0]:.1f} -> {load[1]:.1f}. SDPA kernels {sdpa['kernels']}: FlopCounterMode "
        f"counts {sdpa['default_forward']} forward FLOPs by default, {sdpa['mapped_forward']} with custom_mapping "
        f"(analytic {sdpa['analytic']}).",
        "",
        f"Timings plausible (every peak_fraction <= {PLAUSIBLE_PEAK_FRACTION:.0%}): "
        + ("; ".join(f"T={r['T']} D={r['D']} {'yes' if r['plausible'].passed else '**NO** - ' + r['plausible'].detail}"
                     for r in rows)) + f" ({torch.get_num_threads()} torch threads).",
        "",
        group_rows(rows).markdown(),
        "", "Median wall ms per component [fraction of the matmul peak: wall median / wall best / CPU clock]:", "",
        component_rows(rows).markdown(),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- figures
def _clock(times: tuple[float, float, float]) -> float:
    """The CPU-clock median where measured (not disturbed by waiting for a shared core), else the wall median."""
    return times[2] if math.isfinite(times[2]) else times[0]


UNTRUSTED = "NOT trustworthy"


def mark_untrusted(ax: Any, where: list[str]) -> None:
    """Mark a panel of measured times whose timings failed ``timings_plausible`` (the run's warning, on the plot)."""
    ax.set_title(f"{ax.get_title()}\n{UNTRUSTED}: implausible timings at {', '.join(where)}", color="red",
                 fontsize=9)
    ax.text(0.5, 0.5, UNTRUSTED, transform=ax.transAxes, ha="center", va="center", fontsize=20, color="red",
            alpha=0.25, rotation=25)


def groups_figure(rows: list[dict[str, Any]]) -> Any:
    """Share of analytic forward FLOPs vs share of measured time (CPU clock where measured) per component."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5))
    ax_f, ax_t = fig.subplots(1, 2, sharey=True)
    parts = [("qkv", ("qkv",)), ("QKᵀ", ("scores",)), ("softmax", ("softmax",)), ("·V", ("attn_v",)),
             ("out proj", ("out_proj",)), ("FFN", ("ffn",))]
    labels = [f"T={r['T']}\nD={r['D']}" for r in rows]
    for ax, source, title in ((ax_f, "flops", "analytic forward FLOPs"), (ax_t, "times", "measured time (CPU clock)")):
        bottoms = [0.0] * len(rows)
        for name, comps in parts:
            vals = []
            for r in rows:
                d = r["flops"] if source == "flops" else {c: _clock(v) for c, v in r["times"].items()}
                total = sum(d[c] for _, cs in parts for c in cs)
                vals.append(sum(d[c] for c in comps) / total)
            ax.bar(labels, vals, bottom=bottoms, label=name)
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
        ax.set_title(title)
        ax.set_ylim(0, 1)
    untrusted = [label.replace("\n", " ") for label, r in zip(labels, rows, strict=True)
                 if not r["plausible"].passed]
    if untrusted:  # the run's warning, on the panel it concerns
        mark_untrusted(ax_t, untrusted)
    ax_f.set_ylabel("share of the block")
    ax_t.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.suptitle("Where a block's work goes: T² attention terms grow past the FFN at T > d_ff")
    fig.tight_layout()
    return fig


def sweep_plots(df: Any) -> dict[str, Any]:
    """Top: analytic attention-score FLOPs (QKᵀ + ·V, ∝ T²) vs FFN FLOPs (∝ T) against T, one colour per D,
    crossover ★ at T = d_ff. Bottom: the measured times of the same two parts in each sweep job (CPU-clock
    median where recorded, else wall median); a job whose timings failed ``timings_plausible`` is marked x and the
    panel titled NOT trustworthy, as the job's warning says."""
    import numpy as np
    from matplotlib.figure import Figure

    df = df[df["T"].notna() & df["D"].notna()]
    flops = df[df["name"] == "flops_forward"].pivot_table(index=["D", "T"], columns="component", values="value")
    timed = df[df["name"] == "time_ms"]
    stat = "cpu" if "stat" in timed and timed[timed["stat"] == "cpu"]["value"].notna().any() else "median"
    if "stat" in timed:
        timed = timed[timed["stat"] == stat]
    times = timed.pivot_table(index=["D", "T"], columns="component", values="value")
    cross = df[df["name"] == "crossover_T"].groupby("D")["value"].first()
    fig = Figure(figsize=(8, 8))
    ax, ax_t = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    colors = {d: f"C{i}" for i, d in enumerate(sorted(flops.index.get_level_values("D").unique()))}
    t_all = flops.index.get_level_values("T")
    for D, color in colors.items():
        sub = flops.loc[D].sort_index()
        T0 = float(sub.index[0])
        attn0 = float(sub["scores"].iloc[0] + sub["attn_v"].iloc[0])
        ffn0 = float(sub["ffn"].iloc[0])
        x_T = float(cross.get(D, np.nan))
        lo = min(float(t_all.min()), x_T if math.isfinite(x_T) else np.inf) / 1.5
        hi = max(float(t_all.max()), x_T if math.isfinite(x_T) else 0) * 1.5
        grid = np.geomspace(lo, hi, 100)
        ax.plot(grid, attn0 * (grid / T0) ** 2, color=color, lw=2, label=f"D={int(D)}: attention QKᵀ+·V (T²)")
        ax.plot(grid, ffn0 * grid / T0, color=color, lw=1.2, ls=":", label=f"D={int(D)}: FFN (T)")
        ax.scatter(sub.index, sub["scores"] + sub["attn_v"], color=color, zorder=3)
        ax.scatter(sub.index, sub["ffn"], color=color, marker="s", zorder=3)
        if math.isfinite(x_T):
            ax.plot([x_T], [ffn0 * x_T / T0], marker="*", ms=15, color=color, mec="k", zorder=4)
            ax.annotate(f"T={x_T:.0f}", (x_T, ffn0 * x_T / T0), textcoords="offset points", xytext=(7, -12),
                        fontsize=8)
        if D in times.index.get_level_values("D"):
            tsub = times.loc[D].sort_index()
            ax_t.plot(tsub.index, tsub[["scores", "softmax", "attn_v"]].sum(axis=1), color=color, lw=2,
                      marker="o", label=f"D={int(D)}: attention QKᵀ+softmax+·V")
            ax_t.plot(tsub.index, tsub["ffn"], color=color, lw=1.2, ls=":", marker="s", label=f"D={int(D)}: FFN")
    for a in (ax, ax_t):
        a.set_xscale("log")
        a.set_yscale("log")
        a.grid(True, which="major", alpha=0.3)
    ax.set_ylabel("forward FLOPs (analytic; dots = sweep jobs)")
    ax.set_title("Attention T² FLOPs vs FFN FLOPs per block; ★ = crossover T = d_ff")
    ax.legend(fontsize=7, loc="upper left")
    ax_t.set_xlabel("T (tokens)")
    ax_t.set_ylabel(f"measured ms ({'CPU clock' if stat == 'cpu' else 'wall'} median)")
    ax_t.legend(fontsize=7, loc="upper left")
    flags = df[df["name"] == "timings_plausible"]
    bad = flags[flags["value"] == 0.0]
    if len(bad):  # the jobs' warnings, on the panel they concern: the jobs marked x
        for _, row in bad.iterrows():
            D, T = row["D"], row["T"]
            if (D, T) in times.index:
                y = float(times.loc[(D, T), ["scores", "softmax", "attn_v"]].sum())
                ax_t.plot([T], [y], marker="x", ms=14, mew=3, color="red", zorder=5)
        mark_untrusted(ax_t, [f"T={int(T)} D={int(D)}" for D, T in sorted(set(zip(bad["D"], bad["T"], strict=True)))])
    fig.tight_layout()
    return {"sweep_attention_vs_ffn": fig}
