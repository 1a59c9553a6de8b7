"""Benchmark ``-o s3://`` (issue 33): convert from S3 to S3 against fsspec get + local
convert + fsspec put, time and peak RSS, on moto's S3 server over loopback.

    python benchmarks/s3_output.py --size-mib 512
    python benchmarks/s3_output.py --size-mib 2048 --markdown

The input is a ``torch.save`` file of 64 float32 tensors, uploaded to the server once.
Cases (each a fresh process, median of ``--repeat`` runs after ``--warmup``):

- ckpttool: ``convert s3://bench/in.pt --to FMT -o s3://bench/out/... --force``: the
  input read by ranges, the output uploaded in parts as it is written (no local file);
- baseline: ``fsspec get`` the input to a local file, ``ckpttool convert`` it to a local
  output, ``fsspec put`` that (s3fs's own multipart upload), local files removed.

moto keeps objects in this process's memory (input and outputs); its ranged GETs are
made to cost their range (``remote.serve_ranges_in_place``). Loopback has no network
latency or bandwidth limit: the figures compare the work each way does, not a WAN.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "support"))
sys.path.insert(0, str(HERE))

from measure import child_env, measure, rss_source  # noqa: E402
from remote import human, serve_ranges_in_place  # noqa: E402
from servers import S3Server  # noqa: E402

MiB = 1 << 20
SUFFIX = {"safetensors": ".safetensors", "pt": ".pt"}

BASELINE = """
import os, subprocess, sys, tempfile
import fsspec
src, to, dst, exe = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
fs = fsspec.filesystem("s3")
with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
    local_in = os.path.join(tmp, "in.pt")
    local_out = os.path.join(tmp, "out" + os.path.splitext(dst)[1])
    fs.get(src, local_in)
    subprocess.run([*exe, "convert", local_in, "--select", "all", "--to", to, "-o", local_out,
                    "--quiet"], check=True)
    fs.put(local_out, dst)
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=512, help="the input's size")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--to", nargs="+", default=["safetensors", "pt"])
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-data")
    parser.add_argument("--markdown", action="store_true")
    return parser.parse_args(argv)


def make_input(path: Path, size: int) -> None:
    import torch

    n = 64
    numel = size // n // 4
    tensors = {f"layer{i}.weight": torch.arange(numel, dtype=torch.float32) + i for i in range(n)}
    torch.save(tensors, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    source = args.workdir / f"s3-output-{args.size_mib}m.pt"
    if not source.exists():
        make_input(source, args.size_mib * MiB)
    serve_ranges_in_place()
    s3 = S3Server()
    rows = []
    try:
        env = child_env(args.workdir / "pycache")
        env.update(s3.env)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env["BENCH_TMP"] = str(args.workdir)
        ckpttool = str(Path(sys.executable).with_name("ckpttool"))
        exe = [ckpttool] if Path(ckpttool).exists() else [sys.executable, "-m", "ckpttool"]
        src = s3.upload(source, "bench", "in.pt")
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
            script.write(BASELINE)
        for to in args.to:
            out = f"s3://bench/out/ckpttool{SUFFIX[to]}"
            mine = measure(
                [*exe, "convert", src, "--select", "all", "--to", to, "-o", out, "--force"],
                warmup=args.warmup,
                repeat=args.repeat,
                env=env,
            )
            dst = f"s3://bench/out/baseline{SUFFIX[to]}"
            base = measure(
                [sys.executable, script.name, src, to, dst, *exe],
                warmup=args.warmup,
                repeat=args.repeat,
                env=env,
            )
            client = s3.client()
            a = client.head_object(Bucket="bench", Key=f"out/ckpttool{SUFFIX[to]}")
            b = client.head_object(Bucket="bench", Key=f"out/baseline{SUFFIX[to]}")
            same = a["ContentLength"] == b["ContentLength"]
            rows.append(
                {
                    "case": f"{human(source.stat().st_size)} torch-zip S3 -> {to} S3",
                    "ckpttool": f"{mine.wall:.2f} s, {mine.rss_mib:.0f} MiB",
                    "baseline": f"{base.wall:.2f} s, {base.rss_mib:.0f} MiB",
                    "time ratio": f"{mine.wall / base.wall:.2f}",
                    "RSS ratio": f"{mine.rss_mib / base.rss_mib:.2f}",
                    "same size": "yes" if same else "NO",
                }
            )
        os.unlink(script.name)
    finally:
        s3.close()
    columns = list(rows[0]) if rows else []
    if args.markdown:
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        for row in rows:
            print("| " + " | ".join(row[c] for c in columns) + " |")
    else:
        for row in rows:
            print("  ".join(f"{c}: {row[c]}" for c in columns))
    print(
        f"\nmedian of {args.repeat} (after {args.warmup} warm-up), peak RSS from {rss_source()}; "
        "baseline RSS is the largest of its processes (get/put, convert)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
