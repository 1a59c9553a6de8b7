"""``dcp``: a ``torch.distributed.checkpoint`` folder, ``.metadata`` plus ``*.distcp`` files.

``.metadata`` is a pickle (read with the restricted unpickler) that maps each
flattened key to its global size and chunks, and each chunk to a byte span of a
``.distcp`` file. With the default ``FileSystemWriter`` every span is a complete
``torch.save`` zip; non-tensor values are pickled the same way.

``FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)`` instead
appends one safetensors blob to each file, and every tensor span of that file
points at the blob's start: the blob's header (keyed by the flattened key, with
each chunk's offsets in ``DCP_SHARDING_INFO``) says where the bytes are.
"""

from __future__ import annotations

from typing import Any

from ... import sources
from ...dtypes import DType
from ...errors import CkptError
from ...heap import release_freed_memory
from ...sources import open_input
from ...tree import Checkpoint, Shard, ShardedRef, check_coverage, state_attrs
from ...unpickler import MAX_NESTING
from ..made import checkpoint
from .chunks import (
    FORMAT,
    METADATA_FILE,
    RANK_FILE_RE,
    DcpChunk,
    bytes_value,
    data_file,
    dcp_tensor,
    set_element,
    shared_spans,
    span,
    tensor_properties,
)


def detect(path: str, head: bytes) -> bool:
    """A folder holding ``.metadata``, or one of its files (``.metadata`` or a ``.distcp``
    file): a file holds some chunks of some tensors, or their index, which mean nothing
    without the folder, so the folder is read."""
    return _folder(path) is not None


def is_part_name(name: str) -> bool:
    """Whether a file named ``name`` is a part of a DCP folder (read as that folder)."""
    return name.endswith(".distcp") or name == METADATA_FILE


def _folder(path: str) -> str | None:
    if is_part_name(sources.basename(path)) and not sources.isdir(path):
        return sources.dirname(path) or "."  # read names a missing .metadata
    if sources.isdir(path) and sources.isfile(sources.join(path, METADATA_FILE)):
        return path
    return None


_attrs = state_attrs


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    try:
        return _read(path, permissive)
    finally:  # (a .metadata of millions of chunks frees far more than it keeps)
        release_freed_memory()


def _read(path: str, permissive: bool) -> Checkpoint:
    path = _folder(path) or path
    meta_path = sources.join(path, METADATA_FILE)
    if not sources.isfile(meta_path):
        raise CkptError(
            "a DCP data file, but its folder has no .metadata (incomplete checkpoint)",
            path=path,
        )
    from . import metadata, runs

    # (None: not plain; the next reader reads the file from the start)
    fast = runs.read(path, meta_path, permissive) or metadata.read(path, meta_path, permissive)
    if fast is not None:
        return fast
    seen: set[str] = set()
    meta, entries, spans = _read_metadata(meta_path, permissive, seen)
    shared = shared_spans(spans, meta_path)
    planner_data = meta.get("planner_data")
    planner = planner_data if isinstance(planner_data, dict) else {}
    ranks = {
        m.group(1)
        for i in spans.values()
        if (m := RANK_FILE_RE.match(str(i.get("relative_path", ""))))
    }
    world_size = len(ranks) or None
    files = sorted({data_file(path, i, meta_path) for i in spans.values()})

    root: Any = {}
    for fqn, entry in entries.items():
        obj_path = planner.get(fqn)
        obj_path = tuple(obj_path) if isinstance(obj_path, (tuple, list)) and obj_path else (fqn,)
        if len(obj_path) > MAX_NESTING:  # set_element recurses once per level
            raise CkptError(
                f"corrupt DCP .metadata: the key path of {fqn!r} nests deeper than "
                f"{MAX_NESTING} levels",
                path=meta_path,
            )
        kind = type(entry).__name__
        if kind == "TensorStorageMetadata":
            value = _tensor(path, fqn, _attrs(entry), spans, world_size, shared)
        elif kind == "BytesStorageMetadata":
            value = bytes_value(path, fqn, spans, permissive, seen, shared)
        else:
            raise CkptError(f"corrupt DCP .metadata entry {fqn!r}", path=meta_path)
        try:
            root = set_element(root, obj_path, value, len(entries))
        except CkptError as exc:
            raise CkptError(exc.message, path=meta_path) from None
    ckpt = checkpoint(FORMAT, [meta_path, *files], root, seen)
    ckpt.world_size = world_size
    return ckpt


def _read_metadata(
    meta_path: str, permissive: bool, seen: set[str]
) -> tuple[dict, dict, dict[tuple, dict]]:
    """(``.metadata``'s attributes, its state_dict_metadata, its storage entries by
    (fqn, offsets)), read with the restricted unpickler."""
    from ...unpickler import load_pickle

    with open_input(meta_path) as f:
        metadata = load_pickle(f, path=meta_path, permissive=permissive, seen=seen)
    meta = _attrs(metadata)
    entries = meta.get("state_dict_metadata")
    if not isinstance(entries, dict):
        raise CkptError("corrupt DCP .metadata (no state_dict_metadata)", path=meta_path)
    spans: dict[tuple, dict] = {}
    for index, info in (meta.get("storage_data") or {}).items():
        key = _attrs(index)
        offset = key.get("offset")
        spans[(key.get("fqn"), tuple(offset) if offset is not None else None)] = _attrs(info)
    return meta, entries, spans


def data_spans(folder: str, *, permissive: bool = False) -> dict[str, list[tuple[int, int]]]:
    """Every data file's spans as ``.metadata`` names them: ``{file: [(offset, length)]}``,
    each span once, in file order (tensor chunks and pickled values alike: ``verify``
    checks each span's archive). Reads ``.metadata`` again (a checkpoint read before
    judged it; ``permissive`` as then).

    Raises:
        CkptError: No ``.metadata``, or a storage entry that is not a span of a file in
            the folder.
    """
    meta_path = sources.join(folder, METADATA_FILE)
    _, _, spans = _read_metadata(meta_path, permissive, set())
    shared_spans(spans, meta_path)  # (every span a pair of sizes)
    by_file: dict[str, set[tuple[int, int]]] = {}
    for info in spans.values():
        file = data_file(folder, info, meta_path)
        by_file.setdefault(file, set()).add((int(info["offset"]), int(info["length"])))
    return {file: sorted(found) for file, found in by_file.items()}


def _tensor(
    folder: str,
    fqn: str,
    entry: dict,
    spans: dict,
    world_size: int | None,
    shared: set[tuple[str, int]],
) -> ShardedRef:
    props = tensor_properties(entry.get("properties"))
    dt = props.get("dtype")
    size = entry.get("size")
    if not isinstance(dt, DType) or not isinstance(size, tuple):
        raise CkptError(f"corrupt DCP metadata for {fqn!r}", path=folder)
    shards = []
    for chunk in entry.get("chunks") or []:
        c = _attrs(chunk)
        offsets, sizes = tuple(c.get("offsets") or ()), tuple(c.get("sizes") or ())
        file, start, length, transforms, many = span(folder, fqn, offsets, spans, shared)
        chunk = DcpChunk(file, start, length, dt, sizes, transforms, fqn, offsets, many)
        shards.append(Shard(offsets, sizes, chunk))
    # .metadata alone says which chunks exist: one missing or overlapping another
    # would leave parts of the merged tensor uninitialised
    check_coverage(fqn, size, shards)
    return dcp_tensor(dt, size, shards, props, world_size)
