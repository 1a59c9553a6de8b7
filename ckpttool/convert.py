"""``convert``: write the selected tensors as safetensors (one file or HF shards), torch or DCP."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import distributed, sources
from .api import flatten_tensors, read, select_node
from .dtypes import DTYPES, DType
from .errors import UsageError, translate_errors
from .integrity import unreadable_besides
from .progress import ProgressFactory
from .sizes import parse_size
from .targets import StaleTemp, check_output, output_path, publish
from .writers import (
    WRITERS,
    carried_files,
    default_output,
    hf_source_folder,
    layout_for,
    model_folder,
)

TARGETS = (*WRITERS, "hf")  # hf: safetensors under a Hugging Face architecture's names
CAST_DTYPES = ("float32", "float16", "bfloat16")
# the other names of those dtypes a user writes: the short ones inspect prints, torch's
# aliases (torch.half is torch.float16), and torch's spelling with its module
CAST_ALIASES = {
    **{name: name for name in CAST_DTYPES},
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}


def cast_dtype(name: str) -> str:
    """The dtype ``--dtype name`` casts to (``float32``, ``float16`` or ``bfloat16``).

    Raises:
        UsageError: A name of no such dtype.
    """
    key = name.strip().lower()
    key = key[len("torch.") :] if key.startswith("torch.") else key
    if key not in CAST_ALIASES:
        raise UsageError(
            f"unknown --dtype {name!r}",
            hint=f"choose one of {', '.join(CAST_DTYPES)} (or fp32, fp16, half, bf16)",
        )
    return CAST_ALIASES[key]


DEVICE_RE = re.compile(r"^(cpu|meta|(cuda|xpu|mps|npu|hpu)(:\d+)?)$")


# Formats whose checkpoint is a folder, whatever file of it was given
FOLDER_READ_FORMATS = ("dcp", "megatron", "safetensors-sharded")


@dataclass(frozen=True)
class HfOptions:
    """What ``--to hf`` is told besides the common options.

    Attributes:
        arch: ``auto``, a mapping (``torchtitan:llama3``) or an architecture (``llama``).
        config: An HF ``config.json`` or a folder holding one; None: the input's own.
        tokenizer: A folder whose tokenizer files are copied in; None: the input's.
        dry_run: Map and check, write nothing (the result holds the mapping).
        check: Build the architecture from the written config on the meta device
            (transformers) and compare names, shapes and dtypes exactly.
    """

    arch: str = "auto"
    config: str | None = None
    tokenizer: str | None = None
    dry_run: bool = False
    check: bool = False


@dataclass
class ConvertResult:
    output: str
    files: list[str]
    num_tensors: int
    nbytes: int
    # temp outputs of killed runs removed from the output's folder on the way
    removed: list[StaleTemp] = field(default_factory=list)
    # what a resumed write reused, the units of several processes (targets.Outcome)
    outcome: Any = None
    # what the input lost outside the selection (a short or missing file), one line each
    warnings: list[str] = field(default_factory=list)
    # --to hf: the mapping (a mappings.Export), whether written or a dry run
    export: Any = None


def check_options(
    to: str, dtype: str | None, max_shard_size: str | int | None, map_location: str | None
) -> tuple[str | None, int | None]:
    """The options of a conversion, checked before anything is read (and before a run
    of several processes starts one): the dtype cast to and the shard limit in bytes.

    Raises:
        UsageError: An unknown value, or options that do not fit together.
    """
    if to not in TARGETS:
        raise UsageError(f"unknown --to {to!r}", hint=f"choose one of {', '.join(TARGETS)}")
    if dtype is not None:
        dtype = cast_dtype(dtype)
    if max_shard_size is not None and to not in ("safetensors", "hf"):
        raise UsageError("--max-shard-size applies to --to safetensors and hf only")
    if map_location is not None and to != "pt":
        raise UsageError("--map-location applies to --to pt only")
    if map_location is not None and not DEVICE_RE.match(map_location):
        raise UsageError(f"bad --map-location {map_location!r}", hint="use cpu or cuda:N")
    return dtype, parse_size(max_shard_size) if max_shard_size is not None else None


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
    source_metadata: bool = True,
    hf: HfOptions | None = None,
    layout_of: str | None = None,
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
        source_metadata: Record the input's file name in a safetensors output's
            ``__metadata__`` (``source``); False leaves it out, so the same tensors
            give the same bytes whatever the input was named.
        hf: ``--to hf``: the architecture, config and tokenizer, dry run and check.
        layout_of: ``--to dcp --layout FRAMEWORK:ARCH``: an HF model folder written
            under that framework's names and layout (the way back of ``--to hf``).

    Raises:
        UsageError: Options that do not fit together.
        OutputExistsError: ``out`` exists and not ``force``.
        UnsafeError / CkptError: as :func:`ckpttool.read`.
    """
    dtype, shard_limit = check_options(to, dtype, max_shard_size, map_location)
    cast: DType | None = DTYPES[dtype] if dtype else None

    from .writers import WriteOptions, writer_for

    writer = writer_for("safetensors" if to == "hf" else to)
    ckpt = read(paths, unsafe=unsafe)
    path, node = select_node(ckpt, select, strip_prefix)
    tensors = flatten_tensors(node, str(path[-1]) if path else "")
    if not tensors:
        raise UsageError(
            "the selection holds no tensors", hint="see `ckpttool inspect`, then --select"
        )
    lost = unreadable_besides(ckpt, tensors)  # sizes only: a short file refused before a write
    if layout_of is not None:  # the way back: an HF model under a framework's layout
        if to != "dcp":
            raise UsageError("--layout applies to --to dcp only")
        tensors = _in_layout(paths, tensors, layout_of)
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
        metadata={"source": sources.input_name(first)} if source_metadata else {},
    )
    if to == "hf":  # the model under an HF architecture's names, as a model folder
        from .hf_export import convert_to_hf

        out, names, nbytes, done, mapping = convert_to_hf(
            ckpt, tensors, inputs, named_after, out, options, hf or HfOptions(),
            force=force, progress=progress,
        )  # fmt: skip
        removed, outcome = (done.removed, done.outcome) if done else ([], None)
        return ConvertResult(out, names, len(mapping.mapped), nbytes, removed, outcome, lost,
                             export=mapping)  # fmt: skip
    layout = writer.layout(options)
    hf_folder = _hf_folder_in_and_out(inputs, out, select, to, shard_limit is not None)
    if hf_folder is not None and out is not None:  # DIR/model.safetensors + config & co.
        layout = layout_for(to, shard_limit is not None)
        out = output_path(out, "", folder_output=True)
    elif out is None:
        out = default_output(named_after, to, shard_limit is not None)
    elif layout is None:  # -o DIR/: the default name inside it
        name = os.path.basename(default_output(named_after, to, False, folder=out))
        out = output_path(out, name, folder_output=False)
    else:
        out = output_path(out, "", folder_output=True)
    check_output(out, [*inputs, *ckpt.files], force=force, layout=layout)
    plan = writer.plan(tensors, options)  # metadata only: bad dtypes fail before any write
    if hf_folder is not None:
        plan = model_folder(plan, to, hf_folder, carried_files(hf_folder))
    done = publish(
        plan, out, layout=layout, force=force, inputs=[*inputs, *ckpt.files], files=ckpt.files,
        progress=progress,
    )  # fmt: skip
    names = plan.names or [os.path.basename(out)]
    return ConvertResult(
        out, names, len(tensors), plan.total_bytes, done.removed, done.outcome, lost
    )


def _in_layout(paths: Sequence[str], tensors: dict[str, Any], layout_of: str) -> dict[str, Any]:
    """An HF model folder's tensors under ``layout_of``'s names (its own config says the
    heads the RoPE permutation is undone over).

    Raises:
        UsageError: The input is not an HF model folder (no ``config.json``).
    """
    from . import mappings

    inputs = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    folder = hf_source_folder(inputs, "auto")
    if folder is None:
        raise UsageError(
            "--layout reads a Hugging Face model folder (config.json beside the weights)",
            hint="pass the folder --to hf wrote, or one save_pretrained wrote",
        )
    config, _ = mappings.load_config(folder)
    return mappings.to_layout(layout_of, tensors, config)


def _hf_folder_in_and_out(
    inputs: list[str], out: str | None, select: str, to: str, sharded: bool
) -> str | None:
    """The input's Hugging Face folder where a model folder is converted into a folder
    (``-o DIR/``, an existing DIR, ``-o s3://…/PREFIX/``, or shards) as safetensors or
    pt: then DIR is a model folder."""
    if out is None or to not in ("safetensors", "pt"):
        return None
    if sources.is_url(out):
        into = out.endswith("/") or sharded
    else:
        out = sources.strip_file_scheme(out)
        into = out.endswith(os.sep) or bool(os.altsep and out.endswith(os.altsep))
        into = into or os.path.isdir(out) or sharded
    return hf_source_folder(inputs, select) if into else None
