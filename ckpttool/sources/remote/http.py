"""``http://`` and ``https://``: ranged GETs with the standard library, every answer checked.

A ranged read must come back as ``206 Partial Content`` with a ``Content-Range`` of
exactly the bytes asked for and of the size seen at first contact, a body of exactly
that length, and the ETag / Last-Modified of first contact: anything else is one line
(exit 2), never bytes taken on trust. A server that ignores ``Range`` (``200`` with
the whole body) is detected from the status line: a small file (at most
``WHOLE_BODY_LIMIT``) is then read whole, once, and served from memory; a larger
one is refused without reading its body (the connection is closed), since every
read would otherwise download the file from its start. Connection resets, ``5xx``
and ``429`` are retried with backoff (``Retry-After`` honoured), ``4xx`` never.

HTTP has no folder listing: ``listdir`` of an ``https://`` folder raises, telling the
user to give a file that leads to the others (``model.safetensors.index.json``, a DCP
folder's ``.metadata`` or one of its ``.distcp`` files, Megatron's ``metadata.json``) or
the files themselves.
"""

from __future__ import annotations

import base64
import http.client
import os
import re
import socket
import ssl
import threading
import urllib.parse

from ...errors import CkptError, InputNotFoundError
from .base import RemoteSource, Stat, TransientError, check_changed, redact, with_retries

WHOLE_BODY_LIMIT = 1 << 20  # a server without Range support: files up to this are read whole
MAX_REDIRECTS = 5
TIMEOUT = float(os.environ.get("CKPTTOOL_REMOTE_TIMEOUT", "60"))
RETRY_STATUS = {429, 500, 502, 503, 504}
CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
USER_AGENT = "ckpttool"


class HttpSource(RemoteSource):
    """Files behind ``http(s)://`` URLs, read by validated range requests."""

    name = "http"

    def __init__(self, scheme: str) -> None:
        super().__init__(scheme)
        self._local = threading.local()  # per thread: {(scheme, host, port): connection}
        self._whole: dict[str, bytes] = {}  # files of servers that ignore Range
        self._pid = os.getpid()

    def headers_for(self, parts: urllib.parse.SplitResult) -> dict[str, str]:
        """Headers to send to this host (credentials go to their own host only)."""
        return {}

    # -- connections -------------------------------------------------------------------
    def _connection(self, parts: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        if self._pid != os.getpid():
            # a forked child (the readers' prescan) must not talk on its parent's
            # sockets: the two would read each other's responses
            self._local = threading.local()
            self._pid = os.getpid()
        pool = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = {}
        key = (parts.scheme, parts.hostname, parts.port)
        conn = pool.get(key)
        if conn is None:
            host = parts.hostname or ""
            if parts.scheme == "https":
                conn = http.client.HTTPSConnection(
                    host, parts.port, timeout=TIMEOUT, context=ssl.create_default_context()
                )
            else:
                conn = http.client.HTTPConnection(host, parts.port, timeout=TIMEOUT)
            pool[key] = conn
        return conn

    def _drop_connection(self, parts: urllib.parse.SplitResult) -> None:
        pool = getattr(self._local, "pool", {})
        conn = pool.pop((parts.scheme, parts.hostname, parts.port), None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for conn in getattr(self._local, "pool", {}).values():
            conn.close()
        self._local = threading.local()

    def _open(
        self, method: str, url: str, headers: dict[str, str]
    ) -> tuple[http.client.HTTPResponse, str]:
        """Send a request, following redirects; returns the response and the final URL.

        Raises:
            TransientError: The connection failed, or a 5xx / 429 came back.
            CkptError: Too many redirects.
        """
        for _ in range(MAX_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(url)
            send = {"User-Agent": USER_AGENT, **self.headers_for(parts), **headers}
            if parts.username is not None:
                # credentials in the URL: sent as Basic auth, never shown (see redact)
                user = urllib.parse.unquote(parts.username)
                password = urllib.parse.unquote(parts.password or "")
                send["Authorization"] = "Basic " + base64.b64encode(
                    f"{user}:{password}".encode()
                ).decode("ascii")
            target = parts.path or "/"
            if parts.query:
                target += "?" + parts.query
            conn = self._connection(parts)
            try:
                conn.request(method, target, headers=send)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                self._drop_connection(parts)
                raise TransientError(_reason(exc)) from None
            self.count(0, 1)
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("Location")
                response.read(64 << 10)
                response.close()
                self._drop_connection(parts)
                if not location:
                    raise CkptError(f"HTTP {response.status} without a Location", path=redact(url))
                url = urllib.parse.urljoin(url, location)
                continue
            if response.status in RETRY_STATUS:
                retry_after = _seconds(response.getheader("Retry-After"))
                response.close()
                self._drop_connection(parts)
                raise TransientError(f"HTTP {response.status}", retry_after)
            return response, url
        raise CkptError(f"more than {MAX_REDIRECTS} redirects", path=redact(url))

    # -- primitives --------------------------------------------------------------------
    def _stat(self, path: str) -> Stat:
        def head() -> Stat:
            response, _ = self._open("HEAD", path, {"Accept-Encoding": "identity"})
            response.read()
            response.close()
            if response.status == 404 or response.status == 410:
                raise InputNotFoundError("no such file (HTTP 404)", path=redact(path))
            if response.status in (401, 403):
                raise CkptError(
                    f"access denied (HTTP {response.status})",
                    path=redact(path),
                    hint="check the URL and its credentials",
                )
            if response.status == 405:  # no HEAD: ask for one byte instead
                return self._stat_by_get(path)
            if response.status != 200:
                raise CkptError(f"HTTP {response.status}", path=redact(path))
            length = response.getheader("Content-Length")
            if length is None or not length.isdigit():
                return self._stat_by_get(path)
            return Stat(int(length), _tags(response))

        return with_retries(head, path, "reach it")

    def _stat_by_get(self, path: str) -> Stat:
        response, _ = self._open("GET", path, {"Range": "bytes=0-0", "Accept-Encoding": "identity"})
        try:
            if response.status == 206:
                match = CONTENT_RANGE.match(response.getheader("Content-Range") or "")
                if not match or match.group(3) == "*":
                    raise CkptError("the server sent no usable Content-Range", path=redact(path))
                response.read(1)
                return Stat(int(match.group(3)), _tags(response))
            raise CkptError(f"HTTP {response.status} and no size for the file", path=redact(path))
        finally:
            response.close()

    def exists(self, path: str) -> bool:
        if path.endswith("/"):
            return True
        try:
            self.stat(path)
        except InputNotFoundError:
            return False
        return True

    def isdir(self, path: str) -> bool:
        # HTTP has no folders; a URL ending in "/" stands for one
        return path.endswith("/")

    def listdir(self, path: str) -> list[str]:
        raise CkptError(
            "HTTP cannot list a folder",
            path=redact(path),
            hint="give a file that leads to the others (model.safetensors.index.json, a DCP "
            "folder's .metadata, Megatron's metadata.json) or list the files",
        )

    def glob(self, pattern: str) -> list[str]:
        """HTTP has no listing: a URL whose only ``?`` starts its query (a pre-signed
        URL) is no pattern, and matches itself if it exists; a real pattern is refused."""
        parts = urllib.parse.urlsplit(pattern)
        if not any(c in parts.path for c in "*?["):
            return [pattern] if self.exists(pattern) else []
        raise CkptError(
            "HTTP cannot expand a pattern (no listing)",
            path=redact(pattern),
            hint="list the files, or read the folder from s3:// or hf://",
        )

    def _fetch_into(self, path: str, view: memoryview, offset: int, stat: Stat) -> None:
        whole = self._whole.get(path)
        if whole is not None:
            view[:] = whole[offset : offset + len(view)]
            return
        with_retries(lambda: self._get_range(path, view, offset, stat), path)

    def _get_range(self, path: str, view: memoryview, offset: int, stat: Stat) -> None:
        size = len(view)
        last = offset + size - 1
        response, url = self._open(
            "GET", path, {"Range": f"bytes={offset}-{last}", "Accept-Encoding": "identity"}
        )
        parts = urllib.parse.urlsplit(url)
        keep = False
        try:
            if response.status == 200:
                self._whole_body(path, response, view, offset, stat)
                return
            if response.status in (404, 410):
                raise InputNotFoundError("no such file (HTTP 404)", path=redact(path))
            if response.status == 416:
                raise CkptError(
                    f"the server says bytes {offset}-{last} are outside the file "
                    "(changed while being read?)",
                    path=redact(path),
                )
            if response.status != 206:
                raise CkptError(f"HTTP {response.status} for a range read", path=redact(path))
            match = CONTENT_RANGE.match(response.getheader("Content-Range") or "")
            total = stat.size if match is None or match.group(3) == "*" else int(match.group(3))
            check_changed(path, stat, Stat(total, _tags(response)))
            if match is None or (int(match.group(1)), int(match.group(2))) != (offset, last):
                got = response.getheader("Content-Range")
                raise CkptError(
                    f"asked for bytes {offset}-{last}, the server sent Content-Range {got!r}",
                    path=redact(path),
                )
            length = response.getheader("Content-Length")
            if length is not None and length.strip() != str(size):
                raise CkptError(
                    f"asked for {size} bytes, the server announces {length.strip()}",
                    path=redact(path),
                )
            got_bytes = _read_body(response, view)
            self.count(got_bytes, 0)
            if got_bytes < size:
                raise TransientError(f"the server sent {got_bytes} of {size} bytes")
            keep = not response.will_close
        finally:
            response.close()
            if not keep:
                self._drop_connection(parts)

    def _whole_body(
        self,
        path: str,
        response: http.client.HTTPResponse,
        view: memoryview,
        offset: int,
        stat: Stat,
    ) -> None:
        """A 200 to a ranged GET: the server ignores Range (see the module docstring)."""
        check_changed(path, stat, Stat(stat.size, _tags(response)))
        if stat.size > WHOLE_BODY_LIMIT:
            raise CkptError(
                "the server ignores Range requests (it answered 200 with the whole "
                f"{stat.size}-byte file); refused rather than downloading it for every read",
                path=redact(path),
                hint="download the file and give its local path",
            )
        buf = bytearray(stat.size)
        got = _read_body(response, memoryview(buf))
        self.count(got, 0)
        if got < stat.size:
            raise TransientError(f"the server sent {got} of {stat.size} bytes")
        if response.read(1):
            raise CkptError(
                f"the server sent more than the {stat.size} bytes it announced",
                path=redact(path),
            )
        whole = self._whole[path] = bytes(buf)
        view[:] = whole[offset : offset + len(view)]


def _read_body(response: http.client.HTTPResponse, view: memoryview) -> int:
    """Read at most ``len(view)`` body bytes into ``view``; how many arrived."""
    done = 0
    try:
        while done < len(view):
            n = response.readinto(view[done:])
            if not n:
                break
            done += n
    except (OSError, http.client.HTTPException):
        pass  # counted as a short body by the caller
    return done


def _tags(response: http.client.HTTPResponse) -> tuple[tuple[str, str], ...]:
    tags = []
    for header in ("ETag", "Last-Modified"):
        value = response.getheader(header)
        if value:
            tags.append((header.lower(), value.strip()))
    return tuple(tags)


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error ({exc.reason or exc})"
    return type(exc).__name__ + (f" ({exc})" if str(exc) else "")
