"""``ckpttool inspect FOLDER`` of a folder that holds several checkpoints: one row each."""

from __future__ import annotations

from typing import Any

from .text import columns, human_bytes, plural, printable

# a name longer than this goes whole on a line of its own, the row's cells below it:
# the table stays within 100 columns
MAX_NAME_CELL = 36


def listing_lines(folder: str, rows: list[dict[str, Any]]) -> list[str]:
    """The human view of :func:`ckpttool.formats.folder_checkpoints`'s rows."""
    head = [  # the path whole on its own line, however long
        printable(folder),
        f"a folder of {plural(len(rows), 'checkpoint')} (the other commands take one of them)",
        "",
    ]
    table: list[list[str]] = [["name", "format", "world", "size", "epoch", "step", "complete"]]
    long_names: dict[int, str] = {}
    for row in rows:
        name = printable(row["name"])
        if len(name) > MAX_NAME_CELL:
            long_names[len(table)] = name
            name = ""
        table.append(
            [
                name,
                row["format"] or "?",
                "-" if row["world_size"] is None else str(row["world_size"]),
                human_bytes(row["nbytes"]),
                "-" if row["epoch"] is None else str(row["epoch"]),
                "-" if row["step"] is None else str(row["step"]),
                "yes" if row["complete"] else f"no: {printable(row['missing'])} missing",
            ]
        )
    lines = columns(table, right=(2, 3, 4, 5))
    out = []
    for i, line in enumerate(lines):
        if i in long_names:
            out.append(f"  {long_names[i]}")
        out.append(line)
    return head + out


def report_removed(removed: list[Any]) -> None:
    """One stderr line for the temp outputs of killed runs that a write removed
    (:class:`ckpttool.targets.StaleTemp`); nothing when there were none."""
    if not removed:
        return
    import sys

    total = human_bytes(sum(t.nbytes for t in removed))
    names = ", ".join(f"{printable(t.path)} (pid {t.pid})" for t in removed)
    what = "a temporary file" if len(removed) == 1 else f"{len(removed)} temporary files"
    sys.stderr.write(f"ckpttool: removed {what} of killed runs ({total}): {names}\n")
    sys.stderr.flush()
