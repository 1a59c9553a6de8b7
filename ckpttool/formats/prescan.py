"""Scan the other rank files of a per-rank checkpoint in a forked child, meanwhile.

Every rank file is judged for dangerous globals, but only the lowest rank is
rebuilt. The scans of the others (the C unpickler walking every opcode) are pure
CPU, so a child process does them while the parent reads and combines rank 0.

The child reports only successful scans, as JSON: nothing from the files crosses
the pipe but global names. A file whose scan failed, or a child that died, is
simply scanned again in the parent, which raises the proper error. No child is
forked where ``os.fork`` is missing or other threads run (forking them is unsafe).

Under several processes (:mod:`ckpttool.sharing`) each scans only its share of the
files, and the verdicts (global names, nothing else) are gathered: a process whose
own file fails to scan raises its error before the gather, as one process would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence

from .. import sharing

Scan = Callable[[str], tuple[list[str], list[str], list[str]]]
Found = dict[str, tuple[list[str], list[str], list[str]]]


class Prescan:
    """Scans ``paths`` with ``scan`` in a forked child; :meth:`scan` gives each result.

    A context manager: leaving it stops a child whose results were not wanted.
    """

    def __init__(self, paths: Sequence[str], scan: Scan):
        self._scan = scan
        self._found: Found | None = None
        self._pid, self._fd = 0, -1
        self._paths = list(paths)  # (under several processes, the rank files are dealt
        self._indices = sharing.my_share(len(self._paths))  # by position: same on every one)
        paths = [self._paths[i] for i in self._indices]
        self._gathered = not sharing.shared()
        if not paths or not _can_fork():
            self._found = {}
            return
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: scan, report, leave without running any cleanup
            code = 1
            try:
                os.close(read_end)
                _report(write_end, paths, scan)
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        self._pid, self._fd = pid, read_end

    def scan(self, path: str) -> tuple[list[str], list[str], list[str]]:
        """The child's result for ``path``, or a scan here if it has none."""
        if self._found is None:
            self._found = self._collect()
        if not self._gathered:  # this process's share, whole (errors raised here), then all
            self._gathered = True
            done, paths = self._found, self._paths
            mine = {i: done.get(paths[i]) or self._scan(paths[i]) for i in self._indices}
            self._found = {paths[i]: v for i, v in sharing.gather(mine).items()}
        found = self._found.get(path)
        return found if found is not None else self._scan(path)

    def _collect(self) -> Found:
        with os.fdopen(self._fd, "rb") as pipe:
            raw = pipe.read()
        os.waitpid(self._pid, 0)
        self._pid = 0
        try:
            found = json.loads(raw or b"{}").items()
            return {path: (seen, bad, unknown) for path, (seen, bad, unknown) in found}
        except ValueError:  # a child killed mid-write: scan here
            return {}

    def __enter__(self) -> Prescan:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pid:  # results never collected: the input was not per-rank, or failed
            with contextlib.suppress(OSError):
                os.kill(self._pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.waitpid(self._pid, 0)
            os.close(self._fd)
            self._pid = 0


def _can_fork() -> bool:
    if not hasattr(os, "fork"):
        return False
    threading = sys.modules.get("threading")
    return threading is None or threading.active_count() == 1


def _report(fd: int, paths: Sequence[str], scan: Scan) -> None:
    found: Found = {}
    for path in paths:
        try:
            found[path] = scan(path)
        except Exception:  # the parent scans it again and raises the real error
            continue
    view = memoryview(json.dumps(found).encode())
    while view:
        view = view[os.write(fd, view) :]
