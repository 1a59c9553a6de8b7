"""``convert`` and ``merge`` with several processes: under torchrun, or ``--workers N``.

Every rank runs the same command: reads the input's metadata, plans the output
(the writers' plan: every piece at its offset), then the ranks write it together, a
unit (a fixed-size byte range of an output file) at a time, through the c10d store
torchrun provides (:mod:`.group`, reached with :mod:`.store`'s plain-Python client),
resumably, and rank 0 publishes it (the write itself is :mod:`ckpttool.targets`': its
``ranks``, ``units`` and ``journal``). The bytes are the single-process output's, at any
world size. ``--workers`` starts the processes itself (:mod:`.launch`, no torch).

Nothing here imports torch, except the store of a launcher without torchrun's agent
store (:mod:`.group`); outside torchrun :func:`collective` is a no-op.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from .group import Failed, Group, launched
from .launch import own_launch, run_workers

__all__ = [
    "Failed",
    "Group",
    "collective",
    "current",
    "launched",
    "own_launch",
    "prints_summary",
    "report_errors_with",
    "run_workers",
]

F = TypeVar("F", bound=Callable[..., Any])
EXIT_INTERRUPTED = 130

_current: list[Any] = []  # the Group of the command running now, under torchrun


def current() -> Any:
    """The :class:`.group.Group` of the running command, or None (one process)."""
    return _current[-1] if _current else None


def prints_summary() -> bool:
    """Whether this process prints the summary line: rank 0, or the only process."""
    import os

    return not launched() or os.environ.get("RANK", "0") == "0"


def _store_error(exc: BaseException) -> bool:
    """A failed call to the store: :class:`.store.StoreError` (torchrun's agent store),
    or torch's DistError family (the fallback, where torch is imported already)."""
    import sys

    from .store import StoreError

    if isinstance(exc, StoreError):
        return True
    dist = sys.modules.get("torch.distributed")  # never imported here for this test
    if dist is None:
        return False
    return isinstance(exc, getattr(dist, "DistError", ())) or "TCPStore" in str(exc)


ErrorReport = Callable[[BaseException], int]
_reporters: list[ErrorReport] = []


def report_errors_with(report: ErrorReport) -> None:
    """How the rank whose error is the posted one says it: ``report(exc)`` prints its
    one line and gives the exit code (the CLI's error boundary). It is said before the
    ranks leave together, not after: torchrun ends the other ranks as soon as one
    exits, and a line said after the last one to leave could be cut off."""
    _reporters[:] = [report]


def _said(exc: BaseException, code: int) -> None:
    """``exc`` was reported: from here on it is silent, with its exit code."""
    with contextlib.suppress(AttributeError, TypeError):
        exc.silent = True  # type: ignore[attr-defined]
        exc.exit_code = code  # type: ignore[attr-defined]


def collective(func: F) -> F:
    """Run ``func`` (a verb: convert, merge) as this rank's part of one command.

    Under torchrun the rank joins the group first; the first error of any rank is
    posted: the rank that had it raises it (its one line), every other rank raises
    :class:`Failed` with the same exit code (silent).
    """

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not launched():
            return func(*args, **kwargs)
        from .. import sharing
        from ..errors import CkptError
        from .group import Group

        group = Group()
        _current.append(group)
        try:
            with sharing.joined(group):  # the rank files' scans, dealt among the ranks
                return func(*args, **kwargs)
        except Failed:
            group.leave()
            raise
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                code, message = EXIT_INTERRUPTED, "interrupted"
            elif isinstance(exc, CkptError):
                code, message = exc.exit_code, exc.one_line()
            elif _store_error(exc):  # nothing left to post to: say it here
                raise CkptError(
                    f"lost the conversion's store (torchrun's, at {group.address}): "
                    "its node is gone or stopped answering"
                ) from None
            else:
                code, message = 2, f"{type(exc).__name__}: {exc}"
            try:
                mine = group.post(message, code)
                if mine and _reporters:  # say it before the ranks leave together (below)
                    _said(exc, _reporters[-1](exc))
                group.leave()
            except Exception:  # the store is gone: say it here
                mine = True
            if mine:
                raise
            raise Failed(code) from None
        finally:
            _current.pop()
            group.close()

    return run  # type: ignore[return-value]
