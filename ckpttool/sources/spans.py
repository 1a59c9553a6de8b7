"""Tensor bytes into caller-owned buffers, from wherever their file lives.

Every reader of tensor bytes (a load into a model or a staging buffer, ``diff``'s
block compare, the writers' copy path) comes here: a file with a local path is read
with ``preadv`` through a descriptor kept open in :class:`~ckpttool.sources.OpenFiles`
(thousands of spans from the same few files cost one ``open`` each); any other file
through its source's :meth:`~ckpttool.sources.Source.read_into` (a ranged request).
Both count what they transfer on the path's source. No torch here.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

from ..errors import CkptError, InputNotFoundError
from . import paths as sources
from .source import OpenFiles, read_fd_into

if TYPE_CHECKING:
    pass


def open_fd(files: OpenFiles, local: str, path: str) -> int:
    """The descriptor of the local file ``local`` (the file ``path`` names), from ``files``.

    Raises:
        InputNotFoundError: No such file.
        CkptError: It cannot be opened.
    """
    try:
        return files.fd(local)
    except FileNotFoundError:
        raise InputNotFoundError("no such file or directory", path=path) from None
    except OSError as exc:
        raise CkptError(f"cannot read ({exc.strerror or exc})", path=path) from None


def local_fd(path: str, files: OpenFiles) -> int | None:
    """An open descriptor of ``path`` from ``files`` when it is a local file, else None
    (a URL: its bytes come through its source).

    Raises:
        CkptError: A local file that cannot be opened.
    """
    local = sources.local_path(path)
    return None if local is None else open_fd(files, local, path)


def read_at(path: str, offset: int, view: memoryview, files: OpenFiles | None = None) -> None:
    """Fill ``view`` exactly with the bytes of ``path`` from ``offset``.

    Args:
        path: A local path or a URL.
        offset: Where in the file the bytes start.
        view: A writable byte buffer, filled completely.
        files: Descriptors kept open between calls (local files); None opens the file
            for this read only.

    Raises:
        CkptError: The file ends before ``offset + len(view)`` (truncated), or cannot be
            read.
    """
    size = len(view)
    if not size:
        return
    # a path without "://" is local (no URL scheme): spare the lookup on the fast path
    source = sources.LOCAL if "://" not in path else sources.source_for(path)
    if files is None or (local := source.local_path(path)) is None:
        # remote bytes, or a one-off local read (the source opens the file and counts)
        source.read_into(path, view, offset)
        return
    fd = open_fd(files, local, path)
    try:
        if os.preadv(fd, [view], offset) != size:  # short (a signal, or the end): go on
            read_fd_into(fd, view, offset, path)
    except OSError as exc:
        raise CkptError(f"cannot read ({exc.strerror or exc})", path=path) from None
    source.count(size)


def read_span_into(
    source: ByteSpan, start: int, view: memoryview, files: OpenFiles | None = None
) -> None:
    """Fill ``view`` with the bytes of a span (a file's, a zip entry's, or in memory)
    from ``start`` (relative to the span).

    Raises:
        CkptError: The read lies outside the span, or past the end of its file.
    """
    size = len(view)
    if not size:  # nothing to read: an empty view may sit past its storage's end
        return
    if start < 0 or start + size > source.length:
        raise CkptError("read outside of the stored bytes (truncated file?)", path=source.path)
    if source.data is not None:
        view[:] = memoryview(source.data).cast("B")[start : start + size]
        return
    if source.path is None:
        raise CkptError("tensor bytes have no file")
    source.resolve(files)
    read_at(source.path, source.offset + start, view, files)


class ZipHeaderCheck(Protocol):
    """Checks a zip entry's local header (``size`` bytes: the fixed part and the name)
    against the central directory and returns where the entry's data starts in it."""

    size: int

    def __call__(self, header: bytes) -> int: ...


class ByteSpan:
    """Where a run of bytes lives: a span of a file, an entry of a zip, or memory.

    A zip entry's data offset needs its local header, so it is found on first read.
    """

    def __init__(
        self,
        path: str | None = None,
        offset: int = 0,
        length: int = 0,
        *,
        data: bytes | bytearray | memoryview | None = None,
        zip_header_offset: int | None = None,
        zip_header_check: ZipHeaderCheck | None = None,
    ):
        self.path = path
        self.offset = offset
        self.length = length if data is None else len(data)
        self.data = data
        self._zip_header_offset = zip_header_offset
        self._zip_header_check = zip_header_check

    def unresolved(self) -> bool:
        """A zip entry whose data offset is still to be found (and checked) on first read."""
        return self._zip_header_offset is not None

    def resolve(self, files: OpenFiles | None = None) -> None:
        """Find a zip entry's data offset from its local header (done once, on first use).

        ``files``: descriptors kept open by readers of many entries (local files).
        """
        if self._zip_header_offset is None or self.path is None:
            return
        check = self._zip_header_check
        header = memoryview(bytearray(30 if check is None else check.size))
        try:
            read_at(self.path, self._zip_header_offset, header, files)
        except InputNotFoundError:
            raise
        except CkptError:  # a header cut short is a corrupt entry, whatever the reason
            raise CkptError("corrupt zip entry header", path=self.path) from None
        if check is not None:  # the entry's own checks against its central directory
            self.offset = self._zip_header_offset + check(bytes(header))
        else:
            if header[:4] != b"PK\x03\x04":
                raise CkptError("corrupt zip entry header", path=self.path)
            name_len = int.from_bytes(header[26:28], "little")
            extra_len = int.from_bytes(header[28:30], "little")
            self.offset = self._zip_header_offset + 30 + name_len + extra_len
        self._zip_header_offset = None

    def read(self, start: int = 0, size: int | None = None) -> bytearray:
        """Read ``size`` bytes from ``start`` (relative to the span) into a new buffer."""
        size = self.length - start if size is None else size
        if start < 0 or size < 0 or start + size > self.length:
            raise CkptError("read outside of the stored bytes (truncated file?)", path=self.path)
        if self.data is not None:
            return bytearray(self.data[start : start + size])
        if self.path is None:
            raise CkptError("tensor bytes have no file")
        self.resolve()
        # checked against the file's size before the buffer is allocated: never
        # allocate what a file only declares
        return sources.read(self.path, self.offset + start, size)
