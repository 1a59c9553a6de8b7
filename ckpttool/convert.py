"""``convert``: write the selected tensors as safetensors (one file or HF shards), torch or DCP."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from . import distributed, sources
from .api import flatten_tensors, read, select_node
from .dtypes import DTYPES, DType
from .errors import UsageError, translate_errors
from .output import atomic_output, check_output, output_path
from .progress import ProgressFactory
from .writers import WRITERS

TARGETS = tuple(WRITERS)
CAST_DTYPES = ("float32", "float16", "bfloat16")
SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}
DEVICE_RE = re.compile(r"^(cpu|meta|(cuda|xpu|mps|npu|hpu)(:\d+)?)$")


def parse_size(text: str | int) -> int:
    """``2GB`` -> 2_000_000_000, ``1.5GiB`` -> 1610612736, ``1000`` -> 1000 (as huggingface_hub)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not m or m.group(2) and m.group(2).upper() not in SIZE_UNITS:
        raise UsageError(
            f"bad size {text!r}", hint="use bytes or a number with KB/MB/GB or KiB/MiB/GiB"
        )
    size = int(float(m.group(1)) * SIZE_UNITS[(m.group(2) or "").upper()])
    if size <= 0:
        raise UsageError(f"size must be positive, got {text!r}")
    return size


# Formats whose checkpoint is a folder, whatever file of it was given
FOLDER_READ_FORMATS = ("dcp", "megatron", "safetensors-sharded")


def output_stem(inputs: Sequence[str]) -> tuple[str, str]:
    """(folder, stem) of the input an output is named after: ``/d/ep0-rank0.pt`` ->
    (``/d``, ``ep0``). Per-rank inputs drop their rank: one output for all ranks."""
    first = sources.strip_file_scheme(inputs[0])
    # the output is local: a URL input's goes in the current folder
    folder = "" if sources.is_url(first) else os.path.dirname(os.path.normpath(first))
    name = sources.input_name(first)
    stem = name.split(".", 1)[0] if not sources.isdir(first) else name
    return folder, re.sub(r"[-_]?rank\*?\d*$", "", stem) or stem


def unused_name(folder: str, stem: str, suffix: str, inputs: Sequence[str]) -> str:
    """``folder/stem.pt``, or ``folder/stem-suffix.pt`` where that is an input."""
    candidate = os.path.join(folder, f"{stem}.pt")
    local_inputs = [sources.strip_file_scheme(p) for p in inputs]
    real_inputs = {os.path.realpath(p) for p in local_inputs if not sources.is_url(p)}
    if os.path.realpath(candidate) not in real_inputs:
        return candidate
    return os.path.join(folder, f"{stem}-{suffix}.pt")


def default_output(inputs: Sequence[str], to: str, sharded: bool, folder: str | None = None) -> str:
    """A name beside the input: ``ep0.safetensors``, ``ep0-safetensors/``, ``ep0.pt``, ``ep0-dcp/``.

    Per-rank inputs drop their rank (``ep0-rank0.pt`` -> ``ep0``): one output for all ranks.
    ``folder`` puts it there instead (``-o DIR/``).
    """
    beside, stem = output_stem(inputs)
    folder = beside if folder is None else folder
    if to == "dcp":
        return os.path.join(folder, f"{stem}-dcp")
    if to == "safetensors":
        return os.path.join(folder, f"{stem}-safetensors" if sharded else f"{stem}.safetensors")
    return unused_name(folder, stem, "converted", inputs)


@dataclass
class ConvertResult:
    output: str
    files: list[str]
    num_tensors: int
    nbytes: int
    # several processes: what they did (a distributed.runner.Outcome), else None
    outcome: Any = None


@distributed.collective
@translate_errors
def convert(
    paths: Sequence[str],
    to: str,
    out: str | None = None,
    *,
    select: str = "auto",
    strip_prefix: str = "auto",
    dtype: str | None = None,
    map_location: str | None = None,
    max_shard_size: str | int | None = None,
    force: bool = False,
    unsafe: bool = False,
    progress: ProgressFactory | None = None,
) -> ConvertResult:
    """Write the selected tensors of a checkpoint in another format.

    Args:
        paths: The input (file, folder, per-rank files or glob).
        to: ``safetensors``, ``pt`` or ``dcp``.
        out: Output file or folder; a name beside the input when None.
        select: ``auto`` (model state dict), ``all`` or a dotted key path.
        strip_prefix: ``auto``, ``none`` or a prefix.
        dtype: Cast floating-point tensors to ``float32``, ``float16`` or ``bfloat16``.
        map_location: Device recorded for the tensors of a ``pt`` output.
        max_shard_size: Write Hugging Face shards of at most this size (safetensors).
        force: Replace an existing output.
        unsafe: Accept pickles that reference dangerous globals (kept inert).
        progress: ``progress(total_bytes, description)`` returns a context manager
            yielding a callable that takes bytes done.

    Raises:
        UsageError: Options that do not fit together.
        OutputExistsError: ``out`` exists and not ``force``.
        UnsafeError / CkptError: as :func:`ckpttool.read`.
    """
    if to not in TARGETS:
        raise UsageError(f"unknown --to {to!r}", hint=f"choose one of {', '.join(TARGETS)}")
    if dtype is not None and dtype not in CAST_DTYPES:
        raise UsageError(
            f"unknown --dtype {dtype!r}", hint=f"choose one of {', '.join(CAST_DTYPES)}"
        )
    if max_shard_size is not None and to != "safetensors":
        raise UsageError("--max-shard-size applies to --to safetensors only")
    if map_location is not None and to != "pt":
        raise UsageError("--map-location applies to --to pt only")
    if map_location is not None and not DEVICE_RE.match(map_location):
        raise UsageError(f"bad --map-location {map_location!r}", hint="use cpu or cuda:N")
    shard_limit = parse_size(max_shard_size) if max_shard_size is not None else None
    cast: DType | None = DTYPES[dtype] if dtype else None

    from .writers import writer_for
    from .writers.plan import WriteOptions, write_plan

    writer = writer_for(to)
    ckpt = read(paths, unsafe=unsafe)
    path, node = select_node(ckpt, select, strip_prefix)
    tensors = flatten_tensors(node, str(path[-1]) if path else "")
    if not tensors:
        raise UsageError(
            "the selection holds no tensors", hint="see `ckpttool inspect`, then --select"
        )
    inputs = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    first = sources.strip_file_scheme(inputs[0])
    if ckpt.format in FOLDER_READ_FORMATS and sources.isfile(first):
        # a file stood for its folder (a DCP data file, an index, shards of one model):
        # the output goes beside that folder, never into it (the checkpoint is an input)
        named_after = [sources.dirname(first if sources.is_url(first) else os.path.abspath(first))]
    else:
        named_after = inputs
    options = WriteOptions(
        cast=cast,
        location=map_location or "cpu",
        max_shard_size=shard_limit,
        metadata={"source": sources.input_name(first)},
    )
    layout = writer.layout(options)
    if out is None:
        out = default_output(named_after, to, shard_limit is not None)
    elif layout is None:  # -o DIR/: the default name inside it
        name = os.path.basename(default_output(named_after, to, False, folder=out))
        out = output_path(out, name, folder_output=False)
    else:
        out = output_path(out, "", folder_output=True)
    check_output(out, [*inputs, *ckpt.files], force=force, layout=layout)
    plan = writer.plan(tensors, options)  # metadata only: bad dtypes fail before any write
    total = plan.total_bytes
    group = distributed.current()
    if group is not None:  # under torchrun: every rank writes its share
        from .distributed.runner import write_distributed

        files = [*inputs, *ckpt.files]
        outcome = write_distributed(group, plan, out, layout=layout, force=force, inputs=files)
        names = plan.names or [os.path.basename(out)]
        return ConvertResult(out, names, len(tensors), total, outcome)
    bar = progress(total, f"writing {os.path.basename(out)}") if progress else nullcontext(None)
    with bar as advance, atomic_output(out, force=force, layout=layout) as tmp:
        write_plan(plan, tmp, advance)
    return ConvertResult(out, plan.names or [os.path.basename(out)], len(tensors), total)
