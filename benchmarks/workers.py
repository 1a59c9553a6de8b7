"""``--workers N`` as a user runs it: the whole command, against one process and the copy floor.

For each input size (a ``torch.save`` file of float32 tensors, warm in the page cache):

- ``one``: ``python -m ckpttool convert IN --to safetensors -o OUT -q``;
- ``workers N`` (N = 1, 2, 4): the same command with ``--workers N`` (ckpttool's own
  launch: N worker interpreters, the store served by the launcher; no torch anywhere);
- ``floor N``: N fresh interpreters that ``pread`` -> ``pwrite`` + ``fsync`` the same
  number of bytes in units of ckpttool's size (rank r takes units r, r + N, ...) into a
  file created at full size, started and waited for by one more: a parallel copy with
  nothing else to do, its launch included as the command's is.

Every figure is the wall time of the whole command (start-up included: what pays or
not is the question), the median of ``--repeat`` runs, the output removed (and the
disk synced) before each; ratios are against ``one`` and the floor of the same N from
the same run.

    .venv/bin/python benchmarks/workers.py --sizes-mib 1024 8192 --repeat 3
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOOR = """
import os, sys
src, dst, nbytes, unit, rank, world = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
fin, fout = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY)
view = memoryview(bytearray(16 << 20))
for start in range(rank * unit, nbytes, world * unit):
    end = min(start + unit, nbytes)
    for at in range(start, end, len(view)):
        n = os.preadv(fin, [view[: min(len(view), end - at)]], at)
        os.pwrite(fout, view[:n], at)
    os.fsync(fout)
"""


def make_input(path: Path, size_mib: int) -> None:
    import torch

    per = 64 << 20
    count = max(1, (size_mib << 20) // per)
    torch.save({f"layer{i}.weight": torch.rand(per // 4) for i in range(count)}, path)


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def clean(out: Path) -> None:
    for entry in out.parent.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    os.sync()


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def run_ckpttool(src: Path, out: Path, workers: int | None) -> float:
    cmd = [sys.executable, "-m", "ckpttool", "convert", str(src), "--to", "safetensors"]
    cmd += ["-o", str(out), "-q"] + ([] if workers is None else ["--workers", str(workers)])
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env())
    return time.perf_counter() - start


def run_floor(src: Path, out: Path, world: int) -> float:
    from ckpttool.targets.units import default_unit_bytes

    nbytes = src.stat().st_size
    unit = default_unit_bytes(nbytes)
    start = time.perf_counter()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, nbytes)
    os.close(fd)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FLOOR, str(src), str(out), str(nbytes), str(unit), str(r)]
            + [str(world)]
        )
        for r in range(world)
    ]
    for proc in procs:
        assert proc.wait() == 0
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", default="/tmp/ckpttool-bench-workers")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} cores; median of {args.repeat}; wall time of the whole command")
    for size in args.sizes_mib:
        src = work / f"in-{size}.pt"
        if not src.exists():
            make_input(src, size)
        outs = work / "out"
        outs.mkdir(exist_ok=True)
        out = outs / "out.safetensors"
        runs: dict[str, list[float]] = {}
        cases = [("one", functools.partial(run_ckpttool, src, out, None))]
        for n in (1, 2, 4):
            cases.append((f"workers {n}", functools.partial(run_ckpttool, src, out, n)))
            cases.append((f"floor {n}", functools.partial(run_floor, src, out, n)))
        for _ in range(args.repeat):  # in turn: a slow spell of the machine hits every case
            for name, case in cases:
                clean(out)
                warm(src)
                runs.setdefault(name, []).append(case())
        clean(out)
        times = {name: statistics.median(values) for name, values in runs.items()}
        print(f"\n{src.stat().st_size / 2**30:.2f} GiB input")
        print(f"  one process     {times['one']:7.2f} s")
        for n in (1, 2, 4):
            w, f = times[f"workers {n}"], times[f"floor {n}"]
            print(
                f"  --workers {n}     {w:7.2f} s   {times['one'] / w:5.2f}x one process"
                f"   floor {n}: {f:6.2f} s   {w / f:5.2f}x the floor"
            )


if __name__ == "__main__":
    main()
