"""A leaf's bytes as an output holds them: one ranged copy for every writer and target.

Stored bytes that need no change are copied from their file straight into the output's
buffers (:func:`write_leaf`) or read a chunk at a time (:func:`iter_chunks`); a cast
without torch goes a window of elements at a time (:mod:`.casts`); anything else goes
through torch, one tensor at a time.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

from ..dtypes import DType
from ..errors import CkptError
from ..progress import Progress
from ..sources import ByteSpan
from ..tree import Leaf, SparseRef, TensorRef
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
    tensor = tensor_for_write(leaf, cast)
    yield tensor_bytes(tensor)  # the view keeps no reference: `tensor` lives until here


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
