"""``--workers N``: the same command in N processes on this machine, as
``torchrun --standalone --nproc-per-node=N`` would run it, without torch.

The launcher serves the workers' store itself (:mod:`.store_server`, the c10d protocol
their client speaks), starts ``python -m ckpttool ...`` N times with the environment
torchrun gives its workers (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, the
agent's store), and watches them as torch's agent does: a worker killed by a signal
ends the others at once (they could only wait for its heartbeat), one that failed with
a code has said why and the others follow it with the same code. The workers stay in
the launcher's process group, so a Ctrl-C reaches them all; the launcher says it once.
Nothing here imports torch: the start-up of ``--workers`` is N interpreters and the
command's own imports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import CkptError, UsageError
from .group import launched

WORKERS_OPTION = "--workers"
EXIT_INTERRUPTED = 130
# set in the workers' environment by run_workers: ckpttool's own launch
OWN_LAUNCH = "CKPTTOOL_OWN_LAUNCH"


def own_launch() -> bool:
    """This process is a worker of ``--workers`` (whose launcher says an interrupt)."""
    return os.environ.get(OWN_LAUNCH) == "1"


def without_workers(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--workers N`` / ``--workers=N`` taken out (until a ``--``)."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--":
            out.extend(argv[i:])
            break
        elif arg == WORKERS_OPTION:
            skip = True
        elif not arg.startswith(f"{WORKERS_OPTION}="):
            out.append(arg)
    return out


@dataclass
class Ended:
    """How one worker ended: its rank, pid, exit status (negative: the signal that
    killed it) and when the launcher saw it."""

    rank: int
    pid: int
    status: int
    when: float


FOLLOW_S = 15.0  # after a worker failed with a code: how long the others may take to follow
POLL_S = 0.02


def run_workers(argv: Sequence[str], workers: int, *, debug: bool = False) -> int:
    """Run ``python -m ckpttool ARGV`` (``--workers`` taken out) in ``workers`` processes
    that join one conversion; return their exit code (the same on every one).

    Raises:
        UsageError: A worker count below 1, or ``--workers`` under torchrun.
        CkptError: A worker was killed (it could not say why).
    """
    if workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    if launched():
        raise UsageError("--workers under torchrun: torchrun already started the workers")
    from .store_server import StoreServer

    server = StoreServer()
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "WORLD_SIZE": str(workers),
        "LOCAL_WORLD_SIZE": str(workers),
        "GROUP_RANK": "0",
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCHELASTIC_RUN_ID": str(uuid.uuid4()),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        OWN_LAUNCH: "1",  # the workers leave the interrupted line to this process
    }
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it: N processes share the cores
    args = [sys.executable, "-m", "ckpttool", *without_workers(argv)]
    procs: list[subprocess.Popen[bytes]] = []
    terminated = signal.getsignal(signal.SIGTERM)
    # SIGTERM to the launcher ends the workers too (torchrun's agent does the same)
    signal.signal(signal.SIGTERM, lambda *_: _raise_terminated())
    try:
        for rank in range(workers):
            ranked = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            procs.append(subprocess.Popen(args, env=ranked))
        return _watch(procs)
    except KeyboardInterrupt:  # Ctrl-C reached the workers too: they stop, silent
        _end(procs, signal.SIGINT)
        return EXIT_INTERRUPTED
    except _Terminated:
        _end(procs, signal.SIGTERM)
        return 128 + signal.SIGTERM
    finally:
        _end(procs, signal.SIGKILL, wait_s=0)
        signal.signal(signal.SIGTERM, terminated)
        server.close()


class _Terminated(BaseException):
    """The launcher got SIGTERM."""


def _raise_terminated() -> None:
    raise _Terminated


def _watch(procs: list[subprocess.Popen[bytes]]) -> int:
    """Wait for every worker; the run's exit code (see :func:`_failed_with`)."""
    ended: dict[int, Ended] = {}
    failed_at: float | None = None
    while len(ended) < len(procs):
        for rank, proc in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = Ended(rank, proc.pid, int(proc.returncode), time.monotonic())
                if proc.returncode < 0:  # killed: the others could only wait for its heartbeat
                    _end(procs, signal.SIGTERM)
                elif proc.returncode > 0 and failed_at is None:
                    failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FOLLOW_S:
            _end(procs, signal.SIGTERM)
        time.sleep(POLL_S)
    failures = [e for e in ended.values() if e.status != 0]
    return _failed_with(failures) if failures else 0


def _end(procs: list[subprocess.Popen[bytes]], sig: int, wait_s: float = 10.0) -> None:
    """Send ``sig`` to the workers still running; wait up to ``wait_s`` for them, then kill."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.send_signal(sig)
    deadline = time.monotonic() + wait_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()


def _failed_with(failures: list[Ended]) -> int:
    """The exit code of a run whose workers failed: the code of the one that said why
    (a worker that exits with a code has printed its line), else the first one killed,
    named (a worker killed by a signal says nothing; the launcher ended the others).

    Raises:
        CkptError: A worker was killed.
    """
    said = sorted((e.when, e.status) for e in failures if e.status > 0)
    if said:
        return said[0][1]
    # the launcher ends the others with SIGTERM once one is gone: the first to go is news
    first = min(failures, key=lambda e: e.when)
    if first.status == -signal.SIGINT:
        return EXIT_INTERRUPTED
    try:
        how = f"killed by {signal.Signals(-first.status).name}"
    except ValueError:
        how = f"ended with status {first.status}"
    raise CkptError(
        f"worker {first.rank} (pid {first.pid}) was {how}; nothing was written under the output",
        hint="run the same command again: it resumes the work already durable",
    )
