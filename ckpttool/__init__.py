"""ckpttool: inspect, convert, merge and diff PyTorch checkpoints safely.

>>> import ckpttool
>>> sd = ckpttool.load("ep3-rank0.pt", map_location="cpu")   # model state dict, prefix stripped
>>> full = ckpttool.load("ckpt/", select="all")              # whole structure, shards merged

Importing this package does not import torch; reading tensors does.
"""

from .api import flatten_tensors, load, materialize, read, select_node
from .errors import CkptError, OutputExistsError, UnsafeError, UsageError
from .tree import Checkpoint, Opaque, ShardedRef, TensorRef

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CkptError",
    "Opaque",
    "OutputExistsError",
    "ShardedRef",
    "TensorRef",
    "UnsafeError",
    "UsageError",
    "flatten_tensors",
    "load",
    "materialize",
    "read",
    "select_node",
    "__version__",
]
