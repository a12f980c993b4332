"""Output of the command-line tools: rich tables and progress bars on a terminal when rich is
installed (``pip install mlarope[bench]``), plain text otherwise.

Plain text is also what a pipe or a log file gets, rich or not: rich wraps lines at the
terminal width it guesses (80 columns without a terminal), which broke the demo's header in
logs. Plain lines are never wrapped.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO


def rich_console(stream: TextIO | None = None):
    """A ``rich.console.Console`` on ``stream`` (default stdout) when rich is installed and the
    stream is a terminal; else None."""
    stream = sys.stdout if stream is None else stream
    if not _isatty(stream):
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(file=stream)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Table:
    """Rows of text cells under a title; rendered by :class:`Console`."""

    def __init__(self, title: str | None = None, *, show_header: bool = True) -> None:
        self.title = title
        self.show_header = show_header
        self.columns: list[tuple[str, str]] = []  # (header, "left" | "right")
        self.rows: list[tuple[tuple[str, str | None], ...]] = []  # (text, style) per cell

    def add_column(self, header: str, *, justify: str = "left") -> None:
        if justify not in ("left", "right"):
            raise ValueError(f"justify must be 'left' or 'right', got {justify!r}")
        self.columns.append((header, justify))

    def add_row(self, *cells: str, styles: tuple[str | None, ...] | None = None) -> None:
        """One row; ``styles``: a rich style per cell (``"red"``), shown on a terminal only."""
        columns = len(self.columns) or len(cells)
        if len(cells) != columns:
            raise ValueError(f"a row of {len(cells)} cells in a table of {columns} columns")
        styles = styles or (None,) * len(cells)
        self.rows.append(tuple(zip(cells, styles, strict=True)))

    def plain_lines(self) -> list[str]:
        """The table as lines of text, columns separated by two spaces, no line wrapping."""
        justify = [j for _, j in self.columns] or ["left"] * len(self.rows[0] if self.rows else 0)
        body = [[text for text, _ in row] for row in self.rows]
        if self.show_header and self.columns:
            body.insert(0, [h for h, _ in self.columns])
        widths = [max((len(r[i]) for r in body), default=0) for i in range(len(justify))]
        lines = [self.title] if self.title else []
        for row in body:
            cells = [
                text.rjust(w) if j == "right" else text.ljust(w)
                for text, w, j in zip(row, widths, justify, strict=True)
            ]
            lines.append("  ".join(cells).rstrip())
        return lines

    def to_rich(self):
        from rich.table import Table as RichTable
        from rich.text import Text

        table = RichTable(title=self.title, show_header=self.show_header)
        for header, justify in self.columns or [("", "left")] * len(self.rows[0]):
            table.add_column(header, justify=justify)
        for row in self.rows:
            table.add_row(*(Text(text, style=style or "") for text, style in row))
        return table


class Console:
    """Prints text and tables: through rich on a terminal (when installed), plain otherwise."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = sys.stdout if stream is None else stream
        self.rich = rich_console(self.stream)

    def print(self, item: str | Table, *, style: str | None = None) -> None:
        """Print a line of text (``style``: a rich style such as ``"bold red"``, terminal only;
        no markup is read from the text) or a :class:`Table`."""
        if self.rich is not None:
            from rich.text import Text

            self.rich.print(item.to_rich() if isinstance(item, Table) else Text(item, style=style))
            return
        lines = item.plain_lines() if isinstance(item, Table) else [item]
        for line in lines:
            print(line, file=self.stream, flush=True)

    @contextlib.contextmanager
    def progress(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """A progress report for ``total`` steps, yielding ``advance(steps)``: a rich bar on a
        terminal; plain, a line at every tenth of the way and one at the end (none for no
        steps)."""
        if self.rich is not None:
            from rich.progress import Progress

            with Progress(console=self.rich, transient=False) as bar:
                task = bar.add_task(description, total=total)
                yield lambda steps=1: bar.advance(task, steps)
            return
        report = _PlainProgress(self, description, total)
        yield report.advance
        if total > 0:
            report.line()


class _PlainProgress:
    def __init__(self, console: Console, description: str, total: int) -> None:
        self.console, self.description, self.total = console, description, total
        self.done, self.reported, self.start = 0, 0, time.perf_counter()

    def advance(self, steps: int = 1) -> None:
        self.done += steps
        tenth = 10 * self.done // max(1, self.total)
        if tenth > self.reported and self.done < self.total:
            self.reported = tenth
            self.line()

    def line(self) -> None:
        seconds = time.perf_counter() - self.start
        self.console.print(f"{self.description}: {self.done} of {self.total} ({seconds:.1f} s)")
