"""Read a file once, front to back, and check its zip records on the way.

``verify`` streams every file of a checkpoint through one reused buffer. The checks
that ride along are :class:`Task` objects, each a span of the file: a zip entry's
local header (checked against the central directory; it says where the entry's data
starts), the data (its CRC-32 against the directory's, inflated first where
compressed), the data descriptor after it (the CRC and sizes again). The zip
archives a file holds (the whole file; DCP: one per stored item) are found before
the stream starts, from their central directories, which the readers check.

Memory stays bounded whatever the file size: one block buffer, a header's few dozen
bytes, a deflated entry inflated a chunk at a time. No torch here.
"""

from __future__ import annotations

import abc
import contextlib
import heapq
import itertools
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Generator

from ... import sources
from ...errors import CkptError
from ...sources import OpenFiles, local_fd, read_at
from ...zip_records import LOCAL_HEADER
from .zip_container import check_local_header, entry_ends, raw_name
from .zip_pickle import ZipPickle

# one read of the stream: large enough for disk speed, small enough to stay in cache
BLOCK_BYTES = 8 << 20
# a deflated entry is inflated this much at a time (a small entry may declare gigabytes)
INFLATE_BYTES = 1 << 20
# a data descriptor: signature (optional), CRC-32, then two sizes of 4 bytes (zip64: 8)
DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
DESCRIPTOR_BYTES = 24
DATA_DESCRIPTOR_FLAG = 0x8


class Task(abc.ABC):
    """A check over the bytes ``[start, end)`` of a file, fed as the stream passes them.

    ``finish`` runs when its last byte has passed; it raises :class:`CkptError` on
    damage and returns the tasks that follow from it (a header names its data's span).
    """

    def __init__(self, start: int, size: int):
        self.start, self.end = start, start + size

    @abc.abstractmethod
    def feed(self, data: memoryview) -> None:
        """Take the next bytes of the span, in order."""

    @abc.abstractmethod
    def finish(self) -> list[Task]:
        """Check what was fed; the tasks that follow from it."""


class Entry:
    """One zip entry of an archive at ``base`` in ``path``, as its central directory
    describes it, and how many of its CRC-32s were compared (``counts``)."""

    def __init__(
        self, path: str, base: int, info: zipfile.ZipInfo, end: int, label: str, counts: list[int]
    ):
        self.path, self.base, self.info, self.end = path, base, info, end
        self.label, self.counts = label, counts

    def damage(self, what: str) -> CkptError:
        return CkptError(f"zip entry {self.label}: {what}", path=self.path)


class HeaderTask(Task):
    """An entry's local header (the fixed part and the name): checked against the central
    directory, it places the entry's data."""

    def __init__(self, entry: Entry):
        self.entry = entry
        self.buffer = bytearray()
        size = LOCAL_HEADER.size + len(raw_name(entry.info))
        super().__init__(entry.base + entry.info.header_offset, size)

    def feed(self, data: memoryview) -> None:
        self.buffer += data

    def finish(self) -> list[Task]:
        e = self.entry
        at = e.info.header_offset + check_local_header(
            bytes(self.buffer), e.info, raw_name(e.info), e.path, e.end
        )
        tasks: list[Task] = [DataTask(e, e.base + at)]
        if e.info.flag_bits & DATA_DESCRIPTOR_FLAG:
            after = at + e.info.compress_size
            tasks.append(DescriptorTask(e, e.base + after, min(DESCRIPTOR_BYTES, e.end - after)))
        return tasks


class DataTask(Task):
    """An entry's data: its CRC-32 (of the inflated bytes, where deflated) and size."""

    def __init__(self, entry: Entry, start: int):
        super().__init__(start, entry.info.compress_size)
        self.entry = entry
        self.crc = 0
        self.inflated = 0
        info = entry.info
        if info.compress_type == zipfile.ZIP_DEFLATED:
            self.inflater: zlib._Decompress | None = zlib.decompressobj(-zlib.MAX_WBITS)
        elif info.compress_type == zipfile.ZIP_STORED:
            self.inflater = None
        else:
            raise entry.damage(
                f"compressed with method {info.compress_type}, which no reader takes"
            )

    def feed(self, data: memoryview) -> None:
        if self.inflater is None:
            self.crc = zlib.crc32(data, self.crc)
            self.inflated += len(data)
            return
        try:
            out = self.inflater.decompress(data, INFLATE_BYTES)
            while True:
                self.crc = zlib.crc32(out, self.crc)
                self.inflated += len(out)
                if self.inflated > self.entry.info.file_size:
                    raise self.entry.damage(
                        f"inflates past the {self.entry.info.file_size} bytes it declares"
                    )
                if not self.inflater.unconsumed_tail:
                    break
                out = self.inflater.decompress(self.inflater.unconsumed_tail, INFLATE_BYTES)
        except zlib.error as exc:
            raise self.entry.damage(f"corrupt deflate stream ({exc})") from None

    def finish(self) -> list[Task]:
        info = self.entry.info
        if self.inflater is not None and not self.inflater.eof:
            raise self.entry.damage("deflate stream ends early")
        if self.inflated != info.file_size:
            raise self.entry.damage(f"holds {self.inflated} bytes, declares {info.file_size}")
        if self.crc == info.CRC:
            self.entry.counts[0] += 1
        elif not info.CRC:
            # torch.save with ``config.save.compute_crc32 = False`` records every CRC as
            # 0: nothing to compare (torch.load does not check them either)
            self.entry.counts[1] += 1
        else:
            raise self.entry.damage(
                f"CRC-32 mismatch (the zip records {info.CRC:08x}, its bytes give "
                f"{self.crc:08x}): damaged data"
            )
        return []


class DescriptorTask(Task):
    """The data descriptor after an entry (torch writes one after each): its CRC-32 and
    sizes must be the central directory's."""

    def __init__(self, entry: Entry, start: int, size: int):
        super().__init__(start, max(size, 0))
        self.entry = entry
        self.buffer = bytearray()

    def feed(self, data: memoryview) -> None:
        self.buffer += data

    def finish(self) -> list[Task]:
        info, raw = self.entry.info, bytes(self.buffer)
        want = (info.CRC, info.compress_size, info.file_size)
        for start in (4, 0) if raw[:4] == DESCRIPTOR_SIGNATURE else (0,):
            for layout in ("<III", "<IQQ"):
                size = struct.calcsize(layout)
                if len(raw) >= start + size and struct.unpack_from(layout, raw, start) == want:
                    return []
        raise self.entry.damage(
            "its data descriptor disagrees with the central directory (CRC-32 or sizes)"
        )


def zip_tasks(path: str, base: int = 0, length: int | None = None) -> tuple[list[Task], list[int]]:
    """The tasks that check every entry of the zip archive at ``base`` (``length`` bytes;
    the rest of the file by default), and the counts they fill in: [CRC-32s compared,
    entries whose CRC-32 was not recorded].

    Raises:
        CkptError: A central directory that the readers refuse (see :class:`ZipPickle`).
    """
    counts = [0, 0]
    with ZipPickle(path, base, length) as archive:
        archive.check()  # (its damage: the pickle's verdict came first, from the read)
        infos = sorted(archive.infos.values(), key=lambda info: info.header_offset)
        ends = entry_ends(infos, getattr(archive.zip, "start_dir", archive.length), path)
    where = f" of the archive at byte {base:,}" if base else ""
    tasks: list[Task] = [
        HeaderTask(
            Entry(path, base, info, ends[info.filename], f"{info.filename!r}{where}", counts)
        )
        for info in infos
    ]
    return tasks, counts


def stream_file(
    path: str,
    tasks: list[Task],
    files: OpenFiles,
    advance: Callable[[int], None] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> int:
    """Read ``path`` once from its first byte to its last, running ``tasks`` on the way
    (they may not overlap); return the bytes read.

    Raises:
        CkptError: The first damage a task finds, a task past the end of the file, or
            a read that fails (truncated while read, an I/O error).
    """
    size = sources.getsize(path)
    fd = local_fd(path, files)
    if fd is not None and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger kernel read-ahead
    order = itertools.count()
    heap = [(task.start, next(order), task) for task in tasks]
    heapq.heapify(heap)
    with contextlib.closing(_blocks(path, size, files, block_bytes)) as blocks:
        for pos, view in blocks:
            block_end = pos + len(view)
            if advance is not None and view:
                advance(len(view))
            # a task ending at block_end finishes here; an empty one at the end of the file too
            while heap and (heap[0][0] < block_end or heap[0][0] == block_end == size):
                task = heap[0][2]
                lo, hi = max(task.start, pos), min(task.end, block_end)
                if hi > lo:
                    task.feed(view[lo - pos : hi - pos])
                    task.start = hi  # fed up to here
                if task.end > block_end:
                    break
                heapq.heappop(heap)
                for new in task.finish():
                    heapq.heappush(heap, (new.start, next(order), new))
    if heap:
        task = heap[0][2]
        raise CkptError(
            f"the file ends at byte {size:,}, before the bytes its records place at "
            f"{task.start:,} (truncated)",
            path=path,
        )
    return size


def _blocks(
    path: str, size: int, files: OpenFiles, block_bytes: int
) -> Generator[tuple[int, memoryview], None, None]:
    """(position, bytes) of the file's blocks, front to back, in one reused buffer.

    One thread: the kernel's read-ahead (POSIX_FADV_SEQUENTIAL) overlaps the disk with
    the CRCs. A reader thread filling a second buffer was slower (512 MiB from the page
    cache on 2 busy cores: 0.77-0.93 s against 0.65-0.70 s).
    """
    view = memoryview(bytearray(min(block_bytes, max(size, 1))))
    pos = 0
    while True:
        n = min(len(view), size - pos)
        read_at(path, pos, view[:n], files)
        yield pos, view[:n]
        pos += n
        if pos >= size or not n:
            return
