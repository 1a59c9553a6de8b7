"""Shard geometry: where each block of a sharded tensor lies, and whether blocks tile it.

Blocks come from ShardedTensor and DTensor pickles (their per-rank state is read by
:mod:`ckpttool.unpickler.sharded`), DCP chunks, DeepSpeed partitions and Megatron
shards. Every block is a :class:`~ckpttool.tree.leaves.Block`: it names the stored
tensor that holds its elements (``tensor_ref``), which is how a writer copies a sharded
tensor's bytes without torch (:func:`raw_parts`).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence

from ..errors import CkptError
from .leaves import Leaf, Shard, ShardedRef, TensorRef


def check_coverage(key: str, shape: tuple, shards: Sequence[Shard]) -> None:
    """Every element of the global tensor is in exactly one shard."""
    if _row_blocks(shape, shards):
        return
    nonempty = [s for s in shards if math.prod(s.sizes)]  # empty ranks hold nothing
    if _tiles(shape, nonempty, 0):
        return
    total = math.prod(shape)
    covered = 0
    for s in shards:
        if (
            len(s.offsets) != len(shape)
            or len(s.sizes) != len(shape)
            or any(
                o < 0 or n < 0 or o + n > dim
                for o, n, dim in zip(s.offsets, s.sizes, shape, strict=True)
            )
        ):
            raise CkptError(
                f"tensor {key!r}: a shard lies outside the tensor of shape {list(shape)}"
            )
        covered += math.prod(s.sizes)
    if covered > total:
        raise CkptError(f"tensor {key!r}: shards overlap ({covered} elements for {total})")
    if covered < total:
        raise CkptError(
            f"tensor {key!r}: shards cover {covered} of {total} elements "
            "(incomplete checkpoint: a rank file is missing?)"
        )
    if len(nonempty) > MAX_IRREGULAR_SHARDS:  # the pairwise check below is quadratic
        raise CkptError(
            f"tensor {key!r}: {len(nonempty)} shards that do not form a grid (corrupt checkpoint?)"
        )
    for i, a in enumerate(nonempty):
        for b in nonempty[i + 1 :]:
            if all(
                max(ao, bo) < min(ao + an, bo + bn)
                for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
            ):
                raise CkptError(f"tensor {key!r}: shards overlap")


MAX_IRREGULAR_SHARDS = 4096


def _row_blocks(shape: tuple, shards: Sequence[Shard]) -> bool:
    """The commonest layout (FSDP, DCP, DTensor ``Shard(0)``), checked in bulk: every
    shard whole rows, the non-empty ones' row ranges following each other from 0 to
    the end. A 2048-rank checkpoint has millions of shards. False means only "not this
    case": :func:`_tiles` and the general check decide."""
    if not shape or not shards:
        return False
    return row_blocks(shape, list(map(_OFFSETS, shards)), list(map(_SIZES, shards)))


def row_blocks(shape: tuple, offsets: list[tuple], sizes: list[tuple]) -> bool:
    """:func:`_row_blocks` of the blocks at ``offsets`` of ``sizes`` (tuples)."""
    if not shape or not offsets or not math.prod(shape[1:]):
        return False
    tail = tuple(shape[1:])
    # (2-D, the commonest: the second number, no slice made per block)
    rest = operator.itemgetter(1) if len(tail) == 1 else _TAIL
    if (
        set(map(len, offsets)) != {len(shape)}
        or set(map(len, sizes)) != {len(shape)}
        or set(map(rest, sizes)) != {tail[0] if len(tail) == 1 else tail}
        or set(map(rest, offsets)) != {0 if len(tail) == 1 else (0,) * len(tail)}
    ):
        return False
    firsts, counts = list(map(_ROW, offsets)), list(map(_ROW, sizes))
    if set(map(type, firsts)) != {int} or set(map(type, counts)) != {int}:
        return False
    if min(counts) < 0:
        return False
    # the commonest order: the blocks already in row order (then no sort)
    starts = list(itertools.compress(firsts, counts))
    if starts:
        ends = list(map(operator.add, starts, itertools.compress(counts, counts)))
        if starts[0] == 0 and ends[-1] == shape[0] and ends[:-1] == starts[1:]:
            return True
    rows = sorted(itertools.compress(zip(firsts, counts, strict=True), counts))  # non-empty
    if not rows or min(counts) < 0:
        return False
    starts = list(map(_ROW, rows))
    ends = list(map(operator.add, starts, map(_COUNT, rows)))
    return starts[0] == 0 and ends[-1] == shape[0] and ends[:-1] == starts[1:]


_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")
_TAIL, _ROW, _COUNT = (operator.itemgetter(i) for i in (slice(1, None), 0, 1))


def _tiles(shape: tuple, shards: Sequence[Shard], dim: int) -> bool:
    """The layouts sharding produces, checked in n log n: along ``dim`` the shards'
    ranges follow each other from 0 to the end, shards with the same range form a
    group, and each group tiles the dims after it the same way. Blocks of rows (FSDP,
    DCP, DTensor ``Shard(0)``) and grids (tensor parallel x FSDP) are such layouts.
    False means only "not this case": the general check decides."""
    if dim == len(shape):
        return len(shards) == 1
    groups: dict[tuple[int, int], list[Shard]] = {}
    for s in shards:
        if len(s.offsets) != len(shape) or len(s.sizes) != len(shape):
            return False
        groups.setdefault((s.offsets[dim], s.sizes[dim]), []).append(s)
    end = 0
    for start, size in sorted(groups):
        if start != end or size <= 0:
            return False
        end += size
    return end == shape[dim] and all(_tiles(shape, g, dim + 1) for g in groups.values())


def _raw_copy_ok(leaf: Leaf) -> bool:
    """Bytes can be copied as stored: a contiguous on-disk tensor, no byte swap."""
    return (
        isinstance(leaf, TensorRef)
        and leaf.kind != "quantized"
        and not (leaf.conj or leaf.neg)
        and leaf.storage is not None
        and leaf.storage.source is not None
        and not leaf.storage.big_endian
        and leaf.is_contiguous()
    )


def raw_parts(leaf: Leaf) -> list[TensorRef] | None:
    """Stored tensors whose bytes, one after the other, are the leaf's bytes.

    A plain contiguous tensor is its own single part. A sharded tensor whose shards are
    each one run of its row-major elements (split along dim 0, as FSDP, DCP and DTensor
    ``Shard(0)`` split; or cut from a flat buffer, as DeepSpeed ZeRO's partitions) is
    its shards in element order: no torch, no full tensor in memory. None when the
    bytes need torch (a view, a byte swap, blocks split along other dims).
    """
    if isinstance(leaf, TensorRef):
        return [leaf] if _raw_copy_ok(leaf) else None
    if not isinstance(leaf, ShardedRef):
        return None
    runs = flat_runs(leaf)
    if runs is None:
        return None
    parts = []
    for _, count, shard in runs:
        ref = shard.tensor.tensor_ref()
        if not raw_block(ref, leaf, count):
            return None
        parts.append(ref)
    return parts


def flat_runs(leaf: ShardedRef) -> list[tuple[int, int, Shard]] | None:
    """``(first element, element count, shard)`` of every shard, in element order, when
    the shards are runs of the tensor's row-major elements that tile it exactly; None
    otherwise. From the metadata alone: no block is resolved (a writer then resolves
    only the blocks a byte range needs)."""
    runs = []
    for shard in leaf.shards:
        start = _flat_start(leaf.shape, shard.offsets, shard.sizes)
        if start is None:
            return None
        runs.append((start, math.prod(shard.sizes), shard))
    runs.sort(key=lambda run: run[0])
    end = 0
    for start, count, _ in runs:
        if start != end:
            return None
        end += count
    return runs if end == leaf.numel else None


def raw_block(ref: TensorRef, leaf: ShardedRef, count: int) -> bool:
    """A resolved block of ``count`` elements can be copied as stored into the leaf."""
    return _raw_copy_ok(ref) and ref.dtype == leaf.dtype and ref.numel == count


def _flat_start(shape: tuple, offsets: tuple, sizes: tuple) -> int | None:
    """The row-major index of a block's first element, if its elements are one run of the
    tensor's (a few leading indices fixed, a range along one dim, the dims after it whole)."""
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        return None
    whole = len(shape)  # the dims from here on are whole
    while whole and offsets[whole - 1] == 0 and sizes[whole - 1] == shape[whole - 1]:
        whole -= 1
    if any(n != 1 for n in sizes[: max(whole - 1, 0)]):
        return None
    start, stride = 0, 1
    for dim in reversed(range(len(shape))):
        start += offsets[dim] * stride
        stride *= shape[dim]
    return start
