"""A file object over a source's bytes: ``zipfile`` and the unpickler need one.

:class:`SourceFile` is a read-only, seekable view of a span of a file read through its
:class:`~ckpttool.sources.Source` (``preadv`` on one descriptor for a local file), with
the small caches that keep a remote file to a few requests; :func:`open_input` opens a
whole input as a buffered file, locally with ``open``.
"""

from __future__ import annotations

import io
import os
from typing import Any

from ..errors import CkptError, InputNotFoundError
from .paths import local_path, source_for
from .source import read_fd_into


class SourceFile(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of a file from ``start``, read
    through the file's source (``zipfile`` and the unpickler need a file object).

    A local file is read with ``preadv`` on one descriptor; any other source through
    :meth:`Source.read_into`. Reads always fill what they ask for (up to the end of the
    span), as ``zipfile`` expects. Two caches keep a remote file to a few requests:

    - ``edge``: the first and last ``edge`` bytes of the span, read once on first
      need. ``zipfile`` reads an archive in many small pieces (its end record and
      directory from the end, each entry's header and the pickle from the start).
    - ``block``: reads of the pickles at a file's start (a legacy ``torch.save`` file,
      DCP's ``.metadata``) fetched in aligned blocks of this size, the last
      ``MAX_BLOCKS`` kept: the unpickler seeks back and forth between pickles.
      :meth:`pread` bypasses them (a storage's 8-byte count before megabytes of data).

    Args:
        path: The file (a local path or a URL).
        start, length: The span; the whole file (from ``start``) when ``length`` is None.
        edge: Bytes cached at each end of the span (0: none).
        block: Size of the cached blocks (0: no block cache).

    Raises:
        CkptError: The span runs past the end of the file.
    """

    MAX_BLOCKS = 8

    def __init__(
        self,
        path: str,
        start: int = 0,
        length: int | None = None,
        *,
        edge: int = 4096,
        block: int = 0,
    ):
        super().__init__()
        self.path = path
        self._source = source_for(path)
        size = self._source.size(path)
        length = size - start if length is None else length
        if start < 0 or length < 0 or start + length > size:
            raise CkptError(
                f"span of {length} bytes at {start} runs past the end of the file (truncated?)",
                path=path,
            )
        self._start = start
        self._length = length
        self._pos = 0
        self._edge = min(edge, length)
        self._block = block
        # cached ranges: offset in the span -> bytes (the edges, then blocks, oldest first)
        self._edges: dict[int, bytes] = {}
        self._blocks: dict[int, bytes] = {}
        self._known: list[tuple[int, bytes]] = []  # what the caller read already
        local = self._source.local_path(path)
        self._fd: int | None = None
        if local is not None:
            try:
                self._fd = os.open(local, os.O_RDONLY)
            except OSError as exc:
                raise CkptError(f"cannot read ({exc.strerror or exc})", path=path) from None

    @property
    def length(self) -> int:
        return self._length

    def pread(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of the span (fewer at its end), no cache involved."""
        size = max(0, min(size, self._length - offset))
        buf = bytearray(size)
        if size:
            self._fetch(memoryview(buf), offset)
        return bytes(buf)

    def preload(self, offset: int, data: bytes) -> None:
        """Serve reads of ``data``'s range from it (bytes of the span read before)."""
        if 0 <= offset and offset + len(data) <= self._length:
            self._known.append((offset, data))

    def _fetch(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``offset`` of the span: one read of the source."""
        if self._fd is not None:
            self._source.count(len(view))
            read_fd_into(self._fd, view, self._start + offset, self.path)
        else:
            self._source.read_into(self.path, view, self._start + offset)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        view = memoryview(buffer).cast("B")[:n]
        done = 0
        while done < n:
            done += self._serve(view[done:], self._pos + done)
        self._pos += n
        return n

    def _serve(self, view: memoryview, pos: int) -> int:
        """Fill the start of ``view`` with the bytes at ``pos``; return how many."""
        cached = self._cached(pos, len(view))
        if cached is not None:
            at, data = cached
            got = min(len(view), at + len(data) - pos)
            view[:got] = data[pos - at : pos - at + got]
            return got
        if self._block and len(view) <= self._block * self.MAX_BLOCKS // 2:
            first = pos - pos % self._block
            end = min(self._length, pos + len(view))
            last = end + (-end % self._block)
            missing_end = next(
                (b for b in range(first, last, self._block) if b in self._blocks), last
            )
            run = bytearray(min(self._length, missing_end) - first)
            self._fetch(memoryview(run), first)
            for b in range(first, first + len(run), self._block):
                self._blocks[b] = bytes(run[b - first : b - first + self._block])
            while len(self._blocks) > self.MAX_BLOCKS:
                del self._blocks[next(iter(self._blocks))]
            return self._serve(view, pos)
        self._fetch(view, pos)
        return len(view)

    def _cached(self, pos: int, n: int) -> tuple[int, bytes] | None:
        """A cached range holding ``pos`` (loading an edge it should come from), or None."""
        for at, data in self._known:
            if at <= pos < at + len(data):
                return at, data
        if self._edge:
            if pos + n <= self._edge:
                if 0 not in self._edges:
                    self._edges[0] = self.pread(0, self._edge)
                return 0, self._edges[0]
            tail_at = self._length - self._edge
            if pos >= tail_at:
                if tail_at not in self._edges:
                    self._edges[tail_at] = self.pread(tail_at, self._edge)
                return tail_at, self._edges[tail_at]
        if self._block:
            at = pos - pos % self._block
            block = self._blocks.get(at)
            if block is not None:
                return at, block
        return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        super().close()


OPEN_BLOCK_BYTES = 64 << 10


def open_input(path: str, buffer_size: int = 8 << 10) -> io.BufferedReader:
    """A buffered, seekable binary file over an input (``open(path, "rb")`` locally)."""
    local = local_path(path)
    if local is not None:
        try:
            return open(local, "rb")
        except FileNotFoundError:
            raise InputNotFoundError("no such file or directory", path=path) from None
        except OSError as exc:
            raise CkptError(f"cannot read ({exc.strerror or exc})", path=path) from None
    # a small buffer over blocks: the unpickler's look-ahead stays inside the block
    return io.BufferedReader(SourceFile(path, edge=0, block=OPEN_BLOCK_BYTES), buffer_size)
