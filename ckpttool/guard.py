"""What one pickle read may cost, and what it calls: state the stand-ins report to.

The restricted unpickler runs in C; the only code of ours it runs is the stand-ins
it hands out. They report here, per thread (a context variable), while
:func:`ckpttool.unpickler.load_pickle` has a read open:

* calls of globals on no allow-list (REDUCE, INST, OBJ of a class: the real
  ``__init__`` would run) and of objects (the real ``__call__`` would run), which
  make the file dangerous;
* what constructors build from their arguments (``list(x)``, ``bytes(n)``): a few
  bytes of pickle can call ``list`` on one shared million-item list a thousand
  times, so every constructor charges a budget proportional to the pickle's size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

from .errors import CkptError

# A pickle may build this many items or bytes through constructors, per byte of pickle,
# on top of BASE_BUDGET: real checkpoints call constructors on small arguments only.
BUDGET_PER_BYTE = 16
BASE_BUDGET = 1 << 22


@dataclass
class ReadGuard:
    """One pickle read's record: what it called, what it may still build."""

    budget: int
    called: set[str] = field(default_factory=set)


_CURRENT: ContextVar[ReadGuard | None] = ContextVar("ckpttool_read_guard", default=None)


@contextlib.contextmanager
def guarded_read(pickle_size: int) -> Iterator[ReadGuard]:
    """The guard for one read of a pickle of ``pickle_size`` bytes."""
    guard = ReadGuard(BASE_BUDGET + BUDGET_PER_BYTE * max(pickle_size, 0))
    token = _CURRENT.set(guard)
    try:
        yield guard
    finally:
        _CURRENT.reset(token)


def note_call(name: str) -> None:
    """Record that the pickle being read calls ``name``."""
    guard = _CURRENT.get()
    if guard is not None:
        guard.called.add(name)


def charge(amount: int) -> None:
    """Count ``amount`` items or bytes a constructor is about to build.

    Raises:
        CkptError: The pickle builds far more than its size can explain.
    """
    guard = _CURRENT.get()
    if guard is None:
        return
    guard.budget -= amount
    if guard.budget < 0:
        raise CkptError("corrupt pickle: its constructors build far more data than it holds")
