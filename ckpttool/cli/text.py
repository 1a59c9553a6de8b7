"""Plain-text building blocks of the human output: escaping, units, counts, columns.

Nothing here imports rich or torch: the same lines go to a terminal (coloured by the
caller) and to a pipe, where they never wrap, so ``grep`` sees whole names.
"""

from __future__ import annotations

import os
import sys
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any

from ..sizes import human_bytes

__all__ = ["human_bytes"]  # the CLI's text helpers, the core's byte sizes among them

# C0/C1 controls, format characters (bidi overrides, zero-width), line/paragraph
# separators: shown as escapes, so a key cannot move the cursor, recolour the
# terminal or start a line of its own (a fake "security: ..." line).
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Short dtype names in the tables (the --json output keeps torch's names).
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def printable(text: Any) -> str:
    """``text`` with every control or invisible formatting character escaped."""
    text = str(text)
    if text.isprintable():  # the common case: nothing to do ("isprintable" is C-fast)
        return text
    out = []
    for c in text:
        if c == " " or unicodedata.category(c) not in _ESCAPED_CATEGORIES:
            out.append(c)
        elif c in _NAMED:
            out.append(_NAMED[c])
        elif ord(c) < 0x100:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
    return "".join(out)


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 tensor``, ``2 tensors``, ``1,024 tensors``."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def human_count(n: int) -> str:
    """A parameter count in words, three significant digits: 6.74B, 124M, 84."""
    scales = ((10**3, "K"), (10**6, "M"), (10**9, "B"), (10**12, "T"))
    for i in range(len(scales) - 1, -1, -1):
        scale, suffix = scales[i]
        if n < scale:
            continue
        text = _three_digits(n / scale)
        if float(text) >= 1000 and i + 1 < len(scales):  # 999.96M rounds to 1.00B
            scale, suffix = scales[i + 1]
            text = _three_digits(n / scale)
        return text + suffix
    return str(n)


def _three_digits(value: float) -> str:
    return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f}"


def short_dtype(name: str) -> str:
    return SHORT_DTYPES.get(name, name)


def short_value(value: Any, limit: int = 60) -> str:
    """A plain value for one line: its repr (strings quoted and escaped), cut at ``limit``."""
    text = printable(repr(value))  # an opaque object's is "<opaque pkg.mod.Class>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def cell_width(text: str) -> int:
    """Columns ``text`` takes on a terminal (wide characters count twice)."""
    if text.isascii():
        return len(text)
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def columns(
    rows: Sequence[Sequence[str]], right: Iterable[int] = (), indent: str = "  "
) -> list[str]:
    """Rows as aligned text lines: each column as wide as its widest cell, two spaces
    between columns, nothing cut or wrapped. ``right``: indexes of right-aligned columns."""
    if not rows:
        return []
    right = set(right)
    widths = [max(cell_width(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            pad = " " * (widths[i] - cell_width(cell))
            last = i == len(row) - 1
            cells.append(pad + cell if i in right else cell if last else cell + pad)
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def write(text: str) -> None:
    """Write to stdout; a reader that leaves early (``| head``) ends the command with exit 0.

    click would turn the broken pipe into exit 1, and 1 means "differences" to diff's callers.
    """
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None
