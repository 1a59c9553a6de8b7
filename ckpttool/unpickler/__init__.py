"""The restricted unpickler: rebuilds a pickle's tensors as lazy leaves and never
runs code from the file. ``restricted`` reads, ``policy`` says what is refused and why,
``stand_ins`` is the table of globals a pickle may name, ``rebuild`` and
``numpy_values`` stand in for torch's and numpy's rebuild functions, ``sharded``
extracts ShardedTensor and DTensor metadata.
"""

from __future__ import annotations

from .policy import MAX_NESTING, check_structure
from .restricted import load_pickle, split_seen
from .sharded import LocalShards, own_dtensor_block

__all__ = [
    "LocalShards",
    "MAX_NESTING",
    "check_structure",
    "load_pickle",
    "own_dtensor_block",
    "split_seen",
]
