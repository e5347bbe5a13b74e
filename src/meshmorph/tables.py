"""Tables a person can read, at any width: every table a subcommand prints is described by its
columns (``Column``: header, a shorter header, which cells may wrap, which column may be left out
and in what order) and ``print_table`` fits it to the console's width.

The reports' console (``report_console``) is ``TABLE_WIDTH`` columns wide, on a terminal and
piped to a file alike (narrower where the terminal is), and wraps plain text there; with
``--wide`` (``report_console(wide=True)``) it is as wide as any table, so every column is shown
with its full header and nothing wraps. To fit, ``print_table`` tries, in order: the full table;
short headers and short cells; leaving out the droppable columns, the highest ``drop`` first;
and at last wrapping cells. A cell is never cut, and a line saying which columns were left out
follows a table that left some out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from rich import box as boxes
from rich.box import Box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

TABLE_WIDTH = 100
"""Columns a report fits unless ``--wide`` is given."""

WIDE_WIDTH = 10_000
"""Width of a ``--wide`` console: wider than any table, so none is fitted or wrapped."""

Justify = Literal["left", "center", "right"]


@dataclass(frozen=True)
class Column:
    """One column of a table and how it gives way when the table is too wide."""

    header: str
    """Header shown in the full table (``--wide``, or wherever the table fits as it is)."""
    short: str | None = None
    """Shorter header used when the full table does not fit; None keeps ``header``."""
    justify: Justify = "right"
    """Alignment of the header and the cells."""
    drop: int = 0
    """0: never left out; otherwise the column may be left out to fit, the highest first (ties:
    the rightmost first). Key figures (degrees, step time, MFU) keep 0."""
    wrap: int | None = None
    """When fitting, cells wider than this many columns wrap onto more lines (free text, long
    names); None keeps each cell on one line."""
    abbreviate: Callable[[str], str] | None = None
    """Shortens a cell once short headers are used (``interleaved v2`` -> ``intl v2``); None
    keeps cells as they are."""


@dataclass
class FittedTable:
    """A table built to fit a width, and the headers of the columns it left out."""

    table: Table
    """The rich table to print."""
    left_out: list[str]
    """Full headers of the columns left out to fit, in table order."""
    width: int
    """Columns the table takes when printed (its natural width, capped by the budget)."""


def report_console(wide: bool = False) -> Console:
    """The console of the reports: ``TABLE_WIDTH`` columns (or the terminal's, where narrower)
    on a terminal and piped alike, plain text wrapping there; with ``wide``, wider than any table
    and plain text never wrapped, so nothing is abbreviated, left out or cut."""
    if wide:
        return Console(highlight=False, soft_wrap=True, width=WIDE_WIDTH)
    console = Console(highlight=False)
    console.width = min(console.width, TABLE_WIDTH) if console.is_terminal else TABLE_WIDTH
    return console


def _build(columns: Sequence[Column], rows: Sequence[Sequence[str]], keep: list[int], *,
           short: bool, fitting: bool, title: str | None, caption: str | None, box: Box,
           edges: bool) -> Table:
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left",
                  box=box, show_edge=edges, pad_edge=edges)
    for i in keep:
        col = columns[i]
        table.add_column(col.short if short and col.short else col.header, justify=col.justify,
                         overflow="fold", max_width=col.wrap if fitting else None)
    for row in rows:
        table.add_row(*((columns[i].abbreviate(row[i]) if short and columns[i].abbreviate
                         else row[i]) for i in keep))
    return table


def natural_width(console: Console, table: Table) -> int:
    """Columns ``table`` takes when nothing limits it."""
    return Measurement.get(console, console.options.update_width(WIDE_WIDTH), table).maximum


def fit_table(console: Console, columns: Sequence[Column], rows: Sequence[Sequence[str]], *,
              title: str | None = None, caption: str | None = None,
              box: Box = boxes.HEAVY_HEAD, edges: bool = True) -> FittedTable:
    """``rows`` (one string per column, rich markup allowed) as a table that fits
    ``console.width``: as it is where it fits, else short headers and cells, then without the
    droppable columns (highest ``drop`` first), then with wrapped cells; never a cut cell."""
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a row has {len(row)} cells for {len(columns)} columns")
    budget = console.width
    keep = list(range(len(columns)))
    kwargs = {"title": title, "caption": caption, "box": box, "edges": edges}
    table = _build(columns, rows, keep, short=False, fitting=False, **kwargs)  # type: ignore[arg-type]
    width = natural_width(console, table)
    if width <= budget:
        return FittedTable(table, [], width)
    droppable = sorted((i for i, c in enumerate(columns) if c.drop > 0),
                       key=lambda i: (columns[i].drop, i), reverse=True)
    left_out: list[int] = []
    while True:
        table = _build(columns, rows, keep, short=True, fitting=True, **kwargs)  # type: ignore[arg-type]
        width = natural_width(console, table)
        if width <= budget or not droppable:
            break
        drop = droppable.pop(0)
        keep.remove(drop)
        left_out.append(drop)
    return FittedTable(table, [columns[i].header for i in sorted(left_out)], min(width, budget))


def print_table(console: Console, columns: Sequence[Column], rows: Sequence[Sequence[str]], *,
                title: str | None = None, caption: str | None = None,
                box: Box = boxes.HEAVY_HEAD, edges: bool = True) -> FittedTable:
    """Fit the table to ``console`` (``fit_table``), print it and, where columns were left out,
    a line naming them. ``edges=False`` leaves out the outer border and padding (a compact
    listing)."""
    fitted = fit_table(console, columns, rows, title=title, caption=caption, box=box,
                       edges=edges)
    console.print(fitted.table)
    if fitted.left_out:
        console.print(f"[dim](left out to fit {console.width} columns: "
                      f"{', '.join(fitted.left_out)}; --wide shows them)[/]")
    return fitted
