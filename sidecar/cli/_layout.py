"""How the CLI fits what it prints to the terminal's width. A figure, id or path is never cut, folded
or ellipsised: prose wraps between words, and a table that does not fit is split into tables that
repeat its key columns, or laid out as one block of ``header: value`` lines per row.

Every table goes through ``print_table`` and every line of prose through ``print_text``; a token
longer than the whole width (a deep path) is printed whole on its own line, the only line that may
be wider than the terminal.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Union

from rich import box
from rich.console import Console, Group, RenderableType
from rich.cells import cell_len
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

Cell = Union[str, Text]  # a str is plain text (never markup): a value cannot style the output
WIDE = 10_000  # a --wide table is as wide as its longest value
MAX_TABLES = 2  # a table split into more parts than this reads better as one block per row
INDENT = "  "
_MEASURE = Console(width=WIDE)  # measures and wraps; never prints
# Control characters in a value (a capture's label, a file name) are shown as escapes, never sent to
# the terminal: ESC, CR or BEL there would recolour, overwrite or retitle it. Line breaks stay.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\n\t"}


def printable(text: str) -> str:
    """``text`` with its control characters (but line breaks and tabs) written as ``\\xNN``."""
    return text.translate(_CONTROL)


@dataclass(frozen=True)
class Column:
    """A column: its header, how its values align, and whether they are ``prose`` (a reason, a
    message: wrapped between words) or figures, ids and paths (each kept on one line). Columns of
    one ``group`` stay in one table when a table is split, where a split allows it."""

    header: str
    justify: Literal["left", "right"] = "left"
    prose: bool = False
    group: str = ""


def _text(cell: Cell) -> Text:
    return cell.copy() if isinstance(cell, Text) else Text(printable(cell))


def _longest_word(text: str) -> int:
    return max(map(cell_len, text.split()), default=0)


def _longest_line(text: str) -> int:
    return max(map(cell_len, text.split("\n")), default=0)


@dataclass(frozen=True)
class _Fit:
    """One column's width bounds: ``least`` keeps every value (and header word) whole, ``natural``
    puts each value and the header on one line."""

    least: int
    natural: int


def _fit(column: Column, cells: Sequence[Text]) -> _Fit:
    values = [c.plain for c in cells]
    natural = max([_longest_line(column.header), *map(_longest_line, values)])
    words = [_longest_word(column.header), *(_longest_word(v) if column.prose else _longest_line(v) for v in values)]
    return _Fit(least=max(words + [1]), natural=max(natural, 1))


def _table(columns: Sequence[Column], widths: Sequence[int], rows: Sequence[Sequence[Text]]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1))
    for column, width in zip(columns, widths):
        # widths hold every word whole, so "fold" never breaks one: it only applies past them
        table.add_column(column.header, justify=column.justify, width=width, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


@functools.lru_cache(maxsize=None)
def _chrome(n: int) -> int:
    """Width the table adds to its columns' content: separators and padding."""
    probe = _table([Column("")] * n, [1] * n, [])
    return Measurement.get(_MEASURE, _MEASURE.options.update_width(WIDE), probe).maximum - n


def _widths(fits: Sequence[_Fit], prose: Sequence[bool], width: int) -> list[int] | None:
    """Each column at least its ``least``, then grown towards ``natural`` (figures first, prose
    last) while the table fits ``width``; ``None`` when even the least does not fit."""
    widths = [f.least for f in fits]
    slack = width - _chrome(len(fits)) - sum(widths)
    if slack < 0:
        return None
    for last in (False, True):
        for i, f in enumerate(fits):
            if prose[i] is last:
                grow = min(slack, f.natural - widths[i])
                widths[i] += grow
                slack -= grow
    return widths


def _parts(columns: Sequence[Column], fits: Sequence[_Fit], keys: int, width: int) -> list[list[int]] | None:
    """Column indices of each table, the fewest tables that fit (at most ``MAX_TABLES``), each
    repeating the key columns; of the splits into that many, the one that splits fewest groups, then
    the one whose headers wrap least, then the most even. ``None`` when none fits."""
    rest = list(range(keys, len(columns)))

    def shortfall(part: list[int]) -> int | None:
        idx = list(range(keys)) + part
        widths = _widths([fits[i] for i in idx], [columns[i].prose for i in idx], width)
        return None if widths is None else sum(fits[i].natural - w for i, w in zip(idx, widths))

    for n in range(1, MAX_TABLES + 1):
        best: tuple[tuple[int, int, int], list[list[int]]] | None = None
        for cuts in itertools.combinations(range(1, len(rest)), n - 1):
            split = [rest[a:b] for a, b in zip((0, *cuts), (*cuts, len(rest)))]
            short = [shortfall(part) for part in split]
            if any(x is None for x in short):
                continue
            sizes = [sum(fits[i].natural for i in part) for part in split]
            torn = sum(bool(columns[rest[c]].group) and columns[rest[c]].group == columns[rest[c - 1]].group
                       for c in cuts)
            cost = (torn, sum(x or 0 for x in short), max(sizes) - min(sizes))
            if best is None or cost < best[0]:
                best = (cost, split)
        if best is not None:
            return [list(range(keys)) + part for part in best[1]]
    return None


def wrap(text: Cell, width: int, indent: str = "", hang: str | None = None) -> list[Text]:
    """``text`` wrapped between words into lines of at most ``width`` cells, the first starting with
    ``indent`` and the others with ``hang`` (default: ``indent``). A word longer than the room left
    gets a line of its own, whole, its indent shortened as far as it needs (to none for a word
    wider than the terminal)."""
    hang = indent if hang is None else hang
    lines: list[Text] = []
    for paragraph in _text(text).split("\n", allow_blank=True):
        first = width - cell_len(hang if lines else indent)
        for piece in paragraph.divide(_breaks(paragraph.plain, first, width - cell_len(hang))):
            piece.rstrip()
            lead = hang if lines else indent
            lines.append(Text(lead[: max(0, width - piece.cell_len)]) + piece)
    return lines


def _breaks(plain: str, first: int, rest: int) -> list[int]:
    """Where to break ``plain`` into lines of at most ``first`` cells, then ``rest``: only between
    words, so a word longer than its line gets a line of its own, whole (rich's wrapping folds it)."""
    breaks, used, words = [], cell_len(plain) - cell_len(plain.lstrip()), 0
    for word in re.finditer(r"\S+\s*", plain):
        if words and used + cell_len(word.group().rstrip()) > (rest if breaks else first):
            breaks.append(word.start())
            used = words = 0
        used += cell_len(word.group())
        words += 1
    return breaks


def _record(columns: Sequence[Column], row: Sequence[Text], keys: int, width: int) -> list[Text]:
    """One row as lines: its key values as a heading, then ``header: value`` pairs packed on lines
    (a pair that does not fit a line starts one; a value that does not fit after its header goes
    on its own line; prose wraps)."""

    def pair(column: Column, value: Text) -> Text:
        return Text(f"{column.header}: ") + value if column.header else value

    heading = Text("  ").join(pair(c, v) for c, v in zip(columns[:keys], row[:keys]))
    lines = wrap(heading, width, hang=INDENT)
    line = Text(INDENT)
    for column, value in zip(columns[keys:], row[keys:]):
        if not value.plain:
            continue
        item = pair(column, value)
        alone = column.prose or "\n" in value.plain or len(INDENT) + item.cell_len > width
        if alone or line.cell_len + 2 + item.cell_len > width:
            if line.plain.strip():
                lines.append(line)
            line = Text(INDENT)
        if not alone:
            line = line + (Text("  ") if line.plain.strip() else Text()) + item
            continue
        if column.prose and "\n" not in value.plain:
            lines += wrap(item, width, indent=INDENT, hang=INDENT * 2)
        else:  # a header, then each value line on its own, whole
            lines.append(Text(INDENT + f"{column.header}:"))
            for part in value.split("\n"):
                lines += wrap(part, width, indent=INDENT * 2, hang=INDENT * 3)
    if line.plain.strip():
        lines.append(line)
    return lines


def render_table(title: Cell | None, columns: Sequence[Column | str], rows: Sequence[Sequence[Cell]], *,
                 width: int, keys: int = 1, empty: str | None = None) -> Group:
    """``rows`` under ``columns`` for a terminal ``width`` cells wide: one table when it fits, else
    tables of fewer columns each repeating the first ``keys`` columns (at most ``MAX_TABLES``), else
    one block of ``header: value`` lines per row. ``empty`` is said when there are no rows."""
    cols = [c if isinstance(c, Column) else Column(c) for c in columns]
    body = [[_text(c) for c in row] for row in rows]
    keys = max(1, min(keys, len(cols)))
    out: list[RenderableType] = wrap(title, width) if title is not None else []
    if not body:
        if empty:
            out += wrap(empty, width, indent=INDENT)
        return Group(*out)
    fits = [_fit(c, [row[i] for row in body]) for i, c in enumerate(cols)]
    parts = _parts(cols, fits, keys, width)
    if parts is not None:
        for n, part in enumerate(parts):
            widths = _widths([fits[i] for i in part], [cols[i].prose for i in part], width)
            assert widths is not None  # _parts checked it
            if n:
                out.append(Text())
            out.append(_table([cols[i] for i in part], widths, [[row[i] for i in part] for row in body]))
        return Group(*out)
    for row in body:
        out += _record(cols, row, keys, width)
    return Group(*out)


def print_table(console: Console, title: Cell | None, columns: Sequence[Column | str], rows: Sequence[Sequence[Cell]],
                *, keys: int = 1, empty: str | None = None, wide: bool = False) -> None:
    """Print ``render_table`` for ``console``'s width (``wide``: one table at its natural width,
    whatever the terminal's, for ``--wide``)."""
    out = Console(width=WIDE, file=console.file, color_system=console.color_system, highlight=False) if wide else console
    out.print(render_table(title, columns, rows, width=out.width, keys=keys, empty=empty), crop=False,
              overflow="ignore", highlight=False)


def print_text(console: Console, text: Cell, *, indent: str = "", hang: str | None = None, markup: bool = True) -> None:
    """A line of prose, wrapped between words to ``console``'s width (``hang``: the indent of the
    lines after the first). A ``str`` is rich markup unless ``markup`` is off; escape values in it."""
    if isinstance(text, str):
        text = Text.from_markup(printable(text)) if markup else Text(printable(text))
    for line in wrap(text, console.width, indent=indent, hang=hang):
        console.print(line, soft_wrap=True, highlight=False)
