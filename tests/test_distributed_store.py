"""The ranks' store client (``ckpttool.distributed.store``): torch's c10d TCPStore wire
protocol in plain Python, checked against real torch servers (both backends), against
torch's own client (a key set by one is read by the other), against a server that dies
or stops mid-call and a hostile one; then ranks under torchrun and ``--workers`` that
never import torch, and the torch fallback when no agent store is there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import FIXTURES, finish, run_many, sha256, subprocess_env

from ckpttool.convert import convert
from ckpttool.distributed import collective, current
from ckpttool.distributed.store import MAX_VALUE, StoreError, TCPStoreClient
from ckpttool.errors import CkptError
from ckpttool.merge import merge

PER_RANK = [str(FIXTURES / "fsdp_uneven" / f"model-rank{r}.pt") for r in range(3)]
RANK_HOOK = Path(__file__).parent / "support" / "rank_hook"
PREFIX = "ckpttool/0/0/"  # as a Group's first command names its keys
RSS_BOUND_KIB = 256 << 10  # issue 31: memory per rank at most 256 MiB


@pytest.fixture(params=[True, False], ids=["libuv", "legacy"])
def server(request):
    """A torch TCPStore server in this process: the libuv one (torchrun's agent store)
    and the legacy one."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        use_libuv=request.param,
        timeout=timedelta(seconds=10),
    )
    yield store
    del store


def torch_client(port: int, prefix: str = PREFIX):
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return dist.PrefixStore(prefix, client)


def ours(port: int, timeout: float = 10.0, **kw) -> TCPStoreClient:
    return TCPStoreClient("127.0.0.1", port, timeout=timeout, prefix=PREFIX, **kw)


# ---------------------------------------------------------------- against torch's server


def test_calls_against_a_torch_server(server):
    store = ours(server.port)
    store.set("k", "v")
    store.set("b", b"\x00\xffbytes")
    assert store.get("k") == b"v"
    assert store.get("b") == b"\x00\xffbytes"
    assert store.check(["k", "b"]) is True
    assert store.check(["k", "absent"]) is False
    assert [store.add("n", 3), store.add("n", -1), store.add("n", 0)] == [3, 2, 2]
    assert store.add("fresh", 0) == 0
    assert store.compare_set("error", "", "first") == b"first"  # absent: set
    assert store.compare_set("error", "", "second") == b"first"  # present: kept
    assert store.compare_set("error", "first", "third") == b"third"
    assert store.compare_set("never", "x", "y") == b"x"  # absent, expected not empty
    assert store.check(["never"]) is False
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get("k")


def test_keys_cross_between_torch_and_ours(server):
    """The same wire keys as torch's PrefixStore over TCPStore: either reads the other's."""
    theirs, store = torch_client(server.port), ours(server.port)
    theirs.set("from-torch", "t")
    store.set("from-us", "u")
    assert store.get("from-torch") == b"t"
    assert theirs.get("from-us") == b"u"
    assert theirs.add("count", 2) == 2 and store.add("count", 3) == 5
    assert theirs.add("count", 0) == 5
    assert store.compare_set("error", "", "ours") == b"ours"
    assert theirs.compare_set("error", "", "theirs") == b"ours"
    assert not torch_client(server.port, "ckpttool/0/1/").check(["from-us"])  # other command
    assert server.num_keys() == 4


def test_get_waits_for_the_key_then_gives_up(server):
    store = ours(server.port, timeout=1.0, connect_timeout=60.0)
    theirs = torch_client(server.port)
    patient = ours(server.port, timeout=60.0)  # (a loaded machine may run the timer late)
    threading.Timer(0.3, lambda: theirs.set("late", "here")).start()
    assert patient.get("late") == b"here"
    with pytest.raises(StoreError, match=r"waited 0\.4 s for absent"):
        store.wait(["absent"], 0.4)
    with pytest.raises(StoreError, match="waited 1 s for absent"):
        store.get("absent")
    assert store.get("late") == b"here"  # the canceled waits left the connection usable


# ---------------------------------------------------------------- a server that dies


SERVE = """
import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


def serve_in_child() -> tuple[subprocess.Popen, int]:
    """A torch TCPStore server in a process of its own (to stop or kill)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    return proc, int(proc.stdout.readline())


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (a signal to another
    process is delivered asynchronously: a busy machine may let it answer once more)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that just ended
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
        if states and all(state in "tT" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def test_a_stopped_then_killed_server_fails_calls_within_the_timeout():
    proc, port = serve_in_child()
    try:
        stopped = ours(port, timeout=1.0, connect_timeout=60.0)
        killed = ours(port, timeout=30.0)
        stopped.set("k", "v")
        stop(proc.pid)
        with pytest.raises(StoreError, match="no answer within 1 s"):
            stopped.add("n", 1)
        with pytest.raises(StoreError):  # broken from now on, at once
            stopped.check(["k"])
        os.kill(proc.pid, signal.SIGCONT)
        assert killed.get("k") == b"v"
        failed: list[BaseException] = []

        def blocked_get() -> None:  # waits for a key no one sets
            try:
                killed.get("absent")
            except BaseException as exc:
                failed.append(exc)

        waiter = threading.Thread(target=blocked_get)
        waiter.start()
        time.sleep(0.3)
        proc.kill()
        waiter.join(25)
        assert not waiter.is_alive()
        assert isinstance(failed[0], StoreError), failed
        assert "no answer within" not in str(failed[0])  # the dead server, not the timeout
        with pytest.raises(StoreError, match="no c10d store at 127.0.0.1"):
            ours(port, timeout=0.5)  # nothing listens any more
    finally:
        proc.kill()
        proc.wait()


def test_a_lost_store_is_the_one_line_of_a_collective(monkeypatch):
    """A store that dies during a command: ``collective`` says so in one line (before
    this client a lost store read 'corrupt or unsupported input (DistNetworkError...)')."""
    proc, port = serve_in_child()
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "TORCHELASTIC_RUN_ID": "test",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    @collective
    def command() -> None:
        assert isinstance(current().store, TCPStoreClient)  # no torch for the agent store
        current().counter("claimed", 1)
        proc.kill()
        proc.wait()
        current().counter("claimed", 1)

    try:
        with pytest.raises(CkptError) as raised:
            command()
    finally:
        proc.kill()
        proc.wait()
    assert raised.value.one_line() == (
        f"lost the conversion's store (torchrun's, at 127.0.0.1:{port}): "
        "its node is gone or stopped answering"
    )


# ---------------------------------------------------------------- a hostile server


def hostile(answer: bytes, *, ping: bool = True) -> int:
    """A server that takes the hello (VALIDATE + PING, 10 bytes), echoes the nonce
    (or not), then answers the next request with ``answer`` and stalls."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        hello = b""
        while len(hello) < 10:
            hello += conn.recv(10 - len(hello))
        conn.sendall(hello[6:10] if ping else b"\x00\x00\x00\x00")
        conn.recv(4096)
        conn.sendall(answer)
        time.sleep(3)
        conn.close()
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


@pytest.mark.parametrize(
    "call, answer, error",
    [
        ("compare_set", struct.pack("=Q", 1 << 63), "announced a value of 9223372036854775808"),
        ("compare_set", struct.pack("=Q", MAX_VALUE + 1), f"a value of {MAX_VALUE + 1} bytes"),
        ("compare_set", struct.pack("=Q", 100) + b"only part", "no answer within 0.5 s"),
        ("check", b"\x07", "answered 7 to a check"),
        ("wait", b"\x07", "answered 7 to a wait"),
        ("add", b"", "no answer within 0.5 s"),
        ("get", b"", "no answer within 0.5 s"),  # the wait, then its cancel, unanswered
    ],
    ids=[
        "huge-length",
        "over-the-cap",
        "cut-value",
        "bad-check",
        "bad-wait",
        "silent",
        "no-cancel",
    ],
)
def test_a_hostile_server_is_a_bounded_error(call, answer, error):
    store = ours(hostile(answer), timeout=0.5)
    args = {"compare_set": ("k", "", "v"), "check": (["k"],), "wait": (["k"],), "add": ("n", 1)}
    with pytest.raises(StoreError, match=error):
        getattr(store, call)(*args.get(call, ("k",)))
    with pytest.raises(StoreError):  # the connection is closed after it
        store.add("n", 1)


def test_no_store_there():
    with pytest.raises(StoreError, match="answered a ping with 0.*not a c10d store"):
        ours(hostile(b"", ping=False), timeout=1.0)
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never answers
    with pytest.raises(StoreError, match="no answer to a ping within 0.5 s"):
        ours(silent.getsockname()[1], timeout=0.5)
    silent.close()


# ---------------------------------------------------------------- ranks without torch


def rank_records(folder: Path) -> list[dict]:
    return sorted(
        (json.loads(p.read_text()) for p in folder.glob("rank*.json")), key=lambda r: r["rank"]
    )


def hooked_env(records: Path, **extra: str) -> dict[str, str]:
    env = subprocess_env(CKPTTOOL_TEST_RANK_RECORDS=str(records), CKPTTOOL_UNIT_BYTES="64")
    env["PYTHONPATH"] = os.pathsep.join([str(RANK_HOOK), env["PYTHONPATH"]])
    return {**env, **extra}


@pytest.mark.parametrize(
    "to,name,extra",
    [
        ("safetensors", "o.safetensors", []),
        ("dcp", "o-dcp", []),
        ("safetensors", "o.safetensors", ["--dtype", "bfloat16"]),
    ],
)
def test_one_rank_on_an_agent_store_imports_no_torch(tmp_path, server, to, name, extra):
    """``python -m ckpttool convert`` as a rank of torchrun's: the agent store (here a
    torch server in this process), no torch imported (``--to dcp`` too: its ``.metadata``
    is written without torch; a ``--dtype`` cast too: numpy's), peak RSS under 256 MiB."""
    out, records = tmp_path / name, tmp_path / "records"
    records.mkdir()
    env = hooked_env(
        records,
        RANK="0",
        WORLD_SIZE="1",
        TORCHELASTIC_RUN_ID="test",
        TORCHELASTIC_USE_AGENT_STORE="True",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(server.port),
    )
    cmd = [sys.executable, "-m", "ckpttool", "convert", *PER_RANK, "--to", to, *extra]
    done = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(f"wrote {out} (") and "units" in done.stderr
    (record,) = rank_records(records)
    assert record["ckpttool"] and record["agent_store"] == "True"
    assert record["torch"] == []
    assert record["peak_rss_kib"] < RSS_BOUND_KIB
    want = tmp_path / f"want-{name}"
    convert(PER_RANK, to, str(want), dtype=extra[1] if extra else None)
    assert sha256(out) == sha256(want)


@pytest.mark.slow
def test_torchrun_and_workers_ranks_never_import_torch(tmp_path):
    """Every rank of a torchrun launch and of ``--workers 2`` (torch's elastic launcher,
    the same agent store) converts without importing torch, under 256 MiB each."""
    runs = {}
    for name, cmd in {
        "torchrun": [
            *[sys.executable, "-m", "torch.distributed.run", "--standalone"],
            *["--nproc-per-node=2", "--monitor-interval=0.1", "-m", "ckpttool"],
            *["convert", *PER_RANK, "--to", "safetensors", "-o", str(tmp_path / "t.safetensors")],
        ],
        "workers": [
            *[sys.executable, "-m", "ckpttool", "merge", *PER_RANK],
            *["-o", str(tmp_path / "w.pt"), "--workers", "2"],
        ],
    }.items():
        records = tmp_path / name
        records.mkdir()
        runs[name] = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=hooked_env(records),
            start_new_session=True,
        )
    for name, proc in runs.items():
        done = finish(proc, 300)
        assert done.returncode == 0, done.stderr[-3000:]
        records = rank_records(tmp_path / name)
        assert [r["rank"] for r in records] == [0, 1], records
        for record in records:
            assert record["ckpttool"] and record["agent_store"] == "True"
            assert record["torch"] == [], record
            assert record["peak_rss_kib"] < RSS_BOUND_KIB, record
    want_st, want_pt = tmp_path / "want.safetensors", tmp_path / "want.pt"
    convert(PER_RANK, "safetensors", str(want_st))
    merge(PER_RANK, str(want_pt))
    assert sha256(tmp_path / "t.safetensors") == sha256(want_st)
    assert sha256(tmp_path / "w.pt") == sha256(want_pt)


@pytest.mark.slow
def test_without_an_agent_store_rank0_hosts_torch_store(tmp_path):
    """MASTER_ADDR/PORT set by hand (no torchrun): the torch fallback, rank 0 hosting a
    TCPStore; it outlives the other ranks' last calls, so every rank exits 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, records = tmp_path / "o.safetensors", tmp_path / "records"
    records.mkdir()
    cmd = [sys.executable, "-m", "ckpttool", "convert", *PER_RANK, "--to", "safetensors"]
    procs = [
        subprocess.Popen(
            [*cmd, "-o", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=hooked_env(
                records, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
            ),
        )
        for r in range(2)
    ]
    done = [finish(p, 300) for p in procs]
    assert [d.returncode for d in done] == [0, 0], done[1].stderr[-3000:]
    assert done[0].stderr.startswith(f"wrote {out} (") and done[1].stderr == ""
    records_ = rank_records(records)
    assert [r["agent_store"] for r in records_] == [None, None]
    assert all(r["torch"][:1] == ["torch"] for r in records_)  # the fallback: torch's store
    want = tmp_path / "want.safetensors"
    convert(PER_RANK, "safetensors", str(want))
    assert sha256(out) == sha256(want)


@pytest.mark.slow
def test_torchrun_agent_killed_every_rank_says_the_store_is_lost(tmp_path):
    """SIGKILL torchrun itself (its agent serves the store) mid-conversion: each rank
    left prints the one line and exits; nothing appears under the output's name."""
    import torch

    from ckpttool.targets import journal

    src, out = tmp_path / "in.pt", tmp_path / "out.pt"
    gen = torch.Generator().manual_seed(3)
    torch.save({f"w{i}": torch.randn(256, 97, generator=gen) for i in range(12)}, src)
    proc = subprocess.Popen(
        [
            *[sys.executable, "-m", "torch.distributed.run", "--standalone"],
            *["--nproc-per-node=2", "--monitor-interval=0.1", "-m", "ckpttool"],
            *["convert", str(src), "--to", "pt", "-o", str(out)],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(CKPTTOOL_UNIT_BYTES="4096", CKPTTOOL_DIST_TIMEOUT="10"),
        start_new_session=True,
    )
    logs = Path(journal.resume_dir(str(out))) / journal.JOURNAL
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        # both ranks at work (each has journaled a unit: it reached the store; a rank
        # still starting when the agent goes says it cannot reach the store, rightly)
        counts = [p.read_bytes().count(b"\n") for p in logs.glob("*.log")]
        if sum(counts) >= 5 and len(counts) == 2 and min(counts) >= 1:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the conversion ended before the agent could be killed"
    proc.kill()  # torchrun only: its workers live on, their store gone
    done = finish(proc, 120)  # its pipes close once every worker has exited
    ours = [ln for ln in done.stderr.splitlines() if ln.startswith("ckpttool:")]
    lost = re.compile(
        r"ckpttool: error: lost the conversion's store \(torchrun's, at [\w.:-]+:\d+\): "
        r"its node is gone or stopped answering"
    )
    assert len(ours) == 2 and all(lost.fullmatch(ln) for ln in ours), done.stderr[-3000:]
    assert not out.exists()


def test_a_gathered_value_of_any_size_reaches_every_rank(server, monkeypatch):
    """``Group.each_gathered`` (where every block of thousands of rank files lies, one
    process's at a time) stores a value in parts below the store's cap on a value:
    a value of more than ``MAX_VALUE`` reaches every rank whole, each rank's in rank
    order, and a small one in small parts too."""
    import itertools

    from ckpttool.distributed import group as group_module

    def member(rank: int) -> group_module.Group:
        g = group_module.Group.__new__(group_module.Group)  # (no torchrun here)
        g.rank, g.size, g.store = rank, 2, ours(server.port)
        g._exchanges = itertools.count()
        return g

    big = {"rows": "x" * (MAX_VALUE + 12345), "n": (1, 2)}
    small = {7: ("a", [1, 2, 3])}
    ranks = [member(0), member(1)]
    for part, values in ((group_module.GATHER_PART, (big, small)), (5, (small, {}))):
        monkeypatch.setattr(group_module, "GATHER_PART", part)
        first, second = (g.each_gathered(v) for g, v in zip(ranks, values, strict=True))
        got = [next(first), next(second)]  # each posts its own, then reads rank 0's
        got += [next(first), next(second)]
        assert got == [values[0], values[0], values[1], values[1]]
        assert next(first, None) is None and next(second, None) is None


# ------------------------------------------------------- the store --workers serves itself


def test_own_store_server_answers_the_client_and_torchs_own_client():
    """``store_server.StoreServer`` (what --workers serves, without torch) speaks the c10d
    protocol: ckpttool's client and torch's own ``TCPStore`` client both use it."""
    import datetime

    import torch.distributed as dist

    from ckpttool.distributed.store import StoreError, TCPStoreClient
    from ckpttool.distributed.store_server import StoreServer

    server = StoreServer()
    try:
        client = TCPStoreClient("127.0.0.1", server.port, timeout=5, prefix="p")
        client.set("a", b"x\0y")
        assert client.get("a") == b"x\0y"
        assert [client.add("n", 3), client.add("n", -1), client.add("n", 0)] == [3, 2, 2]
        assert client.check(["a", "n"]) and not client.check(["a", "nope"])
        assert client.compare_set("e", "", "first") == b"first"
        assert client.compare_set("e", "", "second") == b"first"  # set already: unchanged
        assert client.compare_set("e", "first", "third") == b"third"
        assert client.compare_set("absent", "q", "r") == b"q"  # as torch's server answers
        with pytest.raises(StoreError, match="waited 0.2 s for never"):
            client.wait(["never"], timeout=0.2)
        assert client.add("n", 1) == 3  # the canceled wait left the connection usable
        theirs = dist.TCPStore(
            "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=5)
        )
        theirs.set("p/t", "from torch")  # torch's client puts the "/" before a key
        assert client.get("t") == b"from torch"
        assert theirs.add("p/n", 1) == 4
        assert theirs.get("p/a") == b"x\0y"
    finally:
        server.close()


def test_own_store_server_closes_a_connection_that_sends_what_no_client_sends():
    import socket
    import struct

    from ckpttool.distributed.store import MAGIC, MAX_KEY, SET, VALIDATE, TCPStoreClient
    from ckpttool.distributed.store_server import StoreServer

    server = StoreServer()
    try:
        for request in (
            b"\x07" + struct.pack("=I", MAGIC),  # not VALIDATE first
            bytes((VALIDATE,)) + struct.pack("=I", MAGIC + 1),  # the wrong magic
            bytes((VALIDATE,)) + struct.pack("=I", MAGIC) + bytes((SET,))
            + struct.pack("=Q", MAX_KEY + 1),  # a key longer than any store takes
            bytes((VALIDATE,)) + struct.pack("=I", MAGIC) + b"\xee",  # no such query
        ):  # fmt: skip
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                sock.sendall(request)
                try:
                    answer = sock.recv(1)
                except ConnectionResetError:  # closed with the rest of the request unread
                    answer = b""
                assert answer == b""  # closed, nothing answered
        client = TCPStoreClient("127.0.0.1", server.port, timeout=5)
        assert client.add("still", 1) == 1  # the server itself goes on
    finally:
        server.close()


def test_workers_launcher_never_imports_torch(tmp_path):
    """--workers starts its workers and serves their store without torch (its import
    was most of the start-up); the output is one process's."""
    import torch

    torch.save({"w": torch.arange(6.0)}, tmp_path / "in.pt")
    code = (
        "import sys\n"
        "from ckpttool.distributed.launch import run_workers\n"
        f"code = run_workers(['convert', {str(tmp_path / 'in.pt')!r}, '--to', 'pt', '-o', "
        f"{str(tmp_path / 'two.pt')!r}, '-q'], 2)\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
        timeout=120,
    )  # fmt: skip
    assert (done.stdout, done.stderr) == ("0 False\n", "")
    (one,) = run_many([["convert", tmp_path / "in.pt", "--to", "pt", "-o", tmp_path / "one.pt"]])
    assert one["code"] == 0
    assert (tmp_path / "two.pt").read_bytes() == (tmp_path / "one.pt").read_bytes()
