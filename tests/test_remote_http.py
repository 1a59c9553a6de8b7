"""The https:// byte source against a loopback server: exact bytes, few requests, and one
clear error for each way a server can go wrong (tests/support/servers.py has the variants)."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from servers import RangeServer

from ckpttool import sources
from ckpttool.errors import CkptError, InputNotFoundError
from ckpttool.sources.remote import base, http
from ckpttool.sources.remote.http import HttpSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = base.FIRST_WINDOW  # what a file's first small read fetches


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    rng = __import__("random").Random(0)
    (root / "small.bin").write_bytes(rng.randbytes(200_000))
    (root / "big.bin").write_bytes(rng.randbytes(3_000_000))
    (root / "long.bin").write_bytes(rng.randbytes(10_000_000))
    for name in ("a", "b", "c", "d", "e", "f"):  # one file per stateful test
        (root / f"{name}.bin").write_bytes(rng.randbytes(1_500_000))
    srv = RangeServer(root)
    yield srv
    srv.close()


@pytest.fixture
def source(monkeypatch):
    monkeypatch.setattr(base, "BACKOFF", 0.0)
    monkeypatch.setattr(base, "RETRIES", 3)
    src = HttpSource("http")
    yield src
    src.close()


def data(server, name: str) -> bytes:
    return (server.root / name).read_bytes()


def test_reads_exact_bytes_and_coalesces_small_reads(server, source):
    url = server.url("big.bin")
    want = data(server, "big.bin")
    server.reset()
    assert source.size(url) == len(want)
    # what a zip reader does: the end record, the directory before it, then the pickle
    tail = source.read(url, len(want) - 22, 22)
    directory = source.read(url, len(want) - 40_000, 39_978)
    head = b"".join(bytes(source.read(url, at, 100)) for at in range(0, 100_000, 100))
    assert bytes(tail) == want[-22:]
    assert bytes(directory) == want[-40_000:-22]
    assert head == want[:100_000]
    # one HEAD, one window at the end, one at the start: 1000 small reads, 3 requests
    assert [m for m, _, _ in server.requests] == ["HEAD", "GET", "GET"]
    assert source.requests == 3
    tail_window = len(want) - (len(want) - base.FIRST_WINDOW) // base.BLOCK * base.BLOCK
    assert source.bytes_read == base.FIRST_WINDOW + tail_window
    assert source.local_path(url) is None


def test_large_reads_go_straight_and_spans_in_parallel(server, source, monkeypatch):
    monkeypatch.setattr(base, "PART", 256 << 10)
    monkeypatch.setattr(base, "MAX_WINDOW", 128 << 10)
    url = server.url("big.bin")
    want = data(server, "big.bin")
    buf = bytearray(len(want))
    view = memoryview(buf)
    server.reset()
    source.read_spans(
        url, [(view[:10], 0), (view[10:2_000_000], 10), (view[2_000_000:], 2_000_000)]
    )
    assert buf == want
    gets = [r for m, _, r in server.requests if m == "GET"]
    # the small span alone, the large ones in 256 KiB parts, each byte once
    assert len(gets) == 1 + -(-1_999_990 // (256 << 10)) + -(-1_000_000 // (256 << 10))
    assert source.bytes_read == len(want)


def test_scattered_small_spans_cost_their_bytes_and_neighbours_share(server, source):
    url = server.url("big.bin")
    want = data(server, "big.bin")
    bufs = [bytearray(30) for _ in range(20)]
    # 10 local headers far apart, and 10 neighbours 100 bytes apart (one request)
    offsets = [i * 290_000 for i in range(10)] + [2_900_000 + i * 130 for i in range(10)]
    source.size(url)
    server.reset()
    source.read_spans(url, [(memoryview(b), at) for b, at in zip(bufs, offsets, strict=True)])
    assert [bytes(b) for b in bufs] == [want[at : at + 30] for at in offsets]
    assert len(server.requests) == 11
    assert source.bytes_read == 10 * 30 + 9 * 130 + 30


def test_whole_file_read(server, source):
    url = server.url("small.bin")
    assert bytes(source.read(url)) == data(server, "small.bin")
    assert source.identity(url) == source.identity(url)


def test_server_without_range_small_file_read_once(server, source):
    url = server.url("small.bin", "norange")
    want = data(server, "small.bin")
    server.reset()
    assert bytes(source.read(url, 5, 10)) == want[5:15]
    assert bytes(source.read(url, 150_000, 40_000)) == want[150_000:190_000]
    assert [m for m, _, _ in server.requests] == ["HEAD", "GET"]  # read whole, once


def test_server_without_range_large_file_refused(server, source):
    url = server.url("big.bin", "norange")
    with pytest.raises(CkptError, match="ignores Range requests") as info:
        source.read(url, 1000, 10)
    assert "200" in str(info.value)
    # the body was not read: far fewer bytes than the file were counted
    assert source.bytes_read == 0


@pytest.mark.parametrize(
    "mode, message",
    [
        ("short", rf"cannot read after 3 attempts: the server sent {W // 2} of {W} bytes"),
        ("badrange", rf"asked for bytes 0-{W - 1}, the server sent Content-Range 'bytes 1-{W}/"),
        ("etag", r"changed while being read \(etag .* -> \"rewritten\"\)"),
        ("gone", r"no such file \(HTTP 404\)"),
        ("denied", r"access denied \(HTTP 403\)"),
    ],
)
def test_bad_servers_are_one_line_errors(server, source, mode, message):
    url = server.url("a.bin", mode)
    with pytest.raises(CkptError, match=message) as info:
        source.read(url, 0, 10)
        source.read(url, 1_000_000, 10)  # the etag variant changes on this request
    assert "\n" not in str(info.value)
    assert info.value.exit_code == 2
    if mode in ("gone", "denied"):  # a 4xx is never retried
        assert server.hits[(mode, "a.bin")] == 1
    if mode == "gone":
        assert isinstance(info.value, InputNotFoundError)


def test_transient_errors_are_retried(server, source):
    url = server.url("b.bin", "flaky")
    server.reset()
    assert bytes(source.read(url, 0, 10)) == data(server, "b.bin")[:10]
    assert [m for m, _, _ in server.requests] == ["HEAD", "HEAD", "HEAD", "GET"]


def test_retries_are_bounded(server, source, monkeypatch):
    monkeypatch.setattr(base, "RETRIES", 2)
    with pytest.raises(CkptError, match=r"cannot reach it after 2 attempts: HTTP 503"):
        source.size(server.url("c.bin", "flaky"))


def test_no_connection_is_a_one_line_error(source):
    with pytest.raises(CkptError, match=r"cannot reach it after 3 attempts: ConnectionRefused"):
        source.size("http://127.0.0.1:1/x.pt")


def test_credentials_and_signatures_are_never_shown(server, source):
    url = server.url("gone.bin", "gone").replace("http://", "http://user:s3cret@")
    with pytest.raises(CkptError) as info:
        source.size(url + "?X-Amz-Signature=deadbeef&token=t0ken")
    text = str(info.value)
    assert "s3cret" not in text and "deadbeef" not in text and "t0ken" not in text
    assert text.startswith(f"http://127.0.0.1:{server.port}/gone/gone.bin: ")


def test_folders_need_an_index(server, source):
    folder = server.url("", "ok")
    assert source.isdir(folder) and not source.isdir(server.url("a.bin"))
    with pytest.raises(
        CkptError, match=r"HTTP cannot list a folder .*index\.json, a DCP folder's \.metadata"
    ):
        source.listdir(folder)
    assert source.exists(server.url("a.bin")) and not source.exists(server.url("nope.bin"))


@pytest.mark.parametrize("name", ["../secret.pt", "/etc/passwd", "s3://other/x.pt", "a/../../x"])
def test_names_from_a_file_stay_in_the_folder(source, name):
    with pytest.raises(CkptError, match="leaves the checkpoint's folder"):
        source.join("http://127.0.0.1/ok/ckpt", name)
    assert source.join("http://h/ok/ckpt", "sub/x.pt") == "http://h/ok/ckpt/sub/x.pt"


def test_registered_for_http_urls(server):
    url = server.url("small.bin")
    assert isinstance(sources.source_for(url), HttpSource)
    assert isinstance(sources.source_for("https://example.invalid/x"), HttpSource)
    assert sources.getsize(url) == 200_000


def test_header_of_exactly_100000_bytes(tmp_path, server, source):
    """huggingface_hub read a safetensors header of exactly 100,000 bytes wrong
    (hf_hub#4602): the first window must not be mistaken for the whole header."""
    import json
    import struct

    header = {"w": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}}
    text = json.dumps(header).encode()
    text += b" " * (100_000 - len(text))
    path = server.root / "boundary.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000) + text + bytes(range(16)))
    url = server.url("boundary.safetensors")
    (n,) = struct.unpack("<Q", bytes(source.read(url, 0, 8)))
    assert n == 100_000
    assert bytes(source.read(url, 8, n)) == text
    assert bytes(source.read(url, 8 + n, 16)) == bytes(range(16))


def test_local_commands_never_import_the_remote_code():
    code = (
        "import runpy, sys\n"
        "sys.argv = ['ckpttool', 'inspect', 'fixtures/ddp/ep0-rank0.pt']\n"
        "try:\n    runpy.run_module('ckpttool', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fsspec', 's3fs', 'huggingface_hub') or m == 'ckpttool.sources.remote'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs -> ImportError
    monkeypatch.delitem(sources.paths._SOURCES, "s3", raising=False)
    with pytest.raises(CkptError, match=r"needs the package s3fs \(pip install 'ckpttool\[s3\]'\)"):
        sources.getsize("s3://bucket/x.pt")
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    with pytest.raises(CkptError, match=r"pip install gcsfs"):
        sources.source_for("gs://bucket/x.pt")
    with pytest.raises(CkptError, match=r"cannot read nosuch:// paths"):
        sources.source_for("nosuch://bucket/x.pt")
    assert http.WHOLE_BODY_LIMIT == 1 << 20


def test_a_forked_child_uses_its_own_connections(server, source):
    """The readers' prescan forks: parent and child on one socket would read each
    other's responses."""
    want_e, want_f = data(server, "e.bin"), data(server, "f.bin")
    e, f = server.url("e.bin"), server.url("f.bin")
    assert bytes(source.read(e, 0, 10)) == want_e[:10]  # a connection now exists
    pid = os.fork()
    if pid == 0:  # the child: read f while the parent reads e
        ok = all(
            bytes(source.read(f, at, 1000)) == want_f[at : at + 1000]
            for at in range(0, 1_400_000, 350_000)
        )
        os._exit(0 if ok else 1)
    ok = all(
        bytes(source.read(e, at, 1000)) == want_e[at : at + 1000]
        for at in range(300_000, 1_400_000, 350_000)
    )
    _, status = os.waitpid(pid, 0)
    assert ok and os.waitstatus_to_exitcode(status) == 0


def test_reading_in_order_reads_ahead_in_large_chunks(server, source, monkeypatch):
    from ckpttool.sources.remote import stream

    monkeypatch.setattr(stream, "STREAM_CHUNK", 2 << 20)
    monkeypatch.setattr(stream, "STREAM_AFTER", 1 << 20)
    url = server.url("long.bin")
    want = data(server, "long.bin")
    got = bytearray(len(want))
    view = memoryview(got)
    source.size(url)
    server.reset()
    step = 300_000  # a writer copying tensors one after the other
    for at in range(0, len(want), step):
        source.read_spans(url, [(view[at : at + step], at)])
    assert got == want
    # 4 reads of their own, then 2 MiB chunks (the next one fetched in the background)
    assert len(server.requests) <= 4 + -(-len(want) // (2 << 20)) + 1
    assert source.bytes_read <= len(want) + (2 << 20)


# one way (or none) each answer to a ranged GET is wrong; "ok" most often
ANSWERS = ["ok"] * 4 + [
    "status", "content_range", "content_length", "short", "long", "etag",
    "junk_range", "huge_total", "negative_length", "no_headers", "whole_body",
]  # fmt: skip


class _HostileHandler(BaseHTTPRequestHandler):
    """Answers HEAD truthfully, then each ranged GET in a way drawn from ``ANSWERS``."""

    protocol_version = "HTTP/1.1"
    data = b""
    rng = random.Random(0)
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.data)))
        self.send_header("ETag", '"a"')
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        with self.lock:
            kind = self.rng.choice(ANSWERS)
            jitter = [self.rng.randint(-3, 3) for _ in range(3)]
            status_code = self.rng.choice([200, 204, 301, 400, 416, 429, 500, 503])
        first, last = map(int, self.headers["Range"][len("bytes=") :].split("-"))
        body, status, etag = self.data[first : last + 1], 206, '"a"'
        content_range = f"bytes {first}-{last}/{len(self.data)}"
        length = len(body)
        if kind == "status":
            status = status_code
        elif kind == "content_range":
            content_range = (
                f"bytes {first + jitter[0]}-{last + jitter[1]}/{len(self.data) + jitter[2]}"
            )
        elif kind == "content_length":
            length += jitter[0] or 1
        elif kind == "short":
            body = body[: len(body) // 2]
        elif kind == "long":
            body += b"x" * 10
        elif kind == "etag":
            etag = '"b"'
        elif kind == "junk_range":
            content_range = ["", "bytes */*", "bytes x-y/z", "items 0-1/2"][jitter[0] % 4]
        elif kind == "huge_total":
            content_range = f"bytes {first}-{last}/{10**30}"
        elif kind == "negative_length":
            length = -5
        elif kind == "whole_body":
            status, body, content_range, length = 200, self.data, "", len(self.data)
        self.send_response(status)
        if kind != "no_headers":
            if content_range:
                self.send_header("Content-Range", content_range)
            self.send_header("Content-Length", str(length))
            self.send_header("ETag", etag)
            if status == 301:
                self.send_header("Location", self.path)
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)
        if kind in ("short", "long", "no_headers", "content_length", "negative_length"):
            self.close_connection = True


def test_hostile_answers_give_the_right_bytes_or_one_clear_error(monkeypatch):
    """Seeded: whatever way a server's answer is wrong, a read gives exactly the file's
    bytes or a CkptError, never other bytes, another exception, or a hang."""
    monkeypatch.setattr(base, "BACKOFF", 0.0)
    monkeypatch.setattr(http, "TIMEOUT", 5.0)
    _HostileHandler.data = random.Random(1).randbytes(300_000)
    _HostileHandler.rng = random.Random(2)

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: object, client_address: object) -> None:
            pass  # the client hung up on a refused answer

    server = Server(("127.0.0.1", 0), _HostileHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    src = HttpSource("http")
    rng = random.Random(3)
    outcomes = {"right": 0, "refused": 0}
    try:
        for i in range(200):
            url = f"http://127.0.0.1:{server.server_address[1]}/f{i}.bin"  # fresh state
            offset = rng.randrange(len(_HostileHandler.data))
            view = memoryview(bytearray(rng.randint(1, len(_HostileHandler.data) - offset)))
            try:
                src.read_into(url, view, offset)
            except CkptError:
                outcomes["refused"] += 1
                continue
            assert bytes(view) == _HostileHandler.data[offset : offset + len(view)], i
            outcomes["right"] += 1
    finally:
        src.close()
        server.shutdown()
        server.server_close()
    assert outcomes["right"] > 20 and outcomes["refused"] > 20, outcomes
