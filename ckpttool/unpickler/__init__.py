"""The restricted unpickler: rebuilds a pickle's tensors as lazy leaves and never
runs code from the file. ``restricted`` reads, ``policy`` says what is refused and why,
``stand_ins`` is the table of globals a pickle may name, ``rebuild`` and
``numpy_values`` stand in for torch's and numpy's rebuild functions, ``sharded``
extracts ShardedTensor and DTensor metadata. ``pickle_scan`` walks any pickle's opcodes
without building anything (telling a pickle of any protocol apart, naming what a read
that stopped early never reached), ``allow_list`` holds what ``--allow`` trusts, and
``text_persid`` reads protocol 0's persistent ids.
"""

from __future__ import annotations

from .allow_list import ALLOWED, allowing, keep_allowed
from .pickle_scan import is_pickle_start
from .policy import (
    MAX_NESTING,
    allowed_globals,
    api_allow_list,
    check_structure,
    parse_allow,
    python3_name,
)
from .restricted import SafeUnpickler, load_pickle, split_seen
from .sharded import DTENSOR_CLASSES, SHARDED_TENSOR, LocalShards, own_dtensor_block
from .text_persid import text_persistent_id

__all__ = [
    "ALLOWED",
    "DTENSOR_CLASSES",
    "LocalShards",
    "MAX_NESTING",
    "SHARDED_TENSOR",
    "SafeUnpickler",
    "allowed_globals",
    "allowing",
    "api_allow_list",
    "check_structure",
    "is_pickle_start",
    "keep_allowed",
    "load_pickle",
    "own_dtensor_block",
    "parse_allow",
    "python3_name",
    "split_seen",
    "text_persistent_id",
]
