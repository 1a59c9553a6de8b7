"""An output file written as the numbered parts of a multipart upload, from its plan.

A planned file (:class:`~ckpttool.writers.plan.FilePlan`) is cut into parts of one
size (:func:`part_size_for`: at least 8 MiB, at most 10,000 parts), part ``n``
holding bytes ``[(n-1)*size, n*size)``. :class:`PartSink` has the surface of an
:class:`~ckpttool.writers.output_file.OutputFile` (``write``, ``copy_from``,
``patch``, the CRC calls), so :func:`~ckpttool.writers.plan.write` writes into it as
into a file; each part is handed to ``send`` (an upload, on a bounded pool of threads)
as soon as its bytes are final. Memory: the part being filled, the parts being sent,
and a part held back while it holds a field that needs a CRC not known yet (a zip's
local header waits for its tensor's CRC: that part goes once the tensor is written;
the central directory comes last anyway). No byte goes to a local file.

A run of parts (:func:`write_parts`: ``first..last``, any process, any order) reads
only what those parts need: the input bytes of pieces before the run are skipped, and
those after it only where a CRC the run's own bytes need is computed. A field whose
CRC lies in another run is written as zeros and its part is *deferred*: written again
by :func:`write_parts` with ``crcs`` given (the CRCs every run reported), as S3 lets a
part number be uploaded again before the upload is completed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

from .. import sources
from ..errors import CkptError
from ..progress import Progress
from ..sources import OpenFiles, local_fd
from ..writers import FilePlan, OutputFile, Part, Piece, write

PART_BYTES = 8 << 20  # the smallest part size chosen (S3's minimum is 5 MiB)
MAX_PARTS = 10_000
MAX_PART_BYTES = 5 << 30
UPLOAD_THREADS = 4  # parts sent at once, per file
SCRATCH_BYTES = 1 << 20  # bytes outside the run that a CRC still needs pass through here
SPANS_PER_PART = 8  # a remote input fills one part with this many ranges, side by side

# send(number, bytes) -> what the upload gave (a PartDone), or None
Send = Callable[[int, memoryview], Any]


def part_size_for(size: int, wanted: int | None = None) -> int:
    """The part size of a file of ``size`` bytes: ``wanted`` (or 8 MiB), raised to fit
    the file in 10,000 parts (a whole MiB).

    Raises:
        CkptError: The file cannot be one S3 object (over 10,000 parts of 5 GiB).
    """
    part = max(1, wanted or PART_BYTES)
    if size > part * MAX_PARTS:
        need = -(-size // MAX_PARTS)
        part = -(-need // (1 << 20)) * (1 << 20)
    if part > MAX_PART_BYTES:
        raise CkptError(
            f"a file of {size} bytes cannot be one S3 object (10,000 parts of at most 5 GiB)",
            hint="write shards: --to safetensors --max-shard-size",
        )
    return part


def part_count(size: int, part_size: int) -> int:
    """How many parts a file of ``size`` bytes is: at least one (an empty file's part is empty)."""
    return max(1, -(-size // part_size))


def part_range(size: int, part_size: int, number: int) -> tuple[int, int]:
    """The bytes ``[start, stop)`` of part ``number`` (1-based)."""
    start = (number - 1) * part_size
    return start, min(size, start + part_size)


@dataclass
class RunResult:
    """What writing a run of parts left.

    Attributes:
        sent: What ``send`` returned, by part number (the parts written and final).
        crcs: The CRC-32 of the pieces that keep one and start in the run, by offset
            (every run's together are what the deferred parts need).
        deferred: Parts not sent: they hold a field built from CRCs of pieces that
            start in other runs; write them again with ``crcs`` given.
    """

    sent: dict[int, Any] = field(default_factory=dict)
    crcs: dict[int, int] = field(default_factory=dict)
    deferred: list[int] = field(default_factory=list)


def write_parts(
    file: FilePlan,
    part_size: int,
    send: Send,
    *,
    first: int = 1,
    last: int | None = None,
    crcs: Mapping[int, int] | None = None,
    progress: Progress | None = None,
    threads: int = UPLOAD_THREADS,
    on_sent: Callable[[Mapping[int, int], bool], None] | None = None,
) -> RunResult:
    """Write parts ``first..last`` of ``file`` (all by default), handing each to ``send``.

    Args:
        file: The planned file.
        part_size: Bytes per part (the last may be shorter).
        send: ``send(number, data)`` uploads one part (called on a pool of threads; the
            view is valid during the call only).
        first, last: The run of parts (1-based, inclusive).
        crcs: CRCs already known of pieces anywhere in the file (by offset): fields
            built from them are written as they are, never deferred.
        progress: Called with the tensor bytes written.
        threads: Parts sent at once.
        on_sent: ``on_sent(crcs, last)``, called (in this thread) each time a part is
            sent, with the CRCs computed so far by offset, and once more at the end
            (``last``: also when interrupted; the CRCs are the plan's, whatever was
            sent): a journal keeps them, so a rerun need not read those tensors again.
    """
    count = part_count(file.size, part_size)
    last = count if last is None else last
    if not 1 <= first <= last <= count:
        raise ValueError(f"parts {first}..{last} of a file of {count} parts")
    start, stop = (first - 1) * part_size, min(file.size, last * part_size)
    known = dict(crcs or {})
    # the pieces the run holds bytes of, and an empty one at its start (its CRC is this run's)
    pieces = [p for p in file.pieces if p.offset < stop and (p.end > start or p.offset >= start)]
    run_pieces: list[Piece] = []
    for piece in pieces:
        if piece.build is not None and all(n in known for n in piece.needs):
            piece = dataclasses.replace(piece, data=piece.build(known), build=None, needs=())
        elif piece.build is not None and known:  # waits for the CRCs not known only
            left = tuple(n for n in piece.needs if n not in known)
            build = functools.partial(_with_known, piece.build, known)
            piece = dataclasses.replace(piece, build=build, needs=left)
        elif piece.crc and piece.offset < start:
            piece = dataclasses.replace(piece, crc=False)  # its CRC is another run's
        run_pieces.append(piece)
    computed = {p.offset for p in run_pieces if p.crc}
    ends = {p.offset: p.end for p in file.pieces}
    hold: dict[int, int] = {}  # part index -> the position from which its bytes are final
    deferred: set[int] = set()
    for piece in run_pieces:
        if piece.build is None:
            continue
        parts = range(
            piece.offset // part_size, (max(piece.end, piece.offset + 1) - 1) // part_size + 1
        )
        if not all(n in computed for n in piece.needs):
            deferred.update(k + 1 for k in parts)
            continue
        ready = max((ends[n] for n in piece.needs), default=0)
        if ready > piece.offset:  # written as zeros, patched once the CRC is known
            for k in parts:
                hold[k] = max(hold.get(k, 0), ready)
    result = RunResult(deferred=sorted(n for n in deferred if first <= n <= last))
    with PartSink(
        send,
        size=file.size,
        part_size=part_size,
        start=start,
        stop=stop,
        at=run_pieces[0].offset if run_pieces else start,
        hold=hold,
        drop=deferred,
        threads=threads,
        on_sent=on_sent,
    ) as sink:
        if run_pieces:
            # (the sink has OutputFile's surface: plan.write writes into it as into a file)
            written = write(Part(file, run_pieces), cast(OutputFile, sink), progress)
            result.crcs = {o: c for o, c in written.crcs.items() if o in computed}
    result.sent = sink.sent
    return result


def _with_known(build: Callable[[Mapping[int, int]], bytes], known: Mapping[int, int],
                crcs: Mapping[int, int]) -> bytes:  # fmt: skip
    return build({**known, **crcs})


class PartSink:
    """The parts of a file's bytes ``[start, stop)``, each sent once final.

    It has :class:`~ckpttool.writers.output_file.OutputFile`'s surface; bytes outside
    ``[start, stop)`` are dropped (not even read from a local or remote input, unless a
    CRC is being computed over them).

    Args:
        send: ``send(number, data)``, on a pool of ``threads`` threads.
        size: The file's size.
        part_size: Bytes per part.
        start, stop: The bytes sent (whole parts: ``start`` a part boundary, ``stop``
            one or the file's end).
        at: The offset of the first byte written (the first piece's, at or before ``start``).
        hold: Part index -> the position from which its bytes are final (a field
            patched once a CRC is known): it is held until writing passes it.
        drop: Part numbers never sent (deferred).
        on_sent: As :func:`write_parts` says.
    """

    def __init__(
        self,
        send: Send,
        *,
        size: int,
        part_size: int,
        start: int = 0,
        stop: int | None = None,
        at: int | None = None,
        hold: Mapping[int, int] | None = None,
        drop: set[int] | frozenset[int] = frozenset(),
        threads: int = UPLOAD_THREADS,
        on_sent: Callable[[Mapping[int, int], bool], None] | None = None,
    ) -> None:
        self.size, self.part_size = size, part_size
        self.start, self.stop = start, size if stop is None else stop
        self.pos = start if at is None else at
        self.inputs = OpenFiles()
        self.sent: dict[int, Any] = {}
        self._send, self._hold, self._drop = send, dict(hold or {}), set(drop)
        self._threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self._threads, "ckpttool-upload")
        self._inflight: deque[tuple[int, Future[Any], bytearray]] = deque()
        self._free: list[bytearray] = []
        self._made = 0
        self._buffers: dict[int, bytearray] = {}  # part index -> its buffer (filling, held)
        self._held: set[int] = set()
        self._scratch: memoryview | None = None
        self._crc: int | None = None
        self._crc_at = 0
        self.crcs: dict[int, int] = {}  # the CRC of the pieces written, by offset
        self._on_sent = on_sent
        self._lock = threading.Lock()

    def __enter__(self) -> PartSink:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            if exc_type is None:
                self._finish()
        finally:
            self._pool.shutdown(wait=True)
            self.inputs.close()
            if self._on_sent is not None:  # also when interrupted: the CRCs are the plan's
                self._on_sent(self.crcs, True)

    # ------------------------------------------------------------ appending
    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._release()
        while len(view):
            target = self._room(len(view))
            if target is None:  # outside the run, no CRC: dropped
                n = self._skippable(len(view))
                self.pos += n
                view = view[n:]
                continue
            target[:] = view[: len(target)]
            self._filled(target)
            view = view[len(target) :]

    def copy_from(self, path: str, offset: int, nbytes: int, progress: Progress | None) -> None:
        """Append ``nbytes`` at ``offset`` of ``path``, read straight into the part's
        buffer (a local file with ``preadv``, a URL by ranges side by side)."""
        self._release()
        fd = local_fd(path, self.inputs)
        done = 0
        while done < nbytes:
            target = self._room(nbytes - done)
            if target is None:
                n = self._skippable(nbytes - done)
                self.pos += n
            elif fd is not None:
                try:
                    n = os.preadv(fd, [target], offset + done)
                except OSError as exc:  # the input's fault, not the output's
                    raise CkptError(f"cannot read the input ({exc.strerror})", path=path) from None
                if n == 0:
                    raise CkptError("input ends early (truncated)", path=path)
                self._filled(target[:n])
                sources.source_for(path).count(n)
            else:
                step = max(1, -(-len(target) // SPANS_PER_PART))
                at = offset + done
                spans = [(target[i : i + step], at + i) for i in range(0, len(target), step)]
                sources.source_for(path).read_spans(path, spans)
                n = len(target)
                self._filled(target)
            done += n
            if progress:
                progress(n)

    def _inside(self) -> bool:
        return self.start <= self.pos < self.stop

    def _skippable(self, nbytes: int) -> int:
        """Bytes from ``pos`` that can be dropped unseen: up to the run's start."""
        if self.pos < self.start:
            return min(nbytes, self.start - self.pos)
        return nbytes

    def _room(self, nbytes: int) -> memoryview | None:
        """Where the next bytes go (at most ``nbytes`` of the part being filled, or of a
        scratch buffer outside the run while a CRC is computed); None: drop them."""
        if not self._inside():
            if self._crc is None:
                return None
            if self._scratch is None:
                self._scratch = memoryview(bytearray(SCRATCH_BYTES))
            limit = self.start - self.pos if self.pos < self.start else nbytes
            return self._scratch[: min(nbytes, limit, SCRATCH_BYTES)]
        index = self.pos // self.part_size
        buffer = self._buffers.get(index)
        if buffer is None:
            buffer = self._buffers[index] = self._buffer()
        part_start = index * self.part_size
        part_end = min(part_start + self.part_size, self.size)
        at = self.pos - part_start
        return memoryview(buffer)[at : at + min(nbytes, part_end - self.pos)]

    def _filled(self, view: memoryview) -> None:
        if self._crc is not None:
            self._crc = zlib.crc32(view, self._crc)
        index = self.pos // self.part_size
        inside = self._inside()
        self.pos += len(view)
        if inside and self.pos == min((index + 1) * self.part_size, self.size):
            self._part_done(index)

    def _part_done(self, index: int) -> None:
        """Part ``index`` is written: sent now, or held until its patches are in."""
        if self._hold.get(index, 0) >= self.pos:
            self._held.add(index)
        else:
            self._submit(index)

    def _release(self) -> None:
        """Send the held parts whose patches are in (writing passed their position)."""
        for index in sorted(self._held):
            if self._hold[index] <= self.pos:
                self._held.discard(index)
                self._submit(index)

    # ------------------------------------------------------------ buffers, sending
    def _buffer(self) -> bytearray:
        """A free part buffer: a new one while fewer than ``threads + 1`` are in use by
        parts being filled or sent, else the oldest send's once it is done."""
        if self._free:
            return self._free.pop()
        if self._made - len(self._held) >= self._threads + 1 and self._inflight:
            self._wait_oldest()
            return self._free.pop()
        self._made += 1
        return bytearray(self.part_size)

    def _wait_oldest(self) -> None:
        number, future, buffer = self._inflight.popleft()
        self.sent[number] = future.result()  # a failed send raises here
        self._free.append(buffer)
        if self._on_sent is not None:
            self._on_sent(self.crcs, False)

    def _submit(self, index: int) -> None:
        buffer = self._buffers.pop(index)
        number = index + 1
        if number in self._drop:
            self._free.append(buffer)
            return
        start = index * self.part_size
        nbytes = min(start + self.part_size, self.size) - start
        view = memoryview(buffer)[:nbytes]
        future = self._pool.submit(self._send, number, view)
        self._inflight.append((number, future, buffer))

    def _finish(self) -> None:
        self._release()
        if self.pos < self.stop:
            raise CkptError(f"internal error: {self.stop - self.pos} bytes of the run not written")
        if self.size == 0 and self.start == 0 and 1 not in self._drop:  # empty: one empty part
            self._buffers[0] = bytearray()
            self._submit(0)
        if self._held:
            raise CkptError(f"internal error: parts {sorted(self._held)} never patched")
        while self._inflight:
            self._wait_oldest()

    # ------------------------------------------------------------ checksums, patches
    def begin_crc32(self) -> None:
        self._crc, self._crc_at = 0, self.pos

    def end_crc32(self) -> int:
        crc, self._crc = self._crc, None
        if crc is None:
            raise RuntimeError("end_crc32 without begin_crc32")
        self.crcs[self._crc_at] = crc
        return crc

    def patch(self, offset: int, data: bytes) -> None:
        """Rewrite bytes written earlier: in their part's buffer (being filled, or held
        for this); outside the run, nothing."""
        done = 0
        while done < len(data):
            where = offset + done
            index = where // self.part_size
            n = min(len(data) - done, (index + 1) * self.part_size - where)
            if self.start <= where < self.stop and index + 1 not in self._drop:
                buffer = self._buffers.get(index)
                if buffer is None:
                    raise CkptError(f"internal error: part {index + 1} patched after it was sent")
                at = where - index * self.part_size
                buffer[at : at + n] = data[done : done + n]
            done += n
