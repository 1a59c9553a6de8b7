"""The shape every writer shares: a plan, then the write of any part of it.

A writer's ``plan`` step lays the output out from tensor metadata alone (no tensor
byte is read): its files, and in each file the pieces at their offsets: bytes known
now (headers, a pickle, an index), a tensor's output bytes, or bytes known only once
the CRC-32 of other pieces is (a zip's CRC fields and central directory). The
``write`` step writes any contiguous run of pieces (a :class:`Part`) at its offsets
into an open :class:`OutputFile`, so the parts of one file can be written in any
order, or by several processes; :func:`complete` then fills in what needed the CRCs.
:func:`write_plan` does it all front to back in one process, the fast path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import DType
from ..errors import CkptError
from ..progress import Progress
from ..tree import SparseRef
from .leaf_bytes import write_leaf
from .output_file import OutputFile

Crcs = Mapping[int, int]  # the CRC-32 of pieces, by the piece's offset in its file


@dataclass(frozen=True)
class WriteOptions:
    """What a writer's ``plan`` is told besides the tensors.

    Attributes:
        cast: Cast floating-point tensors to this dtype (``--dtype``), or None.
        location: The device recorded for the tensors (``--map-location``; torch zip).
        max_shard_size: Write Hugging Face shards of at most this many bytes (safetensors).
        metadata: The safetensors header's ``__metadata__``, beside ``format: pt``.
    """

    cast: DType | None = None
    location: str | None = None
    max_shard_size: int | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Piece:
    """One run of an output file's bytes at its planned offset.

    Exactly one of ``data``, ``leaf`` or ``build`` says what the bytes are.

    Attributes:
        offset: Where it starts in its file.
        nbytes: How many bytes it is.
        data: Bytes known at plan time.
        leaf: A lazy tensor whose output bytes (cast to ``cast``) these are.
        cast: The dtype floating-point tensors are cast to, or None.
        crc: Keep the CRC-32 of these bytes (a later ``build`` needs it).
        build: Bytes known once the CRCs of the pieces at offsets ``needs`` are.
        needs: The offsets of the pieces whose CRCs ``build`` reads.
        check: A sparse tensor whose invariants are checked (by reading it) before
            these bytes, its first part, are written.
    """

    offset: int
    nbytes: int
    data: bytes | None = None
    leaf: Any = None  # a Leaf, where the bytes are a tensor's
    cast: DType | None = None
    crc: bool = False
    build: Callable[[Crcs], bytes] | None = None
    needs: tuple[int, ...] = ()
    check: SparseRef | None = None

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def check_invariants(self) -> None:
        """Read :attr:`check`'s sparse tensor whole before its first bytes are written:
        ``torch.load`` would refuse an output holding an invalid one. One rule for every
        route that writes pieces (one process, the ranks of a job).

        Raises:
            CkptError: The sparse tensor's indices break its invariants.
        """
        if self.check is not None:
            from ..tensors import load_leaf

            load_leaf(self.check, "cpu")


@dataclass
class FilePlan:
    """One output file: ``name`` inside the output folder ("" for a single-file output)."""

    name: str
    size: int
    pieces: list[Piece]

    def parts(self, max_bytes: int | None = None) -> list[Part]:
        """The file cut into contiguous parts at piece boundaries, each at most
        ``max_bytes`` where one piece is not larger (one part when None)."""
        parts: list[Part] = []
        for piece in self.pieces:
            if parts and (max_bytes is None or parts[-1].nbytes + piece.nbytes <= max_bytes):
                parts[-1].pieces.append(piece)
            else:
                parts.append(Part(self, [piece]))
        return parts


@dataclass
class Part:
    """A contiguous run of one file's pieces: what one ``write`` call writes."""

    file: FilePlan
    pieces: list[Piece]

    @property
    def offset(self) -> int:
        return self.pieces[0].offset

    @property
    def nbytes(self) -> int:
        return self.pieces[-1].end - self.pieces[0].offset


@dataclass
class Plan:
    """Every file of one output, laid out.

    Attributes:
        files: The files, in the order the front-to-back write writes them.
        names: What the output consists of, for the result (file names).
    """

    files: list[FilePlan]
    names: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """The tensor bytes: exactly what the writes report to a :data:`Progress`."""
        return sum(p.nbytes for f in self.files for p in f.pieces if p.leaf is not None)

    def parts(self, max_bytes: int | None = None) -> Iterator[Part]:
        for file in self.files:
            yield from file.parts(max_bytes)


def file_path(target: str, file: FilePlan) -> str:
    """Where ``file`` goes: ``target`` itself for a single-file output, else inside it."""
    return os.path.join(target, file.name) if file.name else target


@dataclass
class Written:
    """What writing a part leaves for :func:`complete`.

    Attributes:
        crcs: The CRC-32 of the pieces that keep one, by offset.
        pending: The offsets of the pieces written as zeros: their bytes need CRCs of
            pieces in other parts.
    """

    crcs: dict[int, int] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)

    def update(self, other: Written) -> None:
        self.crcs.update(other.crcs)
        self.pending += other.pending


def write(part: Part, out: OutputFile, progress: Progress | None = None) -> Written:
    """Write ``part`` into ``out``, an output opened at ``part.offset``.

    A piece whose bytes need CRCs not known yet (of pieces in other parts) is written
    as zeros here; :func:`complete` writes it once every part is done.
    """
    if out.pos != part.offset:
        raise CkptError(f"internal error: part at {part.offset} written at {out.pos}")
    written = Written()
    crcs = written.crcs
    # pieces written as zeros until the CRCs they need are known: offset -> (needs, build)
    waiting: dict[int, tuple[tuple[int, ...], Callable[[Crcs], bytes]]] = {}
    for piece in part.pieces:
        if piece.data is not None:
            out.write(piece.data)
        elif piece.build is not None:
            ready = all(n in crcs for n in piece.needs)
            out.write(piece.build(crcs) if ready else bytes(piece.nbytes))
            if not ready:
                waiting[piece.offset] = (piece.needs, piece.build)
        else:
            piece.check_invariants()
            if piece.crc:
                out.begin_crc32()
            write_leaf(out, piece.leaf, piece.cast, progress)
            if piece.crc:
                crcs[piece.offset] = out.end_crc32()
                # a zip entry's header waits for its data's CRC: patched now, in the
                # staging buffer while it is still there (free), else after the last
                # write; left for complete() only when its CRCs are in other parts
                for offset, (needs, build) in list(waiting.items()):
                    if all(n in crcs for n in needs):
                        out.patch(offset, build(crcs))
                        del waiting[offset]
        if out.pos != piece.end:
            raise CkptError(
                f"internal error: {out.pos - piece.offset} bytes written at {piece.offset}, "
                f"{piece.nbytes} planned"
            )
    written.pending = list(waiting)
    return written


def complete(file: FilePlan, written: Written, patch: Callable[[int, bytes], Any]) -> None:
    """Write the pieces of ``file`` that needed CRCs, once every part is written.

    Args:
        file: The file's plan.
        written: What every :func:`write` of its parts returned, merged.
        patch: ``patch(offset, data)`` writes bytes at an offset of the file.
    """
    pending = set(written.pending)
    for piece in file.pieces:
        if piece.offset in pending and piece.build is not None:
            data = piece.build(written.crcs)
            if len(data) != piece.nbytes:
                raise CkptError(f"internal error: {len(data)} bytes built, {piece.nbytes} planned")
            patch(piece.offset, data)


def write_plan(plan: Plan, target: str, progress: Progress | None = None) -> None:
    """Write every file of ``plan`` front to back, one file at a time, into ``target``
    (the output file, or the output folder): the plan as one part per file."""
    for file in plan.files:
        with OutputFile(file_path(target, file), size_hint=file.size) as out:
            written = Written()
            for part in file.parts():
                written.update(write(part, out, progress))
            complete(file, written, out.patch)


def allocate(plan: Plan, target: str) -> None:
    """Create every file of ``plan`` at its planned size: what writing parts into them
    (``OutputFile(path, offset=...)``) needs first."""
    for file in plan.files:
        path = file_path(target, file)
        if file.name:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, file.size)
        finally:
            os.close(fd)


def write_parts(
    parts: Sequence[Part], target: str, progress: Progress | None = None
) -> dict[str, Written]:
    """Write ``parts`` (of files :func:`allocate` created) in the order given, each through
    an output opened at its offset; return what they left, by file name, for
    :func:`complete_files`."""
    written: dict[str, Written] = {}
    for part in parts:
        with OutputFile(file_path(target, part.file), offset=part.offset) as out:
            written.setdefault(part.file.name, Written()).update(write(part, out, progress))
    return written


def complete_files(plan: Plan, target: str, written: Mapping[str, Written]) -> None:
    """:func:`complete` every file of ``plan`` in place, after :func:`write_parts`."""
    for file in plan.files:
        fd = os.open(file_path(target, file), os.O_WRONLY)
        try:
            done = written.get(file.name, Written())
            complete(file, done, functools.partial(_pwrite, fd))
        finally:
            os.close(fd)


def _pwrite(fd: int, offset: int, data: bytes) -> None:
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
