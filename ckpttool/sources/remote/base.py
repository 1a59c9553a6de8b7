"""What every remote source shares: a block cache, parallel span reads, retries, URL hygiene.

A remote read costs a round trip, so the shape of the requests matters more than
their bytes: the tens of small reads that parse a zip's central directory or a
pickle become one or two requests through :class:`BlockCache` (aligned blocks,
fetched in windows that grow while a file is read sequentially, and that end at the
end of the file when a reader starts from there, as zip readers do). Reads larger
than a window go straight into the caller's buffer. :meth:`RemoteSource.read_spans`
fetches large spans in parallel, in parts, on a bounded pool of threads, each part
into its slice of the caller's view: memory stays what the caller allocated.
"""

from __future__ import annotations

import abc
import functools
import os
import posixpath
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from ... import sources
from ...errors import CkptError
from .stream import Streams

T = TypeVar("T")

BLOCK = 64 << 10  # cache granularity
FIRST_WINDOW = 128 << 10  # bytes fetched on a file's first small read
MAX_WINDOW = 4 << 20  # the window doubles up to this while a file is read in order
CACHE_BYTES = 32 << 20  # least recently used blocks are dropped beyond this
PART = 8 << 20  # read_spans: at most this many bytes per request
GAP = 4 << 10  # read_spans: spans this close share a request
THREADS = 8  # parallel requests of one read_spans call

RETRIES = int(os.environ.get("CKPTTOOL_REMOTE_RETRIES", "4"))  # attempts per request
BACKOFF = float(os.environ.get("CKPTTOOL_REMOTE_BACKOFF", "0.25"))  # first wait, seconds
MAX_BACKOFF = 8.0


class TransientError(Exception):
    """A failure worth retrying (connection reset, 5xx, 429, a body cut short)."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


# a URL as it may be shown (no user, password, query or fragment): defined once, in sources
redact = sources.shown


def with_retries(call: Callable[[], T], url: str, what: str = "read") -> T:
    """``call()``, retried with exponential backoff and jitter on :class:`TransientError`.

    Raises:
        CkptError: It still fails after ``RETRIES`` attempts (the last reason given).
    """
    for attempt in range(max(1, RETRIES)):
        try:
            return call()
        except TransientError as exc:
            if attempt + 1 >= max(1, RETRIES):
                raise CkptError(
                    f"cannot {what} after {attempt + 1} attempts: {exc}", path=redact(url)
                ) from None
            wait = min(MAX_BACKOFF, BACKOFF * 2**attempt) * (0.5 + random.random() / 2)
            if exc.retry_after is not None:
                wait = min(MAX_BACKOFF, max(wait, exc.retry_after))
            time.sleep(wait)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Stat:
    """What a remote object was at first contact; every later response must agree."""

    size: int
    tag: tuple[tuple[str, str], ...] = ()  # ("etag", ...), ("last-modified", ...), ("version", ...)


class BlockCache:
    """Aligned blocks of remote files, least recently used dropped beyond ``CACHE_BYTES``."""

    def __init__(self, capacity: int = CACHE_BYTES) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, path: str, index: int) -> bytes | None:
        with self._lock:
            block = self._blocks.get((path, index))
            if block is not None:
                self._blocks.move_to_end((path, index))
            return block

    def put(self, path: str, index: int, block: bytes) -> None:
        with self._lock:
            old = self._blocks.pop((path, index), None)
            if old is not None:
                self._bytes -= len(old)
            self._blocks[(path, index)] = block
            self._bytes += len(block)
            while self._bytes > self.capacity and len(self._blocks) > 1:
                _, dropped = self._blocks.popitem(last=False)
                self._bytes -= len(dropped)

    def drop(self, path: str) -> None:
        with self._lock:
            for key in [k for k in self._blocks if k[0] == path]:
                self._bytes -= len(self._blocks.pop(key))


class RemoteSource(sources.Source):
    """A source whose bytes arrive by ranged requests (see the module docstring).

    Subclasses implement ``_stat`` (first contact: size and identity tags) and
    ``_fetch_into`` (one validated ranged request into a view), plus the listing
    primitives. ``local_path`` is None: callers use ``read_into``/``read_spans``.
    """

    name = "remote"

    def __init__(self, scheme: str) -> None:
        super().__init__()
        self.scheme = scheme
        self._stats: dict[str, Stat] = {}
        self._cache = BlockCache()
        self._window: dict[str, tuple[int, int]] = {}  # path -> (end of last fetch, size)
        self._streams = Streams(self._fetch_bytes)
        self._lock = threading.Lock()

    def count(self, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            super().count(nbytes, requests)

    # -- for subclasses ----------------------------------------------------------------
    @abc.abstractmethod
    def _stat(self, path: str) -> Stat:
        """First contact: the object's size and identity tags."""

    @abc.abstractmethod
    def _fetch_into(self, path: str, view: memoryview, offset: int, stat: Stat) -> None:
        """Fill ``view`` from ``offset`` with one (retried) ranged request, checked."""

    # -- primitives --------------------------------------------------------------------
    def stat(self, path: str) -> Stat:
        stat = self._stats.get(path)
        if stat is None:
            stat = self._stats[path] = self._stat(path)
        return stat

    def size(self, path: str) -> int:
        return self.stat(path).size

    def identity(self, path: str) -> Hashable:
        stat = self.stat(path)
        return (self.scheme, path, stat.size, stat.tag)

    def local_path(self, path: str) -> str | None:
        return None

    def read_into(self, path: str, view: memoryview, offset: int) -> None:
        stat = self.stat(path)
        size = len(view)
        if offset < 0 or offset + size > stat.size:
            missing = offset + size - stat.size
            raise CkptError(f"file ends {missing} bytes early (truncated?)", path=redact(path))
        if not size:
            return
        if self._streams.read(path, view, offset, stat.size):
            return
        if size > MAX_WINDOW:
            self._fetch_parts(path, view, offset, stat)
            return
        self._read_cached(path, view, offset, stat)

    def read_spans(self, path: str, spans: Sequence[tuple[memoryview, int]]) -> None:
        """Fill each ``(view, offset)``, the spans side by side on at most ``THREADS``
        requests: spans the cache holds are copied from it; the others, in file order,
        are grouped when at most ``GAP`` apart (one request of at most ``PART`` bytes for
        many small neighbours, into a scratch buffer) and a span larger than ``PART`` is
        fetched in parts straight into its view. Nothing is read ahead: a caller asking
        for many scattered small spans (a zip's local headers) pays for their bytes only.
        """
        stat = self.stat(path)
        todo: list[tuple[int, memoryview]] = []
        for view, offset in spans:
            if offset < 0 or offset + len(view) > stat.size:
                missing = offset + len(view) - stat.size
                raise CkptError(f"file ends {missing} bytes early (truncated?)", path=redact(path))
            if not len(view) or self._from_cache(path, view, offset):
                continue
            if not self._streams.read(path, view, offset, stat.size):
                todo.append((offset, view))
        todo.sort(key=lambda item: item[0])
        groups: list[list[tuple[int, memoryview]]] = []
        for offset, view in todo:
            if groups:
                first, last = groups[-1][0], groups[-1][-1]
                near = offset - (last[0] + len(last[1])) <= GAP
                if near and offset + len(view) - first[0] <= PART:
                    groups[-1].append((offset, view))
                    continue
            groups.append([(offset, view)])
        jobs: list[Callable[[], None]] = []
        for group in groups:
            if len(group) == 1:  # straight into the view, in parts
                offset, view = group[0]
                jobs += self._parts(path, view, offset, stat)
            else:
                jobs.append(functools.partial(self._fetch_group, path, group, stat))
        self._run(jobs)

    def _parts(
        self, path: str, view: memoryview, offset: int, stat: Stat
    ) -> list[Callable[[], None]]:
        """Fetches of ``view`` in parts of at most ``PART`` bytes, each into its slice."""
        return [
            functools.partial(self._fetch_into, path, view[at : at + PART], offset + at, stat)
            for at in range(0, len(view), PART)
        ]

    def _fetch_parts(self, path: str, view: memoryview, offset: int, stat: Stat) -> None:
        self._run(self._parts(path, view, offset, stat))

    @staticmethod
    def _run(jobs: list[Callable[[], None]]) -> None:
        """Run fetches on at most ``THREADS`` threads; the first failure is raised."""
        if len(jobs) == 1:
            jobs[0]()
        elif jobs:
            with ThreadPoolExecutor(min(THREADS, len(jobs))) as pool:
                for _ in pool.map(lambda job: job(), jobs):  # consumed in order
                    pass

    def _fetch_bytes(self, path: str, offset: int, size: int) -> bytearray:
        """``size`` bytes at ``offset`` in one request (the read-ahead's chunks)."""
        buf = bytearray(size)
        self._fetch_into(path, memoryview(buf), offset, self.stat(path))
        return buf

    def _fetch_group(self, path: str, group: list[tuple[int, memoryview]], stat: Stat) -> None:
        """One request for neighbouring spans (at most ``PART`` bytes), then copied out."""
        start = group[0][0]
        end = max(offset + len(view) for offset, view in group)
        buf = bytearray(end - start)
        self._fetch_into(path, memoryview(buf), start, stat)
        for offset, view in group:
            view[:] = buf[offset - start : offset - start + len(view)]

    def _from_cache(self, path: str, view: memoryview, offset: int) -> bool:
        """Copy a span from cached blocks if the cache holds all of it."""
        end = offset + len(view)
        blocks = []
        for index in range(offset // BLOCK, (end - 1) // BLOCK + 1):
            block = self._cache.get(path, index)
            if block is None:
                return False
            blocks.append((index, block))
        for index, block in blocks:
            lo, hi = max(offset, index * BLOCK), min(end, index * BLOCK + len(block))
            view[lo - offset : hi - offset] = block[lo - index * BLOCK : hi - index * BLOCK]
        return True

    # -- the block cache -----------------------------------------------------------------
    def _read_cached(self, path: str, view: memoryview, offset: int, stat: Stat) -> None:
        end = offset + len(view)
        first, last = offset // BLOCK, (end - 1) // BLOCK
        index = first
        while index <= last:
            block = self._cache.get(path, index)
            if block is None:
                block = self._fill(path, index, last, stat)
            lo = max(offset, index * BLOCK)
            hi = min(end, index * BLOCK + len(block))
            view[lo - offset : hi - offset] = block[lo - index * BLOCK : hi - index * BLOCK]
            index += 1

    def _fill(self, path: str, index: int, last: int, stat: Stat) -> bytes:
        """Fetch a window holding blocks ``index..last`` (and more: read-ahead); cache it."""
        previous_end, window = self._window.get(path, (-1, FIRST_WINDOW))
        start = index * BLOCK
        if start == previous_end:  # read in order: read further ahead each time
            window = min(MAX_WINDOW, window * 2)
        need_end = min(stat.size, (last + 1) * BLOCK)
        stop = min(stat.size, max(need_end, start + window))
        if stop == stat.size and need_end - start < window:
            # near the end (a zip's directory): take the window ending at the end
            start = min(start, max(0, (stat.size - window) // BLOCK * BLOCK))
        buf = bytearray(stop - start)
        self._fetch_into(path, memoryview(buf), start, stat)
        self._window[path] = (stop, window)
        data = bytes(buf)
        for at in range(start, stop, BLOCK):
            self._cache.put(path, at // BLOCK, data[at - start : at - start + BLOCK])
        return data[index * BLOCK - start : index * BLOCK - start + BLOCK]

    def forget(self, path: str | None = None) -> None:
        """Drop what is known of a path (or of every path): its stat and cached blocks."""
        for p in [path] if path is not None else list(self._stats):
            self._stats.pop(p, None)
            self._window.pop(p, None)
            self._cache.drop(p)
            self._streams.forget(p)

    # -- paths -------------------------------------------------------------------------
    def join(self, folder: str, *names: str) -> str:
        """``folder/name...``, refusing names that leave the folder (``..``, an absolute
        path, another URL): an index or a DCP ``.metadata`` names files inside it."""
        for name in names:
            parts = name.split("/")
            if name.startswith("/") or "://" in name or ".." in parts or "\\" in name:
                raise CkptError(
                    f"the name {name!r} leaves the checkpoint's folder; refused",
                    path=redact(folder),
                )
        return posixpath.join(folder, *names)

    def split(self, path: str) -> tuple[str, str]:
        return posixpath.split(path)

    def isfile(self, path: str) -> bool:
        return not path.endswith("/") and self.exists(path) and not self.isdir(path)


def check_changed(path: str, first: Stat, now: Stat) -> None:
    """Raise if a response describes another version of the object than first contact."""
    if now.size != first.size:
        raise CkptError(
            f"changed while being read (size {first.size} -> {now.size})", path=redact(path)
        )
    before = dict(first.tag)
    for key, value in now.tag:
        if key in before and before[key] != value:
            raise CkptError(
                f"changed while being read ({key} {before[key]} -> {value})",
                path=redact(path),
                hint="read it again once it is written",
            )
