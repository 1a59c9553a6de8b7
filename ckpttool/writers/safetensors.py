"""Write safetensors: one file, or Hugging Face shards plus ``model.safetensors.index.json``."""

from __future__ import annotations

import json
import os
from typing import Any

from ..dtypes import DType
from ..errors import CkptError
from . import OutputFile, Progress, output_dtype, output_nbytes, refuse_sparse, write_leaf

SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HEADER_ALIGN = 8  # safetensors pads the header so tensor data starts 8-byte aligned


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


def header_bytes(tensors: dict[str, Any], cast: DType | None, metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
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


def write_file(
    path: str,
    tensors: dict[str, Any],
    *,
    cast: DType | None = None,
    metadata: dict[str, str] | None = None,
    progress: Progress | None = None,
) -> None:
    """Write ``tensors`` (name -> lazy leaf) to one safetensors file, one tensor at a time."""
    check_dtypes(tensors, cast)
    header = header_bytes(tensors, cast, metadata or {})
    size = len(header) + sum(output_nbytes(leaf, cast) for leaf in tensors.values())
    with OutputFile(path, size_hint=size) as out:
        out.write(header)
        for leaf in tensors.values():
            write_leaf(out, leaf, cast, progress)


def plan_shards(
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


def write_sharded(
    folder: str,
    tensors: dict[str, Any],
    max_shard_size: int,
    *,
    cast: DType | None = None,
    metadata: dict[str, str] | None = None,
    progress: Progress | None = None,
) -> list[str]:
    """Write Hugging Face style shards and their index into ``folder``; return the file names."""
    check_dtypes(tensors, cast)
    plan = plan_shards(tensors, cast, max_shard_size)
    weight_map: dict[str, str] = {}
    names = []
    for index, shard in enumerate(plan, start=1):
        name = SHARD_NAME.format(index=index, count=len(plan))
        write_file(
            os.path.join(folder, name),
            {k: tensors[k] for k in shard},
            cast=cast,
            metadata=metadata,
            progress=progress,
        )
        weight_map.update(dict.fromkeys(shard, name))
        names.append(name)
    total = sum(leaf.numel * output_dtype(leaf, cast).itemsize for leaf in tensors.values())
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(folder, INDEX_NAME), "w", encoding="utf-8") as f:
        json.dump(index_doc, f, indent=2)
        f.write("\n")
    return [*names, INDEX_NAME]
