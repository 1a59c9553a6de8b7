"""A client of torch's c10d ``TCPStore`` in plain Python (``socket`` + ``struct``).

The ranks of a distributed conversion talk only to the store torchrun's agent serves
(``TORCHELASTIC_USE_AGENT_STORE=True``, at ``MASTER_ADDR:MASTER_PORT``); with this
client they never import torch for it (``import torch.distributed`` alone is ~220 MiB
and ~1.5 s a rank). Only the calls :class:`.group.Group` makes are here.

The wire protocol, as torch 2.13 speaks it (``torch/csrc/distributed/c10d/TCPStore.cpp``,
``TCPStoreBackend.hpp``; both servers, the libuv one torchrun starts and the legacy
one, parse it alike):

- every integer in the machine's own byte order (torch sends its structs' bytes; every
  platform torch runs on is little-endian); a string or value is a ``uint64`` length,
  then its bytes; a request is one ``uint8`` query type, then its arguments;
- a connection opens with ``VALIDATE`` + the ``uint32`` magic ``0x3C85F7CE`` (no
  answer), then ``PING`` + a ``uint32`` nonce, which the server echoes;
- ``SET key value``: no answer. ``GET key``: the value (torch waits for the key first:
  ``WAIT``, so does :meth:`TCPStoreClient.get`). ``ADD key int64``: the new ``int64``.
  ``CHECK uint64-count keys...``: one byte, 0 ready, 1 not. ``COMPARE_SET key expected
  desired``: the value now stored (``desired`` when it was set; an absent key is set
  only when ``expected`` is empty). ``WAIT count keys...``: one byte, 0 (stop waiting)
  once every key exists; ``CANCEL_WAIT`` ends a wait: 1 (canceled), after a 0 that
  may already be on its way;
- torch's client puts ``/`` before every key and ``PrefixStore(P)`` makes ``P/key``:
  with a prefix this client sends ``/P/key``, the very bytes of
  ``PrefixStore(P, TCPStore(...))``, so a key set by one is read by the other.

Everything is bounded: each call has a deadline (the ``timeout``), a server that dies or
stops answering raises :class:`StoreError` within it, and a length in an answer is
trusted only up to :data:`MAX_VALUE` (the libuv server's own cap on a value).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT = 0, 1, 2, 3, 4, 5, 6
CANCEL_WAIT, PING = 12, 13  # QueryType in TCPStoreBackend.hpp
MAGIC = 0x3C85F7CE  # validationMagicNumber
READY, NOT_READY = 0, 1  # CheckResponseType
STOP_WAITING, WAIT_CANCELED = 0, 1  # WaitResponseType
MAX_KEY = 8 << 10  # the libuv server closes a connection sending a longer key
MAX_VALUE = 8 << 20  # ... or a longer value; a longer answer is no store's
U32, U64, I64 = struct.Struct("=I"), struct.Struct("=Q"), struct.Struct("=q")
_CANCEL_S = 5.0  # at most this long for a canceled wait's acknowledgement


class StoreError(Exception):
    """A store call failed: the store is unreachable, closed the connection, did not
    answer within the timeout, or answered something no c10d store sends. The
    connection is closed after it; later calls on this client raise it again.

    Neither an ``OSError`` nor a ``RuntimeError``: the verbs' error translation
    (``errors.translate_errors``) lets it through to ``distributed.collective``, which
    says the store is lost, instead of calling it a corrupt input."""


class _NoAnswer(StoreError):
    """The deadline passed before the answer came."""


class TCPStoreClient:
    """One connection to a c10d ``TCPStore`` server (thread-safe: one call at a time).

    Args:
        host: The server's host name or address (``MASTER_ADDR``).
        port: Its port (``MASTER_PORT``).
        timeout: Seconds any one call may take (``get``: waiting for the key, then
            reading it, each).
        connect_timeout: Seconds to connect (retried while refused, as torch's client
            does); ``timeout`` when None.
        prefix: Put before every key as ``PrefixStore(prefix, ...)`` does.

    Raises:
        StoreError: No store answered at ``host:port`` within ``connect_timeout``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float,
        connect_timeout: float | None = None,
        prefix: str = "",
    ):
        self.host, self.port, self.timeout = host, int(port), float(timeout)
        self._prefix = f"/{prefix}/" if prefix else "/"
        self._lock = threading.Lock()
        self._broken = ""
        self._sock = self._connect(self.timeout if connect_timeout is None else connect_timeout)

    def __repr__(self) -> str:
        return f"TCPStoreClient({self.host}:{self.port})"

    # ------------------------------------------------------------ the calls

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._send(bytes((SET,)) + self._key(key) + _value(value), self._deadline())

    def get(self, key: str) -> bytes:
        """The key's value, once it exists (waiting for it up to the timeout)."""
        with self._lock:
            self._wait([key], self.timeout)
            deadline = self._deadline()
            self._send(bytes((GET,)) + self._key(key), deadline)
            return self._recv_value(deadline)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 when absent); the sum."""
        with self._lock:
            deadline = self._deadline()
            self._send(bytes((ADD,)) + self._key(key) + I64.pack(amount), deadline)
            return int(I64.unpack(self._recv(8, deadline))[0])

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists (no waiting)."""
        with self._lock:
            deadline = self._deadline()
            self._send(bytes((CHECK,)) + self._keys(keys), deadline)
            answer = self._recv(1, deadline)[0]
            if answer not in (READY, NOT_READY):
                raise self._fail(f"answered {answer} to a check (0 or 1 expected)")
            return answer == READY

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is absent and
        ``expected`` is empty); the value it holds afterwards."""
        with self._lock:
            deadline = self._deadline()
            request = bytes((COMPARE_SET,)) + self._key(key) + _value(expected)
            self._send(request + _value(desired), deadline)
            return self._recv_value(deadline)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Return once every key exists; :class:`StoreError` after ``timeout`` seconds
        (the client's when None) and the server's answer to the cancel (at most the
        client's timeout, 5 s)."""
        with self._lock:
            self._wait(keys, self.timeout if timeout is None else timeout)

    def close(self) -> None:
        with self._lock:
            self._close("closed")

    # ------------------------------------------------------------ waiting

    def _wait(self, keys: Sequence[str], seconds: float) -> None:
        """WAIT; past ``seconds``, CANCEL_WAIT as torch's client does (the server then
        forgets the wait; a STOP_WAITING already sent comes first)."""
        self._send(bytes((WAIT,)) + self._keys(keys), self._deadline())
        try:
            answer = self._recv(1, time.monotonic() + seconds, close=False)[0]
        except _NoAnswer:
            cancel = time.monotonic() + min(_CANCEL_S, self.timeout)
            self._send(bytes((CANCEL_WAIT,)), cancel)
            answer = self._recv(1, cancel)[0]
            if answer == STOP_WAITING:  # the keys came as we canceled: 1 follows
                answer = self._recv(1, cancel)[0]
            if answer != WAIT_CANCELED:
                raise self._fail(f"answered {answer} to a canceled wait (1 expected)") from None
            raise StoreError(
                f"c10d store at {self.host}:{self.port}: waited {seconds:g} s for "
                + ", ".join(keys)
            ) from None
        if answer != STOP_WAITING:
            raise self._fail(f"answered {answer} to a wait (0 expected)")

    # ------------------------------------------------------------ framing

    def _key(self, key: str) -> bytes:
        data = (self._prefix + key).encode()
        if len(data) > MAX_KEY:
            raise ValueError(f"store key of {len(data)} bytes (at most {MAX_KEY})")
        return U64.pack(len(data)) + data

    def _keys(self, keys: Sequence[str]) -> bytes:
        return U64.pack(len(keys)) + b"".join(self._key(k) for k in keys)

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _send(self, data: bytes, deadline: float) -> None:
        self._usable()
        view = memoryview(data)
        try:
            while view:
                self._sock.settimeout(self._left(deadline))
                view = view[self._sock.send(view) :]
        except TimeoutError:
            raise self._fail(f"took no request for {self.timeout:g} s") from None
        except OSError as exc:  # reset, broken pipe
            raise self._fail(exc.strerror or str(exc)) from None

    def _recv(self, size: int, deadline: float, *, close: bool = True) -> bytes:
        """``size`` bytes; :class:`_NoAnswer` once ``deadline`` passes (the connection
        closed unless ``close`` is False: a wait that times out is canceled instead)."""
        self._usable()
        buf = bytearray(size)
        view = memoryview(buf)
        try:
            while view:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
                got = self._sock.recv_into(view)
                if got == 0:
                    raise self._fail("closed the connection")
                view = view[got:]
        except TimeoutError:
            if not close and len(view) == size:  # nothing of the answer read yet
                raise _NoAnswer("no answer") from None
            raise self._fail(f"no answer within {self.timeout:g} s", _NoAnswer) from None
        except OSError as exc:  # reset
            raise self._fail(exc.strerror or str(exc)) from None
        return bytes(buf)

    def _recv_value(self, deadline: float) -> bytes:
        (size,) = U64.unpack(self._recv(8, deadline))
        if size > MAX_VALUE:
            raise self._fail(f"announced a value of {size} bytes (at most {MAX_VALUE})")
        return self._recv(size, deadline)

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def _usable(self) -> None:
        if self._broken:
            raise StoreError(f"c10d store at {self.host}:{self.port}: {self._broken}")

    def _fail(self, what: str, kind: type[StoreError] = StoreError) -> StoreError:
        """The error to raise; the connection is closed (its state is unknown now)."""
        message = f"c10d store at {self.host}:{self.port}: {what}"
        self._close(what)
        return kind(message)

    def _close(self, why: str) -> None:
        self._broken = self._broken or why
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()

    # ------------------------------------------------------------ connecting

    def _connect(self, seconds: float) -> socket.socket:
        """Connect, VALIDATE, PING; retried while nothing listens or the connection
        drops (a full listen backlog), as torch's client does, until ``seconds``."""
        deadline = time.monotonic() + seconds
        delay = 0.05
        nonce = os.getpid() & 0xFFFFFFFF
        hello = bytes((VALIDATE,)) + U32.pack(MAGIC) + bytes((PING,)) + U32.pack(nonce)
        while True:
            self._broken = ""
            try:
                self._sock = socket.create_connection(
                    (self.host, self.port), timeout=max(0.01, deadline - time.monotonic())
                )
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:
                why = exc.strerror or str(exc) or "timed out"
            else:
                try:
                    self._send(hello, deadline)
                    (echo,) = U32.unpack(self._recv(4, deadline))
                except _NoAnswer:  # something listens but does not answer
                    why = f"no answer to a ping within {seconds:g} s"
                except StoreError as exc:
                    why = self._broken or str(exc)
                else:
                    if echo == nonce:
                        return self._sock
                    raise self._fail(f"answered a ping with {echo}, not {nonce}: not a c10d store")
            if time.monotonic() + delay >= deadline:
                raise StoreError(f"no c10d store at {self.host}:{self.port} ({why})")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def _value(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else bytes(value)
    if len(data) > MAX_VALUE:
        raise ValueError(f"store value of {len(data)} bytes (at most {MAX_VALUE})")
    return U64.pack(len(data)) + data
