"""block-stats' figures: per-run gradient and activation plots, and the depth sweep's plots (Xiong et al. 2020)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tfmoe.experiments.block_stats.stacks import FFN_OUT_PARAM, STAGES, StackStats


# ------------------------------------------------------------------------------------------------ one run
def _figure(n_panels: int, title: str) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * n_panels + 0.6, 3.8), layout="constrained")
    axes = fig.subplots(1, n_panels, sharey=True, squeeze=False)[0]
    fig.suptitle(title)
    return fig, list(axes)


def plot_grad_norm_per_layer(results: dict[str, StackStats]) -> Any:
    fig, axes = _figure(len(results), "gradient norm of each weight matrix per layer (at init)")
    for ax, (name, s) in zip(axes, results.items(), strict=True):
        params = sorted({r["param"] for r in s.param_grads})
        for param in params:
            rows = [r for r in s.param_grads if r["param"] == param]
            ax.plot([r["layer"] for r in rows], [r["grad_norm"] for r in rows], marker="o", ms=3, label=param)
        ax.set_title(name)
        ax.set_xlabel("layer")
        ax.set_yscale("log")
    axes[0].set_ylabel("||dL/dW||")
    axes[-1].legend(fontsize=7)
    return fig


def plot_per_stage(results: dict[str, StackStats], stat: str, title: str) -> Any:
    fig, axes = _figure(len(results), title)
    for ax, (name, s) in zip(axes, results.items(), strict=True):
        for stage in STAGES:
            rows = [r for r in s.activations if r["stage"] == stage]
            ax.plot([r["layer"] for r in rows], [r[stat] for r in rows], marker="o", ms=3, label=stage)
        ax.set_title(name)
        ax.set_xlabel("layer")
        ax.set_yscale("log")
    axes[0].set_ylabel(stat)
    axes[-1].legend(fontsize=7)
    return fig


# ---------------------------------------------------------------------------------------- depth sweep
def _fit_loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return math.nan
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else math.nan


def depth_slopes(df: Any) -> dict[str, float]:
    """From a sweep DataFrame: per variant, the log-log slope of the last layer's ||dL/dW2|| against depth
    (Xiong et al.: about -0.5 for Pre-LN, about 0 for Post-LN)."""
    last = _with_depth(df[df["name"] == "last_layer_grad_norm"], df)
    out = {}
    for variant, g in last.groupby("variant"):
        m = g.groupby("depth")["value"].mean()
        out[str(variant)] = _fit_loglog_slope(list(m.index), list(m.values))
    return out


def _with_depth(rows: Any, df: Any) -> Any:
    """Add a ``depth`` column: the number of layers of each job (max layer index + 1 in its rows)."""
    depth = df[df["layer"].notna()].groupby("job")["layer"].max().astype(int) + 1
    rows = rows.copy()
    rows["depth"] = rows["job"].map(depth)
    return rows


def _per_layer_by_depth(rows: Any, variants: list[str], depths: list[int], color: dict[int, Any], title: str,
                        xlabel: str, ylabel: str, log: bool) -> Any:
    """One panel per variant: the mean value per layer, one line per depth."""
    fig, axes = _figure(len(variants), title)
    for ax, variant in zip(axes, variants, strict=True):
        g = rows[rows["variant"] == variant]
        for depth in depths:
            m = g[g["depth"] == depth].groupby("layer")["value"].mean()
            ax.plot(list(m.index + 1), list(m.values), marker="o", ms=3, color=color[depth], label=f"L={depth}")
        ax.set_title(variant)
        ax.set_xlabel(xlabel)
        if log:
            ax.set_yscale("log")
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(fontsize=7)
    return fig


def sweep_plots(df: Any) -> dict[str, Any]:
    """After ``-m n_layers=...``: per-layer ||dL/dW2|| (pre vs post) across depths, the last layer's
    gradient against depth with a 1/sqrt(L) reference, and the residual stream's std per layer."""
    if "layer" not in df.columns or "variant" not in df.columns:
        return {}
    figs: dict[str, Any] = {}
    w2 = df[(df["name"] == "grad_norm_param") & df["param"].isin(list(FFN_OUT_PARAM.values()))]
    w2 = _with_depth(w2, df)
    variants = [str(v) for v in dict.fromkeys(df["variant"].dropna())]
    depths = sorted(int(d) for d in w2["depth"].dropna().unique())
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    color = {d: cmap(i / max(1, len(depths) - 1)) for i, d in enumerate(depths)}

    figs["sweep_grad_norm_per_layer"] = _per_layer_by_depth(
        w2, variants, depths, color, "||dL/dW2|| per layer at init, across depths (mean over jobs)",
        "layer (1 = nearest the input)", "||dL/dW2||", log=True)

    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(5.5, 4), layout="constrained")
    ax = fig.subplots()
    last = _with_depth(df[df["name"] == "last_layer_grad_norm"], df)
    slopes = depth_slopes(df)
    for variant in variants:
        m = last[last["variant"] == variant].groupby("depth")["value"].mean()
        ax.plot(list(m.index), list(m.values), marker="o", label=f"{variant} (slope {slopes.get(variant, math.nan):.2f})")
    ref = last[last["variant"] == variants[0]].groupby("depth")["value"].mean()
    if len(ref):
        d0, v0 = float(ref.index[0]), float(ref.iloc[0])
        xs = sorted(float(d) for d in ref.index)
        ax.plot(xs, [v0 * math.sqrt(d0 / x) for x in xs], "k--", lw=1, label="1/sqrt(L) reference")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("number of layers L")
    ax.set_ylabel("last layer ||dL/dW2||")
    ax.set_title("Xiong et al. 2020: last-layer gradient vs depth")
    ax.legend(fontsize=8)
    figs["sweep_last_layer_grad_vs_depth"] = fig

    resid = _with_depth(df[df["name"] == "resid_std"], df)
    figs["sweep_std_per_layer"] = _per_layer_by_depth(
        resid, variants, depths, color, "residual stream std per layer at init, across depths", "layer",
        "std of block output", log=False)
    return figs
