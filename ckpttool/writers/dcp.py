"""Write a ``torch.distributed.checkpoint`` folder from a flat name -> tensor dict.

Streams like ``FileSystemWriter`` does with one rank: every tensor is a
``torch.save`` blob appended to ``__0_0.distcp``, described in ``.metadata``.
"""

from __future__ import annotations

import io
import os
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

from ..dtypes import DType
from . import Progress, refuse_sparse, tensor_for_write

DATA_FILE = "__0_0.distcp"
METADATA_FILE = ".metadata"


def write_dcp(
    folder: str,
    tensors: dict[str, Any],
    *,
    cast: DType | None = None,
    progress: Progress | None = None,
) -> None:
    """Write ``tensors`` (name -> lazy leaf) as a one-rank DCP checkpoint into ``folder``."""
    refuse_sparse(tensors, "DCP")
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    with open(os.path.join(folder, DATA_FILE), "wb") as f:
        for name, leaf in tensors.items():
            tensor = tensor_for_write(leaf, cast)
            offset = f.tell()
            blob = io.BytesIO()
            torch.save(tensor, blob)
            f.write(blob.getbuffer())
            zeros = torch.Size([0] * tensor.dim())
            entries[name] = TensorStorageMetadata(
                properties=TensorProperties.create_from_tensor(tensor),
                size=tensor.size(),
                chunks=[ChunkStorageMetadata(offsets=zeros, sizes=tensor.size())],
            )
            storage[MetadataIndex(name, zeros, 0)] = _StorageInfo(
                DATA_FILE, offset, f.tell() - offset
            )
            if progress:
                progress(leaf.nbytes)
            del tensor, blob
    metadata = Metadata(
        state_dict_metadata=entries,
        planner_data={name: (name,) for name in tensors},
        storage_data=storage,
    )
    with open(os.path.join(folder, METADATA_FILE), "wb") as f:
        pickle.dump(metadata, f)
