"""Distributed convert against the parallel copy floor, N = 1, 2, 4 ranks on this machine.

For each N, under ``torchrun --standalone --nproc-per-node=N`` (the same launcher for
both sides, so start-up and the torch import count on both):

- ckpttool: ``-m ckpttool convert IN.pt --to safetensors -o OUT`` (every tensor's bytes
  copied from the input, in 64 MiB units claimed through the store, each fsynced and
  journaled; rank 0 publishes);
- the floor: N processes that ``pread`` -> ``pwrite`` + ``fsync`` the same number of
  bytes in the same 64 MiB units (rank r takes units r, r + N, ...), into a file
  created at full size: a parallel copy with nothing else to do.

Prints wall times (median of ``--repeat``), the ratio ckpttool / floor and the scaling
from 1 to N (time at 1 / time at N, both sides). On a small machine the launch itself
(torchrun, N interpreters importing torch) is much of the time: a null launch (N
processes importing ``torch.distributed`` and exiting) is timed too, and the ratio of
the times past it is printed beside (``net``). The input is a ``torch.save`` file of
``--size-mib`` MiB of float32 tensors, in the page cache (warm), as in benchmarks/run.py.

    .venv/bin/python benchmarks/distributed.py --size-mib 1024 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT = 64 << 20


def null_worker() -> None:
    import torch.distributed  # noqa: F401


def floor_worker(src: str, dst: str, nbytes: int) -> None:
    """One rank of the copy floor (run under torchrun: RANK, WORLD_SIZE from it)."""
    import torch.distributed  # noqa: F401  (the same import the ckpttool ranks pay)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fin = os.open(src, os.O_RDONLY)
    fout = os.open(dst, os.O_WRONLY)
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    for start in range(rank * UNIT, nbytes, world * UNIT):
        end = min(start + UNIT, nbytes)
        for at in range(start, end, len(buf)):
            n = os.preadv(fin, [view[: min(len(buf), end - at)]], at)
            os.pwrite(fout, view[:n], at)
        os.fsync(fout)
    os.close(fin)
    os.close(fout)


def make_input(path: Path, size: int) -> None:
    import torch

    per = 16 << 20
    sd = {f"layer{i}.weight": torch.rand(per // 4) for i in range(max(1, size // per))}
    torch.save(sd, path)


def torchrun(n: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        "--monitor-interval=0.1",
        *args,
    ]


def timed(cmd: list[str], before=None) -> float:
    if before:
        before()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=str(ROOT / "bench-data" / "distributed"))
    parser.add_argument("--floor-worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--null-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.null_worker:
        null_worker()
        return
    if args.floor_worker:
        src, dst, nbytes = args.floor_worker
        floor_worker(src, dst, int(nbytes))
        return
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"in-{args.size_mib}.pt"
    if not src.exists():
        make_input(src, args.size_mib << 20)
    out = work / "out.safetensors"
    floor_out = work / "floor.bin"
    subprocess.run(["cat", str(src)], stdout=subprocess.DEVNULL, check=True)  # warm
    nbytes = src.stat().st_size

    def clean() -> None:
        for p in (out, floor_out):
            if p.exists():
                p.unlink()
        for p in work.glob(".*ckpttool*"):
            shutil.rmtree(p, ignore_errors=True)

    def allocate() -> None:
        clean()
        with open(floor_out, "wb") as f:
            f.truncate(nbytes)

    convert = ["-m", "ckpttool", "convert", str(src), "--to", "safetensors", "-o", str(out), "-q"]
    floor = [__file__, "--floor-worker", str(src), str(floor_out), str(nbytes)]
    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        ours, base, null = [], [], []
        for _ in range(args.repeat):  # interleaved: the machine's load drifts over all
            ours.append(timed(torchrun(n, *convert), clean))
            base.append(timed(torchrun(n, *floor), allocate))
            null.append(timed(torchrun(n, __file__, "--null-worker")))
        rows.append((n, *(statistics.median(x) for x in (ours, base, null))))
    clean()
    print(f"input {nbytes / 2**20:.0f} MiB, units of {UNIT >> 20} MiB, median of {args.repeat}")
    print(
        f"{'N':>3} {'ckpttool s':>11} {'floor s':>9} {'null s':>7} {'ratio':>7} {'net':>7}"
        f" {'scaling':>8} {'floor sc.':>9}"
    )
    t1, f1 = rows[0][1], rows[0][2]
    for n, t, f, z in rows:
        net = (t - z) / max(f - z, 1e-3)
        print(
            f"{n:>3} {t:>11.2f} {f:>9.2f} {z:>7.2f} {t / f:>6.2f}x {net:>6.2f}x"
            f" {t1 / t:>7.2f}x {f1 / f:>8.2f}x"
        )


if __name__ == "__main__":
    main()
