"""``torch-zip``: a ``torch.save`` file in the zip container (PyTorch >= 1.6)."""

from __future__ import annotations

from ..tree import Checkpoint
from .zip_pickle import ZIP_MAGIC, ZipPickle

FORMAT = "torch-zip"


def detect(path: str, head: bytes) -> bool:
    return head.startswith(ZIP_MAGIC)


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    """Read the pickle with lazy tensors; bytes stay in the zip until asked for."""
    archive = ZipPickle(path)
    seen: set[str] = set()
    try:
        root = archive.load(permissive=permissive, seen=seen)
    finally:
        archive.close()
    return checkpoint(FORMAT, [path], root, seen)


def checkpoint(fmt: str, files: list[str], root: object, seen: set[str]) -> Checkpoint:
    """A Checkpoint from a safe unpickle's result and the globals it saw."""
    return Checkpoint(
        format=fmt,
        files=files,
        root=root,
        globals=sorted(g for g in seen if not g.startswith("!")),
        dangerous=sorted(g[1:] for g in seen if g.startswith("!")),
    )
