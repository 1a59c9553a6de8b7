"""Atomic output: write beside the target, fsync, rename at the end.

An interrupted run (SIGKILL, disk full) leaves no partial output and never
touches the input; a temp file left by a killed run is removed by the next one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator, Sequence

from .errors import CkptError, OutputExistsError

TEMP_MARK = ".ckpttool-tmp-"


def check_output(out: str, inputs: Sequence[str], *, force: bool) -> None:
    """Refuse an existing output without ``force``, and any output that is an input."""
    real_out = os.path.realpath(out)
    for path in inputs:
        real_in = os.path.realpath(path)
        if real_out == real_in or real_in.startswith(real_out + os.sep):
            raise CkptError("output would overwrite the input", path=out, hint="choose another -o")
    if os.path.lexists(out) and not force:
        raise OutputExistsError("output exists", path=out, hint="pass --force to overwrite it")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _clean_stale(folder: str, name: str) -> None:
    """Remove temp outputs of earlier runs that were killed (their pid is gone)."""
    stem = f".{name}{TEMP_MARK}"
    for entry in os.listdir(folder):
        if not entry.startswith(stem):
            continue
        pid = entry[len(stem) :].removeprefix("old-")  # also the old output of a --force run
        if pid.isdigit() and not _alive(int(pid)):
            _remove(os.path.join(folder, entry))


def _alive(pid: int) -> bool:
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
    _fsync(path)


def _fsync_entry(folder: str) -> None:
    """Make a rename in ``folder`` durable: fsync the folder itself, never what it holds.

    Best effort: the output is in place and its data on disk; some file systems
    refuse fsync on a folder.
    """
    with contextlib.suppress(OSError):
        _fsync(folder)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(out: str, *, force: bool, folder: bool = False) -> Iterator[str]:
    """Yield a temp path beside ``out``; on success it becomes ``out`` in one rename.

    Args:
        out: The final file or folder.
        force: Replace an existing ``out``.
        folder: The output is a folder (created empty for the caller).

    Raises:
        OutputExistsError: ``out`` exists and not ``force``.
        CkptError: Writing failed (disk full, file too large, permissions).
    """
    out = os.path.abspath(out)
    parent, name = os.path.split(out)
    created = _missing_folders(parent)  # made for the output: removed again if it fails
    try:
        os.makedirs(parent, exist_ok=True)
        _clean_stale(parent, name)
    except OSError as exc:
        _remove_empty(created)
        raise CkptError(f"cannot create the output folder ({exc.strerror})", path=parent) from None
    tmp = os.path.join(parent, f".{name}{TEMP_MARK}{os.getpid()}")
    _remove(tmp)
    if folder:
        os.mkdir(tmp)
    try:
        yield tmp
        fsync_tree(tmp)
        if os.path.lexists(out):
            if not force:
                raise OutputExistsError("output exists", path=out, hint="pass --force")
            old = os.path.join(parent, f".{name}{TEMP_MARK}old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            _remove(old)
        else:
            os.replace(tmp, out)
    except OSError as exc:
        _remove(tmp)
        _remove_empty(created)
        reason = (
            "disk full or file too large"
            if exc.errno in (errno.ENOSPC, errno.EFBIG)
            else exc.strerror
        )
        raise CkptError(
            f"cannot write the output ({reason}); nothing was written", path=out
        ) from None
    except BaseException:
        _remove(tmp)
        _remove_empty(created)
        raise
    _fsync_entry(parent)


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
