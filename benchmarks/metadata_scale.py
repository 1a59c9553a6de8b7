"""Metadata at scale: ckpttool reading a 70B-shaped checkpoint's plan against torch's own.

Builds (once, under ``WORKDIR``) the inputs of ``make_dcp_scale.py`` on sparse files,
then times, each side in a fresh process:

* ``dcp-256``, ``dcp-2048``: ``ckpttool inspect DIR`` and ``ckpttool.read(DIR)`` (what
  every command plans from) against ``FileSystemReader(DIR).read_metadata()``;
  ``dcp-256-fresh``, ``dcp-2048-fresh`` the same with each storage entry's key string
  its own, as torch's saves pickle them (``make_dcp_scale.py --fresh-keys``);
* ``dcp-256-no-hints``, ``-tensor-order``, ``-shuffled``, ``-torch-2.3``: the same
  ``.metadata`` as other writers lay it out (``make_dcp_scale.py --variant``);
* ``dtensor-256``, ``dtensor-256-full``, ``sharded-256``, ``sharded-64-full``: ``ckpttool
  inspect`` of the rank files against ``torch.load(f, weights_only=True, mmap=True)`` of
  each of them (ShardedTensor: ``weights_only=False``, under a fake process group);
* ``sharded-256-full-one``: one ShardedTensor rank file of 256, the whole 70B shape (its
  metadata names 555 K shards), read by ckpttool's zip reader against ``torch.load``.

Wall time, CPU time (user + system, from ``os.wait4``: on a machine shared with other
jobs the fairer figure) and peak RSS (``ru_maxrss`` of the child; this process imports
nothing heavy, so nothing of its own is carried into the children's figure), and the
ratios ckpttool / torch. Targets (issue 31): time at most 0.5x, memory at most 1x.

    .venv/bin/python benchmarks/metadata_scale.py                  # dcp-256
    .venv/bin/python benchmarks/metadata_scale.py --cases dcp-256,dcp-2048,dtensor-256
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
CKPTTOOL = str(Path(PYTHON).with_name("ckpttool"))

TORCH_DCP = (
    "import sys; from torch.distributed.checkpoint import FileSystemReader; "
    "md = FileSystemReader(sys.argv[1]).read_metadata(); "
    "print(len(md.state_dict_metadata), sum(len(getattr(e, 'chunks', ())) "
    "for e in md.state_dict_metadata.values()))"
)
TORCH_RANKS = (
    "import sys, glob, torch, torch.distributed.tensor; "
    "files = sorted(glob.glob(sys.argv[1] + '/ep0-rank*.pt')); "
    "n = sum(len(torch.load(f, weights_only=True, mmap=True)['model']) for f in files); "
    "print(len(files), n)"
)
TORCH_SHARDED = (  # ShardedTensor: no weights_only; its __setstate__ wants its rank's group
    "import sys, glob, re, torch, torch.distributed as dist; "
    "from torch.testing._internal.distributed.fake_pg import FakeStore; "
    "files = sorted(glob.glob(sys.argv[1] + '/ep0-rank*.pt')); n = 0\n"
    "for f in files:\n"
    "    r = int(re.search(r'rank(\\d+)', f).group(1))\n"
    "    dist.init_process_group('fake', store=FakeStore(), rank=r, world_size=len(files))\n"
    "    n += len(torch.load(f, weights_only=False, mmap=True)['model'])\n"
    "    dist.destroy_process_group()\n"
    "print(len(files), n)"
)
TORCH_SHARDED_ONE = (  # one rank file (its rank's group, the world its layout names)
    "import sys, torch, torch.distributed as dist; "
    "from torch.testing._internal.distributed.fake_pg import FakeStore; "
    "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=256); "
    "print(len(torch.load(sys.argv[1] + '/ep0-rank0.pt', weights_only=False, mmap=True)['model']))"
)
CKPTTOOL_ONE = (  # the same file's pickle as every per-rank read reads it (not its siblings)
    "import sys; from ckpttool.formats.torch_save.zip_pickle import ZipPickle; "
    "z = ZipPickle(sys.argv[1]); print(len(z.load()['model']))"
)
CKPTTOOL_READ = (
    "import sys, ckpttool; ck = ckpttool.read(sys.argv[1]); print(len(ck.files), ck.world_size)"
)

CASES = {
    # name: (generator arguments, ranks, what torch does)
    "dcp-256": (["--ranks", "256"], "dcp"),
    "dcp-2048": (["--ranks", "2048"], "dcp"),
    # as torch's own saves pickle the keys: each rank's storage entries name their tensors
    # with strings of their own (a gather's), never named again
    "dcp-256-fresh": (["--ranks", "256", "--fresh-keys"], "dcp"),
    "dcp-2048-fresh": (["--ranks", "2048", "--fresh-keys"], "dcp"),
    # the same .metadata as other writers lay it out (make_dcp_scale.py's VARIANTS): the
    # fast path vouches for the format, not for torch 2.13's order
    **{
        f"dcp-256-{variant}": (["--ranks", "256", "--variant", variant], "dcp")
        for variant in ("no-hints", "tensor-order", "shuffled", "torch-2.3")
    },
    "dtensor-256": (["--ranks", "256", "--per-rank", "dtensor", "--layers", "8"], "ranks"),
    # the whole 70B shape: 2,169 DTensors a file, 555 K blocks (3 minutes to generate)
    "dtensor-256-full": (["--ranks", "256", "--per-rank", "dtensor"], "ranks"),
    "sharded-256": (["--ranks", "256", "--per-rank", "sharded", "--layers", "2"], "sharded"),
    # (256 ShardedTensor ranks: ~85 s of CPU to generate, 8 minutes on 2 busy cores)
    "sharded-32": (["--ranks", "32", "--per-rank", "sharded", "--layers", "2"], "sharded"),
    # the whole 70B shape at 64 ranks: 139 K ShardMetadata a file
    "sharded-64-full": (["--ranks", "64", "--per-rank", "sharded"], "sharded"),
    # one file of 256 ranks, the whole 70B shape: its 555 K ShardMetadata read (the
    # pickle of one rank file; 30 GB for all 256)
    "sharded-256-full-one": (
        ["--ranks", "256", "--per-rank", "sharded", "--files", "1"],
        "sharded-one",
    ),
}


def run_child(cmd: list[str]) -> tuple[float, float, float, str]:
    """(wall s, CPU s, peak RSS MiB, stdout) of one fresh process; its pipes are drained by
    threads while ``os.wait4`` waits for it (and gives its own usage)."""
    import threading

    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    chunks: dict[str, str] = {}

    def drain(name: str, stream) -> None:
        chunks[name] = stream.read()

    threads = [
        threading.Thread(target=drain, args=(n, s))
        for n, s in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for t in threads:
        t.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    for t in threads:
        t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{chunks.get('err', '')[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, chunks["out"].strip()


def generate(workdir: Path, name: str) -> Path:
    args, _ = CASES[name]
    out = workdir / f"scale-{name}"
    done = workdir / f".scale-{name}.done"
    if not done.exists():
        print(f"generating {out} ...", file=sys.stderr, flush=True)
        subprocess.run(
            [PYTHON, str(HERE / "make_dcp_scale.py"), *args, "--out", str(out)], check=True
        )
        done.write_text(" ".join(args))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="dcp-256", help=f"comma-separated: {', '.join(CASES)}")
    parser.add_argument("--workdir", default=str(HERE.parent / "bench-data"))
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per command (median)")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.cases.split(","):
        folder = generate(workdir, name)
        kind = CASES[name][1]
        code = {
            "dcp": TORCH_DCP,
            "ranks": TORCH_RANKS,
            "sharded": TORCH_SHARDED,
            "sharded-one": TORCH_SHARDED_ONE,
        }[kind]
        torch_cmd = [PYTHON, "-c", code, str(folder)]
        target = str(folder) if kind == "dcp" else str(folder / "ep0-rank0.pt")
        sides = {
            "torch": torch_cmd,
            "inspect": [CKPTTOOL, "inspect", target],
            "read": [PYTHON, "-c", CKPTTOOL_READ, target],
        }
        if kind == "sharded-one":  # (its siblings are not there)
            sides = {"torch": torch_cmd, "rank file": [PYTHON, "-c", CKPTTOOL_ONE, target]}
        samples: dict[str, list[tuple[float, float, float, str]]] = {k: [] for k in sides}
        for _ in range(args.repeat):  # interleaved: load drifts over both sides alike
            for side, cmd in sides.items():
                samples[side].append(run_child(cmd))
        median = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
        t = median["torch"]
        for side in [s for s in sides if s != "torch"]:
            rows.append((name, side, median[side], t))
    print()
    print(
        "| case | ckpttool | wall s (torch) | ratio | CPU s (torch) | CPU ratio "
        "| peak RSS MiB (torch) | RSS ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, side, c, t in rows:
        print(
            f"| {name} | `{side}` | {c[0]:.1f} ({t[0]:.1f}) | {c[0] / t[0]:.2f}x "
            f"| {c[1]:.1f} ({t[1]:.1f}) | {c[1] / t[1]:.2f}x "
            f"| {c[2]:.0f} ({t[2]:.0f}) | {c[2] / t[2]:.2f}x |"
        )


if __name__ == "__main__":
    main()
