"""``--workers N``: the same command in N processes on this machine, through torch's
own elastic launcher (what ``torchrun --standalone --nproc-per-node=N`` runs)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Sequence

from ..errors import UsageError
from .group import launched

WORKERS_OPTION = "--workers"


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


def run_workers(argv: Sequence[str], workers: int) -> int:
    """Run ``python -m ckpttool ARGV`` (``--workers`` taken out) in ``workers`` processes
    that join one conversion; return their exit code (the same on every one).

    Raises:
        UsageError: A worker count below 1, or ``--workers`` under torchrun.
    """
    if workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    if launched():
        raise UsageError("--workers under torchrun: torchrun already started the workers")
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
    try:
        elastic_launch(config, sys.executable)(*args)
    except ChildFailedError as exc:  # the workers printed why
        codes = [f.exitcode for _, f in sorted(exc.failures.items())]
        return next((c for c in codes if c > 0), 2)
    return 0
