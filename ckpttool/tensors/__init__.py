"""Leaves become ``torch.Tensor``s.

:func:`load_leaf` is the one dispatch that turns any leaf of the tree into a tensor;
:func:`to_torch` turns a whole tree into torch objects. Inside: ``stored`` (a stored
tensor's bytes as a CPU tensor, dtypes, devices), ``mapped`` (file maps and the load
session that keeps them), ``direct`` (bytes read straight into final memory: a
model's parameters, a GPU), ``materialize`` (the dispatch over leaf kinds).

Importing this package does not import torch: the names that need it are loaded on
first use, so the lazy ``open`` and a load session cost nothing until a tensor is read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .mapped import LoadSession, activated, loading

if TYPE_CHECKING:
    from .direct import read_into, shared_storage_tensors
    from .materialize import load_leaf, sparse_entries, to_torch
    from .stored import as_saved, place, storage_bytes, target_device, torch_dtype

# names that import torch -> the module defining them
_TORCH_NAMES = {
    "read_into": "direct",
    "shared_storage_tensors": "direct",
    "load_leaf": "materialize",
    "sparse_entries": "materialize",
    "to_torch": "materialize",
    "as_saved": "stored",
    "place": "stored",
    "storage_bytes": "stored",
    "target_device": "stored",
    "torch_dtype": "stored",
}

__all__ = [
    "LoadSession",
    "activated",
    "as_saved",
    "load_leaf",
    "loading",
    "place",
    "read_into",
    "shared_storage_tensors",
    "sparse_entries",
    "storage_bytes",
    "target_device",
    "to_torch",
    "torch_dtype",
]


def __getattr__(name: str) -> Any:
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
