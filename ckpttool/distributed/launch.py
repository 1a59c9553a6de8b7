"""``--workers N``: the same command in N processes on this machine, through torch's
own elastic launcher (what ``torchrun --standalone --nproc-per-node=N`` runs)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

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


def run_workers(argv: Sequence[str], workers: int, *, debug: bool = False) -> int:
    """Run ``python -m ckpttool ARGV`` (``--workers`` taken out) in ``workers`` processes
    that join one conversion; return their exit code (the same on every one).

    The workers say ckpttool's one line; the launcher's own logging and warnings (a
    line per failed worker, its view of a Ctrl-C) reach the terminal with ``debug`` only.

    Raises:
        UsageError: A worker count below 1, or ``--workers`` under torchrun.
    """
    if workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    if launched():
        raise UsageError("--workers under torchrun: torchrun already started the workers")
    if not debug:
        logging.disable(logging.CRITICAL)
        warnings.filterwarnings("ignore")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=workers,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    args = ["-m", "ckpttool", *without_workers(argv)]
    os.environ[OWN_LAUNCH] = "1"  # the workers leave the interrupted line to this process
    try:
        elastic_launch(config, sys.executable)(*args)
    except ChildFailedError as exc:
        return _failed_with(exc.failures)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except SignalException as exc:  # Ctrl-C (the caller says it), or SIGTERM as one process
        return EXIT_INTERRUPTED if exc.sigval == signal.SIGINT else 128 + int(exc.sigval)
    finally:
        os.environ.pop(OWN_LAUNCH, None)
    return 0


def _failed_with(failures: dict[int, Any]) -> int:
    """The exit code of a run whose workers failed: the code of the one that said why
    (a worker that exits with a code has printed its line), else the first one killed,
    named (a worker killed by a signal says nothing; the launcher ended the others).

    Raises:
        CkptError: A worker was killed.
    """
    ranked = sorted(failures.items())
    said = [f.exitcode for _, f in ranked if f.exitcode > 0]
    if said:
        return int(said[0])
    # the launcher ends the others with SIGTERM once one is gone: the first to go is news
    rank, first = min(ranked, key=lambda f: (f[1].exitcode == -signal.SIGTERM, f[1].timestamp))
    if first.exitcode == -signal.SIGINT:
        return EXIT_INTERRUPTED
    try:
        how = f"killed by {signal.Signals(-first.exitcode).name}"
    except ValueError:
        how = f"ended with status {first.exitcode}"
    raise CkptError(
        f"worker {rank} (pid {first.pid}) was {how}; nothing was written under the output",
        hint="run the same command again: it resumes the work already durable",
    )
