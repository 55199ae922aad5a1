"""route-sim's figures: the course case's loads, the training simulation's curves and final loads, and the sweep
plot of final CV per strategy and job."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from matplotlib.figure import Figure

from tfmoe.components import moe

if TYPE_CHECKING:
    from tfmoe.experiments.route_sim.training import StrategyTrace


def course_plot(load: torch.Tensor, kept: torch.Tensor, capacity: int | None, tokens: int, top_k: int) -> Figure:
    """Kept and dropped assignments per expert, with the mean load and the capacity."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    experts = np.arange(load.numel())
    ax.bar(experts, kept.numpy(), label="kept")
    ax.bar(experts, (load.cpu() - kept).numpy(), bottom=kept.numpy(), label="dropped", color="tab:red")
    mean = tokens * top_k / load.numel()
    ax.axhline(mean, color="k", ls="--", lw=1, label=f"mean load {mean:g}")
    if capacity is not None:
        ax.axhline(capacity, color="tab:orange", lw=1, label=f"capacity {capacity}")
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments")
    ax.set_xticks(experts)
    ax.set_title(f"{tokens} tokens, top-{top_k}: CV {float(moe.load_cv(load)):.3f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def training_plots(traces: dict[str, StrategyTrace], n_experts: int, train_tokens: int,
                   top_k: int) -> dict[str, Figure]:
    """CV and MaxVio per step, dropped fractions and task loss per step, final-step loads per strategy."""
    figs: dict[str, Figure] = {}
    fig = Figure(figsize=(10, 4))
    ax_cv, ax_mv = fig.subplots(1, 2)
    for s, t in traces.items():
        ax_cv.plot(t.history["cv"], label=s, lw=1)
        ax_mv.plot(t.history["maxvio"], label=s, lw=1)
    ax_cv.set(xlabel="step", ylabel="CV of loads", title="CV per step")
    ax_mv.set(xlabel="step", ylabel="MaxVio", title="MaxVio per step")
    ax_cv.legend(fontsize=8)
    fig.tight_layout()
    figs["cv_maxvio"] = fig

    fig = Figure(figsize=(10, 4))
    ax_drop, ax_loss = fig.subplots(1, 2)
    for s, t in traces.items():
        (line,) = ax_drop.plot(t.history["dropped_fraction"], label=s, lw=1)
        ax_drop.plot(t.history["tokens_dropped_fraction"], color=line.get_color(), ls=":", lw=1)
        ax_loss.plot(t.history["task_loss"], label=s, lw=1)
    ax_drop.set(xlabel="step", ylabel="dropped fraction", title="dropped: assignments (solid), whole tokens (dotted)")
    ax_loss.set(xlabel="step", ylabel="task MSE", yscale="log", title="task loss (the cost side)")
    ax_drop.legend(fontsize=8)
    fig.tight_layout()
    figs["train_cost"] = fig

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    width = 0.8 / max(1, len(traces))
    experts = np.arange(n_experts)
    for i, (s, t) in enumerate(traces.items()):
        ax.bar(experts + i * width, t.final_load.numpy(), width, label=s)
    ax.axhline(train_tokens * top_k / n_experts, color="k", ls="--", lw=1, label="balanced")
    ax.set(xlabel="expert", ylabel="assignments (final step)", title="final-step loads per strategy")
    ax.set_xticks(experts + 0.4 - width / 2, [str(e) for e in experts])
    ax.legend(fontsize=8)
    fig.tight_layout()
    figs["final_loads"] = fig
    return figs


def sweep_plots(df: Any) -> dict[str, Figure]:
    """After a multirun: final-step CV per strategy and job (course-case CV where no training ran)."""
    if df is None or "name" not in df:
        return {}
    cv = df[df["name"] == "cv"]
    if len(cv) and "step" in cv and "strategy" in cv:
        cv = cv[cv["step"] == cv.groupby(["job", "strategy"])["step"].transform("max")]
    else:  # no training simulation ran: the course case's CV (metric course.cv), in a column of its own
        cv = df[df["name"] == "course.cv"].assign(strategy="course case")
    if cv.empty or "job" not in cv:
        return {}
    table = cv.pivot_table(index="job", columns="strategy", values="value", aggfunc="last")
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    width = 0.8 / max(1, len(table.columns))
    xs = np.arange(len(table.index))
    for i, s in enumerate(table.columns):
        ax.bar(xs + i * width, table[s].to_numpy(), width, label=str(s))
    ax.set_xticks(xs + 0.4 - width / 2, [str(j) for j in table.index])
    ax.set(xlabel="job", ylabel="CV (final step)", title="route-sim sweep: final CV per strategy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return {"sweep_final_cv": fig}
