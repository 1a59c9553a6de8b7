"""The globals a user trusts (``--allow``, ``allow=[...]``, torch's ``add_safe_globals``),
while one command or API call runs: a context variable :mod:`ckpttool.unpickler.policy` reads.
What may be allowed, and what it changes, is decided there."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import ParamSpec, TypeVar


@dataclass(frozen=True)
class AllowList:
    """Globals a user trusts: exact names (``pkg.mod.Class``) and module prefixes
    (``pkg.mod.*``: every global under ``pkg.mod``)."""

    names: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()  # each ends with "."

    def matches(self, full: str) -> bool:
        return full in self.names or full.startswith(self.prefixes)

    def __or__(self, other: AllowList) -> AllowList:
        prefixes = tuple(dict.fromkeys(self.prefixes + other.prefixes))
        return AllowList(self.names | other.names, prefixes)

    def __bool__(self) -> bool:
        return bool(self.names or self.prefixes)


NOTHING_ALLOWED = AllowList()
ALLOWED: ContextVar[AllowList] = ContextVar(
    "ckpttool_allowed",
    default=NOTHING_ALLOWED,  # noqa: B039  (frozen: an immutable value)
)


@contextlib.contextmanager
def allowing(allow: AllowList | None) -> Iterator[None]:
    """Trust ``allow``'s globals (with those already trusted) while the block runs."""
    if not allow:
        yield
        return
    token = ALLOWED.set(ALLOWED.get() | allow)
    try:
        yield
    finally:
        ALLOWED.reset(token)


P = ParamSpec("P")
R = TypeVar("R")


def keep_allowed(function: Callable[P, R]) -> Callable[P, R]:
    """``function``, run later (a lazy read of another rank's file) with the globals
    trusted now."""
    allow = ALLOWED.get()
    if not allow:
        return function

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with allowing(allow):
            return function(*args, **kwargs)

    return wrapper
