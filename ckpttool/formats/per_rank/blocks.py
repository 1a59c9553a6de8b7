"""Where each block of a per-rank checkpoint's sharded tensors lies, kept as records
on disk past a few megabytes.

A per-rank checkpoint (:mod:`ckpttool.formats.per_rank`) of a 70B model saved by 256
ranks has 2,169 sharded tensors in every file: 555 K blocks, each one rank's piece of
one tensor. Held as objects (a :class:`~ckpttool.tree.Shard`, the block's
:class:`~ckpttool.tree.TensorRef` with its storage and byte span, the leaf of the
file that held it), each costs about 2 KB, and every rank of a distributed conversion
held them all. Here a block is two fixed-size records in spills
(:class:`~ckpttool.formats.records.Spill`), their tuples and names numbered
(:class:`~ckpttool.formats.records.Interned`: the distinct ones are a few per
shape and rank):

* :class:`Places`: where the block lies in its global tensor and which rank's file
  holds it (``PLACE``, 16 bytes). :class:`RankBlocks` is one tensor's blocks, as a
  sequence of shards made when read.
* :class:`Locations`: where the block's bytes lie in its rank's file (``LOCATION``,
  52 bytes), recorded when that file is read, by this process or by another of the
  same command (:meth:`Locations.export` and :meth:`Locations.take`: the records
  travel compressed); a block's TensorRef is made again from them when its data is
  needed.

A block the records cannot say (a quantized or conjugate view, a remote file's zip
entry whose header is checked on first read) keeps its object, as before; another
process then reads that file itself.
"""

from __future__ import annotations

import base64
import json
import math
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ...dtypes import DTYPES
from ...errors import CkptError
from ...sources import ByteSpan
from ...tree import Shard, StorageRef, TensorRef
from ..records import Interned, Spill, SpilledShards, blocks, group_rows

# a block's place: its tensor (the n-th sharded leaf), the rank whose file holds it (its
# place among the files' ranks: a file's name may claim any number), its offsets and
# sizes (numbers of ``Interned`` tuples)
PLACE = np.dtype([("tensor", "<i4"), ("rank", "<i4"), ("offsets", "<i4"), ("sizes", "<i4")])
# where a block's bytes lie in its file: the TensorRef's offset and stride, its storage
# (``meta``: the numbered dtype, device... of the tensor and its storage; ``key``: the
# numbered name of the storage), the storage's bytes in the file and its element count
LOCATION = np.dtype(
    [
        ("tensor", "<i4"),
        ("offsets", "<i4"),
        ("sizes", "<i4"),
        ("stride", "<i4"),
        ("meta", "<i4"),
        ("key", "<i4"),
        ("offset", "<i8"),
        ("start", "<i8"),
        ("length", "<i8"),
        ("numel", "<i8"),
    ]
)


INT64 = 2**63


class Places:
    """Every block's place, as the files tell it (in any order), then grouped by tensor
    (:meth:`group`)."""

    def __init__(self, tuples: Interned[tuple]):
        self.tuples = tuples
        self._added = Spill()
        self._rows = Spill()  # after group(): each tensor's rows, one after the other
        self._first = np.zeros(1, np.int64)

    def add(
        self, tensors: list[int], ranks: list[int], offsets: list[int], sizes: list[int]
    ) -> None:
        """Blocks of ``tensors`` (their numbers) held by ``ranks``; ``offsets`` and ``sizes``
        numbered by :attr:`tuples`."""
        rows = np.empty(len(tensors), PLACE)
        rows["tensor"], rows["rank"] = tensors, ranks
        rows["offsets"], rows["sizes"] = offsets, sizes
        self._added.append(rows)

    def group(self, count: int) -> None:
        """Group the places added by tensor (``count`` of them), each tensor's in the
        order added."""
        added: list[tuple[Spill, int, int] | np.ndarray] = [
            (self._added, 0, self._added.size // PLACE.itemsize)
        ]
        self._rows, self._first = group_rows(lambda: blocks(added, PLACE), "tensor", count)
        self._added = Spill()

    def rows(self, tensor: int) -> np.ndarray:
        """The places of one tensor's blocks, in the order added."""
        first, end = int(self._first[tensor]), int(self._first[tensor + 1])
        return self._rows.records(PLACE, first * PLACE.itemsize, end - first)


def kept_blocks(rows: np.ndarray, filled: np.ndarray, replicas: bool) -> np.ndarray:
    """``rows`` without empty blocks (a rank that holds nothing of a tensor), and where
    ``replicas`` (a DTensor's ``Replicate``) the first of the blocks at one place only.
    ``filled``: :func:`nonempty` of the numbered tuples."""
    rows = rows[filled[rows["sizes"]]]
    if replicas and len(rows):
        pairs = rows["offsets"].astype(np.int64) << 32 | rows["sizes"].astype(np.int64)
        _, first = np.unique(pairs, return_index=True)
        rows = rows[np.sort(first)]
    return rows


class RankBlocks(SpilledShards):
    """One sharded tensor's blocks, as ``PLACE`` records of a spill: its
    :class:`~ckpttool.tree.Shard` objects and their :class:`RankShard` blocks are made
    when read, not held (see the module's docstring)."""

    __slots__ = ("_spill", "_at", "_count", "_tuples", "_ranks", "_block")

    def __init__(
        self,
        spill: Spill,
        at: int,
        count: int,
        tuples: list[tuple],
        ranks: list[int],  # a record's ``rank`` -> the rank
        block: Callable[[int, tuple, tuple], Any],  # (rank, offsets, sizes) -> its Block
    ):
        self._spill, self._at, self._count = spill, at, count
        self._tuples, self._ranks, self._block = tuples, ranks, block

    def _shards(self, first: int, count: int) -> Iterator[Shard]:
        rows = self._spill.records(PLACE, self._at + first * PLACE.itemsize, count)
        tuples, ranks, block = self._tuples, self._ranks, self._block
        for r, o, n in zip(
            rows["rank"].tolist(), rows["offsets"].tolist(), rows["sizes"].tolist(), strict=True
        ):
            rank, offsets, sizes = ranks[r], tuples[o], tuples[n]
            yield Shard(offsets, sizes, block(rank, offsets, sizes), rank)


class Locations:
    """Where each block of the rank files read so far lies in its file."""

    def __init__(self, tuples: Interned[tuple]):
        self.tuples = tuples
        self._metas: Interned[tuple] = Interned()
        self._keys: Interned[str] = Interned()  # the storages' names
        self._spill = Spill()
        # rank -> (first record, count, each record's tensor where not one per tensor)
        self._files: dict[int, tuple[int, int, np.ndarray | None]] = {}
        self._objects: dict[tuple[int, int, int, int], Any] = {}  # what records can't say
        self._disagree: dict[int, set[int]] = {}  # a file's tensors that differ from the lowest's
        self._odd: set[int] = set()  # the ranks with blocks in ``_objects``

    def has(self, rank: int) -> bool:
        return rank in self._files

    def add_file(
        self,
        rank: int,
        path: str,
        stored: list[tuple[int, tuple, Any]],  # (a TensorRef, or what a pickle made)
        tensors: int,
        disagree: set[int],
    ) -> None:
        """Record the blocks of rank ``rank``'s file ``path``: ``stored`` holds each one's
        ``(tensor, offsets, stored tensor)``, in order of tensor, of ``tensors`` in all;
        ``disagree``: the tensors whose leaf differs from the lowest rank's (refused by
        name when their data is asked for)."""
        ids = self.tuples.id
        rows = np.zeros(len(stored), LOCATION)
        columns: dict[str, list[int]] = {name: [] for name in LOCATION.names or ()}
        for tensor, offsets, ref in stored:
            columns["tensor"].append(tensor)
            columns["offsets"].append(ids(offsets))
            columns["sizes"].append(ids(ref.shape))
            found = _location(ref, path)
            if found is None:  # kept as it is
                self._objects[(rank, tensor, ids(offsets), ids(ref.shape))] = ref
                self._odd.add(rank)
                found = (None, "", (), 0, 0, 0, 0)
            meta, key, stride, offset, start, length, numel = found
            columns["meta"].append(-1 if meta is None else self._metas.id(meta))
            columns["key"].append(self._keys.id(key))
            columns["stride"].append(ids(stride))
            columns["offset"].append(offset)
            columns["start"].append(start)
            columns["length"].append(length)
            columns["numel"].append(numel)
        for name, values in columns.items():
            rows[name] = values
        self._add_rows(rank, rows, tensors, disagree)

    def _add_rows(self, rank: int, rows: np.ndarray, tensors: int, disagree: set[int]) -> None:
        at = self._spill.append(rows)
        order = rows["tensor"]
        dense = len(rows) == tensors and bool((order == np.arange(tensors)).all())
        self._files[rank] = (at, len(rows), None if dense else order.copy())
        if disagree:
            self._disagree[rank] = disagree

    def export(self, rank: int) -> dict | None:
        """Rank ``rank``'s recorded blocks as plain data, for another process that has
        not read its file (:meth:`take`): the records compressed, their tuples and metas
        listed. None where a block kept its object (the other process reads the file)."""
        if rank in self._odd:
            return None
        at, count, _ = self._files[rank]
        rows = self._spill.records(LOCATION, at, count).copy()
        tuples, metas, keys = self.tuples.values, self._metas.values, self._keys.values
        ids = np.concatenate([rows["offsets"], rows["sizes"], rows["stride"]])
        distinct, local = np.unique(ids, return_inverse=True)
        rows["offsets"], rows["sizes"], rows["stride"] = np.split(local.astype("<i4"), 3)
        distinct_metas, rows["meta"] = np.unique(rows["meta"], return_inverse=True)
        distinct_keys, rows["key"] = np.unique(rows["key"], return_inverse=True)
        return {
            "rows": base64.b64encode(zlib.compress(rows.tobytes(), 1)).decode("ascii"),
            "tuples": [tuples[i] for i in distinct.tolist()],
            "metas": [_plain_meta(metas[i]) for i in distinct_metas.tolist()],
            # (one string, not thousands: a file's storages are named "0", "1", ...)
            "keys": json.dumps([keys[i] for i in distinct_keys.tolist()]),
            "disagree": sorted(self._disagree.get(rank, ())),
        }

    def take(self, rank: int, data: dict, tensors: int) -> None:
        """Record rank ``rank``'s blocks as another process read them (:meth:`export`);
        ``tensors`` as for :meth:`add_file`."""
        raw = zlib.decompress(base64.b64decode(data["rows"]))
        rows = np.frombuffer(raw, LOCATION).copy()
        tuple_ids = np.array([self.tuples.id(tuple(t)) for t in data["tuples"]] or [0], "<i4")
        meta_ids = np.array([self._metas.id(_meta(m)) for m in data["metas"]] or [0], "<i4")
        for field in ("offsets", "sizes", "stride"):
            rows[field] = tuple_ids[rows[field]]
        rows["meta"] = meta_ids[rows["meta"]]
        keys = json.loads(data["keys"])
        key_ids = np.array([self._keys.id(str(k)) for k in keys] or [0], "<i4")
        rows["key"] = key_ids[rows["key"]]
        self._add_rows(rank, rows, tensors, set(data["disagree"]))

    def disagrees(self, rank: int, tensor: int) -> bool:
        return tensor in self._disagree.get(rank, ())

    def ref(
        self, rank: int, path: str, tensor: int, offsets: tuple, sizes: tuple
    ) -> TensorRef | None:
        """The stored tensor of rank ``rank``'s block of ``tensor`` at ``offsets`` (its
        file ``path``, already recorded), or None if the file holds no such block."""
        at, count, order = self._files[rank]
        if order is None:
            candidates = [tensor]
        else:
            lo, hi = np.searchsorted(order, [tensor, tensor + 1]).tolist()
            candidates = list(range(lo, hi))
        offsets_id, sizes_id = self.tuples.ids.get(offsets), self.tuples.ids.get(sizes)
        if offsets_id is None or sizes_id is None:
            return None
        for i in candidates:
            row = self._spill.records(LOCATION, at + i * LOCATION.itemsize, 1)[0].tolist()
            _, offsets_at, sizes_at, stride, meta, key, offset, start, length, numel = row
            if offsets_at != offsets_id or sizes_at != sizes_id:
                continue
            if meta < 0:
                return self._objects[(rank, tensor, offsets_id, sizes_id)]
            (dtype, device, requires_grad, parameter, s_dtype, s_device, big_endian) = (
                self._metas.values[meta]
            )
            source = ByteSpan(path, start, length)
            storage = StorageRef(
                self._keys.values[key], s_dtype, numel, s_device, source, big_endian
            )
            return TensorRef(
                dtype,
                sizes,
                self.tuples.values[stride],
                offset,
                storage,
                device=device,
                requires_grad=requires_grad,
                parameter=parameter,
            )
        return None


def _plain_meta(meta: tuple) -> list:
    """A meta as plain data (dtypes by name), for :meth:`Locations.export`."""
    dtype, device, requires_grad, parameter, s_dtype, s_device, big_endian = meta
    return [dtype.name, device, requires_grad, parameter, s_dtype.name, s_device, big_endian]


def _meta(plain: list) -> tuple:
    """:func:`_plain_meta` read back."""
    dtype, device, requires_grad, parameter, s_dtype, s_device, big_endian = plain
    if dtype not in DTYPES or s_dtype not in DTYPES:
        raise CkptError(f"internal error: another process named the dtype {dtype!r}")
    return (
        DTYPES[dtype], device, requires_grad, parameter, DTYPES[s_dtype], s_device, big_endian
    )  # fmt: skip


def _location(ref: Any, path: str) -> tuple | None:
    """(meta, stride, offset, start, length, numel) of a plain stored tensor of the file
    ``path``, as :class:`Locations` records it; None for what a record can't say."""
    if type(ref) is not TensorRef or ref.kind != "tensor" or ref.conj or ref.neg:
        return None
    storage = ref.storage
    if ref.quantizer is not None or storage is None or type(storage) is not StorageRef:
        return None
    source = storage.source
    if type(source) is not ByteSpan or source.path != path or source.data is not None:
        return None
    if source.unresolved():  # a remote zip entry: its header is checked on first read
        return None
    numbers = (ref.offset, source.offset, source.length, storage.numel)
    if not all(-INT64 <= n < INT64 for n in numbers):  # (the records' 64-bit fields)
        return None
    meta = (
        ref.dtype,
        ref.device,
        ref.requires_grad,
        ref.parameter,
        storage.dtype,
        storage.device,
        storage.big_endian,
    )
    return (meta, storage.key, ref.stride, ref.offset, source.offset, source.length, storage.numel)


def nonempty(tuples: list[tuple]) -> np.ndarray:
    """Whether each numbered sizes tuple holds any element (a rank may hold none)."""
    return np.array([math.prod(t) > 0 for t in tuples], bool)
