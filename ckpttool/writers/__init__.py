"""Output writers, one module per output format, picked by ``--to`` from :data:`WRITERS`.

Each writer module has the same surface:

- ``TO``: the contract's ``--to`` value it writes;
- ``layout(options)``: the :class:`~ckpttool.writers.folder_layout.FolderLayout` of a folder output,
  or None for one file;
- ``plan(tensors, options)``: a :class:`~ckpttool.writers.plan.Plan` (files, pieces
  at offsets, sizes) from the tensors' metadata alone;
- ``write(part, out, progress)``: any part of that plan, at its offsets, into an
  open :class:`OutputFile` (the same function for every writer: see ``plan.py``).

Tensors stream one at a time, so memory stays bounded by the largest tensor, never
by the checkpoint.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import UsageError
from .casts import cast_bytes, cast_stored
from .folder_layout import FOLDER_LAYOUTS, FolderLayout
from .hf_output import CARRIED_FILES, carried_files, hf_source_folder, layout_for, model_folder
from .leaf_bytes import (
    CHUNK_BYTES,
    box_bytes,
    box_layout,
    iter_chunks,
    output_dtype,
    output_nbytes,
    raw_parts,
    refuse_sparse,
    tensor_bytes,
    tensor_for_write,
    write_leaf,
)
from .naming import default_name, default_output
from .output_file import OutputFile, preallocate
from .plan import (
    FilePlan,
    Part,
    Piece,
    Plan,
    WriteOptions,
    Written,
    complete,
    write,
    write_plan,
)

__all__ = [
    "CARRIED_FILES",
    "CHUNK_BYTES",
    "FOLDER_LAYOUTS",
    "WRITERS",
    "FilePlan",
    "FolderLayout",
    "OutputFile",
    "Part",
    "Piece",
    "Plan",
    "WriteOptions",
    "Written",
    "cast_bytes",
    "carried_files",
    "cast_stored",
    "complete",
    "default_name",
    "default_output",
    "hf_source_folder",
    "box_bytes",
    "box_layout",
    "iter_chunks",
    "layout_for",
    "model_folder",
    "output_dtype",
    "output_nbytes",
    "preallocate",
    "raw_parts",
    "refuse_sparse",
    "tensor_bytes",
    "tensor_for_write",
    "write",
    "write_leaf",
    "write_plan",
    "writer_for",
]

# --to value -> writer module, imported on first use
WRITERS = {"safetensors": "safetensors", "pt": "torch_zip", "dcp": "dcp"}


def writer_for(to: str) -> ModuleType:
    """The writer module for a ``--to`` value.

    Raises:
        UsageError: No writer writes ``to``.
    """
    if to not in WRITERS:
        raise UsageError(f"unknown --to {to!r}", hint=f"choose one of {', '.join(WRITERS)}")
    return importlib.import_module(f".{WRITERS[to]}", __name__)
