"""Snapshot files of the reference trainer: atomic writes, completeness markers, layouts.

Plain functions over plain data, so tests can call them without torchrun.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

try:
    import ckpttool
except ImportError:  # running from a checkout without `pip install -e .`
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ckpttool

SNAPSHOT_FILE = "ep{epoch}-rank{rank}.pt"
SNAPSHOT_DIR = "ep{epoch}"
COMPLETE_MARKER = "ep{epoch}.complete"


class Snapshot(NamedTuple):
    """The parts of a training snapshot the trainer restores; all but ``model`` optional."""

    model: dict
    optimizer: dict | None = None
    scheduler: dict | None = None
    epochs_run: int = 0
    rng: dict | list | None = None


# Where each layout keeps the parts of a Snapshot, in order (each model path is one of
# the places ckpttool looks for a model, ckpttool.MODEL_KEYS). Composer keys its
# optimizers and schedulers by class name; "*" takes the one value there. Only the model
# is required, so `--resume PATH` also takes e.g. {"model", "optimizer", "epoch"} files.
SNAPSHOT_LAYOUTS = (
    (("MODEL_STATE",), ("OPTIMIZER_STATE",), ("SCHEDULER_STATE",), ("EPOCHS_RUN",), ("RNG",)),
    (
        ("state", "model"),
        ("state", "optimizers", "*"),
        ("state", "schedulers", "*"),
        ("state", "timestamp", "epoch"),
        ("rng",),
    ),
    (("model",), ("optimizer",), ("scheduler",), ("epoch",), ("rng",)),
)


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once the directory entry is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write, die_half_way: bool = False) -> None:
    """Write through ``write(fileobj)`` into a temp file beside ``path``, fsync, rename.

    A reader sees the old file or the whole new one, never a torn one. ``die_half_way`` is the
    test hook: truncate the temp file to half and SIGKILL this process before the rename.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        if die_half_way:
            f.truncate(f.tell() // 2)
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_complete_marker(
    snapshot_dir: Path, epoch: int, fmt: str, world_size: int, parts: list[str]
) -> None:
    """Mark snapshot ``epoch`` complete: list its files and their sizes, atomically.

    Only rank 0 calls this, and only after a barrier that every rank reached with its part
    of the snapshot on disk.
    """
    files: list[Path] = []
    for part in parts:
        path = snapshot_dir / part
        files += sorted(path.iterdir()) if path.is_dir() else [path]
    info = {
        "epoch": epoch,
        "format": fmt,
        "world_size": world_size,
        "parts": parts,
        "files": {str(f.relative_to(snapshot_dir)): f.stat().st_size for f in files},
    }
    marker = snapshot_dir / COMPLETE_MARKER.format(epoch=epoch)
    atomic_write(marker, lambda f: f.write(json.dumps(info, indent=1).encode()))


def find_latest_snapshot(snapshot_dir: str | os.PathLike) -> dict | None:
    """Return the newest complete snapshot in ``snapshot_dir``, or None.

    Complete means rank 0 wrote its marker (which it does only after every rank finished) and
    every file the marker lists is there with the size it lists. Temp files of a rank killed
    while saving, and snapshots without a marker, are never picked.

    Returns:
        The marker's content (``epoch``, ``format``, ``world_size``, ``files``) with ``paths``
        added: the absolute paths to hand to ``ckpttool.load``.
    """
    snapshot_dir = Path(snapshot_dir)
    candidates = []
    for marker in snapshot_dir.glob(COMPLETE_MARKER.format(epoch="*")):
        match = re.fullmatch(r"ep(\d+)\.complete", marker.name)
        if match:
            candidates.append((int(match.group(1)), marker))
    for _, marker in sorted(candidates, reverse=True):
        try:
            info = json.loads(marker.read_text())
            sizes = {snapshot_dir / name: size for name, size in info["files"].items()}
        except (OSError, ValueError, KeyError, AttributeError):
            continue
        if all(p.is_file() and p.stat().st_size == size for p, size in sizes.items()):
            info["paths"] = [str(snapshot_dir / p) for p in info["parts"]]
            return info
    return None


def schedule_position(saved_steps: int, epochs_run: int, steps_per_epoch: int) -> int | None:
    """Where a resumed run's step-counting schedule continues, by samples seen.

    A snapshot is taken at the end of an epoch, so its scheduler has counted
    ``epochs_run`` whole epochs of the saving run's steps. On another world size (or
    batch size) an epoch is another number of steps: the same samples seen are
    ``epochs_run`` epochs of this run's steps. None where the saved count is not whole
    epochs (a snapshot from elsewhere, mid-epoch): it cannot be placed.
    """
    if epochs_run <= 0 or steps_per_epoch <= 0:
        return saved_steps if saved_steps == 0 else None
    if saved_steps <= 0 or saved_steps % epochs_run:
        return None
    return epochs_run * steps_per_epoch


def _get(tree, path: tuple):
    for key in path:
        if not isinstance(tree, Mapping):
            return None
        if key == "*":
            tree = next(iter(tree.values())) if len(tree) == 1 else None
        else:
            tree = tree.get(key)
    return tree


def snapshot_layout(snapshot: object) -> tuple | None:
    """The entry of ``SNAPSHOT_LAYOUTS`` that ``snapshot`` follows (where its parts are),
    or None. Works on a lazy ``ckpttool.read`` tree as on loaded data."""
    for layout in SNAPSHOT_LAYOUTS:
        if isinstance(_get(snapshot, layout[0]), Mapping):
            return layout
    return None


def snapshot_part(snapshot: object, path: tuple):
    """One part of a snapshot by its layout path (``"*"``: the one value there), or None."""
    return _get(snapshot, path)


def unpack_snapshot(snapshot: object) -> Snapshot | None:
    """Find the parts of a snapshot of any known layout; None if it is none of them."""
    layout = snapshot_layout(snapshot)
    if layout is None:
        return None
    model, optimizer, scheduler, epochs_run, rng = (_get(snapshot, p) for p in layout)
    return Snapshot(model, optimizer, scheduler, int(epochs_run or 0), rng)


def strip_wrapper_prefixes(state_dict: dict) -> dict:
    """Drop the wrapper prefixes every key shares (DDP's ``module.``, torch.compile's
    ``_orig_mod.``, stacked in any order), as ckpttool strips them when it loads."""
    return ckpttool.strip_prefix(state_dict, ckpttool.detect_prefix(list(state_dict)))


def optim_state_by_name(optim_state: dict, names: list[str]) -> dict:
    """Key optimizer state by parameter name (FSDP's layout), however it was saved."""

    def name(key):
        return names[key] if isinstance(key, int) else key

    return {
        "state": {name(k): v for k, v in optim_state["state"].items()},
        "param_groups": [
            {**g, "params": [name(p) for p in g["params"]]} for g in optim_state["param_groups"]
        ],
    }


def optim_state_by_index(optim_state: dict, names: list[str]) -> dict:
    """Key optimizer state by parameter index, as ``torch.optim.Optimizer`` wants it."""
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[k]: v for k, v in optim_state["state"].items()},
        "param_groups": [
            {**g, "params": [index[p] for p in g["params"]]} for g in optim_state["param_groups"]
        ],
    }


def get_rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    # RNG states must be CPU byte tensors, wherever map_location put them.
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]  # a reader may hand tuples back as lists
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
