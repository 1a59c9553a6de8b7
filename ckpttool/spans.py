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
from typing import TYPE_CHECKING

from . import sources
from .errors import CkptError, InputNotFoundError
from .sources import OpenFiles

if TYPE_CHECKING:
    from .tree import ByteSource


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
            sources.read_fd_into(fd, view, offset, path)
    except OSError as exc:
        raise CkptError(f"cannot read ({exc.strerror or exc})", path=path) from None
    source.count(size)


def read_span_into(
    source: ByteSource, start: int, view: memoryview, files: OpenFiles | None = None
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
