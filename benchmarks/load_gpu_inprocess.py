"""Loading onto a GPU, timed inside one warm process (no import or CUDA start-up counted).

    python benchmarks/load_gpu_inprocess.py PT SAFETENSORS [--repeat 5]

Complements ``run.py --only load-gpu``, whose fresh processes are mostly ``import torch``
and CUDA's start-up: here each loader is timed from the call to the last tensor on the
device (synchronised), files in the page cache, median of ``--repeat`` after one warm-up.
Then the same load as the first call of a fresh process (after CUDA's start-up). Also
measures the two ceilings of the staged path on this machine (one thread reading the
file into pinned memory; pinned host-to-device copies) and ckpttool with other staging
buffer counts and sizes, to show which of the two bounds it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from measure import child_env
from safetensors.torch import load_file

import ckpttool
import ckpttool.tensors.direct as fastload
from ckpttool import sources

DEVICE = "cuda:0"


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``fn`` (its result dropped before the next run), after a warm-up."""
    walls = []
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        if i:
            walls.append(time.perf_counter() - start)
        del result
    return statistics.median(walls)


def read_into_pinned(path: str, pinned: torch.Tensor, threads: int) -> None:
    """The whole file read into pinned memory by ``threads`` threads, 16 MiB a read."""
    chunk = 16 << 20
    view = fastload.bytes_view(pinned)
    fd = os.open(path, os.O_RDONLY)

    def read(offset: int) -> None:
        sources.read_fd_into(fd, view[offset : offset + chunk], offset)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(0, len(view), chunk)))
    finally:
        os.close(fd)


# One load as the first call of a fresh process, after torch and CUDA's start-up (what
# run.py's fresh processes add to those): the loader's imports, thread starts and pinned
# buffers count here, unlike in the warm loop.
FIRST_CALL = """
import sys, time, torch
kind, path, threads, buffers, mib = sys.argv[1:6]
torch.empty(1, device="cuda:0")
torch.cuda.synchronize()
start = time.perf_counter()
if kind == "load_file":
    from safetensors.torch import load_file
    out = load_file(path, device="cuda:0")
else:
    import ckpttool, ckpttool.tensors.direct as fl
    fl.READ_THREADS, fl.STAGING_BUFFERS = int(threads), int(buffers)
    fl.STAGING_BYTES = int(mib) << 20
    fl.MAX_PENDING = 2 * fl.STAGING_BUFFERS
    out = ckpttool.load(path, map_location="cuda:0")
torch.cuda.synchronize()
print(time.perf_counter() - start)
"""


def first_calls(path: str, repeat: int) -> list[tuple[str, float]]:
    """Median first-call seconds of load_file and of ckpttool with some staging settings."""
    variants = {
        "first call: load_file(device=cuda:0)": ("load_file", 0, 0, 0),
        "first call: ckpttool.load, defaults": (
            "ckpttool", fastload.READ_THREADS, fastload.STAGING_BUFFERS,
            fastload.STAGING_BYTES >> 20,
        ),
        "first call: ckpttool.load, 4 threads, 8 x 4 MiB": ("ckpttool", 4, 8, 4),
        "first call: ckpttool.load, 4 threads, 8 x 16 MiB": ("ckpttool", 4, 8, 16),
        "first call: ckpttool.load, 1 thread, 4 x 32 MiB": ("ckpttool", 1, 4, 32),
    }  # fmt: skip
    walls: dict[str, list[float]] = {name: [] for name in variants}
    # bytecode cached as for an installed package (see measure.child_env); round 0 fills it
    env = child_env(Path(tempfile.gettempdir()) / "ckpttool-bench-pycache")
    for round_no in range(repeat + 1):  # interleaved rounds
        for name, (kind, *config) in variants.items():
            args = [sys.executable, "-c", FIRST_CALL, kind, path, *map(str, config)]
            done = subprocess.run(args, capture_output=True, text=True, env=env)
            if done.returncode:
                print(f"{name}: FAILED: {done.stderr.strip()[-500:]}")
                walls[name].append(float("nan"))
            elif round_no:
                walls[name].append(float(done.stdout.split()[-1]))
    return [(name, statistics.median(w)) for name, w in walls.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pt")
    parser.add_argument("safetensors")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--first-call-repeat", type=int, default=3, help="fresh processes each")
    args = parser.parse_args()
    pt, st = args.pt, args.safetensors
    size = os.path.getsize(st)
    torch.empty(1, device=DEVICE)  # CUDA's start-up, outside every timing

    def model_of_shapes():
        return {k: torch.empty_like(v, device=DEVICE) for k, v in load_file(st).items()}

    target = model_of_shapes()
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(size, dtype=torch.uint8, device=DEVICE)
    loaders = {
        "ceiling: 1 thread preadv file -> pinned": lambda: read_into_pinned(st, pinned, 1),
        "ceiling: 4 threads preadv file -> pinned": lambda: read_into_pinned(st, pinned, 4),
        "ceiling: pinned -> device copy": lambda: on_device.copy_(pinned, non_blocking=True),
        "safetensors load_file(device=cuda:0)": lambda: load_file(st, device=DEVICE),
        "torch.load(pt, mmap, map_location=cuda:0)": lambda: torch.load(
            pt, mmap=True, weights_only=True, map_location=DEVICE
        ),
        "ckpttool.load(st, cuda:0)": lambda: ckpttool.load(st, map_location=DEVICE),
        "ckpttool.load(pt, cuda:0)": lambda: ckpttool.load(pt, map_location=DEVICE),
        "ckpttool.load_into(cuda tensors, st)": lambda: ckpttool.load_into(target, st),
        "ckpttool.load_into(cuda tensors, pt)": lambda: ckpttool.load_into(target, pt),
    }
    rows = []
    for name, fn in loaders.items():
        try:
            rows.append((name, timed(fn, args.repeat)))
        except Exception as exc:  # noqa: BLE001 (one failing loader must not hide the rest)
            print(f"{name}: FAILED: {exc!r}")
            rows.append((name, float("nan")))
    rows += first_calls(st, args.first_call_repeat)
    default = (fastload.READ_THREADS, fastload.STAGING_BUFFERS, fastload.STAGING_BYTES)
    for threads, buffers, mib in ((1, 4, 32), (4, 8, 4), (4, 8, 16), (8, 8, 8)):
        fastload.READ_THREADS, fastload.STAGING_BUFFERS = threads, buffers
        fastload.STAGING_BYTES, fastload.MAX_PENDING = mib << 20, 2 * buffers
        wall = timed(lambda: ckpttool.load(st, map_location=DEVICE), args.repeat)
        rows.append((f"warm ckpttool.load(st), {threads} threads, {buffers} x {mib} MiB", wall))
    fastload.READ_THREADS, fastload.STAGING_BUFFERS, fastload.STAGING_BYTES = default
    fastload.MAX_PENDING = 2 * fastload.STAGING_BUFFERS

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {size / 2**30:.2f} GiB, "
          f"median of {args.repeat}; default: {default[0]} reader threads, {default[1]} x "
          f"{default[2] >> 20} MiB staging")  # fmt: skip
    base = rows[3][1]
    for name, wall in rows:
        print(f"{name:<52} {wall * 1000:8.1f} ms  {size / wall / 2**30:6.1f} GiB/s  "
              f"{wall / base:5.2f}x load_file")  # fmt: skip


if __name__ == "__main__":
    main()
