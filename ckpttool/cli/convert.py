"""``ckpttool convert``: selected tensors -> safetensors (file or HF shards), pt or dcp."""

from __future__ import annotations

from typing import Annotated

import typer

from .app import app, handle_errors
from .options import Force, Paths, Quiet, Unsafe
from .render import human_bytes, progress_factory, stderr_console


@app.command()
@handle_errors
def convert(
    paths: Paths,
    to: Annotated[str, typer.Option("--to", help="safetensors, pt or dcp.", show_default=False)],
    out: Annotated[str | None, typer.Option("-o", "--out", help="Output file or folder.")] = None,
    select: Annotated[
        str, typer.Option("--select", help="auto (model state dict), all, or a KEY.PATH.")
    ] = "auto",
    strip_prefix: Annotated[
        str, typer.Option("--strip-prefix", help="auto, none, or a PREFIX to remove from names.")
    ] = "auto",
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="Cast floating-point tensors: float32, float16, bfloat16."),
    ] = None,
    map_location: Annotated[
        str | None,
        typer.Option("--map-location", help="Device of the tensors in a pt output (cpu, cuda:N)."),
    ] = None,
    max_shard_size: Annotated[
        str | None,
        typer.Option("--max-shard-size", help="Write HF shards of at most SIZE (2GB, 500MiB)."),
    ] = None,
    force: Force = False,
    unsafe: Unsafe = False,
    quiet: Quiet = False,
) -> None:
    """Write the selected tensors in another format (sharded inputs are merged)."""
    from ..convert import convert as convert_checkpoint

    result = convert_checkpoint(
        paths,
        to,
        out,
        select=select,
        strip_prefix=strip_prefix,
        dtype=dtype,
        map_location=map_location,
        max_shard_size=max_shard_size,
        force=force,
        unsafe=unsafe,
        progress=progress_factory(quiet),
    )
    if not quiet:
        from rich.markup import escape  # a path is never markup

        stderr_console().print(
            f"wrote {escape(result.output)} ({result.num_tensors} tensors, "
            f"{human_bytes(result.nbytes)})"
        )
