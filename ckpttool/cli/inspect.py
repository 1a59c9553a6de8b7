"""``ckpttool inspect``: what is inside a checkpoint, without reading tensor data."""

from __future__ import annotations

import sys
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from .entry import app, settings
from .options import Json, Paths, Unsafe, examples
from .render import byte_progress, dumps_json
from .text import printable, write

if TYPE_CHECKING:
    from ..tree import Checkpoint

DEFAULT_LIMIT = 40


class SortBy(str, Enum):
    name = "name"
    size = "size"
    dtype = "dtype"


@app.command(
    short_help="What a checkpoint holds, without reading tensor data.",
    epilog=examples(
        "ckpttool inspect model.safetensors",
        "ckpttool inspect ep3-rank0.pt --filter 'lm_head|embed'",
        "ckpttool inspect hf-model/ --sort size --limit 10",
        "ckpttool inspect ckpt/ --names | grep mlp",
        "ckpttool inspect model.pt --json | jq .num_params    # fields: docs/inspect-json.md",
    ),
)
def inspect(
    paths: Paths,
    json_output: Json = False,
    filter: Annotated[
        str | None,
        typer.Option(
            "--filter",
            metavar="REGEX",
            help="Only tensors/values whose dotted key matches this regex (tree narrowed too).",
        ),
    ] = None,
    stats: Annotated[
        bool, typer.Option("--stats", help="Read the data: min/max/mean/std, NaN/Inf counts.")
    ] = False,
    full: Annotated[
        bool,
        typer.Option(
            "--full", help="Every tensor on its own row (with its file), no limits anywhere."
        ),
    ] = False,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            metavar="N",
            help=f"At most N rows per table; 0: no limit. Default: {DEFAULT_LIMIT} tensor "
            "rows, the values what is left of one screen.",
        ),
    ] = None,
    sort: Annotated[
        SortBy | None,
        typer.Option("--sort", help="Order of the tensor rows (default: as stored)."),
    ] = None,
    names: Annotated[
        bool,
        typer.Option(
            "--names",
            help="Only the tensor names, one per line (for scripts): the names convert "
            "writes and ckpttool.open().keys() gives.",
        ),
    ] = False,
    raw: Annotated[
        bool,
        typer.Option("--raw", help="With --names: the key paths in the file, wrappers and all."),
    ] = False,
    unsafe: Unsafe = False,
) -> None:
    """Show format, model, size, values and security first, then tensors and structure.

    Several separate checkpoints (not the rank files of one) are reported each in turn:
    one section each, or with --json one object per line."""
    from .. import sources
    from ..errors import SeveralCheckpointsError, UnsafeError, UsageError
    from ..inspection import inspect_checkpoints, refused_report

    if limit is not None and limit < 0:
        raise UsageError("--limit must be >= 0 (0: no limit)")
    before = sources.transferred()  # what this command reads, local or remote
    quiet = settings.quiet
    try:
        found = inspect_checkpoints(
            paths,
            unsafe=unsafe,
            filter=filter,
            stats=stats,
            progress=None if quiet else lambda total, what: byte_progress(total, what, True),
            since=before,
        )
    except UnsafeError as exc:
        if json_output:  # the verdict for scripts too: which globals, and why
            write(dumps_json(refused_report(exc, paths, since=before)) + "\n")
        raise
    except SeveralCheckpointsError as exc:
        if len(paths) != 1 or exc.path is None:
            raise
        _list_folder(exc.path, json_output)
        return
    if names and len(found) > 1:
        raise UsageError(
            f"--names lists the tensors of one checkpoint; these are {len(found)} separate ones",
            hint="pass one of them, or use --json (one object per line, each with its files)",
        )
    checkpoints = [(given, ckpt) for given, ckpt, _ in found]
    sections = [report for _, _, report in found]
    if json_output:
        write("".join(dumps_json(report) + "\n" for report in sections))
        return
    if names:
        (_, ckpt), report = checkpoints[0], sections[0]
        shown = _raw_names(report) if raw else _output_names(ckpt, report, filter)
        write("".join(printable(name) + "\n" for name in shown))
        return
    from .inspect_text import Options, inspect_lines
    from .render import Painter

    options = Options(
        full=full,
        limit=0 if full else limit,
        sort=sort.value if sort else None,
        filter=filter,
        width=terminal_width(),
    )
    paint = Painter.for_stdout()
    lines: list[str] = []
    for index, ((given, ckpt), report) in enumerate(zip(checkpoints, sections, strict=True)):
        if len(checkpoints) > 1:
            head = f"== {printable(given)} ({index + 1} of {len(checkpoints)}) =="
            lines += [""] * bool(index) + [paint(head, "bold")]
        lines += inspect_lines(ckpt, report, options, paint)
    write("\n".join(lines) + "\n")


def terminal_width() -> int | None:
    """The columns of the terminal stdout is, that rows fit by shortening; None piped or
    redirected, where every row stays whole (one a line, for grep and awk)."""
    import shutil

    if not sys.stdout.isatty():
        return None
    return max(shutil.get_terminal_size((100, 24)).columns, 40)


def _list_folder(folder: str, json_output: bool) -> None:
    """A folder of several checkpoints: one row each (``--json``: a list of objects)."""
    from ..errors import translate_errors
    from ..formats import folder_checkpoints

    rows = translate_errors(folder_checkpoints)(folder)
    if json_output:
        write(dumps_json(rows) + "\n")
        return
    from .folder_listing import listing_lines

    write("\n".join(listing_lines(folder, rows)) + "\n")


def _raw_names(report: dict) -> list[str]:
    return [".".join(map(str, t["key"])) for t in report["tensors"]]


def _output_names(ckpt: Checkpoint, report: dict, filter: str | None) -> list[str]:
    """The names ``convert`` writes (``--select auto``: the model state dict, its wrapper
    prefix stripped) and ``ckpttool.open().keys()`` gives; where no model state dict is
    found, what ``--select all`` writes: the key paths."""
    import re

    from ..api import flatten_tensors, select_node
    from ..errors import CkptError

    try:
        path, node = select_node(ckpt, "auto", "auto")
    except CkptError:
        return _raw_names(report)
    found = list(flatten_tensors(node, str(path[-1]) if path else ""))
    pattern = re.compile(filter) if filter else None
    return [name for name in found if pattern is None or pattern.search(name)]
