"""Servers on 127.0.0.1 for the remote tests: HTTP with Range (and its broken variants), S3.

:class:`RangeServer` serves the files under a root folder at
``http://127.0.0.1:PORT/<mode>/<path>``; the first part of the URL picks how the
server behaves, so one server per test module covers every variant:

- ``ok``: correct ranged GETs (206, Content-Range, suffix ranges), HEAD, ETag;
- ``norange``: ignores Range, answers 200 with the whole body;
- ``short``: announces the range's length but sends half of it, then closes;
- ``badrange``: answers 206 with a Content-Range one byte off;
- ``etag``: the ETag changes after the first GET of each file (a file rewritten mid-read);
- ``flaky``: the first two requests for each file get 503, then it works;
- ``gone``: 404 for every file; ``denied``: 403.

``requests`` records ``(method, path, range header)`` of every request for tests that
count them.
"""

from __future__ import annotations

import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
MODES = ("ok", "norange", "short", "badrange", "etag", "flaky", "gone", "denied")


class RangeServer:
    """A threaded HTTP file server on 127.0.0.1 (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.requests: list[tuple[str, str, str | None]] = []
        self.hits: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:  # noqa: N802
                server.handle(self, head=True)

            def do_GET(self) -> None:  # noqa: N802
                server.handle(self, head=False)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that hung up on a refused body: expected here

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, relpath: str = "", mode: str = "ok") -> str:
        return f"http://127.0.0.1:{self.port}/{mode}/{relpath}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.hits.clear()

    # -- the handler -------------------------------------------------------------------
    def handle(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        if req.path.startswith("/api/") or "/resolve/" in req.path:
            return self.hub(req, head)
        mode, _, rel = req.path.split("?", 1)[0].lstrip("/").partition("/")
        rng = req.headers.get("Range")
        with self.lock:
            self.requests.append((req.command, req.path, rng))
            hit = self.hits[(mode, rel)] = self.hits.get((mode, rel), 0) + 1
        file = (self.root / rel).resolve()
        if mode not in MODES or not file.is_relative_to(self.root.resolve()):
            return self.status(req, 400)
        if mode == "gone" or not file.is_file():
            return self.status(req, 404)
        if mode == "denied":
            return self.status(req, 403)
        if mode == "flaky" and hit <= 2:
            return self.status(req, 503, {"Retry-After": "0"})
        size = file.stat().st_size
        etag = f'"{size}-{int(file.stat().st_mtime_ns)}"'
        if mode == "etag" and not head and hit > 2:
            etag = '"rewritten"'
        headers = {"ETag": etag, "Accept-Ranges": "none" if mode == "norange" else "bytes"}
        match = RANGE.match(rng or "") if rng and mode != "norange" and not head else None
        if match is None:
            headers["Content-Length"] = str(size)
            return self.send(req, 200, headers, b"" if head else file.read_bytes())
        first, last = match.groups()
        if first == "":  # suffix range: the last N bytes
            start, stop = max(0, size - int(last)), size
        else:
            start = int(first)
            stop = min(size, int(last) + 1) if last else size
        if start >= size or start >= stop:
            return self.status(req, 416, {"Content-Range": f"bytes */{size}"})
        with open(file, "rb") as f:
            f.seek(start)
            body = f.read(stop - start)
        shown = (start + 1, stop) if mode == "badrange" else (start, stop - 1)
        headers["Content-Range"] = f"bytes {shown[0]}-{shown[1]}/{size}"
        headers["Content-Length"] = str(len(body))
        if mode == "short":
            body = body[: len(body) // 2]
            headers["Connection"] = "close"
            req.close_connection = True
        self.send(req, 206, headers, body)

    # -- a Hugging Face Hub, as much of it as HfFileSystem reads ----------------------
    def hub(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        """The Hub's routes over the files under ``root/hub/<user>/<repo>/``:
        ``/api/models/<repo>/revision/<rev>``, ``/api/models/<repo>/tree/<rev>/<path>``
        and ``/<repo>/resolve/<rev>/<path>`` (ranged, as the ``ok`` mode)."""
        import json
        import urllib.parse

        path = urllib.parse.unquote(urllib.parse.urlsplit(req.path).path)
        hub = (self.root / "hub").resolve()
        match = re.match(
            r"^/api/(models|datasets|spaces)/([^/]+/[^/]+)/(revision|tree)/([^/]+)/?(.*)$", path
        )
        if match:
            with self.lock:
                self.requests.append((req.command, req.path, None))
            repo_type, repo, kind, _rev, rel = match.groups()
            if repo_type != "models":  # hub/datasets/<user>/<repo>
                repo = f"{repo_type}/{repo}"
            folder = (hub / repo / rel).resolve()
            if not (hub / repo).is_dir() or not folder.is_relative_to(hub):
                return self.status(req, 404, {"X-Error-Code": "RepoNotFound"})
            if kind == "revision":
                body = {"id": repo, "sha": "0" * 40, "private": False, "siblings": []}
            elif not folder.is_dir():
                return self.status(req, 404, {"X-Error-Code": "EntryNotFound"})
            else:
                body = [
                    {
                        "type": "directory" if f.is_dir() else "file",
                        "oid": "1" * 40,
                        "path": f.relative_to(hub / repo).as_posix(),
                        **({} if f.is_dir() else {"size": f.stat().st_size}),
                    }
                    for f in sorted(folder.iterdir())
                ]
            raw = json.dumps(body).encode()
            return self.send(
                req, 200, {"Content-Type": "application/json", "Content-Length": str(len(raw))}, raw
            )
        match = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if not match:
            return self.status(req, 404)
        repo, _rev, rel = match.groups()
        req.path = f"/ok/hub/{repo}/{rel}"
        return self.handle(req, head)

    @staticmethod
    def send(
        req: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes
    ) -> None:
        req.send_response(status)
        for key, value in headers.items():
            req.send_header(key, value)
        req.end_headers()
        try:
            req.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            req.close_connection = True

    def status(self, req: BaseHTTPRequestHandler, code: int, headers: dict[str, str] | None = None):
        self.send(req, code, {"Content-Length": "0", **(headers or {})}, b"")


class S3Server:
    """moto's S3 server on 127.0.0.1, with the environment s3fs reads pointed at it.

    The AWS variables are dummies (moto accepts any); ``FSSPEC_S3_ENDPOINT_URL`` is
    fsspec's documented way to give s3fs an endpoint (``FSSPEC_<PROTOCOL>_<OPTION>``),
    so subprocesses of the CLI tests inherit it.
    """

    ENV = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.env = {**self.ENV, "FSSPEC_S3_ENDPOINT_URL": self.endpoint}

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def upload(self, local: str | os.PathLike[str], bucket: str, prefix: str) -> str:
        """Upload a file or a folder's files under ``s3://bucket/prefix``; that URL."""
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        local = Path(local)
        if local.is_file():
            client.upload_file(str(local), bucket, prefix)
        else:
            for file in sorted(local.rglob("*")):
                if file.is_file():
                    key = f"{prefix.rstrip('/')}/{file.relative_to(local).as_posix()}"
                    client.upload_file(str(file), bucket, key)
        return f"s3://{bucket}/{prefix}"

    def configure(self) -> Any:
        """Point this process at the server (env for subprocesses, fsspec's config for
        this one: fsspec reads ``FSSPEC_*`` variables once, when it is imported); returns
        an undo callable."""
        import fsspec.config

        saved_env = {k: os.environ.get(k) for k in self.env}
        saved_conf = fsspec.config.conf.get("s3")
        os.environ.update(self.env)
        fsspec.config.conf["s3"] = {**(saved_conf or {}), "endpoint_url": self.endpoint}

        def undo() -> None:
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if saved_conf is None:
                fsspec.config.conf.pop("s3", None)
            else:
                fsspec.config.conf["s3"] = saved_conf

        return undo

    def close(self) -> None:
        self.server.stop()


class S3Proxy:
    """A reverse proxy on 127.0.0.1 in front of an S3 server (moto), for the tests of
    outputs: it logs every request and can answer for the server.

    ``requests`` holds ``(method, path, query)`` of each request; ``fault`` (settable) is
    called with ``(method, query)`` before forwarding and returns None (forward), an
    HTTP status to answer instead (503: the client retries), ``"etag"`` (forward,
    then answer a wrong ETag) or ``"lost"`` (forward, then answer 500). :meth:`uploads`
    counts UploadPart requests.
    """

    def __init__(self, endpoint: str) -> None:
        import http.client
        import urllib.parse

        self.target = urllib.parse.urlsplit(endpoint)
        self.requests: list[tuple[str, str, str]] = []
        self.fault: Any = None
        self.active = 0  # requests being answered
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def relay(self) -> None:
                with proxy.lock:
                    proxy.active += 1
                try:
                    self.forward()
                finally:
                    with proxy.lock:
                        proxy.active -= 1

            def forward(self) -> None:
                path, _, query = self.path.partition("?")
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    proxy.requests.append((self.command, path, query))
                    action = proxy.fault(self.command, query) if proxy.fault else None
                if isinstance(action, int):
                    error = b"<Error><Code>ServiceUnavailable</Code><Message>x</Message></Error>"
                    RangeServer.send(self, action, {"Content-Length": str(len(error))}, error)
                    return
                conn = http.client.HTTPConnection(proxy.target.hostname, proxy.target.port)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "content-length"}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                out = {
                    k: v
                    for k, v in answer.getheaders()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection")
                }
                if action == "lost":  # done, but the answer never reaches the client
                    error = b"<Error><Code>InternalError</Code><Message>x</Message></Error>"
                    RangeServer.send(self, 500, {"Content-Length": str(len(error))}, error)
                    return
                if action == "etag" and "ETag" in out:
                    out["ETag"] = '"00000000000000000000000000000000"'
                if self.command != "HEAD":  # a HEAD's length is the object's
                    out["Content-Length"] = str(len(data))
                else:
                    out["Content-Length"] = answer.getheader("Content-Length") or "0"
                conn.close()
                RangeServer.send(self, answer.status, out, b"" if self.command == "HEAD" else data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay  # noqa: N815

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client killed mid-request: what some tests do

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def uploads(self) -> list[int]:
        """The part numbers of the UploadPart requests seen, in order."""
        import urllib.parse

        numbers = []
        for method, _path, query in self.requests:
            args = urllib.parse.parse_qs(query)
            if method == "PUT" and "partNumber" in args:
                numbers.append(int(args["partNumber"][0]))
        return numbers

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.fault = None

    def settle(self, timeout: float = 30) -> None:
        """Wait until no request is being answered (those of a killed client included)."""
        import time

        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
