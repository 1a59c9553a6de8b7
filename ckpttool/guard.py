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

And what the C unpickler may allocate on its own, before any of that runs
(:func:`address_space_limit`).
"""

from __future__ import annotations

import contextlib
import threading
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
    # how the pickle used those of ``called`` that it did not call (BUILD on a global)
    uses: dict[str, str] = field(default_factory=dict)


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


# How a pickle uses a global that makes it refused, where it is not a plain call (the
# reason shown for it; a plain call is "called")
CONSTRUCTED = "constructed (NEWOBJ: its __new__ and __setstate__ would run)"
BUILD_ON_GLOBAL = "given BUILD state (the global itself changed)"
MUTATED = "changed by SETITEM/APPEND (a module-level object)"
CLASS_SWAP = "given a __class__ or __dict__ by BUILD (a class swap)"
MAKES_CLASS = "made a class of (a metaclass instantiated)"


def note_call(name: str, use: str | None = None) -> None:
    """Record that the pickle being read calls ``name`` (or uses it so: ``use``, one of
    the uses above): the file is refused at the end of the read."""
    guard = _CURRENT.get()
    if guard is not None:
        guard.called.add(name)
        if use is not None:
            guard.uses.setdefault(name, use)


def note_build_on_global(name: str) -> None:
    """Record that the pickle gives the global ``name`` itself BUILD state: the real
    unpickler would change that module, class or function for the rest of the process
    (picklescan's "module override"). No checkpoint does: refused like a call."""
    note_call(name, BUILD_ON_GLOBAL)


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


# While the C unpickler runs, the process may map this much more than it had, plus
# UNPICKLE_SPACE_PER_BYTE per byte of pickle: what the objects of any real pickle take.
UNPICKLE_SPACE_BASE = 256 << 20
UNPICKLE_SPACE_PER_BYTE = 32


# The limit is the process's: one read sets it at a time (reads in other threads wait,
# a read inside a read keeps the outer one's), and each restores what it found.
_LIMIT_LOCK = threading.RLock()
_limit_depth = 0


@contextlib.contextmanager
def address_space_limit(pickle_size: int) -> Iterator[None]:
    """Bound what CPython's C unpickler itself may allocate while it reads one pickle.

    Some of its allocations follow numbers in the file and happen before any code of
    ours runs: a LONG_BINPUT or PUT index of a billion makes it grow its memo table to
    that many slots and zero them (16 GB from an 888-byte pickle). Nothing short of
    parsing every opcode in Python (many times slower) can look at them first, so the
    process's address space is capped for the duration: such an allocation fails as a
    MemoryError, reported as a corrupt file. A no-op where the platform has no limits.
    """
    global _limit_depth
    with _LIMIT_LOCK:
        if _limit_depth:
            yield
            return
        try:
            import resource

            with open("/proc/self/statm", "rb") as f:
                mapped = int(f.read().split()[0]) * resource.getpagesize()
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        except (ImportError, OSError, ValueError):
            yield
            return
        cap = mapped + UNPICKLE_SPACE_BASE + UNPICKLE_SPACE_PER_BYTE * max(pickle_size, 0)
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        if soft != resource.RLIM_INFINITY and soft <= cap:
            yield  # already tighter than ours
            return
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
        _limit_depth += 1
        try:
            yield
        finally:
            _limit_depth -= 1
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
