"""The resumable state of one output: a folder beside it, named after it.

``.NAME.ckpttool-resume/`` (NAME: the output file's or folder's name) holds

- ``state.json``: the key of the work (a hash of the plan, the unit size, the output's
  path and every input's identity: path, size, mtime_ns) and the identities themselves;
- ``lease``: the host and pid of the rank 0 writing it now, its mtime refreshed while
  it runs: a second run of the same output refuses to start beside a live one;
- ``files/``: the output's files at their final size, written unit by unit;
- ``journal/HOST-PID-rR.log``: one line per unit made durable (data fsynced first):
  ``UNIT_ID [[piece, start, length, crc], ...]``, appended and fsynced. A line cut by
  a kill is ignored; its unit is written again.

The name is the same for every run of the output, on any host and at any world size:
that is what lets a rerun find the work (it keeps it only when the key matches, and
says so when it starts over). Two runs never write it at once (the lease); the
single-process path keeps its per-host, per-pid temp names (:mod:`ckpttool.targets.local`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from collections.abc import Iterable, Sequence
from typing import Any

from .. import sources
from ..errors import CkptError
from .local import TEMP_MARK, pid_alive
from .units import CrcRun

SUFFIX = ".ckpttool-resume"
STATE = "state.json"
LEASE = "lease"
FILES = "files"
JOURNAL = "journal"
LEASE_STALE_S = 120.0  # another host's lease untouched this long: its run is gone
LEASE_REFRESH_S = 5.0


def resume_dir(out: str) -> str:
    parent, name = os.path.split(os.path.abspath(out))
    return os.path.join(parent, f".{name}{SUFFIX}")


def input_identities(paths: Iterable[str]) -> list[list[Any]]:
    """(path, size, mtime_ns) of every local input file; a URL or a folder by its name."""
    seen: dict[str, list[Any]] = {}
    for path in paths:
        path = sources.strip_file_scheme(os.fspath(path))
        if sources.is_url(path):
            seen.setdefault(path, [path])
            continue
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except OSError:
            continue
        if os.path.isdir(real):
            seen.setdefault(real, [real])
        else:
            seen.setdefault(real, [real, st.st_size, st.st_mtime_ns])
    return [seen[k] for k in sorted(seen)]


def work_key(digest: str, out: str, identities: Sequence[Sequence[Any]]) -> str:
    text = json.dumps([digest, os.path.abspath(out), list(identities)])
    return hashlib.sha256(text.encode()).hexdigest()


class Journal:
    """The resume folder of one output, as rank 0 opens it (see the module's doc)."""

    def __init__(self, out: str):
        self.root = resume_dir(out)
        self.files = os.path.join(self.root, FILES)
        self.journal = os.path.join(self.root, JOURNAL)

    # ------------------------------------------------------------ rank 0

    def open(self, key: str, identities: list[list[Any]]) -> str:
        """Take the folder for this work: keep what is there when ``key`` matches, else
        start it afresh. Returns a note on what was found ("" when there was nothing).

        Raises:
            CkptError: Another run is writing this output now.
        """
        note = ""
        if os.path.isdir(self.root):
            self._check_lease()
            state = _read_json(os.path.join(self.root, STATE))
            if state is not None and state.get("key") == key:
                self._write_lease()
                return "resumed"
            note = _why_restart(state, identities)
            _rmtree(self.root)
        # made under a name of its own and renamed whole: a run stopped while it is made
        # (a Ctrl-C right after the start) leaves no folder without its state, which
        # the next run could only call unreadable and start over
        # (a temp name as every output's: a run killed meanwhile leaves one the next cleans)
        building = f"{self.root}{TEMP_MARK}{os.getpid()}"
        _rmtree(building)
        os.makedirs(os.path.join(building, FILES))
        os.makedirs(os.path.join(building, JOURNAL))
        _write_json(
            os.path.join(building, LEASE), {"host": socket.gethostname(), "pid": os.getpid()}
        )
        _write_json(os.path.join(building, STATE), {"key": key, "inputs": identities})
        _fsync_dir(building)
        os.rename(building, self.root)
        _fsync_dir(os.path.dirname(self.root))
        return note

    def _check_lease(self) -> None:
        path = os.path.join(self.root, LEASE)
        lease = _read_json(path)
        if not lease:
            return
        host, pid = lease.get("host"), int(lease.get("pid", 0))
        live = False
        if host == socket.gethostname():
            live = pid != os.getpid() and pid_alive(pid)
        else:
            with contextlib.suppress(OSError):
                live = time.time() - os.stat(path).st_mtime < LEASE_STALE_S
        if live:
            raise CkptError(
                f"another ckpttool run ({host} pid {pid}) is writing this output",
                path=self.root,
                hint="wait for it to end, or stop it",
            )

    def _write_lease(self) -> None:
        _write_json(
            os.path.join(self.root, LEASE), {"host": socket.gethostname(), "pid": os.getpid()}
        )

    def refresh_lease(self) -> None:
        with contextlib.suppress(OSError):
            os.utime(os.path.join(self.root, LEASE))

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(self.root, LEASE))

    def done(self) -> dict[int, list[CrcRun]]:
        """Every unit some log records as durable, with its CRC runs."""
        done: dict[int, list[CrcRun]] = {}
        for name in sorted(os.listdir(self.journal)):
            with open(os.path.join(self.journal, name), "rb") as f:
                data = f.read()
            for line in data.split(b"\n")[:-1]:  # the last: "" or a line cut by a kill
                try:
                    unit, _, runs = line.partition(b" ")
                    done[int(unit)] = [tuple(run) for run in json.loads(runs)]  # type: ignore[misc]
                except ValueError:
                    continue
        return done

    def remove(self) -> None:
        _rmtree(self.root)

    def discard_unused(self) -> tuple[int, int] | None:
        """Remove the folder of work no run can use any more (the output was just
        written by another route: one process): (its bytes, the pid that wrote it), or
        None when there was none or a live run holds it."""
        if not os.path.isdir(self.root):
            return None
        try:
            self._check_lease()
        except CkptError:
            return None
        lease = _read_json(os.path.join(self.root, LEASE)) or {}
        nbytes = sum(
            os.lstat(os.path.join(folder, name)).st_size
            for folder, _, names in os.walk(self.root)
            for name in names
        )
        _rmtree(self.root)
        return nbytes, int(lease.get("pid", 0) or 0)

    # ------------------------------------------------------------ every rank

    def log(self, rank: int) -> UnitLog:
        return UnitLog(
            os.path.join(self.journal, f"{socket.gethostname()}-{os.getpid()}-r{rank}.log")
        )


class UnitLog:
    """One process's append-only journal: a line per unit, fsynced."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(self, unit: int, runs: list[CrcRun]) -> None:
        line = f"{unit} {json.dumps([list(r) for r in runs], separators=(',', ':'))}\n"
        os.write(self.fd, line.encode())
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def _why_restart(state: dict | None, identities: list[list[Any]]) -> str:
    if state is None:
        return "an interrupted run's work was unreadable: started over"
    before = {entry[0]: entry for entry in state.get("inputs", [])}
    for entry in identities:
        if entry[0] in before and before[entry[0]] != entry:
            return f"{entry[0]} changed since the interrupted run: started over"
    return "the interrupted run wrote another output (inputs or options differ): started over"


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path: str, value: Any) -> None:
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
