"""What a rank imported: tests/test_distributed_store.py puts this folder first on the
PYTHONPATH of the launches it starts. Python imports ``sitecustomize`` at start-up, so
every torchrun or ``--workers`` rank (a process with RANK set: torchrun sets it for
its workers only) writes, at exit, the torch modules it imported and its peak RSS to
``$CKPTTOOL_TEST_RANK_RECORDS/rank<R>-<pid>.json``. Nothing in ckpttool knows of it."""

import atexit
import json
import os
import resource
import sys

FOLDER = os.environ.get("CKPTTOOL_TEST_RANK_RECORDS")


def peak_rss_kib() -> int:
    """VmHWM: the peak of this process's own image. Not ``ru_maxrss``, which Linux
    carries over fork and exec: a worker forked from torchrun's agent (torch
    imported) would report the agent's peak."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def record() -> None:
    torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    entry = {
        "rank": int(os.environ["RANK"]),
        "ckpttool": "ckpttool.distributed.group" in sys.modules,
        "torch": torch[:20],
        "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
        "peak_rss_kib": peak_rss_kib(),
    }
    with open(os.path.join(FOLDER or ".", f"rank{entry['rank']}-{os.getpid()}.json"), "w") as f:
        json.dump(entry, f)


if FOLDER and "RANK" in os.environ:
    atexit.register(record)  # registered first: runs last, after ckpttool's own exit
