"""The Python API: :func:`read` a checkpoint lazily, :func:`load` its tensors,
:func:`open_checkpoint` (``ckpttool.open``) a lazy mapping, :func:`load_into` a model
in place.
"""

from __future__ import annotations

from .into_model import KeyMismatchError, LoadResult, StateMismatchError, load_into
from .lazy_file import LazyCheckpoint, open_checkpoint
from .reading import flatten_tensors, load, materialize, read, require_data, select_node

__all__ = [
    "KeyMismatchError",
    "LazyCheckpoint",
    "LoadResult",
    "StateMismatchError",
    "flatten_tensors",
    "load",
    "load_into",
    "materialize",
    "open_checkpoint",
    "read",
    "require_data",
    "select_node",
]
