"""Benchmark inputs: what they are, how big, and how to (re)generate them idempotently.

Every input is written under a temporary name and renamed, then a ``<name>.done``
marker records the spec it was built from; a later run with the same spec reuses it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shapes import ADAM_HYPERPARAMS, fill, largest_tensor_bytes, transformer_params

GiB = 1 << 30
HERE = Path(__file__).resolve().parent
SNAPSHOT_EPOCH = 3
DDP_PREFIX = "module."
PERTURBED_TENSORS = 3  # how many tensors differ (slightly) in the "perturbed" copy


@dataclass
class Input:
    """One generated input. ``paths`` are what the cases use; all live in ``folder``."""

    name: str
    kind: str  # snapshot | model | per-rank | dcp
    total_bytes: int  # the size it is generated at (roughly the bytes on disk, per path)
    world_size: int = 1
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def model_bytes(self) -> int:
        return self.total_bytes if self.kind == "model" else self.total_bytes // 3

    @property
    def largest_tensor(self) -> int:
        return largest_tensor_bytes(self.model_bytes)

    def spec(self) -> dict:
        return {"kind": self.kind, "total_bytes": self.total_bytes, "world": self.world_size}


def plan(folder: Path, scale: float) -> dict[str, Input]:
    """The inputs for one scale (1.0 = the sizes named in the issues)."""

    def size(gib: float) -> int:
        return int(gib * GiB * scale)

    inputs = [
        Input("snap-1g", "snapshot", size(1), paths={"pt": folder / "snapshot-1g.pt"}),
        Input("snap-4g", "snapshot", size(4), paths={"pt": folder / "snapshot-4g.pt"}),
        Input(
            "model-1g",
            "model",
            size(1),
            paths={
                "pt": folder / "model-1g.pt",
                "safetensors": folder / "model-1g.safetensors",
                "perturbed": folder / "model-1g-perturbed.pt",
            },
        ),
        Input("rank4", "per-rank", size(2), world_size=4, paths={"dir": folder / "rank4"}),
        Input("dcp2", "dcp", size(2), world_size=2, paths={"dir": folder / "dcp2"}),
    ]
    return {i.name: i for i in inputs}


def disk_bytes(inp: Input) -> int:
    return inp.total_bytes * len(inp.paths)


def _marker(folder: Path, inp: Input) -> Path:
    return folder / f".{inp.name}.done"


def is_ready(folder: Path, inp: Input) -> bool:
    marker = _marker(folder, inp)
    if not marker.is_file() or not all(p.exists() for p in inp.paths.values()):
        return False
    try:
        return json.loads(marker.read_text()) == inp.spec()
    except ValueError:
        return False


def ensure(folder: Path, inp: Input, log=print) -> None:
    """Generate ``inp`` unless a matching one is already there."""
    if is_ready(folder, inp):
        return
    folder.mkdir(parents=True, exist_ok=True)
    _marker(folder, inp).unlink(missing_ok=True)
    start = time.perf_counter()
    log(f"generating {inp.name} ({inp.total_bytes / GiB:.2f} GiB, {inp.kind}) ...")
    if inp.kind in ("snapshot", "model"):
        # In a child process: the benchmark process must not keep gigabytes of freed
        # tensors in its heap (page cache pressure) nor import torch.
        cmd = [sys.executable, str(HERE / "data.py"), inp.kind, str(inp.model_bytes)]
        cmd += [str(p) for p in inp.paths.values()]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"generating {inp.name} failed:\n{proc.stderr[-4000:]}")
    else:
        _generate_distributed(inp)
    _marker(folder, inp).write_text(json.dumps(inp.spec()))
    log(f"  done in {time.perf_counter() - start:.1f} s")


def snapshot(model_bytes: int) -> dict:
    """``{"model", "optimizer", "epoch"}`` as a training loop with Adam would save it."""
    import torch

    params = transformer_params(model_bytes)
    model = {name: fill(shape, "model", name) for name, shape in params}
    state = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": fill(shape, "exp_avg", name),
            "exp_avg_sq": fill(shape, "exp_avg_sq", name, positive=True),
        }
        for i, (name, shape) in enumerate(params)
    }
    groups = [{**ADAM_HYPERPARAMS, "params": list(range(len(params)))}]
    return {
        "model": model,
        "optimizer": {"state": state, "param_groups": groups},
        "epoch": SNAPSHOT_EPOCH,
    }


def _save_torch(obj, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _generate_models(model_bytes: int, pt: Path, safetensors: Path, perturbed: Path) -> None:
    """A DDP state dict (``module.`` keys), its safetensors twin, and a slightly changed copy."""
    import torch
    from safetensors.torch import save_file

    params = transformer_params(model_bytes)
    plain = {name: fill(shape, "model", name) for name, shape in params}
    _save_torch({DDP_PREFIX + k: v for k, v in plain.items()}, pt)
    tmp = safetensors.with_name(safetensors.name + ".tmp")
    save_file(plain, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, safetensors)
    step = max(1, len(params) // PERTURBED_TENSORS)
    for name, _ in params[::step][:PERTURBED_TENSORS]:
        plain[name] = plain[name].clone()
        plain[name].view(-1)[:: max(1, plain[name].numel() // 16)] += torch.tensor(1e-3)
    _save_torch({DDP_PREFIX + k: v for k, v in plain.items()}, perturbed)


def _generate_distributed(inp: Input) -> None:
    out = inp.paths["dir"]
    for stale in (out, out.with_name(out.name + ".tmp")):
        if stale.exists():
            shutil.rmtree(stale)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={inp.world_size}",
        str(HERE / "gen_distributed.py"),
        f"--layout={inp.kind}",
        f"--out={out}",
        f"--model-bytes={inp.model_bytes}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_dir():
        raise RuntimeError(
            f"generating {inp.name} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
        )


if __name__ == "__main__":  # the child process of ensure(): KIND MODEL_BYTES PATH...
    kind, model_bytes, *paths = sys.argv[1:]
    if kind == "snapshot":
        _save_torch(snapshot(int(model_bytes)), Path(paths[0]))
    else:
        _generate_models(int(model_bytes), *map(Path, paths))
