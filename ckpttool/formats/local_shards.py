"""A pickled ShardedTensor's or DTensor's own shards (:class:`LocalShards`), found and
replaced by :class:`ShardedRef` s: what per-rank files and torch 1.13's DCP share, one
floor below both (neither family imports the other)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..tree import Node, Shard, ShardedRef, check_coverage, replace_leaves, walk
from ..unpickler import LocalShards, own_dtensor_block


def has_local_shards(root: Any) -> bool:
    return any(isinstance(v, LocalShards) for _, v in walk(root))


def local_shards(root: Node) -> list[tuple[tuple, LocalShards]]:
    """Every local-shards leaf and its key path, in the order
    :func:`replace_local_shards` replaces them."""
    found: list[tuple[tuple, LocalShards]] = []

    def note(path: tuple, local: LocalShards) -> LocalShards:
        found.append((path, local))
        return local  # (unchanged: nothing in the tree is replaced)

    replace_local_shards(root, (), note)
    return found


def replace_local_shards(node: Node, path: tuple, make: Callable[[tuple, LocalShards], Any]) -> Any:
    """``node`` with every local-shards leaf replaced by ``make(key path, leaf)``
    (:func:`~ckpttool.tree.replace_leaves`)."""
    return replace_leaves(node, path, LocalShards, make)


def lone_rank_shards(node: Node, path: tuple = ()) -> Any:
    """``node`` with every local-shards leaf a :class:`ShardedRef` of only the blocks
    it holds itself: for sharded tensors pickled where no other rank's file can
    complete them. DCP of torch 1.13 pickled a nested dict whole, from the
    coordinator alone, ShardedTensors and all. With one rank that is the whole
    tensor; otherwise the ref says what is missing, and reading it is refused.
    A value without any is returned as it is (no containers rebuilt)."""
    if not has_local_shards(node):
        return node
    return replace_local_shards(node, path, _lone_rank_ref)


def _lone_rank_ref(path: tuple, local: LocalShards) -> ShardedRef:
    key = ".".join(str(k) for k in path)
    if local.kind == "dtensor":
        shards = [own_dtensor_block(key, local, local.rank)]
    else:
        shards = local.shards
    shards = [s for s in shards if math.prod(s.sizes)]
    covered, total = sum(math.prod(s.sizes) for s in shards), math.prod(local.shape)
    incomplete = None
    if covered < total:
        whose = f"rank {local.rank}'s" if isinstance(local.rank, int) else "one rank's"
        incomplete = (
            f"holds {whose} shards only ({covered} of {total} elements): "
            "the other ranks' were not saved with it"
        )
    else:
        check_coverage(key, local.shape, shards)
    return global_ref(local, shards, local.world_size, incomplete)


def global_ref(
    local: LocalShards,
    shards: Sequence[Shard],
    world_size: int | None,
    incomplete: str | None = None,
) -> ShardedRef:
    """The global tensor ``local`` is a part of, made of ``shards``."""
    return ShardedRef(
        dtype=local.dtype,
        shape=local.shape,
        shards=shards,
        device=local.device,
        kind=local.kind,
        requires_grad=local.requires_grad,
        world_size=world_size,
        incomplete=incomplete,
    )
