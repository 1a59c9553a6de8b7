"""``safetensors``: an 8-byte little-endian header length, a JSON header, raw tensor bytes."""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import CkptError
from ..tree import (
    SAFETENSORS_DTYPES,
    ByteSource,
    Checkpoint,
    StorageRef,
    TensorRef,
    contiguous_stride,
)

FORMAT = "safetensors"
# The safetensors library refuses headers over 100 MB; so do we, before allocating.
MAX_HEADER = 100_000_000
# DCP's safetensors files (its safetensors serialization format, HuggingFaceStorageWriter)
# record under this metadata key where each tensor, a block, lies in its global tensor.
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"


def detect(path: str, head: bytes) -> bool:
    if len(head) < 10:
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= MAX_HEADER and head[8:9] == b"{"


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """Return (header dict, offset of the data section), validated."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CkptError("truncated safetensors file (no header length)", path=path)
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or n + 8 > size:
            raise CkptError(
                f"safetensors header length {n} exceeds the file size {size} "
                "(truncated or corrupt)",
                path=path,
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CkptError(f"corrupt safetensors header ({exc})", path=path) from None
    if not isinstance(header, dict):
        raise CkptError("corrupt safetensors header (not a JSON object)", path=path)
    return header, 8 + n


def has_dcp_sharding(header: dict) -> bool:
    """Whether DCP wrote this file: its metadata holds ``DCP_SHARDING_INFO``."""
    metadata = header.get("__metadata__")
    return isinstance(metadata, dict) and DCP_SHARDING_KEY in metadata


def dcp_saved_offsets(header: dict, path: str) -> dict[str, tuple[int, ...]] | None:
    """``{name: offsets}`` from a header's ``DCP_SHARDING_INFO``; None when it has none.

    Raises:
        CkptError: It is there but not ``{name: {"saved_offsets": [int, ...]}}``.
    """
    if not has_dcp_sharding(header):
        return None
    try:
        info = json.loads(header["__metadata__"][DCP_SHARDING_KEY])
        offsets = {name: entry["saved_offsets"] for name, entry in info.items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        offsets = None
    if offsets is None or not all(
        type(o) is list and all(type(n) is int for n in o) for o in offsets.values()
    ):
        raise CkptError(f"corrupt {DCP_SHARDING_KEY} in the safetensors metadata", path=path)
    return {name: tuple(o) for name, o in offsets.items()}


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    header, data_start = read_header(path)
    data_len = os.path.getsize(path) - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CkptError("corrupt safetensors header (__metadata__ is not an object)", path=path)
    root = {}
    for name, info in header.items():
        root[name] = tensor_ref(path, name, info, data_start, data_len)
    return Checkpoint(format=FORMAT, files=[path], root=root, metadata=dict(metadata))


def tensor_ref(path: str, name: str, info: Any, data_start: int, data_len: int) -> TensorRef:
    """A lazy tensor for one header entry, after checking it against the data section."""
    try:
        dt = SAFETENSORS_DTYPES[info["dtype"]]
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CkptError(f"corrupt safetensors header entry {name!r}", path=path) from None
    ref = TensorRef(dtype=dt, shape=shape, stride=contiguous_stride(shape), offset=0, storage=None)
    if any(s < 0 for s in shape) or not 0 <= begin <= end <= data_len or end - begin != ref.nbytes:
        raise CkptError(
            f"tensor {name!r}: offsets do not match its shape or the file (truncated or corrupt)",
            path=path,
        )
    source = ByteSource(path, data_start + begin, end - begin)
    ref.storage = StorageRef(name, dt, ref.numel, "cpu", source)
    return ref
