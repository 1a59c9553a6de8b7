"""Plain-PyTorch baselines that need more than a one-liner (run as subprocesses).

    python benchmarks/baselines.py load-save-safetensors SRC.pt DST.safetensors
    python benchmarks/baselines.py naive-diff A B     # exit 0 equal, 1 different
    python benchmarks/baselines.py durable-write SRC DST

What a user would write without ckpttool: load everything into memory, then act.
``durable-write`` is the disk's floor instead: it writes as many zero bytes as SRC
holds (a file, or a folder's files) to DST the fastest durable way we know here
(blocks allocated up front, O_DIRECT, three 16 MiB writes in flight) and fsyncs,
reading nothing, so no tool that makes its output durable can be much faster on
this disk.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys

DDP_PREFIX = "module."


def flatten(node, prefix: str = "") -> dict:
    """Every tensor of a nested dict/list, named by its key path joined with ``.``."""
    import torch

    if isinstance(node, torch.Tensor):
        return {prefix: node.contiguous()}
    out: dict = {}
    if isinstance(node, (dict, list, tuple)):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def load_save_safetensors(src: str, dst: str) -> int:
    import torch
    from safetensors.torch import save_file

    save_file(flatten(torch.load(src, weights_only=True)), dst, metadata={"format": "pt"})
    return 0


def _load_state_dict(path: str) -> dict:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        sd = load_file(path)
    else:
        import torch

        sd = torch.load(path, weights_only=True)
    if sd and all(k.startswith(DDP_PREFIX) for k in sd):
        sd = {k[len(DDP_PREFIX) :]: v for k, v in sd.items()}
    return sd


def naive_diff(a: str, b: str) -> int:
    import torch

    sd_a, sd_b = _load_state_dict(a), _load_state_dict(b)
    equal = sd_a.keys() == sd_b.keys()
    for name in sd_a.keys() & sd_b.keys():
        if not torch.equal(sd_a[name], sd_b[name]):
            equal = False
            diff = (sd_a[name] - sd_b[name]).abs().max().item()
            print(f"{name}: max |a-b| {diff:.6g}")
    return 0 if equal else 1


def safe_open_stats(path: str) -> int:
    """What ``inspect --stats`` reports, computed the way a user would with safetensors:
    each tensor in float64, NaN/Inf counted and left out, min/max/mean/std."""
    import torch
    from safetensors import safe_open

    stats = {}
    with safe_open(path, "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            t = f.get_tensor(name).to(torch.float64)
            finite = torch.isfinite(t)
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            if nan or inf:
                t = t[finite]
            stats[name] = (float(t.min()), float(t.max()), float(t.mean()), float(t.std()))
            stats[name] += (nan, inf)
    print(len(stats))
    return 0


def _size(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(path)
        for name in names
    )


def durable_write(src: str, dst: str, chunk: int = 16 << 20, in_flight: int = 3) -> int:
    from concurrent.futures import ThreadPoolExecutor

    total = -(-_size(src) // chunk) * chunk  # whole chunks: a few MiB more
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buffer.write(b"\1" * chunk)  # touched: pages of its own, not the shared zero page
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(dst, flags | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:  # a file system without O_DIRECT (tmpfs): buffered, then fsync
        fd = os.open(dst, flags, 0o644)

    def write_chunk(offset: int) -> None:
        done = 0
        while done < chunk:
            done += os.pwrite(fd, memoryview(buffer)[done:], offset + done)

    try:
        with contextlib.suppress(OSError):  # no fallocate here: the writes grow the file
            os.posix_fallocate(fd, 0, total)
        with ThreadPoolExecutor(in_flight) as pool:
            list(pool.map(write_chunk, range(0, total, chunk)))
        os.fsync(fd)
    finally:
        os.close(fd)
    return 0


COMMANDS = {
    "load-save-safetensors": load_save_safetensors,
    "naive-diff": naive_diff,
    "safe-open-stats": safe_open_stats,
    "durable-write": durable_write,
}

if __name__ == "__main__":
    sys.exit(COMMANDS[sys.argv[1]](*sys.argv[2:]))
