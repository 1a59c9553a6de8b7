"""Write a ``torch.distributed.checkpoint`` folder from a flat name -> tensor dict.

Lays out what ``FileSystemWriter`` writes with one rank: every tensor is a
``torch.save`` blob (here a torch zip planned by :func:`.torch_zip.plan_zip`, so
its size is known before any byte is read) in ``__0_0.distcp``, described in
``.metadata``.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..formats.dcp import METADATA_FILE
from ..tensors import torch_dtype
from . import output_dtype, refuse_sparse
from .folder_layout import DCP_FILES, FolderLayout
from .plan import FilePlan, Piece, Plan, WriteOptions, write
from .torch_zip import plan_zip

__all__ = ["TO", "layout", "plan", "write"]

TO = "dcp"
DATA_FILE = "__0_0.distcp"


def layout(options: WriteOptions) -> FolderLayout | None:
    """A DCP checkpoint is a folder."""
    return DCP_FILES


def plan(tensors: dict[str, Any], options: WriteOptions) -> Plan:
    """The data file (one blob per tensor, in key order), then ``.metadata`` naming them."""
    refuse_sparse(tensors, "DCP")
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    pieces: list[Piece] = []
    offset = 0
    for name, leaf in tensors.items():
        blob, size = plan_zip(leaf, cast=options.cast, base=offset)
        pieces += blob
        dtype = output_dtype(leaf, options.cast)
        shape = torch.Size(leaf.shape)
        zeros = torch.Size([0] * len(shape))
        # what TensorProperties.create_from_tensor gives for the tensor as loaded
        grad = leaf.requires_grad and not leaf.sharded
        grad = grad and (dtype.is_floating or dtype.name.startswith("complex"))
        properties = TensorProperties(dtype=torch_dtype(dtype), requires_grad=grad)
        entries[name] = TensorStorageMetadata(
            properties=properties,
            size=shape,
            chunks=[ChunkStorageMetadata(offsets=zeros, sizes=shape)],
        )
        storage[MetadataIndex(name, zeros, 0)] = _StorageInfo(DATA_FILE, offset, size)
        offset += size
    metadata = Metadata(
        state_dict_metadata=entries,
        planner_data={name: (name,) for name in tensors},
        storage_data=storage,
    )
    raw = pickle.dumps(metadata)
    files = [
        FilePlan(DATA_FILE, offset, pieces),
        FilePlan(METADATA_FILE, len(raw), [Piece(0, len(raw), data=raw)]),
    ]
    return Plan(files, [METADATA_FILE, DATA_FILE])
