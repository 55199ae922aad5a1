"""tables.Rows: one table rendered for the terminal (readable at 80 columns) and as markdown."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from tfmoe.contract.tables import Rows, cell


def render(rows: Rows, width: int = 80) -> str:
    console = Console(width=width, record=True, color_system=None)
    with console.capture() as cap:
        console.print(rows.rich(width))
    return cap.get()


def test_cell_formats_floats_missing_values_and_lists() -> None:
    assert cell(0.123456789) == "0.123457"
    assert cell(math.nan) == "" and cell(None) == ""
    assert cell([1, 2]) == "1 2" and cell("aux_loss") == "aux_loss"


def test_markdown_and_rich_hold_the_same_rows() -> None:
    t = Rows("loads", ["strategy", "cv"], [("aux_loss", 0.5), ("aux|free", 1.25)])
    md = t.markdown().splitlines()
    assert md[0] == "| strategy | cv |" and md[1] == "|---|---|"
    assert md[3] == "| aux\\|free | 1.25 |"  # a pipe inside a cell does not split it
    text = render(t)
    assert "aux_loss" in text and "aux|free" in text and "1.25" in text


def test_wide_table_keeps_every_header_and_cell_whole_at_80_columns() -> None:
    """The bug: redirected `tfmoe runs` printed the experiment column one letter wide (`aux_lo…` in route-sim)."""
    cols = ["run_id", "experiment", "status", "exit", "checks", "started_at", "seed", "device", "dtype", "expected"]
    row = ("20261201T084000Z-da348ca0", "route-sim", "ok", 0, "37/37", "2026-12-01T08:40:00", 0, "cpu", "fp32", "")
    text = render(Rows("runs", cols, [row, row]))
    for value in ("20261201T084000Z-da348ca0", "route-sim", "2026-12-01T08:40:00", "experiment", "started_at"):
        assert value in text, f"{value!r} was squeezed:\n{text}"
    assert max(len(line) for line in text.splitlines()) <= 80


def test_narrow_table_is_a_plain_table_and_boundary_empty_table() -> None:
    text = render(Rows("t", ["a", "b"], [(1, 2)]))
    assert "┃ a ┃ b ┃" in text or "a" in text.splitlines()[2]
    assert "a" in render(Rows("empty", ["a"], []))


def test_add_refuses_a_row_of_the_wrong_length_and_keeps_styles_aligned() -> None:
    t = Rows("t", ["a", "b"])
    t.add(1, 2)
    t.add(3, 4, style="red")
    assert t.styles == [None, "red"]
    with pytest.raises(ValueError, match="1 values for 2 columns"):
        t.add(1)


def test_redirected_output_prints_each_row_whole_on_one_line() -> None:
    import io

    cols = ["run_id", "experiment", "status", "started_at", "wall_s", "device", "dtype", "overrides"]
    row = ("20261201T103719Z-540045a9", "route-sim", "ok", "2026-12-01 10:37:19", "5.65", "cpu", "fp32", "steps=20")
    console = Console(file=io.StringIO(), width=80)  # a file: not a terminal, rich assumes 80 columns
    Rows("runs", cols, [row]).print_to(console)
    lines = console.file.getvalue().splitlines()
    assert any(all(v in line for v in row) for line in lines), "\n".join(lines)
    assert console.width == 80  # the console is left as it was


def test_cells_headers_and_titles_are_plain_text_not_rich_markup() -> None:
    """The bug: check names like ``round_trip[cl100k_base]`` lost their ``[...]`` (read as a rich style tag)."""
    t = Rows("checks [pre]", ["check[s]", "detail"],
             [("attention_mixes_tokens[pre]", "[bold]x[/bold] round_trip[cl100k_base]")])
    text = render(t)
    for value in ("checks [pre]", "check[s]", "attention_mixes_tokens[pre]", "[bold]x[/bold] round_trip[cl100k_base]"):
        assert value in text, f"{value!r} lost its brackets:\n{text}"
    blocks = render(Rows("wide [w]", ["alpha", "beta", "gamma[d]"], [("x[pre]" * 4, "y" * 20, "z" * 20)]), width=40)
    assert "wide [w] [1/1]" in blocks and "x[pre]x[pre]" in blocks and "gamma[d]" in blocks  # one block per row


def test_row_blocks_keep_their_values_readable_when_a_header_is_long() -> None:
    """The bug: in the one-block-per-row form a 30-letter header took the whole width at 40 columns and each
    value was printed one letter per line."""
    text = render(Rows("wide", ["a" * 30, "b" * 30, "c" * 30], [("value here", "y", "z")]), width=40)
    assert "value here" in text, text
    assert max(len(line) for line in text.splitlines()) <= 40
    short = render(Rows("t", ["k", "v", "w"], [("x" * 30, "y" * 30, "z" * 30)]), width=40)
    assert "x" * 30 in short  # short headers: the value column gets the rest of the width
