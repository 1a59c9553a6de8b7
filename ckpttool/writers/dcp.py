"""Write a ``torch.distributed.checkpoint`` folder from a flat name -> tensor dict.

Lays out what ``FileSystemWriter`` writes with one rank: every tensor is a
``torch.save`` blob (here a torch zip planned by :func:`~ckpttool.writers.torch_zip.plan_zip`,
so its size is known before any byte is read) in ``__0_0.distcp``, described in
``.metadata`` (torch's ``Metadata`` pickle, written without importing torch: see
:mod:`.dcp_metadata_pickle`).
"""

from __future__ import annotations

from typing import Any

from ..formats.dcp import METADATA_FILE
from .dcp_metadata_pickle import DcpItem, metadata_pickle
from .folder_layout import DCP_FILES, FolderLayout
from .leaf_bytes import output_dtype, refuse_sparse
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
    items: list[DcpItem] = []
    pieces: list[Piece] = []
    offset = 0
    for name, leaf in tensors.items():
        blob, size = plan_zip(leaf, cast=options.cast, base=offset)
        pieces += blob
        dtype = output_dtype(leaf, options.cast)
        # what TensorProperties.create_from_tensor gives for the tensor as loaded
        grad = leaf.requires_grad and not leaf.sharded
        grad = grad and (dtype.is_floating or dtype.name.startswith("complex"))
        shape = tuple(int(dim) for dim in leaf.shape)
        items.append(DcpItem(name, dtype.name, shape, grad, offset, size))
        offset += size
    raw = metadata_pickle(items, DATA_FILE)
    files = [
        FilePlan(DATA_FILE, offset, pieces),
        FilePlan(METADATA_FILE, len(raw), [Piece(0, len(raw), data=raw)]),
    ]
    return Plan(files, [METADATA_FILE, DATA_FILE])
