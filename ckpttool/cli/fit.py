"""Tables and lines of the human views: a row is never broken over two lines.

Piped (no terminal), a table's rows are whole, one a line, whitespace between the
columns, so ``grep`` and ``awk`` find every name and column. On a terminal they fit its
width: a name too long for what is left is shortened in the middle (``model.layers.0…
q_proj.weight``: its start and its end are what tell names apart); a column of free text
(a value) is cut with ``…``, on a terminal and piped alike.
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


def cut_middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` columns, its middle replaced by ``…`` where it was cut."""
    if cell_width(text) <= width:
        return text
    head, tail = "", ""
    chars = list(text)
    while chars and cell_width(head) + cell_width(tail) + 1 < width:
        if cell_width(head) <= cell_width(tail):
            head += chars.pop(0)
        else:
            tail = chars.pop() + tail
    while head and cell_width(head) + cell_width(tail) + 1 > width:
        head = head[:-1]
    return head + "…" + tail


def fit_columns(
    table: Sequence[Sequence[str]],
    right: Iterable[int] = (),
    shrink: int | None = None,
    *,
    header: bool = True,
    width: int | None = MAX_WIDTH,
) -> list[str]:
    """:func:`~.text.columns`, a line a row: column ``shrink`` (free text) cut to fit
    :data:`MAX_WIDTH`, then, within ``width`` (a terminal's), names (column 0) too long
    for what is left shortened in the middle; ``width`` None (piped): names whole.
    ``header``: the first row is the column names (never cut)."""
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
    if width is None:
        return columns(rows, right=right, indent=INDENT)
    name_room = width - gaps - sum(widths[1:])
    name_room = max(name_room, cell_width(rows[0][0]) if header else MIN_CUT, MIN_CUT)
    for row in rows[first:]:
        row[0] = cut_middle(row[0], name_room)
    return columns(rows, right=right, indent=INDENT)
