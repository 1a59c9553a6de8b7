"""Tensor bytes straight from their file: mapped copy-on-write, or read into a given buffer.

``ckpttool.load`` maps a file once per call (``MAP_PRIVATE``, as ``torch.load(mmap=True)`` and
safetensors do) and hands out views of it: nothing is read until a page is touched,
and writing to a loaded tensor copies that page instead of changing the file. The
map lives as long as a tensor uses it; the file may be closed, renamed or deleted.

torch is imported only where a map is made (a tensor is being built anyway).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any

from .. import sources
from ..errors import CkptError
from ..sources import ByteSpan, OpenFiles, open_fd, read_span_into


def _file_map(
    local: str, path: str, fds: OpenFiles, maps: dict[str, tuple[int, Any]]
) -> tuple[int, Any]:
    """(size, map) of the local file ``local``: mapped on its first tensor of a load,
    the same map for the rest (a private map per load: writes to the tensors of one
    load must not show in another's)."""
    found = maps.get(local)
    if found is None:
        import torch

        fd = open_fd(fds, local, path)
        size = os.fstat(fd).st_size
        # torch's own map (what torch.load(mmap=True) uses): MAP_PRIVATE, and unlike
        # Python's mmap it keeps no descriptor open while tensors use it. Mapped
        # through our descriptor, so it is the file whose size was just checked.
        proc = f"/proc/self/fd/{fd}"
        try:
            storage = torch.UntypedStorage.from_file(
                proc if os.path.exists(proc) else local, shared=False, nbytes=size
            )
        except (OSError, RuntimeError) as exc:
            raise CkptError(f"cannot map the file ({exc})", path=path) from None
        found = maps[local] = (size, storage)
    return found


def map_storage(
    source: ByteSpan,
    start: int,
    size: int,
    itemsize: int,
    maps: dict[str, tuple[int, Any]],
    files: OpenFiles | None = None,
) -> Any | None:
    """A copy-on-write ``torch.UntypedStorage`` of ``size`` bytes at ``start`` of
    ``source``: its memory is the file's pages, each read when first touched (a slice
    of the file's one map, as ``torch.load(mmap=True)`` gives each saved storage).

    Returns None where mapping does not apply: bytes held in memory or in a file with
    no local path (a URL: the caller reads them instead), nothing to map, or a file
    offset that is not a multiple of ``itemsize`` (legacy files store tensors at any
    byte; a misaligned tensor would be slow or refused by kernels). ``maps`` holds the
    maps made so far (one per file), for the views to share; ``files`` the open
    descriptors of a session (None: the file is opened for this call).

    Raises:
        CkptError: The span lies outside the stored bytes or past the end of the file
            (it is checked against the file's size before anything is mapped).
    """
    if source.data is not None or source.path is None or size <= 0:
        return None
    if start < 0 or start + size > source.length:
        raise CkptError("read outside of the stored bytes (truncated file?)", path=source.path)
    reader = sources.source_for(source.path)
    local = reader.local_path(source.path)
    if local is None:
        return None
    own = files is None
    fds = OpenFiles() if files is None else files
    try:
        source.resolve(fds)
        begin = source.offset + start
        if begin % itemsize:
            return None
        end = begin + size
        file_size, whole = _file_map(local, source.path, fds, maps)
    finally:
        if own:
            fds.close()
    if end > file_size:
        raise CkptError(
            f"tensor data runs {end - file_size} bytes past the end of the file (truncated?)",
            path=source.path,
        )
    # the pages are read through the map: count them as read (torch.load(mmap=True)
    # touches every one of them too)
    reader.count(size)
    return whole[begin:end]


class SpanReader:
    """Reads spans of many sources into caller-owned buffers, files kept open meanwhile.

    Used where the destination exists already (a model's parameter, a pinned staging
    buffer): the bytes go from the page cache (or a remote source) into it, with no
    buffer in between.
    """

    def __init__(self) -> None:
        self.files = OpenFiles()

    def read_into(self, source: ByteSpan, start: int, view: Any) -> None:
        """Fill the writable buffer ``view`` with the bytes of ``source`` from ``start``."""
        read_span_into(source, start, memoryview(view).cast("B"), self.files)

    def close(self) -> None:
        self.files.close()

    def __enter__(self) -> SpanReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoadSession:
    """How tensors are read during one ``load`` / ``open`` / ``load_into`` call.

    Attributes:
        mmap: Map tensor bytes from their file where the format allows it.
        reader: Open files for reads into existing buffers.
        stagers: Pinned staging buffers per CUDA device (made on first use).
    """

    def __init__(self, mmap: bool = True) -> None:
        self.mmap = mmap
        self.reader = SpanReader()
        self.stagers: dict[str, Any] = {}
        self.maps: dict[str, tuple[int, Any]] = {}  # (size, map) per file; tensors keep maps alive

    def settle(self) -> None:
        """Wait until every device copy in flight has landed (tensors handed out are whole)."""
        for stager in self.stagers.values():
            stager.finish()

    def close(self) -> None:
        """Wait for copies in flight, free staging buffers, close files."""
        try:
            for stager in self.stagers.values():
                stager.close()
        finally:
            self.stagers.clear()
            self.maps.clear()
            self.reader.close()


_SESSION: contextvars.ContextVar[LoadSession | None] = contextvars.ContextVar(
    "ckpttool_load_session", default=None
)


def current_session() -> LoadSession | None:
    """The session of the ``load`` call in progress here, or None (CLI reads)."""
    return _SESSION.get()


@contextlib.contextmanager
def loading(mmap: bool = True) -> Iterator[LoadSession]:
    """Run the reads inside the ``with`` block as one session (see :class:`LoadSession`).

    A session already in progress is reused, so nested calls share files and buffers.
    """
    outer = _SESSION.get()
    if outer is not None and outer.mmap == mmap:
        yield outer
        return
    session = LoadSession(mmap)
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)
        session.close()


@contextlib.contextmanager
def activated(session: LoadSession) -> Iterator[LoadSession]:
    """Make ``session`` the current one inside the block (it stays open afterwards)."""
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)
