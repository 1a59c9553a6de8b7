"""The processes of one conversion: joined through the c10d store torchrun provides.

No process group, no collective: everything goes through the store (torchrun's agent
serves it, so it outlives any worker), with short polls instead of a collective's
10-30 minute timeout:

- every process bumps its heartbeat counter (``hb/R``) from a thread with a store
  connection of its own; rank 0 watches everyone's, the others watch rank 0's. A
  counter that stops moving for :func:`dead_after` seconds (by the watcher's own
  clock: no clocks are compared between hosts) means that process is dead or stopped;
- the first error of any process goes into ``error`` (``compare_set``: one wins); the
  process that posted it raises it (one line printed), every other one exits with the
  same code and prints nothing;
- units are claimed one at a time from an atomic counter (``store.add``), so a fast
  process takes more of them and a slow one fewer.

Under torchrun (and ``--workers``, the same launcher) the agent serves the store
(``TORCHELASTIC_USE_AGENT_STORE=True``): every rank reaches it with :mod:`.store`'s
plain-Python client and never imports torch. Otherwise (``MASTER_ADDR``/``MASTER_PORT``
set by hand, another launcher) rank 0 hosts a torch ``TCPStore``: torch is imported
only there, only then.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from ..errors import CkptError

TIMEOUT_ENV = "CKPTTOOL_DIST_TIMEOUT"  # seconds without a heartbeat before a rank is dead
DEFAULT_DEAD_AFTER = 30.0
HEARTBEAT_S = 0.5
POLL_S = 0.05
LEAVE_POLL_S = 0.002
JOIN_GRACE_S = 120.0  # a rank that never beat: dead after this long
_calls = itertools.count()  # the commands run in this process: each its own keys


def dead_after() -> float:
    try:
        return max(1.0, float(os.environ.get(TIMEOUT_ENV) or DEFAULT_DEAD_AFTER))
    except ValueError:
        return DEFAULT_DEAD_AFTER


def store_timeout() -> timedelta:
    """How long a store call may take: a store gone (torchrun's node lost) fails the
    ranks left within about the heartbeat timeout, as a silent rank does."""
    return timedelta(seconds=max(10.0, dead_after()))


def world_size() -> int:
    """The number of processes torchrun started (1 outside torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def launched() -> bool:
    """Whether this process is one of several that torchrun (or ``--workers``) started
    for one command: WORLD_SIZE, RANK and MASTER_ADDR/PORT set as torchrun sets them.
    One process under torchrun (``--nproc-per-node=1``) takes the same path: it resumes
    and is resumed like the others."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(os.environ.get(n) for n in names):
        return False
    return world_size() > 1 or bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def agent_store() -> bool:
    """Whether torchrun's agent serves the store at MASTER_ADDR:MASTER_PORT (torch's
    own test: ``rendezvous._torchelastic_use_agent_store``)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


class Failed(CkptError):
    """Another process of the conversion failed and said so: exit with its code, print
    nothing (the process that failed printed the one line)."""

    silent = True

    def __init__(self, code: int):
        super().__init__("another rank failed")
        self.exit_code = code


class Group:
    """This process's membership of the conversion.

    Attributes:
        rank: This process's rank.
        size: The number of processes.
        store: The store, under this command's prefix.
    """

    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.size = world_size()
        self._addr = os.environ["MASTER_ADDR"]
        self._port = int(os.environ["MASTER_PORT"])
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"ckpttool/{restart}/{next(_calls)}/"
        self._agent = agent_store()
        if self._agent:
            self.store = self._client()
        else:  # rank 0 hosts a torch TCPStore (torch's env:// rendezvous)
            import torch.distributed as dist

            timeout = store_timeout()
            store, _, _ = next(dist.rendezvous("env://", self.rank, self.size, timeout=timeout))
            self.store = _TorchStore(dist.PrefixStore(self._prefix, store))
        self.store.set(f"who/{self.rank}", f"{socket.gethostname()} pid {os.getpid()}")
        self.store.add(f"hb/{self.rank}", 1)  # joined: from now on silence counts
        self._exchanges = itertools.count()  # the same sequence on every rank
        self._stop = threading.Event()
        self._watching = True
        self._thread = threading.Thread(target=self._heartbeat, name="ckpttool-hb", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self._addr}:{self._port}"

    # ------------------------------------------------------------ liveness

    def _client(self) -> Any:
        """A connection of its own to the store, under this command's prefix."""
        timeout = store_timeout()
        if self._agent:
            from .store import StoreError, TCPStoreClient

            try:
                return TCPStoreClient(
                    self._addr, self._port, timeout=timeout.total_seconds(), prefix=self._prefix
                )
            except StoreError as exc:
                raise CkptError(
                    f"cannot reach the conversion's store (torchrun's, at {self.address}): {exc}"
                ) from None
        import torch.distributed as dist

        client = dist.TCPStore(self._addr, self._port, is_master=False, timeout=timeout)
        return _TorchStore(dist.PrefixStore(self._prefix, client))

    def _heartbeat(self) -> None:
        """Bump our counter; watch the others' (rank 0 all of them, the others rank 0)."""
        try:
            store = self._client()
        except Exception:  # the store is gone: the main thread finds out on its next call
            return
        watched = [r for r in range(self.size) if r != self.rank] if self.rank == 0 else [0]
        seen: dict[int, tuple[int, float]] = {r: (-1, time.monotonic()) for r in watched}
        limit = dead_after()
        while not self._stop.wait(HEARTBEAT_S):
            try:
                store.add(f"hb/{self.rank}", 1)
                if not self._watching:
                    continue
                now = time.monotonic()
                values = _multi_counter(store, [f"hb/{r}" for r in watched])
                for r, value in zip(watched, values, strict=True):
                    last, since = seen[r]
                    # a rank not beating yet may still be importing torch on a busy node
                    allowed = limit if value > 0 else max(limit, JOIN_GRACE_S)
                    if value != last:
                        seen[r] = (value, now)
                    elif now - since > allowed:
                        who = _text(store, f"who/{r}") or "not started"
                        self.post(
                            f"rank {r} ({who}) stopped answering: no heartbeat for {limit:.0f} s",
                            2,
                            store,
                        )
                        store.close()
                        return
            except Exception:  # the store went away (torchrun ended): nothing to watch
                break
        store.close()

    def leave(self) -> None:
        """After an error: wait (boundedly) until every live rank has seen it, so that
        torchrun, which ends the others once one exits, finds them all exiting with
        the same code."""
        self.stop_watching()
        self.counter("left", 1)
        deadline = time.monotonic() + min(dead_after(), 5.0)
        # polled closely: the ranks must see the count reached within a few ms of each
        # other (they exit at once after it; torchrun polls its workers every 100 ms)
        while self.counter("left") < self.size and time.monotonic() < deadline:
            time.sleep(LEAVE_POLL_S)

    def stop_watching(self) -> None:
        """The others may end now (the output is published): their silence is no failure."""
        self._watching = False

    def close(self) -> None:
        """This rank is done with the store. Without torchrun's agent store, rank 0
        hosts it: it waits (boundedly) for the others to be done first, or their last
        calls would find it gone."""
        self._stop.set()
        if not self._agent:
            try:
                self.counter("closed", 1)
                deadline = time.monotonic() + min(dead_after(), 10.0)
                while self.rank == 0 and time.monotonic() < deadline:
                    if self.counter("closed") >= self.size:
                        break
                    time.sleep(POLL_S)
            except Exception:  # the store is gone: nothing to wait for
                pass
        self.store.close()

    # ------------------------------------------------------------ errors

    def post(self, message: str, code: int, store: Any = None) -> bool:
        """Post this process's error unless one is posted; True when ours is the one."""
        value = json.dumps({"rank": self.rank, "code": code, "message": message})
        store = store or self.store
        got = store.compare_set("error", "", value)
        return bool(got == value.encode())

    def posted(self) -> tuple[int, int, str] | None:
        """The posted error (rank, code, message), or None."""
        if not self.store.check(["error"]):
            return None
        value = json.loads(self.store.get("error"))
        return value["rank"], value["code"], value["message"]

    def check(self) -> None:
        """Raise the posted error: as :class:`CkptError` in the process that posted it
        from its watcher thread (its one line), as :class:`Failed` everywhere else."""
        posted = self.posted()
        if posted is None:
            return
        rank, code, message = posted
        if rank == self.rank:  # our watcher thread's (our own errors are raised as they are)
            raise CkptError(message)
        raise Failed(code)

    # ------------------------------------------------------------ waiting, claiming

    def wait(self, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()``, failing as soon as an error is posted."""
        delay = POLL_S
        while not ready():
            self.check()
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        self.check()

    def wait_key(self, key: str) -> str:
        self.wait(lambda: bool(self.store.check([key])))
        return self.store.get(key).decode()

    def counter(self, key: str, add: int = 0) -> int:
        return int(self.store.add(key, add))

    # ------------------------------------------------------------ small values

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (plain data: JSON through the store, never a
        pickle; tuples and integer keys come back as they went)."""
        key = f"bcast/{next(self._exchanges)}"
        if self.rank == 0:
            self.store.set(key, json.dumps(_encode(value)))
            return value
        return _decode(json.loads(self.wait_key(key)))

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (plain data, as :meth:`broadcast`)."""
        key = f"gather/{next(self._exchanges)}"
        self.store.set(f"{key}/{self.rank}", json.dumps(_encode(value)))
        return [_decode(json.loads(self.wait_key(f"{key}/{r}"))) for r in range(self.size)]

    def each_gathered(self, value: Any) -> Iterator[Any]:
        """:meth:`all_gather`'s values one rank's at a time, so that a large exchange
        (where every block of thousands of rank files lies) is never held whole. A
        value is stored in parts below the store's cap on one value; its count of parts
        is set last."""
        key = f"gather/{next(self._exchanges)}"
        text = json.dumps(_encode(value))
        parts = range(0, len(text), GATHER_PART) or range(1)
        for i, start in enumerate(parts):
            self.store.set(f"{key}/{self.rank}/{i}", text[start : start + GATHER_PART])
        self.store.set(f"{key}/{self.rank}", str(len(parts)))
        del text
        for r in range(self.size):
            count = int(self.wait_key(f"{key}/{r}"))
            theirs = "".join(self.store.get(f"{key}/{r}/{i}").decode() for i in range(count))
            yield _decode(json.loads(theirs))


# characters of one stored part of a gathered value (JSON: ASCII), under the store's
# cap on a value (store.MAX_VALUE)
GATHER_PART = 4 << 20


class _TorchStore:
    """Without torchrun's agent store: torch's ``TCPStore`` (rank 0 hosts it), its
    errors raised as :class:`.store.StoreError`, as the agent store client's are."""

    def __init__(self, store: Any):
        self._store = store

    def _call(self, name: str, *args: Any) -> Any:
        import torch.distributed as dist

        from .store import StoreError

        try:
            return getattr(self._store, name)(*args)
        except dist.DistError as exc:
            raise StoreError(" ".join(str(exc).split())[:300]) from None

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return bytes(self._call("compare_set", key, expected, desired))

    def close(self) -> None:
        """Nothing: torch closes its connection when the store is collected."""


def _multi_counter(store: Any, keys: list[str]) -> list[int]:
    return [int(store.add(key, 0)) for key in keys]


def _text(store: Any, key: str) -> str:
    return store.get(key).decode() if store.check([key]) else ""


def _encode(value: Any) -> Any:
    """Plain data as JSON keeps it: tuples and dicts (any keys) tagged."""
    if isinstance(value, tuple):
        return {"t": [_encode(v) for v in value]}
    if isinstance(value, list):
        return {"l": [_encode(v) for v in value]}
    if isinstance(value, dict):
        return {"d": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"not plain data: {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "t" in value:
            return tuple(_decode(v) for v in value["t"])
        if "l" in value:
            return [_decode(v) for v in value["l"]]
        return {_decode(k): _decode(v) for k, v in value["d"]}
    return value
