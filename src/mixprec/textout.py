"""Console output that fits the width it is printed at and never truncates.

A table drawn by rich squeezes its columns to the console's width and cuts what does not fit
(`preci…`, `transf…`). `FittedTable` instead measures its cells when it is printed, leaves out
its least useful columns until the rest fit (saying which, and where the full table is) and
wraps, never cuts, what is still too wide. `console()` gives the width to fit: the terminal's
(rich honours ``COLUMNS``), or, written to a file or a pipe, ``COLUMNS`` when set and
otherwise `FILE_WIDTH`, at which a table keeps every column and wraps its cells between words,
never inside one, so that a name in it can still be searched for.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

__all__ = [
    "Column",
    "FittedTable",
    "console",
]

# written to a file or a pipe without COLUMNS: the width tables are wrapped to (wider where a
# column's longest word needs it); prose is not wrapped
FILE_WIDTH = 120


class FileConsole(Console):
    """A console writing to a file or a pipe: its tables keep every column and break no
    word, growing past the width when their longest words need it (nothing is cropped)."""

    def print(self, *objects: Any, crop: bool = False, **kwargs: Any) -> None:
        super().print(*objects, crop=crop, **kwargs)


def console(stderr: bool = False) -> Console:
    """A console for the CLI's output: the terminal's width on a terminal; in a file or a
    pipe, ``COLUMNS`` when it is set, else a `FileConsole` of `FILE_WIDTH`."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty() or os.environ.get("COLUMNS", "").isdigit():
        return Console(stderr=stderr)
    return FileConsole(stderr=stderr, width=FILE_WIDTH)


@dataclass(frozen=True)
class Column:
    """A table column: its header, justification, and how much it matters (`keep`: higher
    stays longer when the width runs out; `None`: never left out)."""

    header: str
    justify: str = "right"
    keep: int | None = None


def _width(cell: str) -> int:
    return Text.from_markup(cell).cell_len


@dataclass
class FittedTable:
    """A rich table that fits the console it is printed on: columns are left out, least
    useful first, until the rest fit, and named in a note under it (`full` says where the
    whole table is); what still does not fit wraps inside its cell."""

    title: str
    columns: Sequence[Column]
    rows: list[tuple[list[str], str | None]] = field(default_factory=list)
    full: str = ""

    def add_row(self, cells: Sequence[str], style: str | None = None) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"a row of {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append((list(cells), style))

    def natural(self, i: int) -> int:
        """The cells column `i` needs: its widest cell or header word (headers wrap)."""
        header = max(len(w) for w in self.columns[i].header.split())
        return max([header, *(_width(cells[i]) for cells, _ in self.rows)])

    def shown(self, width: int) -> list[int]:
        """The indices of the columns that fit in `width` cells."""
        natural = self.natural
        keep = list(range(len(self.columns)))
        droppable = sorted(
            (i for i, c in enumerate(self.columns) if c.keep is not None),
            key=lambda i: (self.columns[i].keep, -i),
        )
        # a rich table with the default box: one border plus two spaces of padding per column
        while sum(natural(i) + 3 for i in keep) + 1 > width and droppable:
            keep.remove(droppable.pop(0))
        return keep

    def table(self, width: int) -> tuple[Table, list[str]]:
        """The rich table for `width` cells and the headers of the columns left out."""
        keep = self.shown(width)
        # each column as wide as its cells; the room left goes to headers, left to right, so
        # that they wrap as little as possible. A header wrapped to its column's width means
        # rich need not shrink any column (it would shrink them all alike, and cut); cells
        # that still do not fit wrap.
        widths = {i: self.natural(i) for i in keep}
        room = width - sum(w + 3 for w in widths.values()) - 1
        for i in keep:
            grow = max(0, min(len(self.columns[i].header) - widths[i], room))
            widths[i] += grow
            room -= grow
        table = Table(title=self.title)
        for i in keep:
            c = self.columns[i]
            header = textwrap.fill(c.header, widths[i], break_long_words=False)
            table.add_column(header, justify=c.justify, overflow="fold")  # type: ignore[arg-type]
        for cells, style in self.rows:
            table.add_row(*(cells[i] for i in keep), style=style)
        left = [c.header for i, c in enumerate(self.columns) if i not in keep]
        return table, left

    def whole(self, width: int) -> Table:
        """Every column, in `width` cells or as few more as its longest words need: the widest
        columns are narrowed first, none below its longest word, and cells wrap between
        words."""
        shown = list(range(len(self.columns)))
        widths = [self.natural(i) for i in shown]
        floors = [
            max(
                [len(w) for w in c.header.split()]
                + [
                    len(w)
                    for cells, _ in self.rows
                    for w in Text.from_markup(cells[i]).plain.split()
                ]
            )
            for i, c in enumerate(self.columns)
        ]
        while sum(w + 3 for w in widths) + 1 > width:
            narrowable = [i for i in shown if widths[i] > floors[i]]
            if not narrowable:
                break
            i = max(narrowable, key=lambda i: widths[i])
            widths[i] -= 1
        table = Table(title=self.title)
        for c, w in zip(self.columns, widths, strict=True):
            table.add_column(c.header, justify=c.justify, overflow="fold", width=w)  # type: ignore[arg-type]
        for cells, style in self.rows:
            table.add_row(*cells, style=style)
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if isinstance(console, FileConsole):
            yield from console.render(self.whole(options.max_width), options.update_width(1 << 16))
            return
        table, left = self.table(options.max_width)
        yield table
        yield from self._note(left)

    def _note(self, left: list[str]) -> Iterator[Text]:
        if left:
            where = f"; {self.full}" if self.full else ""
            yield Text(f"(left out at this width: {', '.join(left)}{where})", style="dim")
