"""Output writers, one module per format. Each streams tensors one at a time, so
memory stays bounded by the largest tensor, never by the checkpoint."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CkptError
from ..tree import DType, TensorRef

Progress = Callable[[int], None]
CHUNK_BYTES = 16 << 20


def output_dtype(leaf: Any, cast: DType | None) -> DType:
    """``--dtype`` casts floating-point tensors only."""
    if cast is not None and leaf.dtype.is_floating:
        return cast
    return leaf.dtype


def _raw_copy_ok(leaf: Any, cast: DType | None) -> bool:
    """Bytes can be copied as stored: a contiguous on-disk tensor, no cast, no byte swap."""
    return (
        isinstance(leaf, TensorRef)
        and leaf.value is None
        and leaf.kind != "quantized"
        and leaf.storage is not None
        and leaf.storage.source is not None
        and not leaf.storage.big_endian
        and leaf.is_contiguous()
        and output_dtype(leaf, cast) == leaf.dtype
    )


def tensor_for_write(leaf: Any, cast: DType | None) -> Any:
    """The leaf as a contiguous CPU tensor, cast if asked (imports torch)."""
    from ..materialize import torch_dtype

    tensor = leaf.load("cpu")
    target = output_dtype(leaf, cast)
    if target != leaf.dtype:
        tensor = tensor.to(torch_dtype(target))
    return tensor.contiguous()


def tensor_bytes(tensor: Any) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (no numpy needed)."""
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


def iter_chunks(leaf: Any, cast: DType | None) -> Iterator[memoryview]:
    """The bytes of one output tensor, in chunks of at most CHUNK_BYTES when copied raw."""
    if _raw_copy_ok(leaf, cast):
        source = leaf.storage.source
        start, size = leaf.offset * leaf.dtype.itemsize, leaf.nbytes
        for at in range(0, size, CHUNK_BYTES):
            yield memoryview(source.read(start + at, min(CHUNK_BYTES, size - at)))
        return
    tensor = tensor_for_write(leaf, cast)
    yield tensor_bytes(tensor)  # the view keeps no reference: `tensor` lives until here


def write_leaf(fd: int, leaf: Any, cast: DType | None, progress: Progress | None = None) -> None:
    """Append one tensor's bytes to the file descriptor ``fd``.

    Raw copies go through ``os.copy_file_range`` (kernel-side, no user-space buffer)
    where the platform allows, else through bounded chunks.
    """
    if not _raw_copy_ok(leaf, cast):
        for chunk in iter_chunks(leaf, cast):
            _write_all(fd, chunk)
            if progress:
                progress(len(chunk))
        return
    source = leaf.storage.source
    start, remaining = leaf.offset * leaf.dtype.itemsize, leaf.nbytes
    if source.data is None and hasattr(os, "copy_file_range"):
        source._resolve()
        src = os.open(source.path, os.O_RDONLY)
        try:
            while remaining:
                try:
                    n = os.copy_file_range(src, fd, min(remaining, 1 << 30), source.offset + start)
                except OSError:
                    break  # unsupported here (old kernel, other file system): chunks below
                if n == 0:
                    raise CkptError("input ends early (truncated)", path=source.path)
                start, remaining = start + n, remaining - n
                if progress:
                    progress(n)
        finally:
            os.close(src)
    while remaining:
        n = min(CHUNK_BYTES, remaining)
        _write_all(fd, memoryview(source.read(start, n)))
        start, remaining = start + n, remaining - n
        if progress:
            progress(n)


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data) :]
