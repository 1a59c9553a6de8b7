"""What a DCP folder's reader and its bulk ``.metadata`` reader share: the format's names,
a chunk of a ``.distcp`` file (:class:`DcpChunk`), where a chunk's bytes lie, and how a
value of ``.metadata`` is placed in the tree."""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

from ... import sources
from ...dtypes import DType
from ...errors import CkptError
from ...tree import Shard, ShardedRef, TensorRef, state_attrs
from ..local_shards import lone_rank_shards
from ..records import ROW, Spill, SpilledShards
from ..safetensors_file import MAX_HEADER, dcp_saved_offsets
from ..safetensors_file import tensor_ref as safetensors_tensor_ref
from ..torch_save.zip_pickle import ZIP_MAGIC, ZipPickle

FORMAT = "dcp"


METADATA_FILE = ".metadata"


RANK_FILE_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


def dcp_tensor(
    dtype: DType,
    shape: tuple,
    shards: Sequence[Shard],
    properties: dict,
    world_size: int | None,
) -> ShardedRef:
    """A tensor of DCP chunks, as every reader of ``.metadata`` makes it (``properties``:
    its ``TensorProperties``' fields)."""
    return ShardedRef(
        dtype,
        shape,
        shards,
        device="cpu",
        kind="dcp",
        requires_grad=bool(properties.get("requires_grad")),
        world_size=world_size,
    )


class DcpChunks(SpilledShards):
    """The chunks of one DCP tensor, as records of a spill (:mod:`~ckpttool.formats.records`):
    its :class:`~ckpttool.tree.Shard` and :class:`DcpChunk` objects are made when read,
    not held.

    A folder saved by thousands of ranks has millions of chunks, every rank of a
    distributed conversion reads them all, and as objects each costs ~240 bytes (a
    405B-shaped folder of 2048 ranks: 7 M chunks, 1.6 GB); here a chunk is a record
    of 28 bytes in a spill (past a few MB, a temporary file), its offsets and sizes
    numbers of the tuples most chunks share. Consumers read the chunks once or twice
    per tensor, a tensor at a time.
    """

    __slots__ = ("_spill", "_at", "_count", "_tuples", "_files", "_dtype", "_fqn")

    def __init__(
        self,
        spill: Spill,
        at: int,  # where its ``ROW`` records start in ``spill``
        count: int,
        tuples: list[tuple[int, ...]],  # a record's ``offsets`` and ``sizes`` -> the tuple
        files: list[str | None],  # a record's ``path`` -> the data file
        dtype: DType,
        fqn: str,
    ):
        if count < 0 or at + count * ROW.itemsize > spill.size:
            raise CkptError(f"internal error: the chunk records of {fqn!r} are not in the spill")
        self._spill, self._at, self._count = spill, at, count
        self._tuples, self._files, self._dtype, self._fqn = tuples, files, dtype, fqn

    def _records(self, first: int = 0, count: int | None = None) -> Any:
        """The ``ROW`` records of ``count`` chunks (all) from ``first``."""
        count = self._count - first if count is None else count
        return self._spill.records(ROW, self._at + first * ROW.itemsize, count)

    def block_spans(self) -> tuple[list[str | None], Sequence[int], Sequence[int]]:
        """Each chunk's file, start and length (what :class:`DcpChunk` says of its span),
        without making the chunks."""
        rows = self._records()
        files = list(map(self._files.__getitem__, rows["path"].tolist()))
        return files, rows["start"].tolist(), rows["length"].tolist()

    def span_ends(self) -> tuple[list[str | None], Any, Any]:
        """Where each chunk's span ends, as arrays: the files (every tensor's of one
        folder: the same list), each chunk's file's place in it, its end (what
        ``inspect``'s size check reduces for millions of chunks)."""
        rows = self._records()
        return self._files, rows["path"], rows["start"] + rows["length"]

    def _shards(self, first: int, count: int) -> Iterator[Shard]:
        rows = self._records(first, count)
        tuple_of = self._tuples.__getitem__
        files = list(map(self._files.__getitem__, rows["path"].tolist()))
        offsets = list(map(tuple_of, rows["offsets"].tolist()))
        sizes = list(map(tuple_of, rows["sizes"].tolist()))
        starts, lengths = rows["start"].tolist(), rows["length"].tolist()
        return map(
            Shard,
            offsets,
            sizes,
            map(
                DcpChunk,
                files,
                starts,
                lengths,
                itertools.repeat(self._dtype),
                sizes,
                itertools.repeat(None),
                itertools.repeat(self._fqn),
                offsets,
            ),
        )


class DcpChunk:
    """A span of a ``.distcp`` file holding one chunk of ``fqn`` at ``offsets``.

    The span is a ``torch.save`` zip, or the start of the file's safetensors blob.
    """

    cast_to = None  # read as stored (tree.leaves.Block)
    # (millions of them in a folder saved by thousands of ranks)
    __slots__ = (
        *("path", "shared", "offset", "length", "dtype"),
        *("sizes", "transforms", "fqn", "offsets"),
    )

    def __init__(
        self,
        path: str,
        offset: int,
        length: int,
        dtype: DType,
        sizes: tuple,
        transforms: Any,
        fqn: str,
        offsets: tuple,
        shared: bool = False,
    ):
        self.path = path
        self.shared = shared  # other chunks name the span: it must be a safetensors blob
        self.offset = offset
        self.length = length
        self.dtype = dtype
        self.sizes = sizes
        self.transforms = transforms
        self.fqn = fqn
        self.offsets = offsets

    def where(self) -> str:
        """Where the chunk's bytes are, as ``.metadata`` says (nothing read)."""
        return f"{self.path}@{self.offset}+{self.length}:{self.dtype.name}{self.sizes}"

    def tensor_ref(self) -> TensorRef:
        if self.transforms:
            raise CkptError(
                f"chunk stored with transforms {list(self.transforms)} is not supported",
                path=self.path,
            )
        if not sources.isfile(self.path):
            raise CkptError("missing .distcp file", path=self.path)
        size = sources.getsize(self.path)
        head = bytes(sources.read(self.path, self.offset, max(0, min(4, size - self.offset))))
        if head == ZIP_MAGIC:
            if self.shared:  # a zip holds one chunk: several would repeat its bytes
                raise CkptError(
                    f"corrupt DCP .metadata: other chunks name the bytes of {self.fqn!r}",
                    path=self.path,
                )
            with ZipPickle(self.path, self.offset, self.length) as archive:
                ref = archive.load()
            if not isinstance(ref, TensorRef):
                raise CkptError("corrupt chunk: not a tensor", path=self.path)
            return ref
        return self._safetensors_ref()

    def _safetensors_ref(self) -> TensorRef:
        blob = _safetensors_blob(self.path, self.offset)
        if blob is None:
            raise CkptError(
                f"corrupt chunk of {self.fqn!r}: neither a torch.save zip nor a safetensors blob",
                path=self.path,
            )
        header, data_start, data_len = blob
        saved = (dcp_saved_offsets(header, self.path) or {}).get(self.fqn)
        if self.fqn not in header or (saved is not None and tuple(saved) != self.offsets):
            raise CkptError(
                f"the safetensors data of this file holds no chunk of {self.fqn!r} at "
                f"{list(self.offsets)} (corrupt checkpoint)",
                path=self.path,
            )
        ref = safetensors_tensor_ref(self.path, self.fqn, header[self.fqn], data_start, data_len)
        if ref.dtype.name != self.dtype.name or ref.shape != tuple(self.sizes):
            raise CkptError(
                f"chunk of {self.fqn!r}: the safetensors data says {ref.dtype.name} "
                f"{list(ref.shape)}, .metadata {self.dtype.name} {list(self.sizes)}",
                path=self.path,
            )
        return ref


def _safetensors_blob(path: str, offset: int) -> tuple[dict, int, int] | None:
    """(header, data start, data length) of a safetensors blob at ``offset``, if one is there.

    The blob ends the file (it is written last), so its data runs to the end. Every
    chunk of a file points at the same blob: its header is parsed once per version
    of the file (size and mtime are part of the cache key).
    """
    return _parse_safetensors_blob(path, offset, sources.identity(path))


@functools.lru_cache(maxsize=64)
def _parse_safetensors_blob(
    path: str, offset: int, identity: Hashable
) -> tuple[dict, int, int] | None:
    size = sources.getsize(path)
    if not 0 <= offset <= size - 9:
        return None
    head = bytes(sources.read(path, offset, 9))
    n = int.from_bytes(head[:8], "little")
    if head[8:9] != b"{" or not 2 <= n <= MAX_HEADER or offset + 8 + n > size:
        return None
    raw = bytes(sources.read(path, offset + 9, n - 1))
    try:
        header = json.loads(b"{" + raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    data_start = offset + 8 + n
    return header, data_start, size - data_start


def shared_spans(spans: dict[tuple, dict], meta_path: str) -> set[tuple[str, int]]:
    """The (file, offset) where several chunks' spans start; there must be a safetensors
    blob (see :meth:`DcpChunk.tensor_ref`).

    Each chunk has bytes of its own in its data file, as DCP writes them, or names the
    start of its file's safetensors blob, which holds each tensor once: a few bytes of
    .metadata could otherwise name one megabyte for a thousand tensors (a 1 MB folder
    read as gigabytes of tensors).

    Raises:
        CkptError: A span that is no pair of sizes, or two that overlap in part.
    """
    by_file: dict[str, list[tuple[int, int, Any]]] = {}
    for (fqn, _), info in spans.items():
        offset, length = info.get("offset"), info.get("length")
        if type(offset) is not int or type(length) is not int or min(offset, length) < 0:
            raise CkptError(f"corrupt DCP .metadata: the stored span of {fqn!r}", path=meta_path)
        file = str(info.get("relative_path"))
        by_file.setdefault(file, []).append((offset, offset + length, fqn))
    shared = set()
    for file, items in by_file.items():
        items.sort(key=lambda item: item[:2])
        reach, reaching, group = 0, None, None  # the furthest end so far, whose, its start
        for start, end, fqn in items:
            if start == group:  # the blob's start, named by several chunks
                shared.add((file, start))
            elif start < reach:
                raise CkptError(
                    f"corrupt DCP .metadata: the stored bytes of {reaching!r} and {fqn!r} "
                    f"overlap in {file}",
                    path=meta_path,
                )
            else:
                group = start
            if end > reach:
                reach, reaching = end, fqn
    return shared


def data_file(folder: str, info: dict, named_in: str) -> str:
    """The data file a storage entry names, inside the checkpoint's folder."""
    rel = str(info.get("relative_path"))
    if not sources.is_file_name(rel):
        raise CkptError(f"storage path {rel!r} leaves the folder", path=named_in)
    return sources.join(folder, rel)


def tensor_properties(obj: Any) -> dict:
    # TensorProperties pickles its fields as a tuple: (dtype, layout, requires_grad, ...).
    state = getattr(obj, "state", None)
    if isinstance(state, tuple) and len(state) >= 3:
        return {"dtype": state[0], "requires_grad": state[2]}
    return state_attrs(obj)


def bytes_value(
    folder: str,
    fqn: str,
    spans: dict,
    permissive: bool,
    seen: set[str],
    shared: set[tuple[str, int]],
) -> Any:
    file, start, length, transforms, many = span(folder, fqn, None, spans, shared)
    if many:
        raise CkptError(
            f"corrupt DCP .metadata: other entries name the bytes of {fqn!r}", path=folder
        )
    if transforms:
        raise CkptError(f"value {fqn!r} stored with transforms is not supported", path=folder)
    if not sources.isfile(file):
        raise CkptError(f"missing .distcp file (it holds the value {fqn!r})", path=file)
    with ZipPickle(file, start, length) as archive:
        value = archive.load(permissive=permissive, seen=seen)
    return lone_rank_shards(value, (fqn,))


def set_element(root: Any, path: tuple, value: Any, entries: int) -> Any:
    """Place ``value`` at ``path``, creating dicts (str keys) and lists (int keys) as DCP does.

    Every element of a saved list is an entry of ``.metadata``: a list index past the
    ``entries`` it holds would only make a list of millions of holes.

    Raises:
        CkptError: A list index below 0 or past ``entries``.
    """
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(key, int):
        if not 0 <= key < entries:
            raise CkptError(
                f"corrupt DCP .metadata: list index {key} in a key path, "
                f"past the {entries} entries it holds"
            )
        root = root if isinstance(root, list) else []
        while len(root) <= key:
            root.append(None)
        root[key] = set_element(root[key] if root[key] is not None else {}, rest, value, entries)
    else:
        root = root if isinstance(root, dict) else {}
        root[key] = set_element(root.get(key, {}), rest, value, entries)
    return root


def span(
    folder: str, fqn: str, offset: tuple | None, spans: dict, shared: set[tuple[str, int]]
) -> tuple[str, int, int, Any, bool]:
    """(data file, offset, length, transforms, whether other chunks name the span too)."""
    info = spans.get((fqn, offset))
    if info is None:
        raise CkptError(f"no stored data for {fqn!r} (incomplete checkpoint)", path=folder)
    start = int(info["offset"])
    return (
        data_file(folder, info, folder),
        start,
        int(info["length"]),
        info.get("transform_descriptors"),
        (str(info.get("relative_path")), start) in shared,
    )
