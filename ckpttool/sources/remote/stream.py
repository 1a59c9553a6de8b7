"""Read-ahead for remote files read from start to end (a conversion copying every tensor).

A writer copies tensors one by one, each a read of its own: thousands of requests, each
paying a round trip (and, on some servers, a cost that grows with the object). Once a
file has been read in order for ``STREAM_AFTER`` bytes, :class:`Streams` fetches it in
chunks of ``STREAM_CHUNK`` bytes, the next chunk in the background while the caller
copies from the current one: few large requests, overlapped with the writing. Memory:
two chunks per stream, at most ``MAX_STREAMS`` streams (least recently used dropped).
A read that does not continue the stream goes back to the caller's own path.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

STREAM_CHUNK = 32 << 20
STREAM_AFTER = 4 << 20  # bytes read in order before reading ahead (inspect never gets here)
STREAM_GAP = 64 << 10  # a read starting this far past the last one still continues it
MAX_STREAMS = 2


@dataclass
class _Stream:
    start: int
    data: bytes | bytearray
    next_start: int = 0
    next: Future | None = None


class Streams:
    """Sequential read-ahead over ``fetch(path, offset, size) -> bytes``."""

    def __init__(self, fetch: Callable[[str, int, int], bytes | bytearray]) -> None:
        self._fetch = fetch
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._runs: dict[str, tuple[int, int]] = {}  # path -> (end of last read, bytes in order)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def read(self, path: str, view: memoryview, offset: int, file_size: int) -> bool:
        """Fill ``view`` from the stream of ``path`` if this read continues it (starting
        one when the file has been read in order long enough); False: not served."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: no threads, no shared state
                self._streams.clear()
                self._pool = None
                self._pid = os.getpid()
            end = offset + len(view)
            last_end, run = self._runs.get(path, (-1, 0))
            in_order = last_end >= 0 and 0 <= offset - last_end <= STREAM_GAP
            self._runs[path] = (end, run + len(view) if in_order else len(view))
            stream = self._streams.get(path)
            if stream is None:
                if not in_order or run < STREAM_AFTER or len(view) >= STREAM_CHUNK:
                    return False
                size = min(STREAM_CHUNK, file_size - offset)
                stream = _Stream(offset, self._fetch(path, offset, size))
                self._streams[path] = stream
                while len(self._streams) > MAX_STREAMS:
                    _, dropped = self._streams.popitem(last=False)
                    if dropped.next is not None:
                        dropped.next.cancel()
            self._streams.move_to_end(path)
            if not self._serve(path, stream, view, offset, file_size):
                self._streams.pop(path, None)
                return False
            return True

    def _serve(
        self, path: str, stream: _Stream, view: memoryview, offset: int, file_size: int
    ) -> bool:
        pos, end = offset, offset + len(view)
        while pos < end:
            stream_end = stream.start + len(stream.data)
            if stream.start <= pos < stream_end:
                n = min(end, stream_end) - pos
                at = pos - stream.start
                view[pos - offset : pos - offset + n] = stream.data[at : at + n]
                pos += n
                continue
            if stream.next is None or not stream.next_start <= pos:
                return False
            stream.start, stream.data = stream.next_start, stream.next.result()
            stream.next = None
            if not stream.start <= pos < stream.start + len(stream.data):
                return False
            self._ahead(path, stream, file_size)
        self._ahead(path, stream, file_size)
        return True

    def _ahead(self, path: str, stream: _Stream, file_size: int) -> None:
        """Start fetching the chunk after the current one, unless it is on its way."""
        start = stream.start + len(stream.data)
        if stream.next is not None or start >= file_size:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(MAX_STREAMS, thread_name_prefix="ckpttool-ahead")
        stream.next_start = start
        stream.next = self._pool.submit(
            self._fetch, path, start, min(STREAM_CHUNK, file_size - start)
        )

    def forget(self, path: str) -> None:
        with self._lock:
            stream = self._streams.pop(path, None)
            if stream is not None and stream.next is not None:
                stream.next.cancel()
            self._runs.pop(path, None)
