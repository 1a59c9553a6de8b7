"""A leaf's bytes as an output holds them: one ranged copy for every writer and target.

Stored bytes that need no change are copied from their file straight into the output's
buffers (:func:`write_leaf`) or read a chunk at a time (:func:`iter_chunks`); a cast
without torch goes a window of elements at a time (:mod:`.casts`); a sharded tensor split
along other dims than its first (tensor-parallel columns, 2-D DCP chunks) is made a window
of its leading rows at a time from the rows of the blocks that hold them
(:func:`box_layout`); anything else goes through torch, one tensor at a time.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator
from typing import Any

from ..dtypes import DType
from ..errors import CkptError
from ..progress import Progress
from ..sources import ByteSpan
from ..tree import Leaf, ShardedRef, SparseRef, TensorRef, raw_block
from ..tree import raw_parts as stored_parts  # (the stored tensors; raw_parts here: --dtype too)
from .casts import cast_bytes, cast_stored
from .output_file import OutputFile

CHUNK_BYTES = 16 << 20


def output_dtype(leaf: Leaf, cast: DType | None) -> DType:
    """``--dtype`` casts floating-point tensors only."""
    if cast is not None and leaf.dtype.is_floating:
        return cast
    return leaf.dtype


def output_nbytes(leaf: Leaf, cast: DType | None) -> int:
    """Bytes written for one leaf: a sparse tensor writes its parts, not its dense size."""
    if isinstance(leaf, SparseRef):
        return sum(output_nbytes(part, cast) for part in leaf.parts)
    return leaf.numel * output_dtype(leaf, cast).itemsize


def refuse_sparse(tensors: dict[str, Any], target: str) -> None:
    """Fail before writing anything when ``target`` (safetensors, DCP) cannot hold a
    sparse tensor; densifying it could take far more memory and disk than it does."""
    for name, leaf in tensors.items():
        if isinstance(leaf, SparseRef):
            raise CkptError(
                f"tensor {name!r} is sparse ({leaf.layout}): {target} stores dense tensors only",
                hint="use --to pt, or --select other tensors",
            )


def raw_parts(leaf: Leaf, cast: DType | None) -> list[TensorRef] | None:
    """Stored tensors whose bytes, one after the other, are the leaf's output bytes (None
    when they need torch: a cast, a view, a byte swap; see :func:`~ckpttool.tree.stored_parts`)."""
    if output_dtype(leaf, cast) != leaf.dtype:
        return None
    return stored_parts(leaf)


def tensor_for_write(leaf: Leaf, cast: DType | None) -> Any:
    """The leaf as a contiguous CPU tensor (imports torch), cast if asked by
    :func:`.casts.cast_bytes`, the rule every cast follows."""
    import torch

    from ..tensors import load_leaf, torch_dtype

    tensor = load_leaf(leaf, "cpu").contiguous()
    target = output_dtype(leaf, cast)
    if target == leaf.dtype:
        return tensor
    if not tensor.numel():
        return tensor.to(torch_dtype(target))
    data = cast_bytes(tensor_bytes(tensor), leaf.dtype, target)
    return torch.frombuffer(data, dtype=torch_dtype(target)).view(tensor.shape)  # keeps data


def tensor_bytes(tensor: Any) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (no numpy needed)."""
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


def _stored_bytes(ref: TensorRef) -> ByteSpan:
    """Where a raw part's bytes lie (:func:`raw_parts` gives only tensors that have them)."""
    if ref.storage is None or ref.storage.source is None:
        raise CkptError("tensor has no stored data (saved on the meta device)")
    return ref.storage.source


def _raw_chunks(ref: TensorRef) -> Iterator[memoryview]:
    source, base = _stored_bytes(ref), ref.offset * ref.dtype.itemsize
    for at in range(0, ref.nbytes, CHUNK_BYTES):
        yield memoryview(source.read(base + at, min(CHUNK_BYTES, ref.nbytes - at)))


def iter_chunks(leaf: Leaf, cast: DType | None) -> Iterator[memoryview]:
    """The bytes of one output tensor, in chunks of at most CHUNK_BYTES when copied raw."""
    parts = raw_parts(leaf, cast)
    if parts is not None:
        for ref in parts:
            yield from _raw_chunks(ref)
        return
    stored = stored_parts(leaf)
    if stored is not None:  # only a cast: a window of elements at a time, without torch
        target = output_dtype(leaf, cast)
        yield from cast_stored(stored, leaf.dtype, target, 0, leaf.numel * target.itemsize)
        return
    boxes = box_layout(leaf)
    if boxes is not None:
        yield from box_bytes(boxes, leaf, cast, 0, output_nbytes(leaf, cast))
        return
    tensor = tensor_for_write(leaf, cast)
    yield tensor_bytes(tensor)  # the view keeps no reference: `tensor` lives until here


# A block of a sharded tensor as box_bytes copies it: (offsets, sizes, its stored tensor)
Box = tuple[tuple[int, ...], tuple[int, ...], TensorRef]


def box_layout(leaf: Leaf) -> list[Box] | None:
    """The blocks of a sharded tensor of 2 or more dims, each a stored tensor whose bytes
    are copied as they are (contiguous, its dtype, little endian); None otherwise (a
    cast block, a view, a leaf that is not sharded). Resolves every block."""
    if not isinstance(leaf, ShardedRef) or leaf.incomplete or len(leaf.shape) < 2:
        return None
    boxes = []
    placed = set()  # (a replica of a block another rank saved too: the first one's bytes)
    for shard in leaf.shards:
        sizes = tuple(shard.sizes)
        if (tuple(shard.offsets), sizes) in placed:
            continue
        placed.add((tuple(shard.offsets), sizes))
        count = math.prod(sizes)
        if not count:
            continue
        if getattr(shard.tensor, "cast_to", None) is not None:
            return None
        ref = shard.tensor.tensor_ref()
        if len(shard.offsets) != len(leaf.shape) or not raw_block(ref, leaf, count):
            return None
        boxes.append((tuple(shard.offsets), sizes, ref))
    return boxes


WINDOW_BYTES = 8 << 20


def box_bytes(
    boxes: list[Box], leaf: Leaf, cast: DType | None, start: int, length: int
) -> Iterator[memoryview]:
    """Bytes ``[start, start + length)`` of the leaf's output, a window of leading rows
    at a time: each block's rows in the window are one run of its stored bytes, read and
    placed at its columns (numpy, as bytes: any dtype). Memory: a window and its runs.

    Raises:
        CkptError: The blocks leave part of a window unfilled (or fill it twice).
    """
    import numpy as np

    itemsize = leaf.dtype.itemsize
    target = output_dtype(leaf, cast)
    rows, *rest = leaf.shape
    row_elems = math.prod(rest)
    out_row = row_elems * target.itemsize
    if not out_row or not length:
        return
    per_window = max(1, WINDOW_BYTES // (row_elems * itemsize))
    first, last = start // out_row, -(-(start + length) // out_row)
    for r0 in range(first, last, per_window):
        r1 = min(r0 + per_window, last, rows)
        window = np.empty((r1 - r0, *rest[:-1], rest[-1] * itemsize), np.uint8)
        filled = 0
        for offsets, sizes, ref in boxes:
            lo, hi = max(r0, offsets[0]), min(r1, offsets[0] + sizes[0])
            if lo >= hi:
                continue
            inner = math.prod(sizes[1:])
            source = _stored_bytes(ref)
            at = (ref.offset + (lo - offsets[0]) * inner) * itemsize
            run = source.read(at, (hi - lo) * inner * itemsize)
            block = np.frombuffer(run, np.uint8).reshape(
                hi - lo, *sizes[1:-1], sizes[-1] * itemsize
            )
            where = [slice(lo - r0, hi - r0)]
            where += [slice(o, o + n) for o, n in zip(offsets[1:-1], sizes[1:-1], strict=True)]
            where.append(slice(offsets[-1] * itemsize, (offsets[-1] + sizes[-1]) * itemsize))
            window[tuple(where)] = block
            filled += block.size
        if filled != window.size:
            raise CkptError(
                f"corrupt sharded tensor {list(leaf.shape)}: its blocks fill {filled} of "
                f"{window.size} bytes of rows {r0}..{r1}"
            )
        data: memoryview = window.reshape(-1).data
        if target != leaf.dtype:
            data = cast_bytes(data, leaf.dtype, target)
        lo, hi = max(start - r0 * out_row, 0), min(start + length - r0 * out_row, len(data))
        yield data[lo:hi]


def write_leaf(
    out: OutputFile, leaf: Leaf, cast: DType | None, progress: Progress | None = None
) -> None:
    """Append one tensor's bytes to ``out``.

    Stored bytes that need no change are read from their file straight into the
    output's buffers; anything else goes through torch, one tensor at a time.
    """
    parts = raw_parts(leaf, cast)
    if parts is None:
        for chunk in iter_chunks(leaf, cast):
            out.write(chunk)
            if progress:
                progress(len(chunk))
        return
    for ref in parts:
        _copy_raw(out, ref, progress)


def _copy_raw(out: OutputFile, ref: TensorRef, progress: Progress | None) -> None:
    if not ref.nbytes:  # an empty view may sit past its storage's end (torch allows it)
        return
    source = _stored_bytes(ref)
    if source.data is None:
        start = ref.offset * ref.dtype.itemsize
        if start < 0 or start + ref.nbytes > source.length:
            raise CkptError("read outside of the stored bytes (truncated file?)", path=source.path)
        if source.path is None:  # as ByteSpan.read says
            raise CkptError("tensor bytes have no file")
        source.resolve(out.inputs)
        out.copy_from(source.path, source.offset + start, ref.nbytes, progress)
        return
    for chunk in _raw_chunks(ref):
        out.write(chunk)
        if progress:
            progress(len(chunk))
