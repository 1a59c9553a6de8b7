"""Tensor bytes into caller-owned buffers, from wherever their file lives.

Every reader of tensor bytes (a load into a model or a staging buffer, ``diff``'s
block compare, the writers' copy path) comes here: a file with a local path is read
with ``preadv`` through a descriptor kept open in :class:`~ckpttool.sources.OpenFiles`
(thousands of spans from the same few files cost one ``open`` each); any other file
through its source's :meth:`~ckpttool.sources.Source.read_into` (a ranged request).
Both count what they transfer on the path's source. A zip entry stored deflated (a
re-zipped checkpoint: torch reads those too) cannot be read in place: its span holds its
bytes inflated, a bounded number of them at a time (:func:`inflate`). No torch here.
"""

from __future__ import annotations

import os
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import CkptError, InputNotFoundError
from . import paths as sources
from .source import OpenFiles, read_fd_into

if TYPE_CHECKING:
    pass

# a deflated entry is read (and inflated) this much at a time
INFLATE_CHUNK = 1 << 20
# deflate's densest stream: 258 bytes a 2-bit code, 1032 to 1 (RFC 1951); an entry that
# declares more per stored byte cannot hold it, and would only cost memory to find out
MAX_DEFLATE_RATIO = 1032
# inflated entries kept for their next reads (a storage is read a chunk at a time); the
# most recent one is always kept, whatever its size: it is being read
INFLATED_CACHE_BYTES = 256 << 20


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


def inflate(
    read: Callable[[int, int], bytes | bytearray],
    stored: int,
    size: int | None,
    *,
    name: str,
    path: object = None,
    limit: int | None = None,
) -> bytearray:
    """Inflate a raw deflate stream of ``stored`` bytes (``read(offset, n)`` from its
    start) that declares ``size`` bytes: a chunk at a time, never past ``size`` (or
    ``limit``, where smaller: then the first ``limit`` bytes, unchecked past them).
    ``size`` None: as many as the stream holds, up to ``limit``.

    Raises:
        CkptError: A stream that is not deflate, ends early, inflates to another size,
            or declares more than ``stored`` bytes of deflate can hold.
    """
    exact = size is not None
    if size is None:
        size = MAX_DEFLATE_RATIO * stored + INFLATE_CHUNK
        limit = size if limit is None else limit
    elif size > MAX_DEFLATE_RATIO * stored + INFLATE_CHUNK:
        raise CkptError(
            f"corrupt zip entry {name!r} (declares {size} bytes inflated from {stored}: "
            "more than deflate can hold)",
            path=None if path is None else str(path),
        )
    want = size if limit is None else min(size, limit)
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    out = bytearray()
    done = 0
    shown = None if path is None else str(path)
    try:
        while not inflater.eof and len(out) < want + 1:
            chunk: bytes | bytearray = inflater.unconsumed_tail
            if not chunk and done < stored:
                chunk = read(done, min(INFLATE_CHUNK, stored - done))
                done += len(chunk)
            if not chunk:
                raise CkptError(
                    f"corrupt zip entry {name!r} (deflate stream ends early)", path=shown
                )
            out += inflater.decompress(chunk, want + 1 - len(out))
    except zlib.error as exc:
        raise CkptError(f"corrupt zip entry {name!r} ({exc})", path=shown) from None
    if len(out) > size:
        raise CkptError(
            f"corrupt zip entry {name!r} (inflates past the {size} bytes it declares)",
            path=shown,
        )
    if limit is not None and len(out) > limit:
        del out[limit:]  # (the first ``limit`` bytes: a prefix, for a verdict)
    elif exact and len(out) != size:
        raise CkptError(
            f"corrupt zip entry {name!r} (inflates to {len(out)} bytes, declares {size})",
            path=shown,
        )
    return out


# deflated spans whose inflated bytes are kept, the most recently read last; held
# weakly: a span dropped (its checkpoint's) takes its bytes with it
_INFLATED: OrderedDict[int, weakref.ref[DeflatedSpan]] = OrderedDict()


def _keep_inflated(span: DeflatedSpan) -> None:
    _INFLATED.pop(id(span), None)
    _INFLATED[id(span)] = weakref.ref(span)
    live = [(key, s) for key, ref in _INFLATED.items() if (s := ref()) is not None]
    total = sum(len(s._inflated or b"") for _, s in live)
    for key, oldest in live[:-1]:
        if total <= INFLATED_CACHE_BYTES:
            break
        total -= len(oldest._inflated or b"")
        oldest._inflated = None
        del _INFLATED[key]
    for key in [key for key, ref in _INFLATED.items() if ref() is None]:
        del _INFLATED[key]


class ZipHeaderCheck(Protocol):
    """Checks a zip entry's local header (``size`` bytes: the fixed part and the name)
    against the central directory and returns where the entry's data starts in it."""

    size: int

    def __call__(self, header: bytes) -> int: ...


class ByteSpan:
    """Where a run of bytes lives: a span of a file, an entry of a zip, or memory.

    A zip entry's data offset needs its local header, so it is found on first read.
    (A deflated zip entry is a :class:`DeflatedSpan`: a plain span, of which a
    checkpoint has thousands, keeps its five attributes.)
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


class DeflatedSpan(ByteSpan):
    """A zip entry stored deflated (a re-zipped checkpoint, which torch reads): ``length``
    bytes once inflated, ``deflated`` bytes stored where ``path`` and ``offset`` place
    them. :attr:`data` inflates them on first use, so every reader of spans reads it as
    one held in memory; a bounded number of inflated entries is kept (``_keep_inflated``)."""

    def __init__(
        self,
        path: str,
        offset: int,
        length: int,
        *,
        deflated: int,
        name: str,
        zip_header_offset: int | None = None,
        zip_header_check: ZipHeaderCheck | None = None,
    ):
        self._inflated: bytearray | None = None
        super().__init__(
            path,
            offset,
            length,
            zip_header_offset=zip_header_offset,
            zip_header_check=zip_header_check,
        )
        self.deflated = deflated
        self.name = name

    @property  # type: ignore[override]
    def data(self) -> bytearray:
        """The entry's bytes, inflated now where they are not kept."""
        if self._inflated is None:
            self._inflated = self._inflate()
        _keep_inflated(self)
        return self._inflated

    @data.setter
    def data(self, value: bytes | bytearray | memoryview | None) -> None:
        if value is not None:  # (ByteSpan's __init__ sets None: the bytes are the file's)
            raise ValueError("a deflated span's bytes are its file's")

    def _inflate(self) -> bytearray:
        self.resolve()
        path, at = self.path, self.offset
        assert path is not None
        return inflate(
            lambda start, n: sources.read(path, at + start, n),
            self.deflated,
            self.length,
            name=self.name,
            path=path,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_inflated"] = None  # (inflated again where it is read)
        return state
