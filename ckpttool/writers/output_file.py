"""One output file, written front to back at disk speed and durable at the end.

Every output is fsynced before its rename (``atomic_output``). Written through the
page cache, a multi-GB output sits as dirty pages until then and the fsync waits for
all of it; the kernel also has to find free pages for the copy while the input fills
the cache. So the bytes go through a ring of page-aligned staging buffers instead:
the caller fills one (``write``, or ``copy_from`` reading straight into it) while
writer threads send the others to disk with ``O_DIRECT``, bypassing the page cache.
Several writes in flight keep the disk's queue full; the final fsync has almost
nothing left to do. (On this project's benchmark machine: 4 GiB durably written in
about the time ``cp`` takes to leave it in the page cache.)

Writers that know how large the file will be say so (``size_hint``), and its blocks
are allocated up front (``fallocate``). Direct writes past the end of a file grow it,
and ext4 runs those one at a time, each waited for before the next starts; writes
into allocated blocks run side by side. (Same machine: 2 GiB durably written in
about half the time.)

A part of a file (``offset=``: one writer of several, each writing its part of a
planned file that :func:`~ckpttool.writers.plan.allocate` created) starts at any
offset and ends anywhere: its first buffer is cut short so that the next ones start
aligned, and the unaligned ends (which share a block with the neighbouring parts, so
they cannot be padded as the end of a whole file is) go through the page cache.

Where ``O_DIRECT`` is missing or refused (not Linux, FUSE, older overlayfs and
tmpfs) the same buffers are written through the page cache, and writeback of
what is done is started as we go (``sync_file_range``), so the fsync waits only
for the tail.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .. import sources
from ..errors import CkptError
from ..progress import Progress
from ..sources import OpenFiles, local_fd

BUFFER_BYTES = 16 << 20  # one staging buffer
BUFFERS = 4  # one being filled, up to three being written: a disk takes several at once
ALIGNMENT = 4096  # O_DIRECT offsets and sizes: a multiple of any disk's logical block
WRITEBACK_BYTES = 64 << 20  # without O_DIRECT: start writeback this often
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# a remote input fills one staging buffer with this many ranges, fetched side by side
SPANS_PER_BUFFER = 4


class OutputFile:
    """An output file written front to back through a ring of staging buffers.

    Args:
        path: The file.
        size_hint: Its final size where known (blocks allocated up front).
        offset: Write a part of an existing file from this offset: the file is not
            truncated, nothing past the part is touched. None (the default): the
            whole file, from offset 0, cut off after the last byte written.

    ``pos`` is the offset of the next byte written. ``patch`` rewrites bytes already
    written (a zip header field known only after its data). ``begin_crc32`` /
    ``end_crc32`` give the CRC-32 of the bytes written in between, computed as they
    pass, so nothing is read back.
    """

    def __init__(self, path: str, size_hint: int = 0, *, offset: int | None = None):
        self.path = path
        self.whole = offset is None
        start = offset or 0
        if start < 0:
            raise ValueError(f"negative offset {start}")
        self.fd, self.direct = _open_output(path, truncate=self.whole)
        # the unaligned ends of a part go through the page cache (see the module's doc)
        self._plain_fd = os.open(path, os.O_WRONLY) if self.direct and not self.whole else None
        if size_hint > 0 and self.whole:
            preallocate(self.fd, size_hint)
        self.pos = start
        self.inputs = OpenFiles()  # the files we copy from
        size = _round_up(BUFFER_BYTES)  # module constants, read here so tests can shrink them
        # page-aligned anonymous maps, as O_DIRECT needs; each view keeps its map alive
        self._views = _take_buffers(max(2, BUFFERS), size)
        self._pending: list[Future[None] | None] = [None] * len(self._views)
        self._writers = ThreadPoolExecutor(len(self._views) - 1, "ckpttool-write")
        self._current = 0  # index of the buffer being filled
        self._base = start  # file offset of its first byte (aligned but for a part's first)
        self._fill = 0  # bytes in it
        self._room_left = size - start % ALIGNMENT  # its capacity: the next one starts aligned
        self._written_back = start
        self._crc: int | None = None
        self._patches: list[tuple[int, bytes]] = []  # for bytes the writers have

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        clean = False
        try:
            if exc_type is None:
                self._finish()
                clean = True
        finally:
            self._writers.shutdown(wait=True)  # never close a file a write is still using
            self.inputs.close()
            os.close(self.fd)
            if self._plain_fd is not None:
                os.close(self._plain_fd)
            # the buffers are unmapped when the last view of them goes (a traceback
            # may still hold one, and closing an exported mmap raises); after a clean
            # end nothing else holds them: the next output of this process takes them
            if clean:
                _give_back(self._views)

    # ------------------------------------------------------------ appending

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            target = self._room(len(view))
            target[:] = view[: len(target)]
            self._filled(target)
            view = view[len(target) :]

    def copy_from(self, path: str, offset: int, nbytes: int, progress: Progress | None) -> None:
        """Append ``nbytes`` at ``offset`` of ``path``, read straight into the buffers.

        A local file is read with ``preadv`` into each staging buffer; any other (a URL)
        through its source's ``read_spans``, a buffer's worth of ranges at a time, so a
        remote source fetches them side by side while memory stays the staging ring's.
        """
        fd = local_fd(path, self.inputs)
        if fd is None:
            self._copy_spans(path, offset, nbytes, progress)
            return
        done = 0
        while done < nbytes:
            target = self._room(nbytes - done)
            try:
                n = os.preadv(fd, [target], offset + done)
            except OSError as exc:  # the input's fault, not the output's
                raise CkptError(f"cannot read the input ({exc.strerror})", path=path) from None
            if n == 0:
                raise CkptError("input ends early (truncated)", path=path)
            self._filled(target[:n])
            done += n
            if progress:
                progress(n)
        sources.source_for(path).count(nbytes)

    def _copy_spans(self, path: str, offset: int, nbytes: int, progress: Progress | None) -> None:
        source, done = sources.source_for(path), 0
        while done < nbytes:
            target = self._room(nbytes - done)
            step = max(1, -(-len(target) // SPANS_PER_BUFFER))
            spans = [
                (target[at : at + step], offset + done + at) for at in range(0, len(target), step)
            ]
            source.read_spans(path, spans)
            self._filled(target)
            done += len(target)
            if progress:
                progress(len(target))

    def _room(self, nbytes: int) -> memoryview:
        """Where the next bytes go: at most ``nbytes`` of the current buffer's free space."""
        view = self._views[self._current]
        return view[self._fill : self._fill + min(nbytes, self._room_left - self._fill)]

    def _filled(self, view: memoryview) -> None:
        """``view`` (the next bytes of the current buffer) now holds data."""
        if self._crc is not None:
            self._crc = zlib.crc32(view, self._crc)
        self._fill += len(view)
        self.pos += len(view)
        if self._fill == self._room_left:
            self._flush()

    def _flush(self) -> None:
        """Hand the current buffer to a writer thread; go on in the next free one."""
        index = self._current
        self._pending[index] = self._writers.submit(self._write_out, index, self._base, self._fill)
        self._base += self._fill
        self._fill = 0
        self._room_left = len(self._views[index])
        self._current = (index + 1) % len(self._views)
        self._wait(self._current)
        if not self.direct and self._base - self._written_back >= WRITEBACK_BYTES:
            _start_writeback(self.fd, self._written_back, self._base - self._written_back)
            self._written_back = self._base

    def _wait(self, *indices: int) -> None:
        """Wait until these buffers (all by default) are written and free."""
        for index in indices or range(len(self._views)):
            pending, self._pending[index] = self._pending[index], None
            if pending is not None:
                pending.result()  # raises the writer's OSError (disk full) here

    def _write_out(self, index: int, offset: int, nbytes: int) -> None:
        """In a writer thread: ``nbytes`` of buffer ``index`` to ``offset`` of the file."""
        # read once: another writer thread may give O_DIRECT up while this one writes
        direct = self.direct
        fd = self.fd
        if self._plain_fd is not None and (offset % ALIGNMENT or nbytes % ALIGNMENT):
            # a part's unaligned end: padding it would write over the next part
            direct, fd = False, self._plain_fd
        view = self._views[index][: _round_up(nbytes) if direct else nbytes]
        while len(view):
            try:
                n = os.pwrite(fd, view, offset)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                self._stop_direct()  # this file system accepted O_DIRECT, then refused it
                direct = False  # a second EINVAL is a real error
                continue
            view, offset = view[n:], offset + n

    def _stop_direct(self) -> None:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self.direct = False

    def _finish(self) -> None:
        """Write the partly filled buffer, then the patches; cut off what lies past the
        last byte: the direct write's padding, blocks allocated for a larger size hint."""
        end = self.pos
        if self._fill:
            self._flush()
        self._wait()
        self._apply_patches()
        if self.whole and os.fstat(self.fd).st_size != end:
            os.ftruncate(self.fd, end)

    # ------------------------------------------------------------ checksums, patches

    def begin_crc32(self) -> None:
        """Start the CRC-32 of the bytes appended from now on."""
        self._crc = 0

    def end_crc32(self) -> int:
        crc, self._crc = self._crc, None
        if crc is None:
            raise RuntimeError("end_crc32 without begin_crc32")
        return crc

    def patch(self, offset: int, data: bytes) -> None:
        """Overwrite bytes already written (a header field known only after its data).

        Bytes still in the buffer being filled change there, at no cost. Bytes already
        handed to the writers are patched once the last write is done (``_finish``):
        patching now would wait for the writes in flight.
        """
        split = min(len(data), max(0, self._base - offset))
        written, buffered = data[:split], data[split:]
        if buffered:
            at = offset + split - self._base
            self._views[self._current][at : at + len(buffered)] = buffered
        if written:
            self._patches.append((offset, written))

    def _apply_patches(self) -> None:
        if not self._patches:
            return
        # a few bytes cannot go through O_DIRECT: a second descriptor through the page
        # cache (the fsync at the end writes it; every direct write is done by now)
        fd = os.open(self.path, os.O_WRONLY) if self.direct else self.fd
        try:
            for offset, data in sorted(self._patches):
                if os.pwrite(fd, data, offset) != len(data):
                    raise OSError(errno.EIO, "short write")
        finally:
            if fd != self.fd:
                os.close(fd)


# Staging buffers of outputs that ended cleanly, kept for the next one: a rank writes
# its units one OutputFile each, and fresh maps cost a page fault per 4 KiB written
# (a third of a unit's time). At most one output's worth is kept.
_spare: list[memoryview] = []
_spare_lock = threading.Lock()


def _take_buffers(count: int, size: int) -> list[memoryview]:
    with _spare_lock:
        taken = [_spare.pop() for _ in range(min(count, len(_spare))) if len(_spare[-1]) == size]
    return taken + [memoryview(mmap.mmap(-1, size)) for _ in range(count - len(taken))]


def _give_back(views: list[memoryview]) -> None:
    with _spare_lock:
        _spare[:] = views[: max(2, BUFFERS)]


def _open_output(path: str, *, truncate: bool = True) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0)
    if _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def _round_up(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages, do not wait
_libc_functions: dict[str, Any] = {}  # resolved on first use; None where unavailable


def _libc(name: str, *argtypes: Any) -> Any:
    """A Linux libc function, or None (not Linux/glibc: the caller only loses speed)."""
    if name not in _libc_functions:
        try:
            func = getattr(ctypes.CDLL(None, use_errno=True), name)
            func.argtypes = list(argtypes)
        except (AttributeError, OSError):
            func = None
        _libc_functions[name] = func
    return _libc_functions[name]


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    func = _libc("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    if func:
        func(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # a failure only costs speed


def preallocate(fd: int, nbytes: int) -> None:
    """Allocate the file's blocks (and set its size) up front, where the file system can.

    Linux's ``fallocate``, not ``posix_fallocate``: where the file system cannot,
    glibc's fallback writes every block once, which would double the work. A failure
    costs only speed; a real one (disk full) is met again by the writes.
    """
    func = _libc("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    if func:
        func(fd, 0, 0, nbytes)
