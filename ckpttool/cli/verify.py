"""``ckpttool verify``: read every byte of a checkpoint once; exit 2 naming the first damage."""

from __future__ import annotations

from typing import Any

from .entry import app, fail, settings
from .options import Json, Paths, Quiet, Unsafe, examples
from .render import dumps_json, human_bytes, progress_factory
from .text import plural, printable, write


@app.command(
    short_help="Check that a checkpoint is whole: every byte read once.",
    epilog=examples(
        "ckpttool verify model.pt                # after copying it between machines",
        "ckpttool verify ckpt-dcp/ --json | jq .damage",
        "ckpttool verify ep3-rank*.pt            # one checkpoint in rank files",
        "ckpttool verify a.pt b.safetensors      # separate checkpoints: each in turn",
    )
    + "\n\nChecks the CRC-32 of every zip record (torch.save files, DCP data files, "
    "TorchScript), the spans, offsets and sizes every format records, and that the "
    "shards of every sharded tensor are there and fit. "
    "Exit 0: whole, 2: damaged or unreadable (the first damage is named), 3: unsafe.",
)
def verify(
    paths: Paths,
    json_output: Json = False,
    unsafe: Unsafe = False,
    quiet: Quiet = False,
) -> None:
    """Read every byte of the checkpoint once and check all its formats record."""
    from ..errors import SeparateCheckpointsError
    from ..integrity import verify as verify_checkpoint

    progress = progress_factory(quiet or settings.quiet)

    def report(given: list[str], result: dict[str, Any]) -> None:
        """One checkpoint's verdict: stdout for a whole one (and every --json object),
        one stderr line and exit 2 for a damaged one."""
        if json_output:
            write(dumps_json(result) + "\n")
        elif result["ok"]:
            write(summary(given, result) + "\n")
        if not result["ok"]:
            fail(f"error: {result['damage']['file']}: {result['damage']['reason']}")

    try:
        result = verify_checkpoint(paths, unsafe=unsafe, progress=progress)
    except SeparateCheckpointsError as exc:  # several checkpoints: each in turn
        for path in exc.files:
            report([path], verify_checkpoint(path, unsafe=unsafe, progress=progress))
        return
    report(paths, result)


def summary(given: list[str], result: dict[str, Any]) -> str:
    """``whole: model.pt (torch-zip; 1 file, 8 zip records CRC-checked, 1.7 KiB read)``."""
    files = result["files"]
    checked = sum(f["crc_checked"] for f in files)
    unrecorded = sum(f["crc_unrecorded"] for f in files)
    what = [plural(len(files), "file")]
    if checked:
        what.append(f"{plural(checked, 'zip record')} CRC-checked")
    if unrecorded:
        what.append(f"{plural(unrecorded, 'zip record')} saved without a CRC-32")
    what.append(f"{human_bytes(result['bytes_checked'])} read")
    name = given[0] + (f" (+{len(given) - 1} more)" if len(given) > 1 else "")
    return f"whole: {printable(name)} ({result['format']}; {', '.join(what)})"
