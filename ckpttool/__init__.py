"""ckpttool: inspect, convert, merge and diff PyTorch checkpoints safely.

>>> import ckpttool
>>> sd = ckpttool.load("ep3-rank0.pt", map_location="cpu")   # model state dict, prefix stripped
>>> full = ckpttool.load("ckpt/", select="all")              # whole structure, shards merged
>>> with ckpttool.open("ckpt/") as f:                        # lazy, like safe_open
...     rows = f.get_slice("embed.weight")[:128]
>>> ckpttool.load_into(model, "ckpt/")                       # in place, keys reported
>>> ckpttool.verify("ckpt/")["ok"]                           # every byte read, CRCs checked

Importing this package imports nothing heavy (no torch, no readers) until a name
is used, so ``ckpttool --help`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "load": "api",
    "load_into": "api",
    "open": "api",
    "LazyCheckpoint": "api",
    "LoadResult": "api",
    "KeyMismatchError": "api",
    "StateMismatchError": "api",
    "read": "api",
    "select_node": "api",
    "flatten_tensors": "api",
    "materialize": "api",
    "verify": "integrity",
    "WRAPPER_PREFIXES": "tree",
    "MODEL_KEYS": "tree",
    "detect_prefix": "tree",
    "strip_prefix": "tree",
    "CkptError": "errors",
    "InputNotFoundError": "errors",
    "OutputExistsError": "errors",
    "SeparateCheckpointsError": "errors",
    "SeveralCheckpointsError": "errors",
    "UnsafeError": "errors",
    "UsageError": "errors",
    "Checkpoint": "tree",
    "Opaque": "tree",
    "ShardedRef": "tree",
    "SparseRef": "tree",
    "TensorRef": "tree",
}
# the attribute a package face gives each name under, where it differs
_ATTRIBUTES = {"open": "open_checkpoint"}

# `from ckpttool import *` must not shadow the builtin open(): ckpttool.open stays an attribute
__all__ = [name for name in _EXPORTS if name != "open"] + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpttool' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), _ATTRIBUTES.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *_EXPORTS})
