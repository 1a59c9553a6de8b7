"""The :class:`~ckpttool.tree.Checkpoint` a reader returns: one rule for every family."""

from __future__ import annotations

from ..tree import Checkpoint
from ..unpickler import split_seen


def checkpoint(
    fmt: str, files: list[str], root: object, seen: set[str], world_size: int | None = None
) -> Checkpoint:
    """A Checkpoint from a safe unpickle's result and the globals it saw."""
    globals_, dangerous, unverified = split_seen(seen)
    return Checkpoint(
        format=fmt,
        files=files,
        root=root,
        world_size=world_size,
        globals=globals_,
        dangerous=dangerous,
        unverified=unverified,
    )
