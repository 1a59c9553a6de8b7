"""What every rank of a distributed ``convert`` computes before it writes a byte, at scale.

Under torchrun every rank of ``convert DIR --to safetensors ...`` reads the input's
metadata and plans the output itself (``ckpttool/convert.py``, then
``distributed/runner.py``: ``write_distributed``). This script runs those same calls,
in one fresh process (one rank), phase by phase, on a DCP folder of
``make_dcp_scale.py`` (sparse data files; or one of its ``--per-rank`` rank files,
which reads them all), and times each phase (wall and CPU) with the process's peak
RSS after it:

1. ``read``: ``ckpttool.read(DIR)`` (the ``.metadata`` and every check);
2. ``select``: ``select_node`` + ``flatten_tensors`` (``--select``, default ``auto``:
   the model's weights);
3. ``plan``: the writer's plan (``writer_for(TO).plan``: every file of the output,
   every piece at its offset);
4. ``units``: ``plan_units`` (the 64 MiB byte ranges the ranks claim);
5. ``key``: the work's key (``plan_digest`` of every piece, the inputs' identities:
   a ``stat`` of every data file), as rank 0 posts it and every rank checks it;

and a **sample** of the units, as a rank writes them (``units.write_unit``:
the same reads of the same input ranges), into a sink that hashes the bytes
(sha256) instead of writing them: no byte reaches a disk. The sample is ``--sample``
units spread evenly over the output (every ``len(units) / K``-th). The data files
are sparse: reading them gives zeros at page-cache speed, so the sample measures the
per-unit cost (ranges, reads, the sink's hashing), not a disk. The sample is measured
before the key (the longest phase at thousands of ranks: a run stopped during it keeps
the rest; ``--json`` is written after every phase); nothing either caches for the other.

    .venv/bin/python benchmarks/make_dcp_scale.py --shape 405b --ranks 2048 --out DIR
    .venv/bin/python benchmarks/dist_plan.py DIR --max-shard-size 5GB --sample 16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time
import zlib

PHASES = ("read", "select", "plan", "units", "key")
# measured in this order: the work's key last (at thousands of input ranks it is the
# longest phase; nothing the others do is cached for it, nor by it for them)
ORDER = ("read", "select", "plan", "units", "write", "key")


class HashSink:
    """What ``write_unit`` uses of an ``OutputFile``, hashing the bytes instead of writing
    them: ``write``, ``copy_from`` (``preadv`` from the input into one reused buffer),
    ``begin_crc32``/``end_crc32`` and ``inputs`` (the open input files)."""

    BUFFER = 16 << 20

    def __init__(self) -> None:
        from ckpttool.sources import OpenFiles

        self.inputs = OpenFiles()
        self.hash = hashlib.sha256()
        self.nbytes = 0
        self.reads = 0
        self._buf = memoryview(bytearray(self.BUFFER))
        self._crc: int | None = None

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.nbytes += len(view)
        if self._crc is not None:
            self._crc = zlib.crc32(view, self._crc)

    def copy_from(self, path: str, offset: int, nbytes: int, progress=None) -> None:
        from ckpttool.sources import local_fd

        fd = local_fd(path, self.inputs)
        if fd is None:
            raise SystemExit(f"not a local file: {path}")
        done = 0
        while done < nbytes:
            want = min(len(self._buf), nbytes - done)
            n = os.preadv(fd, [self._buf[:want]], offset + done)
            if n <= 0:
                raise SystemExit(f"{path} ends early")
            self.reads += 1
            self.write(self._buf[:n])
            done += n

    def begin_crc32(self) -> None:
        self._crc = 0

    def end_crc32(self) -> int:
        crc, self._crc = self._crc or 0, None
        return crc


def rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB."""
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a DCP folder or a rank file (make_dcp_scale.py)")
    parser.add_argument("--to", default="safetensors")
    parser.add_argument("--select", default="auto")
    parser.add_argument("--max-shard-size", default="5GB", help="'' for one file")
    parser.add_argument(
        "--sample", type=int, default=16, help="units written into the sink (0: none)"
    )
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--profile", help="cProfile the phases into this file")
    parser.add_argument("--no-key", action="store_true", help="skip the key (to profile the rest)")
    args = parser.parse_args()

    wall0, cpu0 = time.perf_counter(), time.process_time()
    figures: dict[str, dict] = {}
    import ckpttool  # noqa: F401  (what the CLI imports before it runs)
    from ckpttool.api import flatten_tensors, read, select_node
    from ckpttool.sizes import parse_size
    from ckpttool.targets import units as unit_mod
    from ckpttool.targets.journal import input_identities, work_key
    from ckpttool.writers import writer_for
    from ckpttool.writers.plan import WriteOptions

    figures["import"] = {
        "wall": time.perf_counter() - wall0,
        "cpu": time.process_time() - cpu0,
        "rss": rss_mib(),
    }
    state: dict = {}
    out = os.path.join(os.path.dirname(os.path.abspath(args.folder)), "never-written")

    def phase_read() -> str:
        state["ckpt"] = read(args.folder)
        ck = state["ckpt"]
        return f"{len(ck.files)} files, world size {ck.world_size}"

    def phase_select() -> str:
        path, node = select_node(state["ckpt"], args.select, "auto")
        state["tensors"] = flatten_tensors(node, str(path[-1]) if path else "")
        return f"{len(state['tensors'])} tensors"

    def phase_plan() -> str:
        shard = parse_size(args.max_shard_size) if args.max_shard_size else None
        options = WriteOptions(location="cpu", max_shard_size=shard, metadata={"source": "x"})
        state["plan"] = writer_for(args.to).plan(state["tensors"], options)
        plan = state["plan"]
        pieces = sum(len(f.pieces) for f in plan.files)
        return f"{len(plan.files)} files, {pieces} pieces, {plan.total_bytes / 1e9:.1f} GB"

    def phase_units() -> str:
        state["size"] = unit_mod.unit_bytes(state["plan"])
        state["units"] = unit_mod.plan_units(state["plan"], state["size"])
        return f"{len(state['units'])} units of {state['size'] >> 20} MiB"

    def phase_key() -> str:
        digest = unit_mod.plan_digest(state["plan"], state["size"])
        inputs = [args.folder, *state["ckpt"].files]
        state["key"] = work_key(digest, out, input_identities(inputs))
        return f"key {state['key'][:12]}, {len(inputs)} inputs' identities"

    def phase_write() -> str:
        units = state["units"]
        k = max(1, min(args.sample, len(units)))
        sample = [units[i * len(units) // k] for i in range(k)]
        sink = HashSink()
        for unit in sample:
            unit_mod.write_unit(state["plan"], unit, sink)
        expect = sum(u.nbytes for u in sample)
        if sink.nbytes != expect:
            raise SystemExit(f"the sink got {sink.nbytes} bytes, the units hold {expect}")
        state["sink"], state["sample"] = sink, k
        return ""

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    notes: dict[str, str] = {}
    runs = {
        "read": phase_read,
        "select": phase_select,
        "plan": phase_plan,
        "units": phase_units,
        "write": phase_write,
        "key": phase_key,
    }
    skipped = {"key"} if args.no_key else set()
    if args.sample <= 0:  # e.g. a folder made without --chunk-zips: its chunks hold nothing
        skipped.add("write")
    order = [n for n in ORDER if n not in skipped]
    for name in order:
        w, c = time.perf_counter(), time.process_time()
        if profiler:
            profiler.enable()
        notes[name] = runs[name]()
        if profiler:
            profiler.disable()
        figures[name] = {
            "wall": time.perf_counter() - w,
            "cpu": time.process_time() - c,
            "rss": rss_mib(),
        }
        if name == "write":
            sink, k = state["sink"], state["sample"]
            wr = figures[name]
            wr.update(bytes=sink.nbytes, reads=sink.reads, units=k)
            notes[name] = (
                f"{k} of {len(state['units'])} units, {sink.nbytes / 2**30:.2f} GiB in "
                f"{sink.reads} reads, {sink.nbytes / 2**30 / wr['wall']:.2f} GiB/s "
                f"({sink.nbytes / 2**30 / max(wr['cpu'], 1e-9):.2f} GiB per CPU s)"
            )
        print(f"{name}: {figures[name]} {notes[name]}", file=sys.stderr, flush=True)
        if args.json:  # after every phase: a run stopped early keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"figures": figures, "notes": notes}, f, indent=1)
    if profiler:
        profiler.dump_stats(args.profile)
    plan = state["plan"]
    total_bytes = plan.total_bytes
    print()
    print(
        f"`{args.folder}` -> `--to {args.to}`"
        + (f" `--max-shard-size {args.max_shard_size}`" if args.max_shard_size else "")
        + f", `--select {args.select}`: "
        f"{total_bytes / 1e9:.1f} GB of output"
    )
    print()
    print("| phase | wall s | CPU s | RSS after, MiB | peak RSS so far, MiB | what |")
    print("|---|---|---|---|---|---|")
    for name in ("import", *order):
        f = figures[name]
        print(
            f"| {name} | {f['wall']:.2f} | {f['cpu']:.2f} | {f['rss'][0]:.0f} | {f['rss'][1]:.0f} "
            f"| {notes.get(name, '')} |"
        )
    if "key" in figures:
        plan_wall = sum(figures[n]["wall"] for n in PHASES)
        plan_cpu = sum(figures[n]["cpu"] for n in PHASES)
        print(
            f"| **before the first unit** | {plan_wall:.2f} | {plan_cpu:.2f} | | "
            f"{figures['key']['rss'][1]:.0f} | read + select + plan + units + key |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"figures": figures, "notes": notes}, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # not the minutes of freeing millions of objects one by one


if __name__ == "__main__":
    main()
