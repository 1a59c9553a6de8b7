"""Balance of a distributed convert when the byte source is slow and one rank slower still.

N ranks (default 4) run the real command under ``torchrun --standalone``:
``python -m ckpttool convert IN.pt --to safetensors -o OUT`` (the CLI, unchanged:
``distributed/runner.py`` claims the units one at a time from the store's atomic
counter). What this script adds to each rank, before the CLI runs, is in this file
and nowhere in the package:

- **a throttled byte source**: every read of input bytes a unit makes
  (``OutputFile.copy_from``, the one call that reads a tensor's stored bytes into the
  staging buffers) goes through a bandwidth model, 1 MiB at a time: a **shared cap**
  over all ranks (``--cap-mib`` MiB/s: a token bucket kept in a file under an
  ``flock``, so the N processes share it) and a **per-rank link** (``--rank-mib``
  MiB/s), which is ``--slowdown`` times slower (default 5x) for rank ``--slow-rank``
  (default the last). A read finishes when both its slot in the shared bucket and
  its rank's own link would have carried it;
- **a recorder**: each unit's id, size, start (``units.write_unit`` called) and end
  (its journal line written, after its fsync), written to ``WORKDIR`` at exit.

Per rank it prints the units and bytes it took and its **busy time**: from the moment
the first unit was claimed (by any rank) to the end of its own last unit. Balance is
the busiest rank's busy time over the mean (target: at most 1.1x): the slow rank
should take fewer units and finish its last one about when the others do.

For contrast, the same throttle with a **static split**: the same bytes in the same
units, rank r taking units r, r + N, ... (by index, as ``i % world_size`` splits in
torch's ``consolidate_safetensors_files_on_every_rank``), each copied
``pread`` -> ``pwrite`` + ``fsync``: what balance is without claiming.

The output's sha256 is checked against one process's output of the same command.

    .venv/bin/python benchmarks/dist_balance.py                    # 1 GiB, the default units
    .venv/bin/python benchmarks/dist_balance.py --unit-mib 64      # units of 64 MiB
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = 1 << 20  # the throttle's grain: 1 MiB


class Throttle:
    """A shared bandwidth cap (a token bucket in ``state``, under ``flock``: the time
    the shared pipe is busy until) and this rank's own link speed."""

    def __init__(self, state: str, cap: float, rate: float):
        self.fd = os.open(state, os.O_RDWR)
        self.cap, self.rate = cap, rate  # bytes per second
        self.own_next = 0.0

    def take(self, nbytes: int) -> None:
        now = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process here
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            (busy_until,) = struct.unpack("d", os.pread(self.fd, 8, 0))
            shared_end = max(now, busy_until) + nbytes / self.cap
            os.pwrite(self.fd, struct.pack("d", shared_end), 0)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.own_next = max(now, self.own_next) + nbytes / self.rate
        delay = max(shared_end, self.own_next) - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def rank_rate(args: argparse.Namespace, rank: int) -> float:
    slow = args.slow_rank if args.slow_rank >= 0 else args.ranks - 1
    rate = args.rank_mib * 2**20
    return rate / args.slowdown if rank == slow else rate


def reset_throttle(path: Path) -> None:
    path.write_bytes(struct.pack("d", 0.0))


def dump(work: str, mode: str, rank: int, records: list) -> None:
    Path(work, f"{mode}-r{rank}.json").write_text(json.dumps(records))


def claimed_worker(args: argparse.Namespace) -> None:
    """One rank of ``python -m ckpttool convert ...``, its reads throttled, its units
    recorded (see the module's doc); then the CLI, as ``-m ckpttool`` runs it."""
    import runpy

    from ckpttool.targets import journal as journal_mod
    from ckpttool.targets import units as unit_mod
    from ckpttool.writers.output_file import OutputFile

    rank = int(os.environ["RANK"])
    throttle = Throttle(str(Path(args.workdir, "throttle")), args.cap_mib * 2**20, 0.0)
    throttle.rate = rank_rate(args, rank)
    copy_from = OutputFile.copy_from

    def throttled(self, path, offset, nbytes, progress):
        for at in range(0, nbytes, STEP):
            n = min(STEP, nbytes - at)
            throttle.take(n)
            copy_from(self, path, offset + at, n, progress)

    OutputFile.copy_from = throttled  # type: ignore[method-assign]
    records: dict[int, list] = {}
    write_unit = unit_mod.write_unit

    def recorded_write(plan, unit, out, progress=None):
        records[unit.id] = [unit.id, unit.nbytes, time.monotonic(), None]
        return write_unit(plan, unit, out, progress)

    unit_mod.write_unit = recorded_write  # runner.py calls units.write_unit by the module
    record = journal_mod.UnitLog.record

    def recorded_journal(self, unit, runs):
        record(self, unit, runs)
        records[unit][3] = time.monotonic()  # durable: data fsynced, journal line fsynced

    journal_mod.UnitLog.record = recorded_journal  # type: ignore[method-assign]
    sys.argv = ["ckpttool", "convert", args.src, "--to", "safetensors", "-o", args.dst]
    try:
        runpy.run_module("ckpttool", run_name="__main__", alter_sys=True)
    finally:
        dump(args.workdir, "claimed", rank, list(records.values()))


def static_worker(args: argparse.Namespace) -> None:
    """One rank of the static split: units r, r + N, ... of the input's bytes, copied
    ``pread`` -> ``pwrite`` + ``fsync`` through the same throttle."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = next(dist.rendezvous("env://", rank, world))[0]
    store.add("ready", 1)
    while int(store.add("ready", 0)) < world:
        time.sleep(0.001)
    throttle = Throttle(str(Path(args.workdir, "throttle")), args.cap_mib * 2**20, 0.0)
    throttle.rate = rank_rate(args, rank)
    nbytes = os.path.getsize(args.src)
    unit = unit_size(args, nbytes)
    fin, fout = os.open(args.src, os.O_RDONLY), os.open(args.dst, os.O_WRONLY)
    buf = memoryview(bytearray(STEP))
    records = []
    for k, start in enumerate(range(0, nbytes, unit)):
        if k % world != rank:
            continue
        end = min(start + unit, nbytes)
        t0 = time.monotonic()
        for at in range(start, end, STEP):
            throttle.take(min(STEP, end - at))
            n = os.preadv(fin, [buf[: min(STEP, end - at)]], at)
            os.pwrite(fout, buf[:n], at)
        os.fsync(fout)
        records.append([k, end - start, t0, time.monotonic()])
    os.close(fin)
    os.close(fout)
    dump(args.workdir, "static", rank, records)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def launch(args: argparse.Namespace, mode: str, src: Path, dst: Path) -> float:
    """One torchrun launch of ``mode``'s workers; its wall time."""
    work = Path(args.workdir)
    for p in work.glob(f"{mode}-r*.json"):
        p.unlink()
    reset_throttle(work / "throttle")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={args.ranks}", "--monitor-interval=0.1", __file__]
    cmd += [f"--{mode}-worker", str(src), str(dst), *forwarded(args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if args.unit_mib:
        env["CKPTTOOL_UNIT_BYTES"] = str(args.unit_mib << 20)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def unit_size(args: argparse.Namespace, nbytes: int) -> int:
    """The units' size: ``--unit-mib``, or the size ckpttool picks for ``nbytes``."""
    from ckpttool.targets.units import default_unit_bytes

    return args.unit_mib << 20 if args.unit_mib else default_unit_bytes(nbytes)


def forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--workdir", args.workdir, "--ranks", str(args.ranks), "--unit-mib", str(args.unit_mib)]
    out += ["--cap-mib", str(args.cap_mib), "--rank-mib", str(args.rank_mib)]
    out += ["--slowdown", str(args.slowdown), "--slow-rank", str(args.slow_rank)]
    return out


def report(args: argparse.Namespace, mode: str, title: str) -> dict:
    """Per-rank table of one run; returns its summary."""
    ranks = []
    for r in range(args.ranks):
        path = Path(args.workdir, f"{mode}-r{r}.json")
        ranks.append(json.loads(path.read_text()) if path.exists() else [])
    starts = [u[2] for rec in ranks for u in rec]
    t0 = min(starts)
    slow = args.slow_rank if args.slow_rank >= 0 else args.ranks - 1
    rows = []
    for r, rec in enumerate(ranks):
        busy = max((u[3] for u in rec), default=t0) - t0
        in_units = sum(u[3] - u[2] for u in rec)
        rows.append((r, len(rec), sum(u[1] for u in rec), busy, in_units))
    mean = sum(row[3] for row in rows) / len(rows)
    busiest = max(row[3] for row in rows)
    print(f"\n{title}\n")
    print("| rank | link MiB/s | units | MiB | busy s | in its units s | busy / mean |")
    print("|---|---|---|---|---|---|---|")
    for r, n, nbytes, busy, in_units in rows:
        link = rank_rate(args, r) / 2**20
        mark = " (slow)" if r == slow else ""
        print(
            f"| {r}{mark} | {link:.0f} | {n} | {nbytes / 2**20:.0f} | {busy:.2f} "
            f"| {in_units:.2f} | {busy / mean:.2f} |"
        )
    others = [row[1] for row in rows if row[0] != slow]
    summary = {
        "busiest_over_mean": busiest / mean,
        "span": busiest,
        "slow_units": rows[slow][1],
        "other_units_mean": sum(others) / max(1, len(others)),
        "units": sum(row[1] for row in rows),
    }
    print(
        f"\nbusiest / mean busy time: **{busiest / mean:.2f}x** (target <= 1.1x); "
        f"span {busiest:.2f} s; slow rank {summary['slow_units']} units, "
        f"the others {summary['other_units_mean']:.1f} on average"
    )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="input size")
    parser.add_argument(
        "--unit-mib", type=int, default=0, help="CKPTTOOL_UNIT_BYTES in MiB (0: the default)"
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--cap-mib", type=float, default=200.0, help="shared cap, MiB/s")
    parser.add_argument("--rank-mib", type=float, default=100.0, help="each rank's link, MiB/s")
    parser.add_argument("--slowdown", type=float, default=5.0, help="the slow rank's factor")
    parser.add_argument("--slow-rank", type=int, default=-1, help="which (default: the last)")
    parser.add_argument("--workdir", default=str(ROOT / "bench-data" / "balance"))
    parser.add_argument("--no-static", action="store_true", help="skip the static split")
    parser.add_argument("--claimed-worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--static-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for mode in ("claimed", "static"):
        pair = getattr(args, f"{mode}_worker")
        if pair:
            args.src, args.dst = pair
            (claimed_worker if mode == "claimed" else static_worker)(args)
            return
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"in-{args.size_mib}.pt"
    if not src.exists():
        sys.path.insert(0, str(Path(__file__).parent))
        from distributed import make_input

        make_input(src, args.size_mib << 20)
    subprocess.run(["cat", str(src)], stdout=subprocess.DEVNULL, check=True)  # warm
    ref, out, copy = work / "one.safetensors", work / "out.safetensors", work / "static.bin"
    for p in (ref, out, copy):
        if p.exists():
            p.unlink()
    for p in work.glob(".*ckpttool*"):
        shutil.rmtree(p, ignore_errors=True)
    ckpttool = str(Path(sys.executable).with_name("ckpttool"))
    subprocess.run(
        [ckpttool, "convert", str(src), "--to", "safetensors", "-o", str(ref)], check=True
    )
    wall = launch(args, "claimed", src, out)
    same = sha256(out) == sha256(ref)
    cap, rate = args.cap_mib, args.rank_mib
    size = src.stat().st_size
    print(
        f"input {size / 2**20:.0f} MiB, units of {unit_size(args, size) >> 20} MiB, "
        f"{args.ranks} ranks; throttle: shared cap {cap:.0f} MiB/s, each rank's link "
        f"{rate:.0f} MiB/s, the slow rank's {rate / args.slowdown:.0f} MiB/s"
    )
    claimed = report(args, "claimed", "**Units claimed from the store's counter (ckpttool)**")
    print(f"whole launch {wall:.1f} s; sha256 equal to one process's output: **{same}**")
    if not args.no_static:
        with open(copy, "wb") as f:
            f.truncate(src.stat().st_size)
        launch(args, "static", src, copy)
        report(args, "static", "**Static split, units r, r + N, ... (no claiming), same throttle**")
        copy.unlink()
    out.unlink()
    ref.unlink()
    ok = same and claimed["busiest_over_mean"] <= 1.1
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
