"""Atomic output: write beside the target, fsync, rename at the end.

An interrupted run (SIGKILL, disk full) leaves no partial output and never
touches the input; a temp file left by a killed run is removed by the next one on
the same host that writes into that folder (whatever output it was for; the caller
reports it). Temp names carry the host and the process id: on a file system that
several nodes share, a process id says nothing about another node's processes, so
a node never takes another's running output for a dead run's (docs/folders.md).

``--force`` replaces only what a ckpttool output consists of: the output file, or the
files of a folder output (HF shards and their index, DCP's ``.metadata`` and
``*.distcp``). A folder output goes into an existing folder beside whatever else it
holds; other files are never touched, whatever the flags.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .. import sources
from ..errors import CkptError, OutputExistsError
from ..writers import FOLDER_LAYOUTS, FolderLayout


def _host_name() -> str:
    """This host's name as it goes into temp names: letters, digits, dots and dashes
    only (never the ``_`` that ends it in :data:`TEMP_MARK`)."""
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "localhost"


HOST = _host_name()
# What this host's temp names hold between the output's name and the process id:
# ``.out.pt.ckpttool-tmp-node1_1234`` (and ``..._old-1234``, the old output of a
# --force run, moved aside until the new one is in place)
TEMP_MARK = f".ckpttool-tmp-{HOST}_"
_TEMP_TAIL = re.compile(r"(?:old-)?([1-9]\d{0,9})")  # what follows TEMP_MARK: a pid


def output_path(out: str, default_name: str, *, folder_output: bool) -> str:
    """Where ``-o OUT`` puts the output.

    ``OUT/`` (a trailing slash) or an existing folder means "into this folder": a
    single-file output gets ``default_name`` inside it; a folder output (shards, DCP)
    is written into OUT itself.

    Raises:
        UsageError: OUT is a URL ckpttool cannot write (only ``s3://``; ``file://``
            paths are local).
    """
    if sources.is_url(out):  # s3:// (others are refused there, saying what they lack)
        from .s3 import output_url

        return output_url(out, default_name, folder_output=folder_output)
    out = sources.strip_file_scheme(out)
    into = out.endswith(os.sep) or bool(os.altsep and out.endswith(os.altsep))
    if folder_output:
        return out.rstrip(os.sep + (os.altsep or "")) or out
    if into or os.path.isdir(out):
        return os.path.join(out, default_name)
    return out


def check_output(
    out: str, inputs: Sequence[str], *, force: bool, layout: FolderLayout | None = None
) -> None:
    """Refuse, before any work, an output that would touch an input or replace what it may not.

    Args:
        out: The output file, or the folder of a folder output (``layout``).
        inputs: Every input path (files and folders) the checkpoint was read from.
        force: Replace an earlier output.
        layout: The files of a folder output; None for a single file.

    Raises:
        CkptError: The output would write into, over or beside-and-replace an input, or
            ``--force`` would replace something that is not a checkpoint output.
        OutputExistsError: An earlier output is there and not ``force``.
    """
    if sources.is_url(out):  # what is there is checked when the uploads start
        from .s3 import check_inputs

        check_inputs(out, inputs, layout)
        return
    if layout is None:
        parent = os.path.dirname(os.path.abspath(out))
        if _is_file(parent) and any(_same_file(parent, path) for path in inputs):
            # -o ep0.pt/ of the input ep0.pt: the folder asked for is the input file
            raise CkptError(
                f"-o asks for a folder where the input file {os.path.basename(parent)} is",
                path=parent,
                hint="drop the trailing slash, or name another folder",
            )
    _check_inputs(out, inputs, layout)
    if layout is None:
        parent = os.path.dirname(os.path.abspath(out))
        if _is_file(parent):  # OUT/name asked for a folder where a file is
            _check_replace_file(parent, force)
        elif os.path.isdir(out):
            _check_replace_folder(out, force)
        elif os.path.lexists(out):
            _check_replace_output_file(out, force)
    elif os.path.isdir(out):
        owned_entries(out, layout, force)
    elif os.path.lexists(out):
        _check_replace_file(out, force)


def _check_inputs(out: str, inputs: Sequence[str], layout: FolderLayout | None) -> None:
    real_out = os.path.realpath(out)
    for path in inputs:
        path = sources.strip_file_scheme(path)
        if sources.is_url(path):  # remote: never where a local output is written
            continue
        real_in = os.path.realpath(path)
        touched = real_out == real_in or _inside(real_out, real_in)  # written into an input
        if layout is None or not os.path.isdir(out):
            touched = touched or _inside(real_in, real_out)  # replaced with what it holds
        else:  # written into a folder: only its own files are replaced
            touched = touched or (
                os.path.dirname(real_in) == real_out and layout.owns(os.path.basename(real_in))
            )
        if touched:
            raise CkptError("output would overwrite the input", path=out, hint="choose another -o")


def _same_file(path: str, other: str) -> bool:
    other = sources.strip_file_scheme(other)
    return not sources.is_url(other) and os.path.realpath(path) == os.path.realpath(other)


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip(os.sep) + os.sep)


def _is_file(path: str) -> bool:
    return os.path.lexists(path) and not os.path.isdir(path)


def _check_replace_file(path: str, force: bool) -> None:
    """A file where the output needs a folder: replaced with ``force`` if it is one of ours."""
    if not force:
        raise OutputExistsError(
            "a file is where the output needs a folder",
            path=path,
            hint="pass --force to replace it if it is a checkpoint, or choose another -o",
        )
    if not is_checkpoint_file(path):
        raise CkptError(
            "a file that is not a checkpoint is where the output needs a folder; "
            "--force replaces only what ckpttool writes",
            path=path,
            hint="move it away or choose another -o",
        )


def _check_replace_output_file(path: str, force: bool) -> None:
    """A file where the output goes: replaced with ``force`` if it is a checkpoint
    ckpttool could have written (a notes.txt named by -o never is)."""
    if not force:
        raise OutputExistsError("output exists", path=path, hint="pass --force to overwrite it")
    if not is_checkpoint_file(path):
        raise CkptError(
            "output exists and is not a checkpoint; --force replaces only what ckpttool "
            "writes (safetensors, torch.save files)",
            path=path,
            hint="move it away or choose another -o",
        )


def _check_replace_folder(path: str, force: bool) -> None:
    """A folder where the output needs a file: replaced with ``force`` if it is one of ours."""
    if not force:
        raise OutputExistsError(
            "a folder is where the output needs a file",
            path=path,
            hint="pass --force to replace it if it is a checkpoint, or choose another -o",
        )
    if not is_checkpoint_folder(path):
        raise CkptError(
            "a folder that holds other files is where the output needs a file; "
            "--force replaces only what ckpttool writes",
            path=path,
            hint="move it away or choose another -o",
        )


def owned_entries(folder: str, layout: FolderLayout, force: bool) -> list[str]:
    """The files of an earlier output of this layout in ``folder`` (replaced by this run)."""
    owned = sorted(name for name in os.listdir(folder) if layout.owns(name))
    for name in owned:
        if os.path.isdir(os.path.join(folder, name)) or not os.path.lexists(
            os.path.join(folder, name)
        ):
            raise CkptError(
                f"{name} is a folder where the output writes a file",
                path=folder,
                hint="move it away or choose another -o",
            )
    if owned and not force:
        shown = ", ".join(owned[:3]) + (f" and {len(owned) - 3} more" if len(owned) > 3 else "")
        raise OutputExistsError(
            f"output exists: the folder holds {layout.kind} ({shown})",
            path=folder,
            hint="pass --force to replace them; other files in it stay",
        )
    return owned


def is_checkpoint_file(path: str) -> bool:
    """A file ckpttool writes as an output: safetensors, or a ``torch.save`` zip."""
    from ..formats import is_output_file

    return os.path.isfile(path) and is_output_file(path)


def is_checkpoint_folder(path: str) -> bool:
    """A folder that holds nothing but the files of one folder output (shards, DCP)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return bool(names) and any(
        all(layout.owns(n) and _is_file(os.path.join(path, n)) for n in names)
        for layout in FOLDER_LAYOUTS
    )


def remove_output(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@dataclass(frozen=True)
class StaleTemp:
    """A temporary output of a killed run on this host, removed by a later run.

    Attributes:
        path: What was removed (a file, or a folder output's temp folder).
        nbytes: The bytes it held.
        pid: The process that wrote it.
    """

    path: str
    nbytes: int
    pid: int


def clean_stale_temps(folder: str) -> list[StaleTemp]:
    """Remove the temp outputs of earlier runs on this host whose writer is gone.

    Whatever output they were for: a killed run leaves ``.NAME.ckpttool-tmp-HOST_PID``
    (a folder output's ``.ckpttool-tmp-HOST_PID``), full size, hidden from ``ls``. Its
    writer is gone when that process is not alive, or when the temp is older than this
    host's boot (the id may belong to another process since). Only names that this
    host's ckpttool gives (:data:`TEMP_MARK`, then a pid or ``old-`` and a pid), owned
    by this user, are removed: another host's (a shared file system; its processes
    cannot be checked from here), another user's or program's files never.

    Returns:
        What was removed, for the caller to report (the core prints nothing).
    """
    booted = _boot_time()
    removed = []
    for entry in os.listdir(folder):
        at = entry.rfind(TEMP_MARK)
        if at < 0 or (at > 0 and not entry.startswith(".")):
            continue
        match = _TEMP_TAIL.fullmatch(entry[at + len(TEMP_MARK) :])
        if match is None or int(match.group(1)) > _MAX_PID:
            continue
        pid = int(match.group(1))
        path = os.path.join(folder, entry)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if info.st_uid != os.getuid() or pid == os.getpid():
            continue
        if pid_alive(pid) and (booted is None or info.st_mtime >= booted):
            continue
        nbytes = _tree_bytes(path)
        remove_output(path)
        if not os.path.lexists(path):
            removed.append(StaleTemp(path, nbytes, pid))
    return removed


def _boot_time() -> float | None:
    """When this host booted (Linux ``/proc/stat``), or None where that is not known."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _tree_bytes(path: str) -> int:
    if os.path.isdir(path) and not os.path.islink(path):
        total = 0
        for root, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_size
        return total
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


_MAX_PID = (1 << 31) - 1  # no process has a larger id (os.kill would overflow)


def pid_alive(pid: int) -> bool:
    """Whether a process of this id lives on this host (0 and negative ids name groups)."""
    if not 0 < pid <= _MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_tree(path: str) -> None:
    """fsync a file, or every file of a folder and the folder itself.

    Only for what we wrote (the temp output): it walks the whole folder.
    """
    if os.path.isdir(path) and not os.path.islink(path):
        for entry in os.listdir(path):
            fsync_tree(os.path.join(path, entry))
    fsync_file(path)


def fsync_entry(folder: str) -> None:
    """Make a rename in ``folder`` durable: fsync the folder itself, never what it holds.

    Best effort: the output is in place and its data on disk; some file systems
    refuse fsync on a folder.
    """
    with contextlib.suppress(OSError):
        fsync_file(folder)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(
    out: str,
    *,
    force: bool,
    folder: bool = False,
    layout: FolderLayout | None = None,
    removed: list[StaleTemp] | None = None,
    needed: int | None = None,
) -> Iterator[str]:
    """Yield a temp path beside ``out``; on success it becomes ``out`` in one rename.

    Args:
        out: The final file, or the folder of a folder output.
        force: Replace an earlier output (see :func:`check_output` for what may be replaced).
        folder: The output is a folder: the caller gets an empty temp folder to fill.
        layout: The files of a folder output. Into an existing folder they are moved
            one by one (the ``last`` file last), replacing an earlier run's files of
            the same layout and nothing else; without a layout an existing folder is
            refused.
        needed: The output's bytes, said when the disk is full.

    Raises:
        OutputExistsError: An earlier output is there and not ``force``.
        CkptError: Writing failed (disk full, file too large, permissions), or ``out``
            is something ``--force`` may not replace.
    """
    given, out = out, os.path.abspath(out)  # lines name the output as the user did
    parent, name = os.path.split(out)
    folder = folder or layout is not None
    if folder and os.path.isdir(out):
        if layout is None:
            raise OutputExistsError("output exists", path=out, hint="choose another -o")
        with _into_folder(out, layout, force, removed, needed) as tmp:
            yield tmp
        return
    if not folder and _is_file(parent):  # OUT/name where OUT is a checkpoint file
        _check_replace_file(parent, force)
        with atomic_output(parent, force=force, folder=True, removed=removed, needed=needed) as tmp:
            yield os.path.join(tmp, name)
        return
    created = _missing_folders(parent)  # made for the output: removed again if it fails
    try:
        os.makedirs(parent, exist_ok=True)
        stale = clean_stale_temps(parent)
    except OSError as exc:
        _remove_empty(created)
        raise CkptError(f"cannot create the output folder ({exc.strerror})", path=parent) from None
    if removed is not None:
        removed.extend(stale)
    tmp = os.path.join(parent, f".{name}{TEMP_MARK}{os.getpid()}")
    try:
        remove_output(tmp)
        if folder:
            os.mkdir(tmp)
    except OSError as exc:
        _remove_empty(created)
        raise write_error(exc, given, parent) from None
    try:
        yield tmp
        fsync_tree(tmp)
        if os.path.lexists(out):
            check_replaceable(out, force, want_folder=folder)
            old = os.path.join(parent, f".{name}{TEMP_MARK}old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            remove_output(old)
        else:
            os.replace(tmp, out)
    except OSError as exc:
        remove_output(tmp)
        _remove_empty(created)
        raise write_error(exc, given, parent, needed) from None
    except BaseException:
        remove_output(tmp)
        _remove_empty(created)
        raise
    fsync_entry(parent)


def check_replaceable(out: str, force: bool, *, want_folder: bool) -> None:
    """What is at ``out`` may be replaced by the new output (checked again at the end:
    something may have appeared there while we wrote)."""
    if want_folder:
        _check_replace_file(out, force)
    elif os.path.isdir(out):
        _check_replace_folder(out, force)
    else:
        _check_replace_output_file(out, force)


@contextlib.contextmanager
def _into_folder(
    folder: str,
    layout: FolderLayout,
    force: bool,
    removed: list[StaleTemp] | None = None,
    needed: int | None = None,
) -> Iterator[str]:
    """A folder output written into an existing folder, beside what else it holds.

    The files are written into a temp folder inside it, synced, then moved in one by
    one: the data files first, ``layout.last`` (the index, the metadata) after them,
    then an earlier run's files that this run did not write again (stale shards) go.
    """
    try:
        stale = clean_stale_temps(folder)
    except OSError as exc:
        raise CkptError(
            f"cannot write into the output folder ({exc.strerror})", path=folder
        ) from None
    if removed is not None:
        removed.extend(stale)
    owned_entries(folder, layout, force)
    tmp = os.path.join(folder, f"{TEMP_MARK}{os.getpid()}")
    try:
        remove_output(tmp)
        os.mkdir(tmp)
        yield tmp
        fsync_tree(tmp)
        earlier = owned_entries(folder, layout, force)
        written = sorted(os.listdir(tmp), key=lambda n: (n == layout.last, n))
        for name in written:
            os.replace(os.path.join(tmp, name), os.path.join(folder, name))
        for name in earlier:
            if name not in written:
                remove_output(os.path.join(folder, name))
        os.rmdir(tmp)
    except OSError as exc:
        remove_output(tmp)
        raise write_error(exc, folder, folder, needed) from None
    except BaseException:
        remove_output(tmp)
        raise
    fsync_entry(folder)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def write_error(exc: OSError, out: str, folder: str, needed: int | None = None) -> CkptError:
    """The error of a failed write, naming what the user named: the output, or the
    folder it goes into where that refuses new files, never the hidden temp path; a
    full disk with the bytes the output needs (``needed``) and those free there."""
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CkptError(
            f"cannot write into this folder ({exc.strerror}); nothing was written",
            path=folder,
            hint="choose another -o",
        )
    if exc.errno not in DISK_FULL:
        return CkptError(f"cannot write the output ({exc.strerror}); nothing was written", path=out)
    reason = "disk full or file too large"
    if needed is not None:
        from ..sizes import human_bytes

        reason = f"disk full or file too large: the output needs {human_bytes(needed)}"
        with contextlib.suppress(OSError):
            info = os.statvfs(folder)
            reason += f", {human_bytes(info.f_bavail * info.f_frsize)} free there"
    return CkptError(f"cannot write the output ({reason}); nothing was written", path=out)


def _missing_folders(folder: str) -> list[str]:
    """``folder`` and those of its parents that do not exist yet, outermost first."""
    missing = []
    while folder and not os.path.lexists(folder):
        missing.append(folder)
        up = os.path.dirname(folder)
        if up == folder:
            break
        folder = up
    return missing[::-1]


def _remove_empty(folders: list[str]) -> None:
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # only if still empty: never what someone else put there
