"""Reading that the processes of one command share (under torchrun or ``--workers``).

Some of what every process reads before converting costs each of them the same: the
globals scan of every other rank file of a checkpoint saved by thousands of ranks is
one (every ShardedTensor rank file names every rank's shards, so N ranks scanning N
files each is N-squared work). Under several processes, :func:`my_share` gives each
its share of such a list and :func:`gather` hands every process all the results; in one
process the share is the whole list. :mod:`ckpttool.distributed` joins its group here
(:func:`joined`) while its command runs; the core never imports it.

Every process must make the same calls in the same order (they run the same command
on the same inputs, so they do): a gather is a collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class Members(Protocol):
    """The processes of one command, as the distributed group presents them."""

    rank: int
    size: int

    def all_gather(self, value: Any) -> list[Any]:
        """Every process's ``value`` (plain data), in rank order."""
        ...

    def each_gathered(self, value: Any) -> Iterator[Any]:
        """The same, one process's value at a time (never all held at once)."""
        ...


_joined: list[Members] = []


@contextmanager
def joined(members: Members) -> Iterator[None]:
    """Share the reading with ``members`` while the block runs."""
    _joined.append(members)
    try:
        yield
    finally:
        _joined.pop()


def shared() -> bool:
    """Whether several processes share this command's reading."""
    return bool(_joined) and _joined[-1].size > 1


def my_share(count: int) -> range:
    """The indices, of ``count`` jobs, that this process does."""
    if not shared():
        return range(count)
    members = _joined[-1]
    return range(members.rank, count, members.size)


def largest_share(count: int) -> int:
    """How many of ``count`` jobs the busiest process does (the same in every process)."""
    size = _joined[-1].size if shared() else 1
    return -(-count // size)


def gather(mine: dict[int, Any]) -> dict[int, Any]:
    """Every process's results (``{index: result}``, plain data) merged: ``mine`` in one
    process."""
    if not shared():
        return mine
    merged: dict[int, Any] = {}
    for theirs in _joined[-1].all_gather(mine):
        merged.update(theirs)
    return merged


def gather_each(mine: dict[int, Any]) -> Iterator[tuple[int, Any]]:
    """Every process's results, as :func:`gather`, but one ``(index, result)`` at a time
    and one process's results held at a time (a large exchange). Iterate to the end:
    it is a collective."""
    if not shared():
        yield from mine.items()
        return
    for theirs in _joined[-1].each_gathered(mine):
        yield from theirs.items()
