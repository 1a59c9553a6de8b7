"""Where an output's bytes go: "what bytes" is the writers' :class:`~ckpttool.writers.plan.Plan`,
this package is where they are put.

:func:`publish` is the one way a verb writes a plan, whatever the route:

- one process, a local (or shared) path: :mod:`.local`, a temp name beside the output,
  fsync, one rename (a folder output's files moved in one by one, the last one last);
- the ranks of a job (torchrun, ``--workers``): :mod:`.ranks`, units of the plan
  claimed through the store, journaled (:mod:`.journal`, :mod:`.units`) so a rerun
  resumes, published by rank 0 under the same names and rules;
- ``s3://``: :mod:`.s3`, multipart uploads of the same files (:mod:`.s3_parts` cuts
  them into parts, :mod:`.s3_client` speaks S3), from one process or from every rank,
  completed at the end in the same order.

The output policy (what ``-o`` means, what ``--force`` may replace, what an input
forbids) is :func:`output_path` and :func:`check_output`, for every route.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from .. import distributed, sources
from ..progress import ProgressFactory
from ..writers import FolderLayout, Plan
from .journal import Journal
from .local import StaleTemp, check_output, output_path

__all__ = ["Published", "StaleTemp", "check_output", "output_path", "publish"]


@dataclass
class Published:
    """What :func:`publish` did, for the summary line.

    Attributes:
        removed: Temp outputs of killed runs removed from the output's folder.
        outcome: What a resumed write reused (a :class:`.outcome.Outcome`: the ranks' units,
            S3's parts), else None.
    """

    removed: list[StaleTemp] = field(default_factory=list)
    outcome: Any = None


def publish(
    plan: Plan,
    out: str,
    *,
    layout: FolderLayout | None,
    force: bool,
    inputs: Sequence[str],
    files: Sequence[str],
    progress: ProgressFactory | None = None,
) -> Published:
    """Write ``plan`` as ``out`` (which the caller has checked with :func:`check_output`)
    by whatever route this process is on: nothing is under the output's name before it
    is whole.

    Args:
        plan: The output, laid out.
        out: The output file, or the folder of a folder output (``layout``).
        layout: The files of a folder output; None for a single file.
        force: Replace an earlier output.
        inputs: The inputs as given and the files read (their identities key a resume).
        files: The files the checkpoint was read from.
        progress: As in :func:`ckpttool.convert.convert`.

    Raises:
        CkptError: Writing failed; what was left for a rerun is named.
    """
    group = distributed.current()
    description = f"writing {os.path.basename(out)}"
    if group is not None:  # under torchrun or --workers: every rank writes its share
        from .ranks import write_on_every_rank

        # rank 0 shows the whole output's bytes, units of every rank counted as they end
        shows = progress if progress and group.rank == 0 and not sources.is_url(out) else None
        total = sum(file.size for file in plan.files)
        with shows(total, description) if shows else nullcontext(None) as advance:
            outcome = write_on_every_rank(
                group, plan, out, layout=layout, force=force, inputs=list(inputs),
                files=list(files), progress=advance,
            )  # fmt: skip
        return Published(outcome=outcome)
    bar = progress(plan.total_bytes, description) if progress else nullcontext(None)
    if sources.is_url(out):  # s3://: multipart uploads, completed at the end
        from .s3 import write as upload_plan

        with bar as advance:
            outcome = upload_plan(
                plan, out, layout=layout, force=force, inputs=files, progress=advance
            )
        return Published(outcome=outcome)
    from ..writers import write_plan
    from .local import atomic_output

    removed: list[StaleTemp] = []
    needed = sum(file.size for file in plan.files)
    with (
        bar as advance,
        atomic_output(out, force=force, layout=layout, removed=removed, needed=needed) as tmp,
    ):
        write_plan(plan, tmp, advance)
    # the work of an interrupted run of several processes is of no use once the output
    # is whole: its folder goes, said as any killed run's temp is
    journal = Journal(out)
    unused = journal.discard_unused()
    if unused is not None:
        removed.append(StaleTemp(journal.root, *unused))
    return Published(removed=removed)
