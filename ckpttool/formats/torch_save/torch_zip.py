"""``torch-zip``: a ``torch.save`` file in the zip container (PyTorch >= 1.6)."""

from __future__ import annotations

from ...tree import Checkpoint
from ..made import checkpoint
from .zip_pickle import ZIP_MAGIC, ZipPickle

FORMAT = "torch-zip"


def detect(path: str, head: bytes) -> bool:
    return head.startswith(ZIP_MAGIC)


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    """Read the pickle with lazy tensors; bytes stay in the zip until asked for."""
    seen: set[str] = set()
    with ZipPickle(path) as archive:
        root = archive.load(permissive=permissive, seen=seen)
    return checkpoint(FORMAT, [path], root, seen)
