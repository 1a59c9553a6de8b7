"""``merge``: per-rank shards or a DCP folder -> ONE torch.save file with full tensors."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import distributed
from .api import read, require_data
from .errors import translate_errors
from .integrity import check_sizes
from .progress import ProgressFactory
from .targets import StaleTemp, check_output, output_path, publish
from .tree import iter_tensors, recorded_classes
from .writers import default_name


@dataclass
class MergeResult:
    output: str
    num_tensors: int
    nbytes: int
    stand_ins: list[str] = field(default_factory=list)
    # temp outputs of killed runs removed from the output's folder on the way
    removed: list[StaleTemp] = field(default_factory=list)
    # what a resumed write reused, the units of several processes (targets.Outcome)
    outcome: Any = None


@distributed.collective
@translate_errors
def merge(
    paths: Sequence[str],
    out: str,
    *,
    force: bool = False,
    unsafe: bool = False,
    progress: ProgressFactory | None = None,
) -> MergeResult:
    """Write the whole nested structure with every sharded tensor (model AND optimizer) full.

    The file loads with ``torch.load(weights_only=True)``: opaque objects become
    plain-data records (``{"__class__": ..., "state": ...}``), numpy arrays tensors.

    Args:
        paths: Per-rank files, a glob, one rank's file, or a DCP folder (any readable input works).
        out: The output ``.pt`` file; ``DIR/`` or an existing folder puts it there under
            the name of the input (``ep0-rank0.pt`` -> ``DIR/ep0.pt``).
        force: Replace an existing output.
        unsafe: Accept pickles that reference dangerous globals (kept inert).
        progress: As in :func:`ckpttool.convert.convert`.

    Returns:
        What was written, including the classes kept as plain-data records.
    """
    from .writers import WriteOptions, writer_for

    ckpt = read(paths, unsafe=unsafe)
    inputs = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    out = output_path(os.fspath(out), default_name(inputs, out), folder_output=False)
    check_output(out, [*inputs, *ckpt.files], force=force)
    require_data(ckpt.root)
    check_sizes(ckpt)  # every byte is written: a short or missing file refused before a write
    leaves = [leaf for _, leaf in iter_tensors(ckpt.root)]
    total = sum(leaf.nbytes for leaf in leaves)
    stand_ins = recorded_classes(ckpt.root)
    plan = writer_for("pt").plan(ckpt.root, WriteOptions())  # metadata only, the pickle included
    done = publish(
        plan, out, layout=None, force=force, inputs=[*inputs, *ckpt.files], files=ckpt.files,
        progress=progress,
    )  # fmt: skip
    return MergeResult(out, len(leaves), total, stand_ins, done.removed, done.outcome)
