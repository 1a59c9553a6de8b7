"""Write safetensors: one file, or Hugging Face shards plus ``model.safetensors.index.json``."""

from __future__ import annotations

import json
from typing import Any

from ..dtypes import DType
from ..errors import CkptError
from ..tree import tied_names
from .folder_layout import HF_SHARDS, FolderLayout
from .leaf_bytes import output_dtype, refuse_sparse
from .plan import FilePlan, Piece, Plan, WriteOptions, write

__all__ = ["TO", "layout", "plan", "write"]

TO = "safetensors"
SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
INDEX_NAME = HF_SHARDS.last  # the name is defined once, with the layout --force may replace
HEADER_ALIGN = 8  # safetensors pads the header so tensor data starts 8-byte aligned


def layout(options: WriteOptions) -> FolderLayout | None:
    """Shards and their index go into a folder; without a shard size, one file."""
    return HF_SHARDS if options.max_shard_size is not None else None


def plan(tensors: dict[str, Any], options: WriteOptions) -> Plan:
    """One file, or shards of at most ``options.max_shard_size`` bytes and their index.

    A tensor that is the same weight as one before it (a tied ``lm_head.weight``) is
    written once, as ``save_pretrained`` writes it: its name maps to the kept one in the
    ``__metadata__`` of the file that holds that one (``{"lm_head.weight":
    "transformer.wte.weight"}``, as safetensors' ``save_model`` records it and
    ``load_model`` and ckpttool read it back)."""
    check_dtypes(tensors, options.cast)
    check_names(tensors)
    reserved = {"format", *options.metadata}  # (an alias there would be metadata's)
    tied = {alias: k for alias, k in tied_names(tensors).items() if alias not in reserved}
    kept = {name: leaf for name, leaf in tensors.items() if name not in tied}
    if options.max_shard_size is None:
        return Plan([plan_file("", kept, options, tied)])
    return plan_sharded(kept, options, tied)


def check_dtypes(tensors: dict[str, Any], cast: DType | None) -> None:
    """Fail before writing anything if a tensor has no safetensors dtype."""
    refuse_sparse(tensors, "safetensors")
    for name, leaf in tensors.items():
        if getattr(leaf, "kind", "") == "quantized":
            raise CkptError(
                f"tensor {name!r} is quantized ({leaf.dtype.name}): safetensors cannot store it "
                "and its values cannot be read without its scale and zero point",
                hint="dequantize it before saving, or --select other tensors",
            )
        if output_dtype(leaf, cast).safetensors is None:
            raise CkptError(
                f"tensor {name!r} has dtype {leaf.dtype.name}, which safetensors cannot store",
                hint="use --to pt, or --dtype for floating-point tensors",
            )


def check_names(tensors: dict[str, Any]) -> None:
    """Fail before writing anything if a name cannot be a key of a safetensors header.

    The names come from the input: ``__metadata__`` is the header's own entry (a tensor
    of that name would replace it), and a string with a lone surrogate (a pickle can
    hold one) is written as an escape that no JSON reader of the format accepts.
    """
    for name in tensors:
        if name == "__metadata__":
            raise CkptError(
                "a tensor is named '__metadata__', the safetensors header's own entry",
                hint="use --to pt, or --select other tensors",
            )
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise CkptError(
                f"tensor name {name!r} is not valid Unicode (a lone surrogate): "
                "safetensors cannot hold it",
                hint="use --to pt, or --select other tensors",
            ) from None


def valid_text(text: str) -> str:
    """``text`` as valid Unicode: a lone surrogate (a file name's undecodable byte, as
    Python decodes names) as its escape, since no reader of the format accepts one."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def header_bytes(tensors: dict[str, Any], cast: DType | None, metadata: dict[str, str]) -> bytes:
    # metadata names the input (its file name): text, not a tensor name to refuse
    written = {valid_text(k): valid_text(v) for k, v in metadata.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **written}}
    offset = 0
    for name, leaf in tensors.items():
        dt = output_dtype(leaf, cast)
        size = leaf.numel * dt.itemsize
        header[name] = {
            "dtype": dt.safetensors,
            "shape": list(leaf.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % HEADER_ALIGN)
    return len(raw).to_bytes(8, "little") + raw


def plan_file(
    name: str, tensors: dict[str, Any], options: WriteOptions, tied: dict[str, str] | None = None
) -> FilePlan:
    """One safetensors file: its header, then every tensor's bytes in key order; the
    aliases of ``tied`` whose weight it holds named in its metadata."""
    aliases = {alias: kept for alias, kept in (tied or {}).items() if kept in tensors}
    header = header_bytes(tensors, options.cast, {**options.metadata, **aliases})
    pieces, offset = [Piece(0, len(header), data=header)], len(header)
    for leaf in tensors.values():
        nbytes = leaf.numel * output_dtype(leaf, options.cast).itemsize
        pieces.append(Piece(offset, nbytes, leaf=leaf, cast=options.cast))
        offset += nbytes
    return FilePlan(name, offset, pieces)


def shard_names(
    tensors: dict[str, Any], cast: DType | None, max_shard_size: int
) -> list[list[str]]:
    """Greedy in key order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = []
    size = 0
    for name, leaf in tensors.items():
        nbytes = leaf.numel * output_dtype(leaf, cast).itemsize
        if not shards or (size + nbytes > max_shard_size and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards or [[]]


def plan_sharded(
    tensors: dict[str, Any], options: WriteOptions, tied: dict[str, str] | None = None
) -> Plan:
    """Hugging Face style shards, then their index (written last: it names them; as
    ``save_pretrained``'s, it lists the tensors written, not their aliases)."""
    if options.max_shard_size is None:
        raise ValueError("plan_sharded needs options.max_shard_size")
    shards = shard_names(tensors, options.cast, options.max_shard_size)
    files, weight_map = [], {}
    for index, keys in enumerate(shards, start=1):
        name = SHARD_NAME.format(index=index, count=len(shards))
        files.append(plan_file(name, {k: tensors[k] for k in keys}, options, tied))
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(f.size - f.pieces[0].nbytes for f in files)  # the tensors' bytes
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    raw = (json.dumps(index_doc, indent=2) + "\n").encode()
    files.append(FilePlan(INDEX_NAME, len(raw), [Piece(0, len(raw), data=raw)]))
    return Plan(files, [f.name for f in files])
