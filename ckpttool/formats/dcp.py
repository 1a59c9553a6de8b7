"""``dcp``: a ``torch.distributed.checkpoint`` folder, ``.metadata`` plus ``*.distcp`` files.

``.metadata`` is a pickle (read with the restricted unpickler) that maps each
flattened key to its global size and chunks, and each chunk to a byte span of a
``.distcp`` file. With the default ``FileSystemWriter`` every span is a complete
``torch.save`` zip; non-tensor values are pickled the same way.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import CkptError
from ..policy import MAX_NESTING
from ..tree import (
    ByteSource,
    Checkpoint,
    DType,
    Shard,
    ShardedRef,
    StorageRef,
    TensorRef,
    contiguous_stride,
    state_attrs,
)
from .torch_zip import checkpoint
from .zip_pickle import ZIP_MAGIC, ZipPickle

FORMAT = "dcp"
METADATA_FILE = ".metadata"
RANK_FILE_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


def detect(path: str, head: bytes) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_FILE))


_attrs = state_attrs


class DcpChunk:
    """A span of a ``.distcp`` file holding one chunk: a ``torch.save`` zip, or raw bytes."""

    def __init__(self, path: str, offset: int, length: int, dtype: DType, sizes: tuple, transforms):
        self.path = path
        self.offset = offset
        self.length = length
        self.dtype = dtype
        self.sizes = sizes
        self.transforms = transforms

    def tensor_ref(self) -> TensorRef:
        if self.transforms:
            raise CkptError(
                f"chunk stored with transforms {list(self.transforms)} is not supported",
                path=self.path,
            )
        if not os.path.isfile(self.path):
            raise CkptError("missing .distcp file", path=self.path)
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            head = f.read(4)
        if head == ZIP_MAGIC:
            with ZipPickle(self.path, self.offset, self.length) as archive:
                ref = archive.load()
            if not isinstance(ref, TensorRef):
                raise CkptError("corrupt chunk: not a tensor", path=self.path)
            return ref
        # SerializationFormat.SAFETENSORS-style raw bytes.
        ref = TensorRef(self.dtype, self.sizes, contiguous_stride(self.sizes), 0, None)
        if self.length != ref.nbytes:
            raise CkptError("corrupt chunk: size does not match", path=self.path)
        ref.storage = StorageRef(
            "raw", self.dtype, ref.numel, "cpu", ByteSource(self.path, self.offset, self.length)
        )
        return ref

    def load(self, map_location: Any = "cpu") -> Any:
        return self.tensor_ref().load(map_location)


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    meta_path = os.path.join(path, METADATA_FILE)
    seen: set[str] = set()
    with open(meta_path, "rb") as f:
        from ..unpickler import load_pickle

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
    planner = meta.get("planner_data") if isinstance(meta.get("planner_data"), dict) else {}
    ranks = {
        m.group(1)
        for i in spans.values()
        if (m := RANK_FILE_RE.match(str(i.get("relative_path", ""))))
    }
    world_size = len(ranks) or None
    files = sorted({os.path.join(path, str(i.get("relative_path"))) for i in spans.values()})

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
            value = _tensor(path, fqn, _attrs(entry), spans, world_size)
        elif kind == "BytesStorageMetadata":
            value = _bytes_value(path, fqn, spans, permissive, seen)
        else:
            raise CkptError(f"corrupt DCP .metadata entry {fqn!r}", path=meta_path)
        root = set_element(root, obj_path, value)
    ckpt = checkpoint(FORMAT, [meta_path, *files], root, seen)
    ckpt.world_size = world_size
    return ckpt


def _span(folder: str, fqn: str, offset: tuple | None, spans: dict) -> tuple[str, int, int, Any]:
    info = spans.get((fqn, offset))
    if info is None:
        raise CkptError(f"no stored data for {fqn!r} (incomplete checkpoint)", path=folder)
    rel = str(info.get("relative_path"))
    if os.path.basename(rel) != rel:
        raise CkptError(f"storage path {rel!r} leaves the folder", path=folder)
    return (
        os.path.join(folder, rel),
        int(info["offset"]),
        int(info["length"]),
        info.get("transform_descriptors"),
    )


def _tensor(folder: str, fqn: str, entry: dict, spans: dict, world_size: int | None) -> ShardedRef:
    props = _tensor_properties(entry.get("properties"))
    dt = props.get("dtype")
    size = entry.get("size")
    if not isinstance(dt, DType) or not isinstance(size, tuple):
        raise CkptError(f"corrupt DCP metadata for {fqn!r}", path=folder)
    shards = []
    for chunk in entry.get("chunks") or []:
        c = _attrs(chunk)
        offsets, sizes = tuple(c.get("offsets") or ()), tuple(c.get("sizes") or ())
        file, start, length, transforms = _span(folder, fqn, offsets, spans)
        shards.append(Shard(offsets, sizes, DcpChunk(file, start, length, dt, sizes, transforms)))
    return ShardedRef(
        dt,
        size,
        shards,
        device="cpu",
        kind="dcp",
        requires_grad=bool(props.get("requires_grad")),
        world_size=world_size,
    )


def _tensor_properties(obj: Any) -> dict:
    # TensorProperties pickles its fields as a tuple: (dtype, layout, requires_grad, ...).
    state = getattr(obj, "state", None)
    if isinstance(state, tuple) and len(state) >= 3:
        return {"dtype": state[0], "requires_grad": state[2]}
    return _attrs(obj)


def _bytes_value(folder: str, fqn: str, spans: dict, permissive: bool, seen: set[str]) -> Any:
    file, start, length, transforms = _span(folder, fqn, None, spans)
    if transforms:
        raise CkptError(f"value {fqn!r} stored with transforms is not supported", path=folder)
    if not os.path.isfile(file):
        raise CkptError(f"missing .distcp file (it holds the value {fqn!r})", path=file)
    with ZipPickle(file, start, length) as archive:
        return archive.load(permissive=permissive, seen=seen)


def set_element(root: Any, path: tuple, value: Any) -> Any:
    """Place ``value`` at ``path``, creating dicts (str keys) and lists (int keys) as DCP does."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(key, int):
        root = root if isinstance(root, list) else []
        while len(root) <= key:
            root.append(None)
        root[key] = set_element(root[key] if root[key] is not None else {}, rest, value)
    else:
        root = root if isinstance(root, dict) else {}
        root[key] = set_element(root.get(key, {}), rest, value)
    return root
