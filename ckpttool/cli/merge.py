"""``ckpttool merge``: per-rank shards or a DCP folder -> one torch.save file."""

from __future__ import annotations

from typing import Annotated

import typer

from .entry import app, settings
from .options import Force, Paths, Quiet, Unsafe, Workers, examples
from .render import human_bytes, progress_factory, stderr_console
from .text import plural, printable


@app.command(
    short_help="Merge per-rank shards or DCP into one torch.save file.",
    epilog=examples(
        "ckpttool merge 'ep3-ba100-rank*.pt' -o ep3-full.pt",
        "ckpttool merge ckpt-dcp/ -o full.pt",
        "ckpttool merge ep3-rank0.pt -o full.pt    # its sibling ranks are found beside it",
        "ckpttool merge 'ep3-ba100-rank*.pt' -o ep3-full.pt --workers 4",
    ),
)
def merge(
    paths: Paths,
    out: Annotated[
        str,
        typer.Option(
            "-o",
            "--out",
            metavar="OUT.pt",
            help="The output .pt file, or DIR/ to write it into that folder.",
            show_default=False,
        ),
    ],
    force: Force = False,
    unsafe: Unsafe = False,
    quiet: Quiet = False,
    workers: Workers = None,
) -> None:
    """Merge per-rank shards or a DCP folder (model AND optimizer) into one torch.save file."""
    from rich.markup import escape  # paths and class names: never markup

    from ..distributed import prints_summary
    from ..merge import merge as merge_checkpoint
    from .convert import check_extension, outcome_note, run_workers

    check_extension(out, "pt", None)
    run_workers(workers, paths)
    if not prints_summary():
        quiet = True

    result = merge_checkpoint(
        paths, out, force=force, unsafe=unsafe, progress=progress_factory(quiet or settings.quiet)
    )
    from .folder_listing import report_removed

    report_removed(result.removed)
    console = stderr_console()
    if result.stand_ins and prints_summary():
        console.print(
            "[yellow]warning[/]: kept as plain-data stand-ins ({'__class__': ...}): "
            + escape(printable(", ".join(result.stand_ins))),
            highlight=False,
        )
    if not (quiet or settings.quiet):
        console.print(
            f"wrote {escape(printable(result.output))} ({plural(result.num_tensors, 'tensor')}, "
            f"{human_bytes(result.nbytes)}){escape(printable(outcome_note(result.outcome)))}"
        )
