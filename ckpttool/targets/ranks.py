"""Write one planned output with every process of the group.

1. Every rank has the plan (each computed it from the metadata; rank 0 posts the
   work's key and every other rank checks its own against it).
2. Rank 0 opens the resume folder (:mod:`.journal`): keeps the journaled units when
   the key matches, else starts afresh; creates the files at full size; posts the
   units still to do.
3. Every rank claims units one at a time (an atomic counter), writes each at its
   offsets (:func:`.units.write_unit` into an :class:`OutputFile` opened there),
   fsyncs, then journals it.
4. Once every unit is counted done, rank 0 combines the CRCs, writes the pieces built
   from them (zip CRC fields, central directory), fsyncs, and publishes: the files
   move under their final names, a folder output's index or ``.metadata`` last.
   Every other rank waits for that and ends with rank 0's outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable

from ..distributed import Group
from ..errors import CkptError
from ..progress import Progress
from ..writers import OutputFile, Plan, Written, complete, preallocate
from . import units as unit_mod
from .journal import LEASE_REFRESH_S, Journal, UnitLog, input_identities, work_key
from .local import (
    DISK_FULL,
    FolderLayout,
    check_replaceable,
    fsync_entry,
    fsync_file,
    fsync_tree,
    owned_entries,
    remove_output,
    write_error,
)
from .outcome import Outcome

SINGLE_FILE = "output"  # a single-file output's name inside the resume folder


def write_on_every_rank(
    group: Group,
    plan: Plan,
    out: str,
    *,
    layout: FolderLayout | None,
    force: bool,
    inputs: list[str],
    files: list[str],
    progress: Progress | None = None,
) -> Outcome | None:
    """This rank's share of writing ``plan`` as ``out``: a local (or shared) path through
    :func:`write_distributed`, an ``s3://`` URL as the parts of the same multipart uploads
    (``targets.s3.write_ranks``, the session and CRCs exchanged through the store).

    Args:
        inputs: The inputs as given and the files read (their identities key the work).
        files: The files the checkpoint was read from.
    """
    from .. import sources

    if not sources.is_url(out):
        return write_distributed(
            group, plan, out, layout=layout, force=force, inputs=inputs, progress=progress
        )
    from .s3 import write_ranks

    write_ranks(
        plan,
        out,
        layout=layout,
        force=force,
        inputs=files,
        rank=group.rank,
        world=group.size,
        broadcast=group.broadcast,
        all_gather=group.all_gather,
    )
    return None


def write_distributed(
    group: Group,
    plan: Plan,
    out: str,
    *,
    layout: FolderLayout | None,
    force: bool,
    inputs: list[str],
    progress: Progress | None = None,
) -> Outcome:
    """Write ``plan`` as ``out`` with every rank of ``group`` (see the module's doc).

    Raises:
        CkptError: Writing failed, another run writes this output, the ranks planned
            different outputs, or a rank died (:class:`.group.Failed` on the ranks
            that did not post the error).
    """
    size = unit_mod.unit_bytes(plan)
    all_units = unit_mod.plan_units(plan, size)
    key = work_key(unit_mod.plan_digest(plan, size), out, input_identities(inputs))
    journal = Journal(out)
    if group.rank == 0:
        group.store.set("key", key)
    elif group.wait_key("key") != key:
        raise CkptError(
            f"rank {group.rank} planned another output than rank 0",
            hint="every rank must see the same input files and options",
        )
    lease: threading.Event | None = None
    try:
        if group.rank == 0:
            lease = _start(journal, plan, out, key, inputs, all_units, group)
        state = json.loads(group.wait_key("todo"))
        todo = state["todo"]
        shown = _Shown(group, progress if group.rank == 0 else None, state["reused_bytes"])
        _work(group, plan, journal, [all_units[i] for i in todo], out, shown)
        # this rank is done with the resume folder (its journal closed): rank 0 removes
        # that folder when it publishes, so it waits for every rank to get here first
        group.counter("idle", 1)
        group.wait(lambda: shown.update() and group.counter("finished") >= len(todo))
        if group.rank == 0:
            group.wait(lambda: group.counter("idle") >= group.size)
            group.stop_watching()
            _finish(journal, plan, out, layout, force)
            group.store.set("published", "1")
        else:
            group.wait_key("published")
            group.stop_watching()
    finally:
        if lease is not None:
            lease.set()
            journal.release()
    return Outcome(len(all_units), state["reused"], state["reused_bytes"], state["note"])


def _start(
    journal: Journal,
    plan: Plan,
    out: str,
    key: str,
    inputs: list[str],
    all_units: list[unit_mod.Unit],
    group: Group,
) -> threading.Event:
    """Rank 0: take the resume folder, create the files, post what is left to do."""
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        note = journal.open(key, input_identities(inputs))
    except OSError as exc:
        raise CkptError(
            f"cannot create the output's work folder ({exc.strerror})", path=parent
        ) from None
    done = journal.done() if note == "resumed" else {}
    if done and not all(_has_size(journal, f.name, f.size) for f in plan.files):
        journal.remove()
        journal.open(key, input_identities(inputs))
        done, note = {}, "the interrupted run's files were missing: started over"
    try:
        for file in plan.files if not done else []:
            fd = os.open(_file_path(journal, file.name), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, file.size)
                preallocate(fd, file.size)
            finally:
                os.close(fd)
    except OSError as exc:  # nothing of this run is of use to another: its folder goes
        with contextlib.suppress(OSError):
            journal.remove()
        raise write_error(exc, out, parent, sum(f.size for f in plan.files)) from None
    stop = threading.Event()
    threading.Thread(target=_keep_lease, args=(journal, stop), daemon=True).start()
    todo = [u.id for u in all_units if u.id not in done]
    reused = [u for u in all_units if u.id in done]
    state = {
        "todo": todo,
        "reused": len(reused),
        "reused_bytes": sum(u.nbytes for u in reused),
        "note": "" if note == "resumed" else note,
    }
    group.store.set("todo", json.dumps(state))
    return stop


def _has_size(journal: Journal, name: str, size: int) -> bool:
    path = _file_path(journal, name)
    return os.path.isfile(path) and os.path.getsize(path) == size


def _keep_lease(journal: Journal, stop: threading.Event) -> None:
    while not stop.wait(LEASE_REFRESH_S):
        journal.refresh_lease()


def _file_path(journal: Journal, name: str) -> str:
    return os.path.join(journal.files, name or SINGLE_FILE)


class _Shown:
    """Rank 0's progress bar of the whole output: the bytes of the units every rank
    counts done in the store (each rank adds its own), shown as they grow."""

    def __init__(self, group: Group, progress: Progress | None, reused: int):
        self.group, self.progress = group, progress
        self.reused, self.shown = reused, 0  # units an interrupted run made durable count done

    def done(self, nbytes: int) -> None:
        """This rank made a unit of ``nbytes`` durable."""
        self.group.counter("bytes", nbytes)
        self.update()

    def update(self) -> bool:
        if self.progress is not None:
            total = self.reused + self.group.counter("bytes")
            if total > self.shown:
                self.progress(total - self.shown)
                self.shown = total
        return True


def _work(group: Group, plan: Plan, journal: Journal, todo: list, out: str, shown: _Shown) -> None:
    """Claim units until none is left: write, fsync, journal each."""
    log: UnitLog | None = None
    try:
        log = journal.log(group.rank)
        while True:
            group.check()
            index = group.counter("claimed", 1) - 1
            if index >= len(todo):
                return
            unit = todo[index]
            path = _file_path(journal, plan.files[unit.file].name)
            try:
                with OutputFile(path, offset=unit.start) as sink:
                    runs = unit_mod.write_unit(plan, unit, sink)
                fsync_file(path)
            except OSError as exc:
                needed = sum(f.size for f in plan.files)
                error = write_error(exc, out, os.path.dirname(os.path.abspath(out)), needed)
                if exc.errno in DISK_FULL:  # no rerun can use the work: the disk stays full
                    with contextlib.suppress(OSError):
                        journal.remove()
                raise error from None
            log.record(unit.id, runs)
            group.counter("finished", 1)
            shown.done(unit.nbytes)
    finally:
        if log is not None:
            log.close()


def _finish(
    journal: Journal, plan: Plan, out: str, layout: FolderLayout | None, force: bool
) -> None:
    """Rank 0: the pieces built from CRCs, fsync, then the final names."""
    done = journal.done()
    crcs = unit_mod.piece_crcs(plan, _runs_by_file(plan, done))
    try:
        for index, file in enumerate(plan.files):
            pending = [p.offset for p in file.pieces if p.build is not None]
            if not pending:
                continue
            fd = os.open(_file_path(journal, file.name), os.O_WRONLY)
            try:
                complete(file, Written(dict(crcs[index]), pending), _pwriter(fd))
            finally:
                os.close(fd)
        fsync_tree(journal.files)
        _publish(journal, plan, out, layout, force)
    except OSError as exc:
        raise write_error(exc, out, os.path.dirname(os.path.abspath(out))) from None
    journal.remove()


def _runs_by_file(plan: Plan, done: dict[int, list]) -> list[tuple[int, unit_mod.CrcRun]]:
    size = unit_mod.unit_bytes(plan)
    units = unit_mod.plan_units(plan, size)
    return [(units[uid].file, tuple(run)) for uid, runs in done.items() for run in runs]  # type: ignore[misc]


def _pwriter(fd: int) -> Callable[[int, bytes], None]:
    def patch(offset: int, data: bytes) -> None:
        view = memoryview(data)
        while len(view):
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n

    return patch


def _publish(
    journal: Journal, plan: Plan, out: str, layout: FolderLayout | None, force: bool
) -> None:
    """Move the written files under their final names (nothing is there before)."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    aside = os.path.join(journal.root, "old")
    if layout is None:
        source = _file_path(journal, "")
        if os.path.lexists(out):
            check_replaceable(out, force, want_folder=False)
            if os.path.isdir(out) and not os.path.islink(out):
                os.replace(out, aside)
        os.replace(source, out)
    elif os.path.isdir(out):
        earlier = owned_entries(out, layout, force)
        written = sorted(os.listdir(journal.files), key=lambda n: (n == layout.last, n))
        for name in written:
            os.replace(os.path.join(journal.files, name), os.path.join(out, name))
        for name in earlier:
            if name not in written:
                remove_output(os.path.join(out, name))
        fsync_entry(out)
    else:
        if os.path.lexists(out):
            check_replaceable(out, force, want_folder=True)
            os.replace(out, aside)
        os.replace(journal.files, out)
    fsync_entry(parent)
    with contextlib.suppress(OSError):
        remove_output(aside)
