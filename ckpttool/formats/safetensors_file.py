"""``safetensors``: an 8-byte little-endian header length, a JSON header, raw tensor bytes."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

from .. import sources
from ..dtypes import SAFETENSORS_DTYPES
from ..errors import CkptError
from ..sources import ByteSpan
from ..tree import Checkpoint, StorageRef, TensorRef, contiguous_stride

FORMAT = "safetensors"
# The safetensors library refuses headers over 100 MB; so do we, before allocating.
MAX_HEADER = 100_000_000
# Tensors one file may list: the largest real files (a whole MoE model in one file)
# hold tens of thousands.
MAX_TENSORS = 1 << 17
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
    size = sources.getsize(path)
    head = sources.read_head(path, 8)
    if len(head) < 8:
        raise CkptError("truncated safetensors file (no header length)", path=path)
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER or n + 8 > size:
        raise CkptError(
            f"safetensors header length {n} exceeds the file size {size} (truncated or corrupt)",
            path=path,
        )
    raw = bytes(sources.read(path, 8, n))
    # counted in C before anything is parsed: a header of a million empty tensors is a
    # few dozen MB of JSON but gigabytes of Python objects and report entries
    entries = raw.count(b'"data_offsets"')
    if entries > MAX_TENSORS:
        raise CkptError(
            f"safetensors header lists {entries} tensors, more than any checkpoint file "
            f"holds (at most {MAX_TENSORS} are read)",
            path=path,
        )
    try:
        header = json.loads(raw)
        # each tensor entry names its data_offsets once: a different count means a key
        # given twice (json keeps the last one silently; another reader may take the
        # first), or a header to look at closely
        if isinstance(header, dict) and entries != len(header) - ("__metadata__" in header):
            header = json.loads(raw, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise CkptError(
            f"corrupt safetensors header: {exc.args[0]!r} appears twice "
            "(readers disagree on which one counts)",
            path=path,
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:  # (also a number of 5,000 digits)
        raise CkptError(f"corrupt safetensors header ({exc})", path=path) from None
    except RecursionError:  # json recurses once per nesting level
        raise CkptError("corrupt safetensors header (nested too deep)", path=path) from None
    if not isinstance(header, dict):
        raise CkptError("corrupt safetensors header (not a JSON object)", path=path)
    check_header(header, path)
    return header, 8 + n


def check_header(header: dict[str, Any], path: str) -> None:
    """What the safetensors library requires of a header beyond JSON, so that ckpttool
    reads no file the library refuses: ``__metadata__`` maps strings to strings, and
    every key and metadata value is valid Unicode (JSON can escape a lone surrogate,
    which no UTF-8 text holds).

    Raises:
        CkptError: Saying which rule the header breaks.
    """
    metadata = header.get("__metadata__")
    if metadata is not None and not isinstance(metadata, dict):
        raise CkptError("corrupt safetensors header (__metadata__ is not an object)", path=path)
    if metadata and not all(type(v) is str for v in metadata.values()):
        raise CkptError(
            "corrupt safetensors header (__metadata__ values must be strings)", path=path
        )
    for text in itertools.chain(header, metadata or (), (metadata or {}).values()):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise CkptError(
                f"corrupt safetensors header: {text!r:.80} is not valid Unicode", path=path
            ) from None


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


def check_layout(refs: dict[str, TensorRef], data_start: int, data_len: int, path: str) -> None:
    """The tensors' bytes follow each other from the start of the data section to its
    end, as the safetensors library requires. No overlap: a small file must not make a
    huge output by naming the same bytes a million times; no gap, nothing after.

    Raises:
        CkptError: Naming the first tensor out of place.
    """
    sources = ((name, r.storage.source) for name, r in refs.items())  # type: ignore[union-attr]
    spans = [(s.offset, s.length, name) for name, s in sources]  # type: ignore[union-attr]
    if any(a[:2] > b[:2] for a, b in itertools.pairwise(spans)):  # in file order: no sort
        spans.sort()
    end = data_start
    for start, nbytes, name in spans:
        if start != end:
            what = "overlap another tensor's" if start < end else "leave a gap after the previous"
            raise CkptError(
                f"tensor {name!r}: its bytes {what} (corrupt safetensors file)", path=path
            )
        end = start + nbytes
    if end != data_start + data_len:
        raise CkptError(
            f"{data_start + data_len - end} bytes after the last tensor (corrupt safetensors file)",
            path=path,
        )


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
    data_len = sources.getsize(path) - data_start
    metadata = header.pop("__metadata__", None) or {}  # (checked by read_header)
    root = {}
    for name, info in header.items():
        root[name] = tensor_ref(path, name, info, data_start, data_len)
    check_layout(root, data_start, data_len, path)
    add_tied(root, metadata)
    return Checkpoint(format=FORMAT, files=[path], root=root, metadata=dict(metadata))


def add_tied(tensors: dict[str, Any], metadata: dict[str, str]) -> None:
    """The tied names a file's metadata records (``{"lm_head.weight": "wte.weight"}``,
    as safetensors' ``save_model`` and ckpttool write a weight saved once for two
    names), each the same tensor as the one it names, after it: what ``load_model``
    gives back. An entry that names no tensor of the file, or a name it holds, is
    plain metadata."""
    for alias, kept in metadata.items():
        if alias not in tensors and kept in tensors and alias != "format":
            tensors[alias] = tensors[kept]


def _integers(values: Any) -> tuple[int, ...]:
    """A JSON list of integers, as the library reads it: ``true``, ``4.0`` or ``"4"`` is
    no size (``int()`` would take each, and 4.5 as 4).

    Raises:
        TypeError: Anything else.
    """
    if type(values) is not list or not all(type(v) is int for v in values):
        raise TypeError("not a list of integers")
    return tuple(values)


def tensor_ref(path: str, name: str, info: Any, data_start: int, data_len: int) -> TensorRef:
    """A lazy tensor for one header entry, after checking it against the data section."""
    try:
        dt = SAFETENSORS_DTYPES[info["dtype"]]
        shape = _integers(info["shape"])
        begin, end = _integers(info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CkptError(f"corrupt safetensors header entry {name!r}", path=path) from None
    numel = math.prod(shape)
    if (
        min(shape, default=0) < 0
        or not 0 <= begin <= end <= data_len
        or end - begin != numel * dt.itemsize
    ):
        raise CkptError(
            f"tensor {name!r}: offsets do not match its shape or the file (truncated or corrupt)",
            path=path,
        )
    storage = StorageRef(name, dt, numel, "cpu", ByteSpan(path, data_start + begin, end - begin))
    try:
        return TensorRef(
            dtype=dt, shape=shape, stride=contiguous_stride(shape), offset=0, storage=storage
        )
    except CkptError as exc:  # a shape no tensor has (TensorRef checks every one)
        raise CkptError(f"tensor {name!r}: {exc.message}", path=path) from None
