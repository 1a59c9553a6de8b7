"""Units of work: fixed-size byte ranges of a plan's output files, and how one is written.

A unit is ``[k * unit_bytes, (k + 1) * unit_bytes)`` of one planned file (the last one
of a file shorter). The cut depends only on the plan and the unit size, never on the
number of processes, so work done at one world size is reused at any other. A unit
covers parts of pieces: a tensor larger than a unit is split over several, headers
and small tensors share one.

:func:`write_unit` writes one unit's bytes through any sink that has what it uses of
:class:`~ckpttool.writers.output_file.OutputFile` (``write``, ``copy_from``,
``begin_crc32``/``end_crc32`` and ``inputs``, the open input files): a local file
opened at the unit's offset here, a multipart upload's part elsewhere. Pieces built from
CRCs (a zip's CRC fields and central directory) are written as zeros; :func:`piece_crcs`
combines the CRCs of the tensor runs the units wrote (:func:`crc32_combine`, no byte
read back), and the one who completes the output builds them (see :mod:`.ranks`).
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..dtypes import DType
from ..errors import CkptError
from ..progress import Progress
from ..sizes import env_size
from ..tree import Leaf, ShardedRef, TensorRef, flat_runs, raw_block
from ..tree import raw_parts as stored_parts  # (the stored tensors; writers.raw_parts: --dtype too)
from ..writers import (
    CHUNK_BYTES,
    FilePlan,
    Piece,
    Plan,
    box_bytes,
    box_layout,
    cast_stored,
    output_dtype,
    raw_parts,
    tensor_bytes,
    tensor_for_write,
)

UNIT_BYTES = 64 << 20  # the largest unit: big enough that its fsync and journal line cost nothing
# A smaller output is cut into about this many units (at least MIN_UNIT_BYTES each): a
# rank never gives up a unit it took, so the run can end up to one unit after the others
# at the slowest rank's speed, and that tail must stay a small part of the run.
UNITS_WANTED = 128
MIN_UNIT_BYTES = 4 << 20
UNIT_ALIGN = 1 << 20  # units start aligned for O_DIRECT
UNIT_BYTES_ENV = "CKPTTOOL_UNIT_BYTES"  # tests cut small outputs into many units
_RESOLVING = threading.Lock()  # (units may be written from several threads)

# (piece offset, start within the piece, length, CRC-32 of those bytes)
CrcRun = tuple[int, int, int, int]


def unit_bytes(plan: Plan) -> int:
    """The unit size for ``plan``: ``$CKPTTOOL_UNIT_BYTES`` when set (a multiple of 4096
    keeps the writes aligned for ``O_DIRECT``), else the output's bytes over
    :data:`UNITS_WANTED`, between :data:`MIN_UNIT_BYTES` and :data:`UNIT_BYTES`. It
    depends on the plan alone, never on the number of processes, so work done at one
    world size is reused at any other."""
    size = env_size(UNIT_BYTES_ENV)
    if size is None:
        return default_unit_bytes(sum(file.size for file in plan.files))
    return size


def default_unit_bytes(total: int) -> int:
    """The unit size for an output of ``total`` bytes (see :func:`unit_bytes`)."""
    wanted = -(-total // UNITS_WANTED // UNIT_ALIGN) * UNIT_ALIGN
    return min(UNIT_BYTES, max(MIN_UNIT_BYTES, wanted))


@dataclass(frozen=True)
class Unit:
    """One unit of work: ``[start, end)`` of ``plan.files[file]``; ``id`` its index in
    :func:`plan_units`' list (the same for every process and every run of one plan)."""

    id: int
    file: int
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def plan_units(plan: Plan, size: int) -> list[Unit]:
    """Every unit of ``plan``, file by file, front to back.

    Raises:
        CkptError: The pieces of a file do not tile it (an internal error).
    """
    units: list[Unit] = []
    for index, file in enumerate(plan.files):
        at = 0
        for piece in file.pieces:
            if piece.offset != at:
                raise CkptError(f"internal error: {file.name or 'output'} has a gap at {at}")
            at = piece.end
        if at != file.size:
            raise CkptError(f"internal error: {file.name or 'output'} planned {file.size} bytes")
        for start in range(0, file.size, size):
            units.append(Unit(len(units), index, start, min(start + size, file.size)))
    return units


def pieces_in(file: FilePlan, start: int, end: int) -> Iterator[tuple[Piece, int, int]]:
    """The pieces of ``file`` that ``[start, end)`` covers: (piece, start within the
    piece, length)."""
    offsets = [p.offset for p in file.pieces]
    i = max(0, bisect.bisect_right(offsets, start) - 1)
    while i < len(file.pieces) and file.pieces[i].offset < end:
        piece = file.pieces[i]
        lo, hi = max(start, piece.offset), min(end, piece.end)
        if hi > lo:
            yield piece, lo - piece.offset, hi - lo
        i += 1


def write_unit(plan: Plan, unit: Unit, out: Any, progress: Progress | None = None) -> list[CrcRun]:
    """Write ``unit``'s bytes into ``out`` (a sink positioned at ``unit.start``).

    Returns:
        The CRC-32 of every run of a CRC-keeping piece (a zip entry's tensor) it wrote.
    """
    runs: list[CrcRun] = []
    for piece, start, length in pieces_in(plan.files[unit.file], unit.start, unit.end):
        if piece.data is not None:
            out.write(memoryview(piece.data)[start : start + length])
        elif piece.build is not None:
            out.write(bytes(length))  # built from the CRCs once every unit is written
        else:
            if start == 0:
                piece.check_invariants()
            if piece.crc:
                out.begin_crc32()
            write_leaf_range(out, piece.leaf, piece.cast, start, length, progress)
            if piece.crc:
                runs.append((piece.offset, start, length, out.end_crc32()))
    return runs


def write_leaf_range(
    out: Any, leaf: Leaf, cast: Any, start: int, length: int, progress: Progress | None = None
) -> None:
    """Append bytes ``[start, start + length)`` of one tensor's output bytes to ``out``.

    Stored bytes that need no change are copied from their file, only the range asked
    for (memory: the sink's buffers); stored bytes that need a cast only, the range's
    elements a chunk at a time. Bytes that need more of torch (a view, a byte swap,
    shards split along other dims) are made for the whole tensor, then the range taken.
    """
    if _copy_blocks_in_range(out, leaf, cast, start, length, progress):
        return
    parts, stored, boxes = _resolved(leaf, cast)
    if stored is not None:  # only a cast: the range's elements, a chunk at a time
        _cast_range(out, stored, leaf.dtype, output_dtype(leaf, cast), start, length, progress)
        return
    if boxes is not None:  # blocks split along other dims: the range's rows, a window at a time
        for chunk in box_bytes(boxes, leaf, cast, start, length):
            out.write(chunk)
            if progress:
                progress(len(chunk))
        return
    if parts is None:
        tensor = tensor_for_write(leaf, cast)
        view = tensor_bytes(tensor)[start : start + length]
        for at in range(0, len(view), CHUNK_BYTES):
            chunk = view[at : at + CHUNK_BYTES]
            out.write(chunk)
            if progress:
                progress(len(chunk))
        del view, tensor
        return
    pos, end = 0, start + length
    for ref in parts:
        lo, hi = max(start, pos), min(end, pos + ref.nbytes)
        if hi > lo:
            _copy_range(out, ref, lo - pos, hi - lo, progress)
        pos += ref.nbytes
        if pos >= end:
            break


def _copy_blocks_in_range(
    out: Any, leaf: Leaf, cast: Any, start: int, length: int, progress: Progress | None
) -> bool:
    """Copy bytes ``[start, start + length)`` of a sharded tensor whose blocks are runs
    of its bytes straight from the blocks they lie in, resolving only those (a unit of a
    tensor saved by 2048 ranks opens the ~256 chunk zips it covers, not all 2048);
    False, nothing written, where any of them cannot be copied as stored (the caller
    then writes the range the general way: the same bytes)."""
    if not isinstance(leaf, ShardedRef) or output_dtype(leaf, cast) != leaf.dtype:
        return False
    layout = _block_layout(leaf)
    if layout is None:
        return False
    starts, runs = layout
    size, end = leaf.dtype.itemsize, start + length
    pieces = []
    i = max(bisect.bisect_right(starts, start) - 1, 0)
    while i and starts[i - 1] == starts[i]:  # an empty block shares its start
        i -= 1
    while i < len(runs) and starts[i] < end:
        first, count, shard = runs[i]
        lo, hi = max(start, starts[i]), min(end, starts[i] + count * size)
        if hi > lo:
            ref = shard.tensor.tensor_ref()
            if not raw_block(ref, leaf, count):
                return False
            pieces.append((ref, lo - starts[i], hi - lo))
        i += 1
    for ref, at, nbytes in pieces:
        _copy_range(out, ref, at, nbytes, progress)
    return True


_LAYOUTS: OrderedDict[int, tuple[Leaf, Any]] = OrderedDict()


def _block_layout(leaf: ShardedRef) -> tuple[list[int], list] | None:
    """(each block's first byte, :func:`~ckpttool.tree.flat_runs`) of a sharded tensor, for
    the last few tensors (its units come one after another): metadata only."""
    with _RESOLVING:
        hit = _LAYOUTS.get(id(leaf))
        if hit is not None and hit[0] is leaf:
            _LAYOUTS.move_to_end(id(leaf))
            return hit[1]  # type: ignore[no-any-return]
    runs = flat_runs(leaf)
    layout = None if runs is None else ([r[0] * leaf.dtype.itemsize for r in runs], runs)
    with _RESOLVING:
        _LAYOUTS[id(leaf)] = (leaf, layout)
        while len(_LAYOUTS) > _RESOLVED_LEAVES:
            _LAYOUTS.popitem(last=False)
    return layout


_RESOLVED: OrderedDict[tuple[int, str | None], tuple[Leaf, Any, Any, Any]] = OrderedDict()
_RESOLVED_LEAVES = 8


def _resolved(leaf: Leaf, cast: Any) -> tuple[Any, Any, Any]:
    """(:func:`raw_parts` of the leaf as written, the stored parts where only a cast
    stands between), for the last few leaves written: a process writes the units of a
    big tensor one after another, and resolving its parts opens every block's file (a
    tensor of a DCP folder saved by 2048 ranks: 2048 zips, ~1.5 s) once per tensor, not
    once per unit. The leaf is held with its parts, so its id is not reused meanwhile."""
    key = (id(leaf), getattr(cast, "name", None))
    with _RESOLVING:
        hit = _RESOLVED.get(key)
        if hit is not None and hit[0] is leaf:
            _RESOLVED.move_to_end(key)
            return hit[1], hit[2], hit[3]
    parts = raw_parts(leaf, cast)
    stored = stored_parts(leaf) if parts is None else None
    boxes = box_layout(leaf) if parts is None and stored is None else None
    with _RESOLVING:
        _RESOLVED[key] = (leaf, parts, stored, boxes)
        while len(_RESOLVED) > _RESOLVED_LEAVES:
            _RESOLVED.popitem(last=False)
    return parts, stored, boxes


def _cast_range(
    out: Any, parts: list, dtype: DType, target: DType, start: int, length: int, progress: Any
) -> None:
    """Bytes ``[start, start + length)`` of stored elements cast to ``target``: only the
    elements they hold are read and cast (:func:`~ckpttool.writers.casts.cast_stored`:
    the same bytes as the whole tensor's cast, element by element)."""
    for view in cast_stored(parts, dtype, target, start, length):
        out.write(view)
        if progress:
            progress(len(view))


def _copy_range(out: Any, ref: Any, skip: int, nbytes: int, progress: Progress | None) -> None:
    source = ref.storage.source if ref.storage is not None else None
    if source is None:
        raise CkptError("tensor has no stored data (saved on the meta device)")
    base = ref.offset * ref.dtype.itemsize + skip
    if source.data is None:
        if base < 0 or base + nbytes > source.length:
            raise CkptError("read outside of the stored bytes (truncated file?)", path=source.path)
        if source.path is None:
            raise CkptError("tensor bytes have no file")
        source.resolve(out.inputs)
        out.copy_from(source.path, source.offset + base, nbytes, progress)
        return
    for at in range(0, nbytes, CHUNK_BYTES):
        chunk = source.read(base + at, min(CHUNK_BYTES, nbytes - at))
        out.write(chunk)
        if progress:
            progress(len(chunk))


# ------------------------------------------------------------------ CRC-32 of pieces


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, row) for row in matrix]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's
    ``crc32_combine``: ``crc1`` advanced over ``len2`` zero bytes in GF(2), then xor)."""
    if len2 <= 0:
        return crc1  # crc32(b"") is 0
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four
    while True:
        even = _gf2_square(odd)  # the first pass: one zero byte
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def piece_crcs(plan: Plan, runs: Iterable[tuple[int, CrcRun]]) -> list[dict[int, int]]:
    """The CRC-32 of every CRC-keeping piece, by file index then piece offset, from the
    runs the units wrote (``(file index, run)``).

    Raises:
        CkptError: A piece's runs do not cover it exactly (an internal error).
    """
    by_piece: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for index, (offset, start, length, crc) in runs:
        by_piece.setdefault((index, offset), []).append((start, length, crc))
    crcs: list[dict[int, int]] = [{} for _ in plan.files]
    for index, file in enumerate(plan.files):
        for piece in file.pieces:
            if piece.leaf is None or not piece.crc:
                continue
            crc, at = 0, 0
            for start, length, run_crc in sorted(by_piece.get((index, piece.offset), [])):
                if start != at:
                    raise CkptError(f"internal error: no CRC for bytes {at}.. of a piece")
                crc = crc32_combine(crc, run_crc, length) if at else run_crc
                at += length
            if at != piece.nbytes:
                raise CkptError(f"internal error: no CRC for bytes {at}.. of a piece")
            crcs[index][piece.offset] = crc
    return crcs


# ------------------------------------------------------------------ the plan's identity


def plan_digest(plan: Plan, size: int) -> str:
    """A hash of everything that decides the output's bytes, but the input bytes
    themselves (the inputs' identities are hashed beside it, see :mod:`.journal`):
    the files, every piece's place and kind, the bytes known now, where each tensor's
    bytes are read from and how they are cast; and the unit size."""
    h = hashlib.sha256(f"units {size}\n".encode())
    for planned in plan.files:
        h.update(f"file {planned.name!r} {planned.size} {len(planned.pieces)}\n".encode())
        for piece in planned.pieces:
            h.update(f"{piece.offset} {piece.nbytes} ".encode())
            if piece.data is not None:
                h.update(b"d" + hashlib.sha256(piece.data).digest())
            elif piece.build is not None:
                h.update(f"b{piece.needs}".encode())
            else:
                h.update(f"t{piece.crc} {getattr(piece.cast, 'name', None)}".encode())
                h.update(_leaf_identity(piece.leaf).encode())
    return h.hexdigest()


def _leaf_identity(leaf: Leaf) -> str:
    """Where a tensor's bytes come from, named from what the plan knows already: no
    block is resolved, no file opened. (Resolving every chunk of a DCP folder saved by
    2048 ranks opens millions of zips: 12 minutes of every rank's CPU for a 405B model.)
    The files themselves are identified beside the digest (size and mtime of each), so
    naming the places in them is enough."""
    if isinstance(leaf, TensorRef):
        return " " + _ref_where(leaf)
    if isinstance(leaf, ShardedRef):
        blocks = ",".join(f"{s.offsets}+{s.sizes}={_block_where(s.tensor)}" for s in leaf.shards)
        return f" {leaf.dtype.name}{leaf.shape} {blocks}"
    return f" {type(leaf).__name__} {getattr(leaf, 'dtype', None)} {getattr(leaf, 'shape', None)}"


def _ref_where(ref: TensorRef) -> str:
    source = ref.storage.source if ref.storage is not None else None
    return (
        f"{getattr(source, 'path', None)}@{getattr(source, 'offset', 0)}+{ref.offset}"
        f":{ref.dtype.name}{ref.shape}{ref.stride}"
    )


def _block_where(block: Any) -> str:
    """A block's place: its own ``where()`` where it has one (a DCP chunk, another rank's
    shard: named without reading), else its stored tensor's (already in memory)."""
    where = getattr(block, "where", None)
    if callable(where):
        return str(where())
    cast = getattr(block, "cast_to", None)
    return _ref_where(block.tensor_ref()) + (f" as {cast.name}" if cast is not None else "")
