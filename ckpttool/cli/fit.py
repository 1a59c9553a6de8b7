"""Tables and lines of the human views within :data:`MAX_WIDTH` columns.

Nothing is wrapped by a terminal: a name too long for its column goes whole on a line of
its own, above its row (so ``grep`` still finds it whole); a column of free text (a value)
is cut with ``…``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .text import cell_width, columns

MAX_WIDTH = 100
MIN_CUT = 16  # a cut column keeps at least this many characters
INDENT = "  "


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` columns, ``…`` where it was cut."""
    if cell_width(text) <= width:
        return text
    out = ""
    for char in text:
        if cell_width(out + char) > width - 1:
            break
        out += char
    return out + "…"


def fit_columns(
    table: Sequence[Sequence[str]],
    right: Iterable[int] = (),
    shrink: int | None = None,
    *,
    header: bool = True,
) -> list[str]:
    """:func:`~.text.columns` within :data:`MAX_WIDTH`: column ``shrink`` cut to fit, then
    names (column 0) too long for what is left each on a line of their own. ``header``:
    the first row is the column names (never cut or moved)."""
    rows = [list(row) for row in table]
    if not rows:
        return []
    first = 1 if header else 0
    count = len(rows[0])
    widths = [max(cell_width(row[i]) for row in rows) for i in range(count)]
    gaps = len(INDENT) + 2 * (count - 1)
    if shrink is not None:
        others = sum(w for i, w in enumerate(widths) if i != shrink)
        room = max(MIN_CUT, MAX_WIDTH - gaps - min(others, MAX_WIDTH // 2))
        for row in rows[first:]:
            row[shrink] = cut(row[shrink], room)
        widths[shrink] = max(cell_width(row[shrink]) for row in rows)
    name_room = MAX_WIDTH - gaps - sum(widths[1:])
    name_room = max(name_room, cell_width(rows[0][0]) if header else MIN_CUT)
    long_names: dict[int, str] = {}
    for i, row in enumerate(rows[first:], start=first):
        if cell_width(row[0]) > name_room:
            long_names[i] = row[0]
            row[0] = ""
    lines = columns(rows, right=right, indent=INDENT)
    out = []
    for i, line in enumerate(lines):
        if i in long_names:
            out.append(INDENT + long_names[i])
        out.append(line)
    return out
