"""Tensors rebuilt from DeepSpeed ZeRO's flat partitions, lazily.

ZeRO keeps each parameter group's fp32 master weights (and the optimizer's moments) as
one flat 1-D tensor per rank. A parameter is a run of elements of that flat space: in
ZeRO-1/2 a slice of the group's flat buffer, split between ranks where a partition
ends; in ZeRO-3 one slice per rank of each rank's own flat buffer. Each run of elements
is cut into the few rectangular blocks of the parameter's shape it covers, so the
parameter becomes a :class:`~ckpttool.tree.ShardedRef` whose shards are views into the
stored partitions: nothing is read until the tensor is written, and then only its bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ...dtypes import DTYPES, DType
from ...errors import CkptError
from ...tree import Shard, ShardedRef, TensorRef, check_coverage, contiguous_stride

# what ShardedRef.kind says of a tensor rebuilt from ZeRO partitions (inspect shows it)
ZERO_KIND = "zero"


@dataclasses.dataclass(frozen=True)
class Piece:
    """``count`` elements of one rank's flat tensor, from element ``start`` of it."""

    rank: int
    flat: TensorRef
    start: int
    count: int


def flat_span(flat: TensorRef, start: int, count: int, where: str) -> TensorRef:
    """Elements ``[start, start + count)`` of a stored 1-D tensor, as a 1-D view of it."""
    if len(flat.shape) != 1 or not flat.is_contiguous():
        raise CkptError(f"{where}: a flat partition of shape {list(flat.shape)} is not 1-D")
    if start < 0 or count < 0 or start + count > flat.shape[0]:
        raise CkptError(
            f"{where}: elements {start}..{start + count} lie past the end of a flat "
            f"partition of {flat.shape[0]} (corrupt or mismatched checkpoint?)"
        )
    return dataclasses.replace(flat, shape=(count,), stride=(1,), offset=flat.offset + start)


def blocks(shape: tuple[int, ...], start: int, count: int) -> list[tuple[tuple, tuple, int]]:
    """Cut the row-major elements ``[start, start + count)`` of ``shape`` into rectangular
    blocks: (offsets, sizes, element offset into the run), in order. Each block is
    contiguous in row-major order: a few leading indices fixed, a range along one dim,
    every element of the dims after it; at most 2 * ndim - 1 blocks."""
    if not shape:
        return [((), (), 0)] if count else []
    out: list[tuple[tuple, tuple, int]] = []
    strides = contiguous_stride(shape)
    pos, end = start, start + count
    while pos < end:
        # the largest aligned block starting at pos that fits before end
        for dim in range(len(shape)):
            step = strides[dim]
            index = (pos // step) % shape[dim]
            if pos % step == 0:
                rows = min(shape[dim] - index, (end - pos) // step)
                if rows >= 1:
                    break
        else:  # unreachable: the last dim has step 1
            raise CkptError("internal error cutting a flat range into blocks")
        offsets = tuple((pos // strides[d]) % shape[d] for d in range(len(shape)))
        sizes = tuple(1 if d < dim else (rows if d == dim else shape[d]) for d in range(len(shape)))
        out.append((offsets, sizes, pos - start))
        pos += rows * step
    return out


def rebuild(key: str, shape: tuple[int, ...], pieces: list[Piece], world_size: int) -> ShardedRef:
    """A parameter of ``shape`` whose row-major elements are ``pieces``, one after another.

    Raises:
        CkptError: The pieces do not hold exactly the parameter's elements, or their
            dtypes differ.
    """
    numel = math.prod(shape)
    held = sum(p.count for p in pieces)
    if held != numel:
        raise CkptError(
            f"tensor {key!r}: the ZeRO partitions hold {held} of its {numel} elements "
            "(corrupt or mismatched checkpoint?)"
        )
    dtypes = {p.flat.dtype.name for p in pieces}
    if len(dtypes) > 1:
        raise CkptError(f"tensor {key!r}: its partitions have different dtypes {sorted(dtypes)}")
    dtype = pieces[0].flat.dtype if pieces else DTYPES["float32"]
    shards: list[Shard] = []
    at = 0
    for piece in pieces:
        if not piece.count:
            continue
        for offsets, sizes, into in blocks(shape, at, piece.count):
            span = flat_span(piece.flat, piece.start + into, math.prod(sizes), key)
            block = dataclasses.replace(span, shape=sizes, stride=contiguous_stride(sizes))
            shards.append(Shard(offsets, sizes, block, rank=piece.rank))
        at += piece.count
    check_coverage(key, shape, shards)
    return ShardedRef(dtype, shape, shards, kind=ZERO_KIND, world_size=world_size)


def split_run(
    stream: list[tuple[int, TensorRef, int]], start: int, count: int, where: str
) -> list[Piece]:
    """The pieces of elements ``[start, start + count)`` of a stream of flat tensors laid
    one after another, each ``(rank, flat, length)`` contributing its first ``length``
    elements (the rest of a flat tensor is alignment padding)."""
    pieces = []
    base = 0
    for rank, flat, length in stream:
        lo, hi = max(start, base), min(start + count, base + length)
        if lo < hi:
            flat_span(flat, lo - base, hi - lo, where)  # checked here, cut later
            pieces.append(Piece(rank, flat, lo - base, hi - lo))
        base += length
    if sum(p.count for p in pieces) != count:
        raise CkptError(
            f"{where}: elements {start}..{start + count} lie past the end of the flat "
            f"partitions ({base} elements; corrupt or mismatched checkpoint?)"
        )
    return pieces


class CastTensor:
    """A stored tensor read as another dtype (zero_to_fp32 gives buffers in fp32)."""

    def __init__(self, ref: TensorRef, dtype: DType):
        self.ref = ref
        self.dtype = dtype
        self.cast_to: DType | None = dtype
        self.shape = ref.shape

    def tensor_ref(self) -> TensorRef:
        return self.ref


def as_float32(ref: Any) -> Any:
    """A floating tensor as float32, lazily; anything else as it is."""
    fp32 = DTYPES["float32"]
    if not isinstance(ref, TensorRef) or not ref.dtype.is_floating or ref.dtype == fp32:
        return ref
    shard = Shard((0,) * len(ref.shape), ref.shape, CastTensor(ref, fp32))
    return ShardedRef(fp32, ref.shape, [shard], device=ref.device, kind="cast")
