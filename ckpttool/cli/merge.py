"""``ckpttool merge``: per-rank shards or a DCP folder -> one torch.save file."""

from __future__ import annotations

from typing import Annotated

import typer

from .app import app, handle_errors
from .options import Force, Paths, Quiet, Unsafe
from .render import human_bytes, progress_factory, stderr_console


@app.command()
@handle_errors
def merge(
    paths: Paths,
    out: Annotated[
        str,
        typer.Option(
            "-o",
            "--out",
            help="The output .pt file, or DIR/ to write it there.",
            show_default=False,
        ),
    ],
    force: Force = False,
    unsafe: Unsafe = False,
    quiet: Quiet = False,
) -> None:
    """Merge every sharded tensor (model AND optimizer) into one torch.save file."""
    from rich.markup import escape  # paths and class names: never markup

    from ..merge import merge as merge_checkpoint

    result = merge_checkpoint(
        paths, out, force=force, unsafe=unsafe, progress=progress_factory(quiet)
    )
    console = stderr_console()
    if result.stand_ins:
        console.print(
            "[yellow]warning[/]: kept as plain-data stand-ins ({'__class__': ...}): "
            + escape(", ".join(result.stand_ins)),
            highlight=False,
        )
    if not quiet:
        console.print(
            f"wrote {escape(result.output)} ({result.num_tensors} tensors, "
            f"{human_bytes(result.nbytes)})"
        )
