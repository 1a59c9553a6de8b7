"""``ckpttool convert``: selected tensors -> safetensors (file or HF shards), pt or dcp."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from .entry import app, fail, settings
from .options import Force, Paths, Quiet, Select, StripPrefix, Unsafe, Workers, examples
from .render import human_bytes, progress_factory, stderr_console

# What an output's file name says it is: refused when --to says otherwise.
EXTENSIONS = {
    ".safetensors": "safetensors",
    ".pt": "pt",
    ".pth": "pt",
    ".bin": "pt",
    ".ckpt": "pt",
    ".distcp": "dcp",
}


def _complete(name: str) -> Any:
    """Shell completion of an option's choices, ``ckpttool.convert``'s constant ``name``
    (imported when completing only: --help stays fast; the core checks the value)."""

    def complete(incomplete: str) -> list[str]:
        from .. import convert as core

        return [c for c in getattr(core, name) if c.startswith(incomplete)]

    return complete


@app.command(
    short_help="Write the tensors as safetensors, pt, dcp or a Hugging Face model.",
    epilog=examples(
        "ckpttool convert ep3-rank0.pt --to safetensors    # writes ep3.safetensors",
        "ckpttool convert model.pt --to safetensors --dtype bfloat16 -o model-bf16.safetensors",
        "ckpttool convert 'ep0-ba1-rank*.pt' --to safetensors --max-shard-size 5GB -o hf-model/",
        "ckpttool convert ckpt.pt --to dcp -o ckpt-dcp/",
        "ckpttool convert 'ep9-rank*.pt' --to safetensors -o ep9.safetensors --workers 4",
        "torchrun --nproc-per-node=8 -m ckpttool convert ckpt-dcp/ --to safetensors -o out/",
        "ckpttool convert step-1000/ --to hf --config config.json -o llama-hf/",
        "ckpttool convert llama-hf/ --to dcp --layout torchtitan:llama3 -o step-0/",
    )
    + "\n\nWithout -o the output goes beside the first input, named after it without its "
    "extension and rank (NAME): NAME.safetensors, NAME-safetensors/ with --max-shard-size, "
    "NAME.pt (NAME-converted.pt when that is the input itself), NAME-dcp/, NAME-hf/. "
    "-o DIR/ writes that name inside DIR.",
)
def convert(
    paths: Paths,
    to: Annotated[
        str,
        typer.Option(
            "--to",
            metavar="<safetensors|pt|dcp|hf>",
            help="The output format.",
            show_default=False,
            autocompletion=_complete("TARGETS"),
        ),
    ],
    out: Annotated[
        str | None,
        typer.Option(
            "-o",
            "--out",
            metavar="OUT",
            help="Output file, or folder (DIR/: the default name inside it). "
            "Default: beside the input, see below.",
            show_default=False,
        ),
    ] = None,
    select: Select = "auto",
    strip_prefix: StripPrefix = "auto",
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            metavar="<float32|float16|bfloat16>",
            help="Cast floating-point tensors to this dtype (also fp32, float, fp16, half, bf16).",
            autocompletion=_complete("CAST_DTYPES"),
        ),
    ] = None,
    map_location: Annotated[
        str | None,
        typer.Option(
            "--map-location",
            metavar="cpu|cuda:N",
            help="Device of the tensors in a pt output.",
        ),
    ] = None,
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            "--max-shard-size",
            metavar="SIZE",
            help="Write HF shards of at most SIZE (2GB = 2*1000^3 bytes, 500MiB = 500*1024^2).",
        ),
    ] = None,
    source_metadata: Annotated[
        bool,
        typer.Option(
            "--source-metadata/--no-source-metadata",
            help="Record the input's file name in a safetensors output's __metadata__.",
        ),
    ] = True,
    arch: Annotated[
        str,
        typer.Option(
            "--arch",
            metavar="NAME|auto",
            help="--to hf: the mapping (torchtitan:llama3) or architecture (llama).",
        ),
    ] = "auto",
    config: Annotated[
        str | None,
        typer.Option("--config", metavar="FILE|DIR", help="--to hf: the model's HF config.json."),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option("--tokenizer", metavar="DIR", help="--to hf: copy its tokenizer files."),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="--to hf: print the mapping, write nothing."),
    ] = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="--to hf: build the model on the meta device and compare (transformers).",
        ),
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="--to hf --dry-run: the mapping as JSON.")
    ] = False,
    layout_of: Annotated[
        str | None,
        typer.Option(
            "--layout",
            metavar="FRAMEWORK:ARCH",
            help="--to dcp from an HF model folder: that framework's layout (torchtitan:llama3).",
        ),
    ] = None,
    force: Force = False,
    unsafe: Unsafe = False,
    quiet: Quiet = False,
    workers: Workers = None,
) -> None:
    """Write the selected tensors as safetensors, pt, dcp or a Hugging Face model (hf);
    sharded inputs are merged."""
    from ..convert import HfOptions
    from ..convert import convert as convert_checkpoint
    from ..distributed import prints_summary

    hf = HfOptions(arch=arch, config=config, tokenizer=tokenizer, dry_run=dry_run, check=check)
    if to != "hf" and (hf != HfOptions() or json_output):
        fail("error: --arch, --config, --tokenizer, --dry-run, --check and --json apply to --to hf")

    check_extension(out, to, max_shard_size)
    if workers is not None:  # what one process would refuse at once, before N start
        from ..convert import check_options

        check_options(to, dtype, max_shard_size, map_location)
    run_workers(workers, paths)
    quiet = quiet or not prints_summary()
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
        progress=progress_factory(quiet or settings.quiet),
        source_metadata=source_metadata,
        hf=hf if to == "hf" else None,
        layout_of=layout_of,
    )
    if dry_run:
        from .hf_mapping import print_mapping

        print_mapping(result.export, json_output)
        return
    from .folder_listing import report_removed

    report_removed(result.removed)
    if result.warnings and prints_summary():
        from rich.markup import escape

        from .text import printable

        for line in result.warnings:
            stderr_console().print(
                f"[yellow]warning[/]: {escape(printable(line))}", highlight=False
            )
    if not (quiet or settings.quiet):
        from rich.markup import escape  # a path is never markup

        from .text import plural, printable

        stderr_console().print(
            f"wrote {escape(printable(result.output))} ({plural(result.num_tensors, 'tensor')}, "
            f"{human_bytes(result.nbytes)}){escape(printable(outcome_note(result.outcome)))}",
            highlight=False,
        )


def run_workers(workers: int | None, paths: list[str]) -> None:
    """``--workers N``: run this command line again in N processes, exit with their code
    (a missing input is said here, before any of them starts)."""
    if workers is None:
        return
    from ..distributed import run_workers as launch
    from ..formats import require_inputs

    require_inputs(paths)
    raise typer.Exit(launch(settings.argv, workers, debug=settings.debug))


def outcome_note(outcome: Any) -> str:
    """What several processes did beyond writing: work reused, or why it was not."""
    from .text import plural

    if outcome is None:
        return ""
    parts = [plural(outcome.units, outcome.kind)]
    if outcome.reused:
        parts.append(
            f"reused {outcome.reused} ({human_bytes(outcome.reused_bytes)}) from an interrupted run"
        )
    if outcome.note:
        parts.append(outcome.note)
    return "; " + ", ".join(parts)


def check_extension(out: str | None, to: str, max_shard_size: str | None) -> None:
    """Refuse ``--to pt -o x.safetensors``: a file whose name says one format and holds another."""
    from ..convert import TARGETS

    if out is None or out.endswith(("/", os.sep)) or os.path.isdir(out):
        return
    says = EXTENSIONS.get(os.path.splitext(out)[1].lower())
    if says is None or says == to or to not in TARGETS:  # an unknown --to: the core says so
        return
    if max_shard_size and to == "safetensors":
        return  # shards go into a folder; its name is free
    stem = os.path.splitext(out)[0]
    fix = {"safetensors": f"{stem}.safetensors", "pt": f"{stem}.pt", "dcp": f"{stem}-dcp/"}[to]
    fail(f"error: -o {out} names a {says} file but --to is {to} (use -o {fix}, or --to {says})")
