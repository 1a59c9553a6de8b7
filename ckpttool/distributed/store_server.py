"""A c10d ``TCPStore`` server in plain Python: what ``--workers`` serves its workers.

The other side of :mod:`.store`'s client, for the calls it makes (see its doc for the
wire protocol, as torch 2.13 speaks it): ``VALIDATE``, ``PING``, ``SET``, ``GET``,
``ADD``, ``CHECK``, ``COMPARE_SET``, ``WAIT`` and ``CANCEL_WAIT``. Served by ckpttool's
own launch, a run of several processes needs torch nowhere: the launcher's import of
torch's elastic agent alone was most of the start-up of ``--workers``.

It binds 127.0.0.1 only (the workers are this machine's), holds keys of at most
:data:`.store.MAX_KEY` bytes and values of at most :data:`.store.MAX_VALUE` bytes, and
closes a connection that sends anything else; one thread a connection.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

from .store import (
    ADD,
    CANCEL_WAIT,
    CHECK,
    COMPARE_SET,
    GET,
    I64,
    MAGIC,
    MAX_KEY,
    MAX_VALUE,
    NOT_READY,
    PING,
    READY,
    SET,
    STOP_WAITING,
    U32,
    U64,
    VALIDATE,
    WAIT,
    WAIT_CANCELED,
)

MAX_KEYS = 1 << 16  # keys in one CHECK or WAIT
_WAKE_S = 0.05  # a waiting connection looks for a CANCEL_WAIT this often


class _Closed(Exception):
    """The peer closed the connection, or sent what no client of this protocol sends."""


class StoreServer:
    """A store on 127.0.0.1 at :attr:`port` until :meth:`close`."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._changed = threading.Condition()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = int(self._listener.getsockname()[1])
        self._closed = threading.Event()
        self._peers: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="ckpttool-store", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        for peer in list(self._peers):
            with contextlib.suppress(OSError):
                peer.close()
        with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------ connections

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                peer, _ = self._listener.accept()
            except OSError:
                return
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._peers.add(peer)
            threading.Thread(target=self._serve, args=(peer,), daemon=True).start()

    def _serve(self, peer: socket.socket) -> None:
        try:
            if self._recv(peer, 1)[0] != VALIDATE or U32.unpack(self._recv(peer, 4))[0] != MAGIC:
                return
            while not self._closed.is_set():
                self._answer(peer, self._recv(peer, 1)[0])
        except (_Closed, OSError):
            pass
        finally:
            self._peers.discard(peer)
            with contextlib.suppress(OSError):
                peer.close()

    def _answer(self, peer: socket.socket, query: int) -> None:
        if query == PING:
            peer.sendall(self._recv(peer, 4))
        elif query == SET:
            key, value = self._key(peer), self._value(peer)
            with self._changed:
                self._data[key] = value
                self._changed.notify_all()
        elif query == GET:
            key = self._key(peer)
            with self._changed:
                found = self._data.get(key)
            if found is None:  # the client waits for a key before it gets it
                raise _Closed
            peer.sendall(U64.pack(len(found)) + found)
        elif query == ADD:
            key, (amount,) = self._key(peer), I64.unpack(self._recv(peer, 8))
            with self._changed:
                total = int(self._data.get(key, b"0")) + amount
                self._data[key] = str(total).encode()
                self._changed.notify_all()
            peer.sendall(I64.pack(total))
        elif query == CHECK:
            keys = self._keys(peer)
            with self._changed:
                ready = all(k in self._data for k in keys)
            peer.sendall(bytes((READY if ready else NOT_READY,)))
        elif query == COMPARE_SET:
            key, expected, desired = self._key(peer), self._value(peer), self._value(peer)
            with self._changed:
                now = self._data.get(key)
                reply: bytes
                if now == expected or (now is None and not expected):
                    self._data[key] = reply = desired
                    self._changed.notify_all()
                else:  # torch's server: an absent key answers what was expected
                    reply = now if now is not None else expected
            peer.sendall(U64.pack(len(reply)) + reply)
        elif query == WAIT:
            self._wait(peer, self._keys(peer))
        else:
            raise _Closed

    def _wait(self, peer: socket.socket, keys: list[bytes]) -> None:
        """Answer STOP_WAITING once every key exists, or WAIT_CANCELED to a CANCEL_WAIT."""
        while not self._closed.is_set():
            with self._changed:
                if all(k in self._data for k in keys):
                    peer.sendall(bytes((STOP_WAITING,)))
                    return
                self._changed.wait(_WAKE_S)
            if select.select([peer], [], [], 0)[0]:
                if self._recv(peer, 1)[0] != CANCEL_WAIT:
                    raise _Closed
                peer.sendall(bytes((WAIT_CANCELED,)))
                return
        raise _Closed

    # ------------------------------------------------------------ framing

    def _recv(self, peer: socket.socket, size: int) -> bytes:
        buf = bytearray()
        while len(buf) < size:
            chunk = peer.recv(size - len(buf))
            if not chunk:
                raise _Closed
            buf += chunk
        return bytes(buf)

    def _value(self, peer: socket.socket, limit: int = MAX_VALUE) -> bytes:
        (size,) = U64.unpack(self._recv(peer, 8))
        if size > limit:
            raise _Closed
        return self._recv(peer, size)

    def _key(self, peer: socket.socket) -> bytes:
        return self._value(peer, MAX_KEY)

    def _keys(self, peer: socket.socket) -> list[bytes]:
        (count,) = U64.unpack(self._recv(peer, 8))
        if count > MAX_KEYS:
            raise _Closed
        return [self._key(peer) for _ in range(count)]
