"""``merge``: per-rank shards or a DCP folder -> ONE torch.save file with full tensors."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .api import read, require_data
from .errors import translate_errors
from .output import atomic_output, check_output
from .plain import stand_in_names
from .tree import iter_tensors


@dataclass
class MergeResult:
    output: str
    num_tensors: int
    nbytes: int
    stand_ins: list[str] = field(default_factory=list)


@translate_errors
def merge(
    paths: Sequence[str],
    out: str,
    *,
    force: bool = False,
    unsafe: bool = False,
    progress: Any = None,
) -> MergeResult:
    """Write the whole nested structure with every sharded tensor (model AND optimizer) full.

    The file loads with ``torch.load(weights_only=True)``: opaque objects become
    plain-data stand-ins (``{"__class__": ..., "state": ...}``), numpy arrays tensors.

    Args:
        paths: Per-rank files, a glob, one rank's file, or a DCP folder (any readable input works).
        out: The output ``.pt`` file.
        force: Replace an existing output.
        unsafe: Accept pickles that reference dangerous globals (kept inert).
        progress: As in :func:`ckpttool.convert.convert`.

    Returns:
        What was written, including the classes turned into stand-ins.
    """
    from contextlib import nullcontext

    ckpt = read(paths, unsafe=unsafe)
    inputs = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    check_output(out, [*inputs, *ckpt.files], force=force)
    require_data(ckpt.root)
    leaves = [leaf for _, leaf in iter_tensors(ckpt.root)]
    total = sum(leaf.nbytes for leaf in leaves)
    stand_ins = stand_in_names(ckpt.root)
    bar = progress(total, f"writing {os.path.basename(out)}") if progress else nullcontext(None)
    with bar as advance, atomic_output(out, force=force) as tmp:
        from .writers.torch_zip import write_torch

        write_torch(tmp, ckpt.root, progress=advance)
    return MergeResult(out, len(leaves), total, stand_ins)
