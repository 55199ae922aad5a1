"""tokenize's report: the tokens-per-category table (terminal and summary.md from one :class:`tfmoe.contract.tables.Rows`),
the pieces of the first samples, the figures, and the sweep plot of the premium."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tfmoe.contract.tables import Rows
from tfmoe.experiments.tokenize.measures import ALL, Encoded
from tfmoe.experiments.tokenize.samples import Sample

if TYPE_CHECKING:
    from tfmoe.experiments.tokenize.settings import Settings


def results_rows(encoded: list[Encoded], categories: list[str], totals: dict[str, dict[str, int]],
                 premiums: dict[str, float]) -> Rows:
    """Tokens per (tokenizer, category), the vocabulary size and the premium ("-" where not computed)."""
    rows = Rows("tokens per category (lower = cheaper)", ("tokenizer", "vocab", *categories, ALL, "premium"))
    for e in encoded:
        name = e.adapter.name
        rows.add(name, e.adapter.vocab_size, *(totals[name][c] for c in [*categories, ALL]),
                 f"{premiums[name]:.2f}" if name in premiums else "-")
    return rows


def bar_chart(encoded: list[Encoded], categories: list[str], totals: dict[str, dict[str, int]]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 1.3 * len(categories) + 2), 4.2))
    ax = fig.subplots()
    width = 0.8 / max(1, len(encoded))
    for k, e in enumerate(encoded):
        xs = [i + (k - (len(encoded) - 1) / 2) * width for i in range(len(categories))]
        ax.bar(xs, [totals[e.adapter.name][c] for c in categories], width, label=e.adapter.name)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("tokens (total over the category)")
    ax.set_title("Tokens per category and tokenizer")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def digit_chart(rows: dict[str, list[int]]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    styles = ["-", "--", "-.", ":"]
    for k, (name, counts) in enumerate(rows.items()):  # wide-to-thin lines keep coinciding ones visible
        ax.plot(range(1, len(counts) + 1), counts, ls=styles[k % len(styles)], lw=max(1.0, 4.0 - 0.45 * k),
                marker=".", label=name)
    ax.set_xlabel("digits in the run (prefixes of pi)")
    ax.set_ylabel("tokens")
    ax.set_title("How digit runs are split")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "\\n")


def _md_piece(piece: str) -> str:
    """A piece for a markdown table: spaces shown as '␣' so leading spaces stay visible."""
    return _md_cell(piece).replace(" ", "␣")


def summary_markdown(samples: list[Sample], encoded: list[Encoded], categories: list[str],
                     totals: dict[str, dict[str, int]], premiums: dict[str, float], s: Settings) -> str:
    lines = ["## Tokens per category", "", results_rows(encoded, categories, totals, premiums).markdown()]
    if premiums:
        lines += ["", f"Premium = total tokens of `{s.numerator}` / total tokens of `{s.denominator}` on the "
                  "parallel samples (a ratio of totals, Petrov et al. 2023)."]
    shown = [x for cat in categories for x in [y for y in samples if y.category == cat][: s.show]]
    if shown:
        lines += ["", "## Why: the pieces", ""]
        for x in shown:
            lines += [f"**line {x.line} ({x.category})**: `{_md_cell(x.text)}`", "",
                      "| tokenizer | n | pieces |", "|---|---:|---|"]
            i = samples.index(x)
            for e in encoded:
                pieces = " ".join(f"`{_md_piece(p)}`" for p in e.adapter.pieces(e.ids[i]))
                lines.append(f"| {e.adapter.name} | {len(e.ids[i])} | {pieces} |")
            lines.append("")
    lines += ["Pieces are shown in backticks, ␣ = a space, \\xNN = a byte that is only part of a UTF-8 character.",
              "All samples' ids and pieces: metrics.parquet, rows `name == 'tokens'`, columns `ids`, `pieces`."]
    return "\n".join(lines)


def sweep_plots(df) -> dict[str, Any]:
    """After a multirun: the premium of each tokenizer against the first override key that varies."""
    import pandas as pd
    from matplotlib.figure import Figure

    known = {"name", "value", "step", "tokenizer", "category", "sample", "ids", "pieces", "numerator",
             "denominator", "job", "run_id", "status"}
    prem = df[df["name"] == "premium"] if "name" in df.columns else df.iloc[0:0]
    keys = [c for c in df.columns if c not in known and prem[c].astype(str).nunique() > 1]
    if not keys or prem.empty:
        return {}
    key = keys[0]
    numeric = pd.to_numeric(prem[key], errors="coerce")
    x = numeric if numeric.notna().all() else prem[key].astype(str)
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for name, part in prem.assign(_x=x).groupby("tokenizer"):
        part = part.sort_values("_x")
        ax.plot(part["_x"], part["value"], marker="o", label=str(name))
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel(key)
    if {"numerator", "denominator"} <= set(prem.columns):
        ax.set_ylabel(f"premium ({prem['numerator'].iloc[0]} tokens / {prem['denominator'].iloc[0]} tokens)")
    else:
        ax.set_ylabel("premium")
    ax.set_title(f"Tokenization premium vs {key}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return {"premium_sweep": fig}
