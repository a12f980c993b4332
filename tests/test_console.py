"""The command-line tools' output (``mlarope.tools._console``): plain text off a terminal."""

from __future__ import annotations

import io

import pytest

from mlarope.tools._console import Console, Table, rich_console


def _table() -> Table:
    table = Table(title="results")
    table.add_column("tensor")
    table.add_column("error", justify="right")
    table.add_row("attention out", "1.0e-07")
    table.add_row("dq", "3.25e-06", styles=(None, "red"))
    return table


def test_plain_table_aligns_columns_and_never_wraps():
    out = io.StringIO()
    Console(out).print(_table())
    assert out.getvalue().splitlines() == [
        "results",
        "tensor            error",
        "attention out   1.0e-07",
        "dq             3.25e-06",
    ]


def test_plain_text_ignores_style_and_keeps_long_lines():
    out = io.StringIO()
    line = "x" * 300 + " [5, 16, 11]"
    Console(out).print(line, style="bold")
    assert out.getvalue() == line + "\n"


def test_no_rich_console_off_a_terminal():
    assert rich_console(io.StringIO()) is None
    assert Console(io.StringIO()).rich is None


def test_headerless_table():
    table = Table(title=None, show_header=False)
    table.add_column("key")
    table.add_column("value")
    table.add_row("torch", "2.13.0")
    table.add_row("TRITON_INTERPRET", "1")
    assert table.plain_lines() == ["torch             2.13.0", "TRITON_INTERPRET  1"]


def test_table_rejects_bad_rows_and_justification():
    table = Table()
    table.add_column("a")
    with pytest.raises(ValueError, match="2 cells in a table of 1 columns"):
        table.add_row("x", "y")
    with pytest.raises(ValueError, match="'center'"):
        table.add_column("b", justify="center")


def test_plain_progress_reports_tenths_and_the_end():
    out = io.StringIO()
    with Console(out).progress("trials", 20) as advance:
        for _ in range(20):
            advance(1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10
    assert [line.split(" (")[0] for line in lines[:2]] == ["trials: 2 of 20", "trials: 4 of 20"]
    assert lines[-1].startswith("trials: 20 of 20 (")


def test_plain_progress_cut_short_says_how_far():
    out = io.StringIO()
    with Console(out).progress("trials", 100) as advance:
        advance(3)
    assert out.getvalue().startswith("trials: 3 of 100 (")


def test_plain_progress_of_nothing_prints_nothing():
    out = io.StringIO()
    with Console(out).progress("racy control", 0):
        pass
    assert out.getvalue() == ""
