"""Option types shared by several commands."""

from __future__ import annotations

from typing import Annotated

import typer

Paths = Annotated[
    list[str],
    typer.Argument(
        metavar="PATH...",
        help="A file, a folder (DCP, sharded safetensors, HF model), per-rank files or a "
        "quoted glob.",
        show_default=False,
    ),
]
Unsafe = Annotated[
    bool,
    typer.Option(
        "--unsafe",
        help="Accept pickles that reference dangerous globals. Only for files you trust.",
    ),
]
Force = Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing output.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object for scripts.")]
# The model selection, as convert and diff take it (the core checks the values).
Select = Annotated[
    str,
    typer.Option(
        "--select",
        metavar="auto|all|KEY.PATH",
        help="auto (the model state dict), all (every tensor: optimizer state too), or a KEY.PATH.",
    ),
]
StripPrefix = Annotated[
    str,
    typer.Option(
        "--strip-prefix",
        metavar="auto|none|PREFIX",
        help="auto, none, or a PREFIX to remove from names.",
    ),
]
Quiet = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress bar (also before the command).")
]
Workers = Annotated[
    int | None,
    typer.Option(
        "--workers",
        metavar="N",
        help="Write with N processes on this machine (torch's launcher; as under torchrun).",
        show_default=False,
    ),
]


def examples(*lines: str) -> str:
    """An examples section for a command's --help, one command per line as written
    (click rewraps paragraphs unless they start with its \\b marker)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)
