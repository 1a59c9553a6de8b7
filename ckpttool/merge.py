"""``merge``: per-rank shards or a DCP folder -> ONE torch.save file with full tensors."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import distributed
from .api import read, require_data
from .errors import translate_errors
from .output import atomic_output, check_output, output_path
from .plain import stand_in_names
from .progress import ProgressFactory
from .tree import iter_tensors


@dataclass
class MergeResult:
    output: str
    num_tensors: int
    nbytes: int
    stand_ins: list[str] = field(default_factory=list)
    # several processes: what they did (a distributed.runner.Outcome), else None
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
    plain-data stand-ins (``{"__class__": ..., "state": ...}``), numpy arrays tensors.

    Args:
        paths: Per-rank files, a glob, one rank's file, or a DCP folder (any readable input works).
        out: The output ``.pt`` file; ``DIR/`` or an existing folder puts it there under
            the name of the input (``ep0-rank0.pt`` -> ``DIR/ep0.pt``).
        force: Replace an existing output.
        unsafe: Accept pickles that reference dangerous globals (kept inert).
        progress: As in :func:`ckpttool.convert.convert`.

    Returns:
        What was written, including the classes turned into stand-ins.
    """
    from contextlib import nullcontext

    from .writers.plan import WriteOptions, write_plan
    from .writers.torch_zip import plan as plan_torch

    ckpt = read(paths, unsafe=unsafe)
    inputs = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    out = output_path(os.fspath(out), default_name(inputs, out), folder_output=False)
    check_output(out, [*inputs, *ckpt.files], force=force)
    require_data(ckpt.root)
    leaves = [leaf for _, leaf in iter_tensors(ckpt.root)]
    total = sum(leaf.nbytes for leaf in leaves)
    stand_ins = stand_in_names(ckpt.root)
    plan = plan_torch(ckpt.root, WriteOptions())  # metadata only, the pickle included
    group = distributed.current()
    if group is not None:  # under torchrun: every rank writes its share
        from .distributed.runner import write_distributed

        files = [*inputs, *ckpt.files]
        outcome = write_distributed(group, plan, out, layout=None, force=force, inputs=files)
        return MergeResult(out, len(leaves), total, stand_ins, outcome)
    description = f"writing {os.path.basename(out)}"
    bar = progress(plan.total_bytes, description) if progress else nullcontext(None)
    with bar as advance, atomic_output(out, force=force) as tmp:
        write_plan(plan, tmp, advance)
    return MergeResult(out, len(leaves), total, stand_ins)


def default_name(inputs: Sequence[str], folder: str) -> str:
    """The merged file's name in ``folder`` (``-o DIR/``): the input's, its rank dropped
    (``ep0-rank0.pt``, ``ep0/`` -> ``ep0.pt``); ``ep0-merged.pt`` where that is an input."""
    from .convert import output_stem, unused_name

    return os.path.basename(unused_name(folder, output_stem(inputs)[1], "merged", inputs))
