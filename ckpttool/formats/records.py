"""Records kept out of memory past a few megabytes: the chunk table of a DCP
``.metadata``, and the every-rank shard metadata of ShardedTensor rank files.

The one room both scale readers share (one floor below them: no family imports the
other's). A folder saved by thousands of ranks has millions of chunks (a 405B-shaped
one of 2048 ranks: 7 M), and every rank of a distributed conversion reads them all:
held in memory, even at ~36 bytes a chunk, they alone pass the 256 MiB a rank may use,
and grow with the world size. So the opcode readers (:mod:`ckpttool.formats.skeleton.metadata_runs`,
:mod:`ckpttool.formats.dcp.runs`, :mod:`ckpttool.formats.skeleton.shard_runs`,
:mod:`ckpttool.formats.per_rank.blocks`) write each chunk as a fixed-size record to a
:class:`Spill` (memory while small, then an unnamed temporary file), names every
tuple and string by a number (:class:`Interned`: the distinct ones are few, a few per
rank and shape), groups the records by tensor and by data file on disk, a block at a
time (:func:`group_rows`), and keeps per tensor only where its rows are. A consumer
reads a tensor's rows when it asks for its chunks
(:class:`~ckpttool.formats.dcp.chunks.DcpChunks`), a tensor at a time.
"""

from __future__ import annotations

import os
import tempfile
import threading
from abc import abstractmethod
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import numpy as np

if TYPE_CHECKING:
    from ..tree import Shard

# a storage entry: its tensor's and data file's names, its offsets (``Interned``
# numbers; -1: a byte value's, no offsets), where its bytes are in the data file
STORAGE = np.dtype(
    [("fqn", "<i4"), ("path", "<i4"), ("key", "<i4"), ("start", "<i8"), ("length", "<i8")]
)
CHUNK = np.dtype([("offsets", "<i4"), ("sizes", "<i4")])  # a chunk of a tensor's list
# a tensor's chunk, joined to its stored bytes: what DcpChunks reads
ROW = np.dtype(
    [("start", "<i8"), ("length", "<i8"), ("path", "<i4"), ("offsets", "<i4"), ("sizes", "<i4")]
)

IN_MEMORY = 8 << 20  # bytes a spill keeps in memory before it moves to a file
BLOCK_ROWS = 1 << 18  # records a pass over a spill holds at a time

T = TypeVar("T", bound=Hashable)


class Spill:
    """Append-only bytes, in memory up to ``IN_MEMORY``, past it in an unnamed temporary
    file (``tempfile``'s directory: ``TMPDIR``); read back by offset from any thread.
    The file is gone once the spill is (unlinked at creation)."""

    def __init__(self) -> None:
        self._memory: bytearray | None = bytearray()
        self._file: Any = None
        self.size = 0
        self._lock = threading.Lock()

    def append(self, data: Any) -> int:
        """Write ``data`` (bytes or an array) at the end; its offset."""
        raw = _raw(data)
        with self._lock:
            at = self.size
            self._write(at, raw)
            return at

    def reserve(self, nbytes: int) -> int:
        """``nbytes`` of zeros at the end, to be written with :meth:`write_at`; their offset."""
        with self._lock:
            at = self.size
            if self._memory is not None and at + nbytes <= IN_MEMORY:
                self._memory.extend(bytes(nbytes))
            else:
                self._to_file()
                os.ftruncate(self._file.fileno(), at + nbytes)
            self.size = at + nbytes
            return at

    def write_at(self, at: int, data: Any) -> None:
        raw = _raw(data)
        if at + raw.nbytes > self.size:
            raise ValueError("write past the spill's end")
        with self._lock:
            self._write(at, raw)

    def read(self, at: int, nbytes: int) -> bytes:
        if not 0 <= at <= at + nbytes <= self.size:
            raise ValueError("read past the spill's end")
        memory = self._memory
        if memory is not None:
            return bytes(memory[at : at + nbytes])
        out = bytearray(nbytes)
        view, done = memoryview(out), 0
        while done < nbytes:
            n = os.preadv(self._file.fileno(), [view[done:]], at + done)
            if n <= 0:
                raise OSError("the spill file is shorter than written")
            done += n
        return bytes(out)

    def records(self, dtype: np.dtype, at: int, count: int) -> np.ndarray:
        """``count`` records of ``dtype`` from offset ``at`` (a fresh array)."""
        return np.frombuffer(self.read(at, count * dtype.itemsize), dtype)

    def _write(self, at: int, raw: memoryview) -> None:
        end = at + raw.nbytes
        if self._memory is not None and end > IN_MEMORY:
            self._to_file()
        if self._memory is not None:
            self._memory[at:end] = raw
        else:
            done = 0
            while done < raw.nbytes:
                done += os.pwrite(self._file.fileno(), raw[done:], at + done)
        self.size = max(self.size, end)

    def _to_file(self) -> None:
        if self._memory is None:
            return
        self._file = tempfile.TemporaryFile(prefix="ckpttool-chunks-")
        self._file.write(self._memory)
        self._file.flush()
        self._memory = None


def _raw(data: Any) -> memoryview:
    """The bytes of ``data`` (an array's: records of a structured dtype too)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8)
    return memoryview(data).cast("B")


class SpilledShards(Sequence):
    """One sharded tensor's shards kept as records of a spill, each
    :class:`~ckpttool.tree.Shard` made when read (a DCP tensor's chunks, a per-rank
    tensor's blocks): a subclass makes ``count`` of them from the ``first``."""

    __slots__ = ()
    _count: int

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Shard: ...
    @overload
    def __getitem__(self, index: slice) -> list[Shard]: ...
    def __getitem__(self, index: int | slice) -> Shard | list[Shard]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -self._count <= index < self._count:
            raise IndexError("shard index out of range")
        return next(iter(self._shards(index % self._count, 1)))

    def __iter__(self) -> Iterator[Shard]:
        return iter(self._shards(0, self._count))

    @abstractmethod
    def _shards(self, first: int, count: int) -> Iterator[Shard]: ...


class Interned(Generic[T]):
    """Distinct values numbered in order of first sight (a chunk's offsets, a name)."""

    def __init__(self) -> None:
        self.ids: dict[T, int] = {}
        self.values: list[T] = []

    def id(self, value: T) -> int:
        n = self.ids.get(value)
        if n is None:
            n = self.ids[value] = len(self.values)
            self.values.append(value)
        return n

    def ids_of(self, values: list[T] | tuple[T, ...]) -> list[int]:
        got = list(map(self.ids.get, values))
        if None in got:
            list(map(self.id, values))
            got = list(map(self.ids.__getitem__, values))
        return got  # type: ignore[return-value]


def blocks(
    parts: list[tuple[Spill, int, int] | np.ndarray], dtype: np.dtype
) -> Iterator[np.ndarray]:
    """The records of ``parts`` in order, ``BLOCK_ROWS`` at a time (the last fewer): each
    part a spill's ``(spill, offset, count)`` or an array in memory. (Parts are often
    small, a frame's run and the entry after it: blocks join them, so that a pass
    over the table costs a few calls per block, not per part.)"""
    pending: list[np.ndarray] = []
    held = 0
    for piece in _pieces(parts, dtype):
        while len(piece):
            take = piece[: BLOCK_ROWS - held]
            pending.append(take)
            held += len(take)
            piece = piece[len(take) :]
            if held == BLOCK_ROWS:
                yield np.concatenate(pending) if len(pending) > 1 else pending[0]
                pending, held = [], 0
    if held:
        yield np.concatenate(pending) if len(pending) > 1 else pending[0]


def _pieces(
    parts: list[tuple[Spill, int, int] | np.ndarray], dtype: np.dtype
) -> Iterator[np.ndarray]:
    """Each part's records, at most ``BLOCK_ROWS`` read at a time; spill parts that
    lie one after the other read together."""
    run: tuple[Spill, int, int] | None = None  # adjacent spill parts so far
    for part in [*parts, None]:
        if run is not None and isinstance(part, tuple):
            spill, at, count = part
            if spill is run[0] and at == run[1] + run[2] * dtype.itemsize:
                run = (spill, run[1], run[2] + count)
                continue
        if run is not None:
            spill, at, count = run
            for first in range(0, count, BLOCK_ROWS):
                n = min(BLOCK_ROWS, count - first)
                yield spill.records(dtype, at + first * dtype.itemsize, n)
            run = None
        if isinstance(part, tuple):
            run = part
        elif part is not None:
            yield part


def group_rows(
    passes: Callable[[], Iterator[np.ndarray]], field: str, groups: int
) -> tuple[Spill, np.ndarray]:
    """The records ``passes()`` gives (twice), grouped by ``field`` (a number in
    ``range(groups)``) into a new spill, each group's in the order given; and each
    group's first row there (``groups + 1`` of them: group g is rows
    ``first[g]:first[g + 1]``). A counting sort, a block at a time: one write per
    group per block."""
    counts = np.zeros(groups, np.int64)
    dtype = None
    for block in passes():
        dtype = block.dtype
        counts += np.bincount(block[field], minlength=groups)[:groups]
    first = np.concatenate(([0], np.cumsum(counts)))
    out = Spill()
    if dtype is None:
        return out, first
    base = out.reserve(int(first[-1]) * dtype.itemsize)
    filled = first[:-1].copy()
    for block in passes():
        order = np.argsort(block[field], kind="stable")
        ordered = block[order]
        keys, starts, lengths = np.unique(ordered[field], return_index=True, return_counts=True)
        for key, start, n in zip(keys.tolist(), starts.tolist(), lengths.tolist(), strict=True):
            out.write_at(base + int(filled[key]) * dtype.itemsize, ordered[start : start + n])
            filled[key] += n
    return out, first
