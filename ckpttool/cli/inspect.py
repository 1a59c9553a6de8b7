"""``ckpttool inspect``: what is inside a checkpoint, without reading tensor data."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from .app import app, settings
from .options import Json, Paths, Unsafe, examples
from .render import byte_progress, dumps_json
from .text import printable, write

STATS_PROGRESS_BYTES = 256 << 20
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
        int,
        typer.Option("--limit", metavar="N", help="At most N rows per table; 0: no limit."),
    ] = DEFAULT_LIMIT,
    sort: Annotated[
        SortBy | None,
        typer.Option("--sort", help="Order of the tensor rows (default: as stored)."),
    ] = None,
    names: Annotated[
        bool, typer.Option("--names", help="Only the tensor names, one per line (for scripts).")
    ] = False,
    unsafe: Unsafe = False,
) -> None:
    """Show format, model, size, values and security first, then tensors and structure."""
    from .. import sources
    from ..api import read
    from ..errors import UsageError
    from ..formats import gc_paused
    from ..report import inspect_report
    from ..tree import iter_tensors

    if limit < 0:
        raise UsageError("--limit must be >= 0 (0: no limit)")
    before = sources.transferred()  # what this command reads, local or remote
    # no cyclic collection while the report is made either: it would walk the whole tree
    # (a 2048-rank DCP folder: millions of chunks), and there are no cycles to find
    with gc_paused():
        ckpt = read(paths, unsafe=unsafe)
        total = sum(ref.nbytes for _, ref in iter_tensors(ckpt.root)) if stats else 0
        enabled = stats and total > STATS_PROGRESS_BYTES and not settings.quiet
        with byte_progress(total, "reading tensors", enabled) as advance:
            report = inspect_report(
                ckpt, filter=filter, stats=stats, progress=advance, since=before
            )
    if json_output:
        write(dumps_json(report) + "\n")
        return
    if names:
        write("".join(printable(".".join(map(str, t["key"]))) + "\n" for t in report["tensors"]))
        return
    from .inspect_text import Options, inspect_lines
    from .render import Painter

    options = Options(
        full=full,
        limit=0 if full else limit,
        sort=sort.value if sort else None,
        filter=filter,
    )
    write("\n".join(inspect_lines(ckpt, report, options, Painter.for_stdout())) + "\n")
