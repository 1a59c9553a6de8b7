"""Distributed convert against the parallel copy floor, N = 1, 2, 4 ranks on this machine.

For each N, under ``torchrun --standalone --nproc-per-node=N`` (the same launcher for
both sides, so its start-up counts on both; the ranks of neither import torch):

- ckpttool: ``-m ckpttool convert IN.pt --to safetensors -o OUT`` (every tensor's bytes
  copied from the input, in units claimed through the store, each fsynced and
  journaled; rank 0 publishes; the unit size is ckpttool's default: 1/128 of the
  output, 4 to 64 MiB);
- the floor: N processes that ``pread`` -> ``pwrite`` + ``fsync`` the same number of
  bytes in units of the same size (rank r takes units r, r + N, ...), into a file
  created at full size: a parallel copy with nothing else to do.

Both sides run as torchrun workers that wait for each other after their imports, then
time their work (ckpttool: the Python API's ``convert``, the code the CLI runs: read
the metadata, plan, write the units, publish). Printed (median of ``--repeat``): the
work span (first rank's start to last rank's end), the ratio ckpttool / floor, the
scaling from 1 to N (span at 1 / span at N, both sides), and beside them the wall time
of whole launches, a null launch's included (N rank interpreters that start and exit):
on a small machine the launch is most of it; RSS: the largest peak RSS of a ckpttool
rank. The input is a ``torch.save`` file of ``--size-mib`` MiB of float32 tensors, in
the page cache (warm), as in benchmarks/run.py.

    .venv/bin/python benchmarks/distributed.py --size-mib 1024 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def unit_size(nbytes: int) -> int:
    """The unit size ckpttool picks for an output of ``nbytes`` (the floor uses the same)."""
    from ckpttool.targets.units import default_unit_bytes

    return default_unit_bytes(nbytes)


def null_worker() -> None:
    """A rank that starts and exits (ranks import no torch: :func:`synced`)."""


def synced(work: str, name: str, run) -> None:
    """Under torchrun: wait for every rank (after the imports), run ``run()``, write this
    rank's start and end times and peak RSS to ``work/name-rR.t`` (the parent takes the
    span). The ranks meet through torchrun's agent store with ckpttool's own client, as
    the conversion's ranks do: no torch imported here, so the RSS is a rank's own."""
    from ckpttool.distributed.store import TCPStoreClient

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = TCPStoreClient(addr, port, timeout=300, prefix="bench")
    store.add(f"{name}-ready", 1)
    while int(store.add(f"{name}-ready", 0)) < world:
        time.sleep(0.001)
    start = time.time()
    run()
    end = time.time()
    rss = peak_rss_mib()
    store.close()
    Path(work, f"{name}-r{rank}.t").write_text(f"{start} {end} {rss}")


def peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM, the high-water mark of its own memory image.
    Not ``ru_maxrss``: Linux carries that over fork and exec, so a worker forked from
    torchrun's agent (torch imported, ~220 MiB) would report the agent's."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def ckpttool_worker(src: str, dst: str) -> None:
    """One rank of the conversion, through the Python API (the same code as the CLI)."""
    from ckpttool.convert import convert

    convert([src], "safetensors", dst)


def floor_worker(src: str, dst: str, nbytes: int) -> None:
    """One rank of the copy floor (run under torchrun: RANK, WORLD_SIZE from it)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fin = os.open(src, os.O_RDONLY)
    fout = os.open(dst, os.O_WRONLY)
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    unit = unit_size(nbytes)
    for start in range(rank * unit, nbytes, world * unit):
        end = min(start + unit, nbytes)
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


def timed(cmd: list[str], before=None, work: Path | None = None) -> tuple[float, float, float]:
    """(wall time of the launch, span of the ranks' work: first start to last end, the
    largest rank's peak RSS in MiB)."""
    if before:
        before()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    if work is None:
        return wall, 0.0, 0.0
    times = [tuple(map(float, p.read_text().split())) for p in work.glob("*.t")]
    for p in work.glob("*.t"):
        p.unlink()
    span = max(t[1] for t in times) - min(t[0] for t in times)
    return wall, span, max(t[2] for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=str(ROOT / "bench-data" / "distributed"))
    parser.add_argument("--floor-worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--ckpttool-worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--null-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.null_worker:
        null_worker()
        return
    if args.floor_worker:
        src, dst, nbytes = args.floor_worker
        synced(args.workdir, "floor", lambda: floor_worker(src, dst, int(nbytes)))
        return
    if args.ckpttool_worker:
        src, dst = args.ckpttool_worker
        synced(args.workdir, "ckpttool", lambda: ckpttool_worker(src, dst))
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

    ours_cmd = [__file__, "--workdir", str(work), "--ckpttool-worker", str(src), str(out)]
    floor_cmd = [__file__, "--workdir", str(work), "--floor-worker", str(src), str(floor_out)]
    floor_cmd.append(str(nbytes))
    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        ours, base, null = [], [], []
        for _ in range(args.repeat):  # interleaved: the machine's load drifts over all
            ours.append(timed(torchrun(n, *ours_cmd), clean, work))
            base.append(timed(torchrun(n, *floor_cmd), allocate, work))
            null.append(timed(torchrun(n, __file__, "--null-worker"))[0])
        med = statistics.median
        rows.append(
            (n, med(r[0] for r in ours), med(r[0] for r in base), med(null))
            + (med(r[1] for r in ours), med(r[1] for r in base), max(r[2] for r in ours))
        )
    clean()
    unit = unit_size(nbytes) >> 20
    print(f"input {nbytes / 2**20:.0f} MiB, units of {unit} MiB, median of {args.repeat}")
    print("launch = the whole torchrun launch; work = first rank's start to last rank's end,")
    print("after every rank has imported and joined (ckpttool: read, plan, write, publish)")
    print(
        f"{'N':>3} {'launch s':>9} {'floor':>7} {'null':>6} | {'work s':>7} {'floor':>7}"
        f" {'ratio':>7} {'scaling':>8} {'floor sc.':>9} {'RSS MiB':>8}"
    )
    s1, b1 = rows[0][4], rows[0][5]
    for n, t, f, z, s_ours, s_base, rss in rows:
        print(
            f"{n:>3} {t:>9.2f} {f:>7.2f} {z:>6.2f} | {s_ours:>7.2f} {s_base:>7.2f}"
            f" {s_ours / s_base:>6.2f}x {s1 / s_ours:>7.2f}x {b1 / s_base:>8.2f}x {rss:>8.0f}"
        )


if __name__ == "__main__":
    main()
