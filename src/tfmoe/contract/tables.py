"""One table, two renderings: a rich table for the terminal and a markdown table for summary.md.

Experiments and reports build a :class:`Rows` once and ask it for either form, so the two never drift apart.
On a terminal the table fits its width (80 columns or more): columns keep at least their header's width, long
cells wrap inside their column, and rows that cannot fit that way are printed as one small ``column  value`` block
each instead of being squeezed one letter wide. Redirected to a file or a pipe (where rich would assume 80 columns),
each row is one whole line at the table's natural width, so nothing is cut and ``grep`` finds whole rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from tfmoe.rules.safe_text import cell_text

COMPACT_WIDTH = 14  # a column wider than this may wrap (its header never does)


def cell(value: Any) -> str:
    """A value as table text: floats to 6 significant digits, NaN/None/NA empty, lists space-separated; control and
    bidi characters as escapes (safe_text.cell_text: text on disk never acts on the terminal)."""
    if value is None or str(value) in ("<NA>", "NaT"):
        return ""
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        value = value.tolist()
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return cell_text(" ".join(map(str, value)))
    return cell_text(str(value))


@dataclass
class Rows:
    """A titled table: ``columns`` names, ``rows`` of values (formatted by :func:`cell`), optional row styles."""

    title: str
    columns: Sequence[str]
    rows: list[Sequence[Any]] = field(default_factory=list)
    styles: list[str | None] | None = None  # one rich style per row (terminal only)

    def add(self, *values: Any, style: str | None = None) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"{len(values)} values for {len(self.columns)} columns {list(self.columns)}")
        self.rows.append(values)
        if style is not None or self.styles is not None:
            self.styles = (self.styles or [None] * (len(self.rows) - 1)) + [style]

    def texts(self) -> list[list[str]]:
        return [[cell(v) for v in row] for row in self.rows]

    def markdown(self) -> str:
        """A GitHub markdown table (pipes in cells escaped); the title is left to the caller's heading."""
        def line(values: Sequence[str]) -> str:
            return "| " + " | ".join(v.replace("|", "\\|").replace("\n", " ") for v in values) + " |"

        return "\n".join([line([str(c) for c in self.columns]), "|" + "---|" * len(self.columns),
                          *(line(r) for r in self.texts())])

    def natural_width(self) -> int:
        """The width at which every cell fits on one line."""
        texts = self.texts()
        cols = [max([len(str(h)), *(len(r[i]) for r in texts)]) for i, h in enumerate(self.columns)]
        return max(sum(cols) + 3 * len(cols) + 1, len(self.title))

    def print_to(self, console: Console, fit: int | None = None) -> None:
        """Print on ``console``: fitted to a terminal (or to ``fit`` columns), at natural width when redirected."""
        if fit is not None:
            width, saved = fit, console.width
            console.width = width
            try:
                console.print(self.rich(width))
            finally:
                console.width = saved
        elif console.is_terminal:
            console.print(self.rich(console.width))
        else:
            width, saved = max(console.width, self.natural_width()), console.width
            console.width = width  # Console.print(width=...) still measures the table at the console's width
            try:
                console.print(self.rich(width))
            finally:
                console.width = saved

    def rich(self, width: int = 80) -> RenderableType:
        """A rich table that fits ``width`` columns, or one ``column  value`` block per row when it cannot.
        Cells, headers and the title are plain text, never rich markup: ``round_trip[cl100k_base]`` stays whole."""
        texts = self.texts()
        headers = [str(c) for c in self.columns]
        natural = [max([len(h), *(len(r[i]) for r in texts)]) for i, h in enumerate(headers)]
        compact = [min(n, max(len(h), COMPACT_WIDTH)) for n, h in zip(natural, headers, strict=True)]
        frame = 3 * len(headers) + 1  # borders and padding of a rich table
        styles = self.styles or [None] * len(texts)
        if sum(compact) + frame <= width:
            table = Table(title=Text(self.title) if self.title else None)
            fits = sum(natural) + frame <= width
            for h, n, c in zip(headers, natural, compact, strict=True):
                table.add_column(Text(h), min_width=c, no_wrap=fits or n <= c, overflow="fold")
            for r, style in zip(texts, styles, strict=True):
                table.add_row(*map(Text, r), style=style)
            return table
        blocks: list[RenderableType] = []
        for i, (r, style) in enumerate(zip(texts, styles, strict=True)):
            block = Table(title=Text(f"{self.title} [{i + 1}/{len(texts)}]") if self.title else None,
                          show_header=False, style=style)
            # a header longer than half the width wraps, so its value never shrinks to one letter per line
            block.add_column(style="bold", max_width=max(COMPACT_WIDTH, width // 2), overflow="fold")
            block.add_column(overflow="fold")
            for h, v in zip(headers, r, strict=True):
                block.add_row(Text(h), Text(v))
            blocks.append(block)
        return Group(*blocks)


def print_rows(table: Rows, fmt: str, console: Console, fit: int | None = None) -> None:
    """``table`` on stdout as md (a ``### title`` heading, then the markdown table, or ``(none)``) or on
    ``console`` as a terminal table, fitted to ``fit`` columns when given (json is its caller's: it knows its
    values' types)."""
    if fmt == "md":
        if table.title:
            print(f"\n### {table.title}\n")
        print(table.markdown() if table.rows and table.columns else "(none)")
    else:
        table.print_to(console, fit)


def from_frame(df: Any, title: str = "") -> Rows:
    """A pandas DataFrame as :class:`Rows` (its columns, its rows)."""
    return Rows(title, [str(c) for c in df.columns], [tuple(r) for r in df.itertuples(index=False)])
