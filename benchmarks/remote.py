"""Benchmark ckpttool on remote inputs (issue 22), baselines in the same run.

    python benchmarks/remote.py --scale 0.125          # 512 MiB snapshot, 4 x 256 MiB ranks
    python benchmarks/remote.py --scale 1 --markdown   # the issue's sizes (4 GB file)

Servers run in this process, on 127.0.0.1 only (tests/support/servers.py): a Range-capable
HTTP file server and moto's S3 server. Cases and targets:

- ``inspect`` of the ~4 GB torch-zip snapshot over HTTP: at most 1 MiB and 5 requests
  (what ``inspect --json`` reports in ``transfer``, checked against the server's log);
- ``inspect`` of a 4-rank per-rank checkpoint over HTTP (the rank files as URLs): at
  most 1 MiB per rank;
- ``convert --select all --to safetensors`` of the snapshot from S3 to a local file:
  wall at most 1.5x fsspec's ``get`` of the same object alone, peak RSS at most 512 MiB.

moto keeps objects in memory: at scale 1 this process holds the 4 GB object (twice:
see ``serve_ranges_in_place``, which makes a ranged GET cost its range, as on S3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

import data  # noqa: E402
from measure import Measurement, child_env, measure, rss_source  # noqa: E402
from servers import RangeServer, S3Server  # noqa: E402

MiB = 1 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-data")
    parser.add_argument("--scale", type=float, default=1.0, help="1.0: a 4 GB snapshot")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", type=Path, help="write the raw samples here")
    return parser.parse_args(argv)


def serve_ranges_in_place() -> None:
    """Make moto's ranged GETs cost their range, as on S3.

    moto answers every GetObject by reading the whole object out of its spooled temporary
    file (a copy of 0.5-4 GB per request) and only then slicing the range: a benchmark of
    range reads would measure that. The object's bytes are kept once instead (dropped
    when the object is written); what a request sends is unchanged.
    """
    from moto.s3.models import FakeKey

    plain = FakeKey.value

    def get(self):
        cached = self.__dict__.get("_bench_value")
        if cached is None:
            cached = self.__dict__["_bench_value"] = plain.fget(self)
        return cached

    def put(self, new_value):
        self.__dict__.pop("_bench_value", None)
        plain.fset(self, new_value)

    FakeKey.value = property(get, put)


def transfer_of(stdout: bytes) -> dict:
    return json.loads(stdout)["transfer"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = args.workdir / f"scale-{args.scale:g}"
    folder.mkdir(parents=True, exist_ok=True)
    inputs = data.plan(folder, args.scale)
    snap, ranks = inputs["snap-4g"], inputs["rank4"]
    for inp in (snap, ranks):
        data.ensure(folder, inp, log=lambda m: print(m, file=sys.stderr, flush=True))
    env = child_env(args.workdir / "pycache")
    ckpttool = str(Path(sys.executable).with_name("ckpttool"))
    exe = [ckpttool] if Path(ckpttool).exists() else [sys.executable, "-m", "ckpttool"]
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    rows: list[dict] = []
    samples: dict[str, dict] = {}

    def run(name: str, cmd: list[str], **kw) -> Measurement:
        m = measure(cmd, warmup=args.warmup, repeat=args.repeat, env=env, **kw)
        samples[name] = m.as_dict()
        return m

    # -- inspect over HTTP -----------------------------------------------------------
    http = RangeServer(folder)
    try:
        pt = snap.paths["pt"]
        url = http.url(str(pt.relative_to(folder)))
        seen: dict[str, dict] = {}

        def keep(name: str):
            def check(stdout: bytes) -> str | None:
                seen[name] = transfer_of(stdout)
                return None

            return check

        http.reset()
        m = run("inspect-http", [*exe, "inspect", "--json", url], check_stdout=keep("zip"))
        runs = args.warmup + args.repeat
        server_requests = len(http.requests) / runs
        t = seen["zip"]
        rows.append(
            {
                "case": f"inspect {human(pt.stat().st_size)} torch-zip over HTTP",
                "ckpttool": f"{m.wall:.2f} s, {human(t['bytes'])}, {t['requests']} requests",
                "baseline": f"server saw {server_requests:g} requests/run",
                "target": "<= 1 MiB, <= 5 requests",
                "ok": t["bytes"] <= MiB and t["requests"] <= 5 and server_requests <= 5,
            }
        )
        files = sorted(ranks.paths["dir"].glob("*.pt"))
        urls = [http.url(str(f.relative_to(folder))) for f in files]
        m = run("inspect-http-rank4", [*exe, "inspect", "--json", *urls], check_stdout=keep("rk"))
        t = seen["rk"]
        per_rank = t["bytes"] / max(1, len(files))
        rows.append(
            {
                "case": f"inspect {len(files)}-rank per-rank "
                f"({human(sum(f.stat().st_size for f in files))}) over HTTP",
                "ckpttool": f"{m.wall:.2f} s, {human(per_rank)}/rank, {t['requests']} requests",
                "baseline": "",
                "target": "<= 1 MiB per rank",
                "ok": per_rank <= MiB,
            }
        )
    finally:
        http.close()

    # -- convert from S3 ----------------------------------------------------------------
    serve_ranges_in_place()
    s3 = S3Server()
    try:
        env.update(s3.env)
        src = s3.upload(snap.paths["pt"], "bench", "snapshot.pt")
        out = args.workdir / "remote-out.safetensors"
        got = args.workdir / "remote-get.pt"
        get = "import fsspec, sys; fsspec.filesystem('s3').get(sys.argv[1], sys.argv[2])"
        base = run("s3-get", [sys.executable, "-c", get, src, str(got)], outputs=[got])
        m = run(
            "convert-s3",
            [*exe, "convert", src, "--select", "all", "--to", "safetensors", "-o", str(out)],
            outputs=[out],
        )
        ratio = m.wall / base.wall
        rows.append(
            {
                "case": f"convert {human(snap.paths['pt'].stat().st_size)} from S3 to safetensors",
                "ckpttool": f"{m.wall:.2f} s, {m.rss_mib:.0f} MiB RSS",
                "baseline": f"fsspec get {base.wall:.2f} s, {base.rss_mib:.0f} MiB RSS",
                "target": "<= 1.5x, <= 512 MiB",
                "ok": ratio <= 1.5 and m.rss_mib <= 512,
                "ratio": ratio,
            }
        )
    finally:
        s3.close()

    print_table(rows, args)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "samples": samples}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    columns = ("case", "ckpttool", "baseline", "ratio", "target", "ok")
    cells = [
        [
            str(r["case"]),
            str(r["ckpttool"]),
            str(r["baseline"]),
            f"{r['ratio']:.2f}" if "ratio" in r else "",
            str(r["target"]),
            "yes" if r["ok"] else "NO",
        ]
        for r in rows
    ]
    if args.markdown:
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        for row in cells:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
        for row in cells:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print(
        f"\nscale {args.scale:g}, median of {args.repeat} (after {args.warmup} warm-up), "
        f"RSS from {rss_source()}, {time.strftime('%Y-%m-%d')}"
    )


if __name__ == "__main__":
    sys.exit(main())
