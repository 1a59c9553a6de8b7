"""Where checkpoint bytes come from: one interface for local files and, by URL, remote ones.

Every reader, ``diff`` and the writers' copy path get their bytes through a
:class:`Source`: sizes, ranged reads into caller-owned buffers, folder listings and
globs, and an identity that changes when a file does (caches key on it). Paths stay
plain strings (a local path, or a URL such as ``s3://bucket/run/ep3/``), so a reader
joins and splits them as it always did; :func:`source_for` picks the source a path
belongs to. A local file also exposes its path (:meth:`Source.local_path`) so the fast
paths (``mmap``, ``preadv`` into staging buffers, ``O_DIRECT``) stay available; a
remote source has none and callers fall back to :meth:`Source.read_into`.
"""

from __future__ import annotations

import abc
import fnmatch
import glob as globlib
import os
import posixpath
import re
from collections.abc import Hashable, Sequence

from ..errors import CkptError, InputNotFoundError

# what format detection reads of a file's start (magic numbers, a JSON index's first keys)
HEAD_BYTES = 512


# scheme://... (two letters at least, so a Windows drive "C:/" is never a scheme)
URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")


class Source(abc.ABC):
    """A file system holding checkpoint files, addressed by path strings.

    Subclasses implement the primitives (``size``, ``read_into``, ``listdir``,
    ``isdir``, ``exists``, ``identity``); the rest is built on them. Every source
    counts what it transfers (``bytes_read``, ``requests``): ``inspect`` reports it,
    and the tests prove with it that metadata reads stay small.
    """

    name = "source"

    def __init__(self) -> None:
        self.bytes_read = 0
        self.requests = 0

    def count(self, nbytes: int, requests: int = 1) -> None:
        """Record a transfer (the fast local paths that bypass ``read_into`` call it too)."""
        self.bytes_read += nbytes
        self.requests += requests

    # -- primitives -------------------------------------------------------------------
    @abc.abstractmethod
    def size(self, path: str) -> int:
        """The file's size in bytes."""

    @abc.abstractmethod
    def read_into(self, path: str, view: memoryview, offset: int) -> None:
        """Fill ``view`` exactly with the file's bytes from ``offset``.

        Raises:
            CkptError: The file ends before ``offset + len(view)`` (truncated), or the
                bytes cannot be read.
        """

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of a folder's entries, sorted."""

    @abc.abstractmethod
    def isdir(self, path: str) -> bool:
        """Whether ``path`` is a folder (an object-store prefix holding objects)."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether ``path`` is a file or a folder."""

    @abc.abstractmethod
    def identity(self, path: str) -> Hashable:
        """A value that changes when the file does (size and mtime; ETag or version)."""

    # -- built on the primitives -----------------------------------------------------
    def isfile(self, path: str) -> bool:
        return self.exists(path) and not self.isdir(path)

    def local_path(self, path: str) -> str | None:
        """The path to ``open``/``mmap`` for the fast paths, or None (remote bytes)."""
        return None

    def read(self, path: str, offset: int = 0, size: int | None = None) -> bytearray:
        """``size`` bytes from ``offset`` (to the end of the file if None) in a new buffer.

        The size is checked against the file before anything is allocated: a file
        never makes us allocate what it only declares.
        """
        total = self.size(path)
        if size is None:
            size = max(0, total - offset)
        if offset < 0 or size < 0:
            raise CkptError("read outside of the stored bytes", path=path)
        missing = offset + size - total
        if missing > 0:
            raise CkptError(f"file ends {missing} bytes early (truncated?)", path=path)
        buf = bytearray(size)
        if size:
            self.read_into(path, memoryview(buf), offset)
        return buf

    def read_spans(self, path: str, spans: Sequence[tuple[memoryview, int]]) -> None:
        """Fill each ``(view, offset)``; remote sources fetch them in parallel."""
        for view, offset in spans:
            self.read_into(path, view, offset)

    def glob(self, pattern: str) -> list[str]:
        """Paths matching a glob whose magic is in its last part only, sorted."""
        folder, name = self.split(pattern)
        if not self.isdir(folder or "."):
            return []
        names = self.listdir(folder or ".")
        return [self.join(folder, n) for n in names if fnmatch.fnmatch(n, name)]

    def join(self, folder: str, *names: str) -> str:
        return posixpath.join(folder, *names)

    def split(self, path: str) -> tuple[str, str]:
        return posixpath.split(path)

    def close(self) -> None:  # noqa: B027 (optional: most sources hold nothing open)
        """Release what the source keeps open (descriptors, connections)."""


MAX_OPEN_FILES = 64


class OpenFiles:
    """Read-only descriptors of input files, kept open while many blocks are read.

    A per-rank merge or a diff reads thousands of blocks from the same few files: an
    open and a close each would cost more than the read. At most ``MAX_OPEN_FILES``
    stay open, least recently used closed first (a DCP folder from a thousand ranks
    would otherwise reach the usual limit of 1024 descriptors per process).
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}  # least recently used first

    def fd(self, path: str) -> int:
        fd = self._fds.pop(path, None)
        if fd is None:
            if len(self._fds) >= MAX_OPEN_FILES:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = os.open(path, os.O_RDONLY)
        self._fds[path] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class LocalSource(Source):
    """Files on a local (or mounted) file system."""

    name = "local"

    def size(self, path: str) -> int:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            raise InputNotFoundError("no such file or directory", path=path) from None
        except OSError as exc:
            raise CkptError(f"cannot read ({exc.strerror or exc})", path=path) from None

    def read_into(self, path: str, view: memoryview, offset: int) -> None:
        self.count(len(view))
        try:
            with open(path, "rb", buffering=0) as f:
                read_fd_into(f.fileno(), view, offset, path)
        except FileNotFoundError:
            raise InputNotFoundError("no such file or directory", path=path) from None
        except OSError as exc:
            raise CkptError(f"cannot read ({exc.strerror or exc})", path=path) from None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError as exc:
            raise CkptError(f"cannot list the folder ({exc.strerror or exc})", path=path) from None

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def identity(self, path: str) -> Hashable:
        st = os.stat(path)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def local_path(self, path: str) -> str | None:
        return path

    def glob(self, pattern: str) -> list[str]:
        return sorted(globlib.glob(pattern))

    def join(self, folder: str, *names: str) -> str:
        return os.path.join(folder, *names)

    def split(self, path: str) -> tuple[str, str]:
        return os.path.split(path)


def read_fd_into(fd: int, view: memoryview, offset: int, path: str | None = None) -> None:
    """Fill ``view`` from an open descriptor at ``offset``, or raise if the file is short."""
    done = 0
    size = len(view)
    while done < size:
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            raise CkptError(f"file ends {size - done} bytes early (truncated?)", path=path)
        done += n


LOCAL = LocalSource()
