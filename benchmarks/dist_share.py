"""Per-rank files read by several processes: each reads its share (issue 31).

A checkpoint saved per rank with DTensor leaves names only its own rank's mesh
coordinate, so every rank file is read (its metadata) to place the blocks. Under
``torchrun -m ckpttool convert`` each process reads only its share of the files and
the places are gathered (``formats/per_rank.RankFiles.read_shares``); before, every
process read all of them.

For each N, ``torchrun --standalone --nproc-per-node=N`` runs the Python API's
``convert`` of the 256 rank files of ``metadata_scale.py``'s ``dtensor-256`` (70B-shaped,
8 layers) with ``--select`` of one small tensor, so that planning (the reading of the
rank files) is the work, not writing. Printed per N: the work span (first rank's start
to last rank's end), the largest per-rank CPU time and peak RSS, the CPU summed over
the ranks, and the ratios to N = 1 (the CPU summed stays about that of one process
where the reading is dealt; it grows N-fold where every rank reads every file).

    .venv/bin/python benchmarks/metadata_scale.py --cases dtensor-256   # makes the input
    .venv/bin/python benchmarks/dist_share.py --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from distributed import ROOT, peak_rss_mib, timed, torchrun  # noqa: E402

SELECT = "model.model.norm.weight"


def worker(src: str, dst: str, work: str) -> None:
    """One rank: wait for every rank, convert, write start, end, CPU and peak RSS."""
    from ckpttool.convert import convert
    from ckpttool.distributed.store import TCPStoreClient

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStoreClient(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=300, prefix="bench"
    )
    store.add("ready", 1)
    while int(store.add("ready", 0)) < world:
        time.sleep(0.001)
    start, cpu = time.time(), time.process_time()
    convert([src], "safetensors", dst, select=SELECT, force=True)
    cpu, end = time.process_time() - cpu, time.time()
    store.close()
    Path(work, f"r{rank}.t").write_text(f"{start} {end} {cpu} {peak_rss_mib()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", default=str(ROOT / "bench-data" / "scale-dtensor-256"))
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    src = str(Path(args.input) / "ep0-rank0.pt")
    work = ROOT / "bench-data" / "dist-share"
    rows = []
    for n in map(int, args.ranks.split(",")):
        runs = []
        for _ in range(args.repeat):
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            dst = str(work / "out.safetensors")
            timed(torchrun(n, __file__, "--worker", src, dst, str(work)))
            times = [list(map(float, p.read_text().split())) for p in work.glob("r*.t")]
            span = max(t[1] for t in times) - min(t[0] for t in times)
            cpus = [t[2] for t in times]
            runs.append((span, max(cpus), sum(cpus), max(t[3] for t in times)))
        rows.append((n, *(statistics.median(r[i] for r in runs) for i in range(4))))
    shutil.rmtree(work, ignore_errors=True)
    base = rows[0]
    print(f"`{args.input}`: convert --select {SELECT}, median of {args.repeat}\n")
    print("| N | span s | ratio to N=1 | CPU s, busiest rank | CPU s, all ranks | ratio to N=1 "
          "| peak RSS MiB, largest rank |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n, span, busiest, total, rss in rows:
        print(
            f"| {n} | {span:.2f} | {span / base[1]:.2f}x | {busiest:.2f} | {total:.2f} "
            f"| {total / base[3]:.2f}x | {rss:.0f} |"
        )


if __name__ == "__main__":
    main()
