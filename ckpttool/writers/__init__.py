"""Output writers, one module per format. Each streams tensors one at a time, so
memory stays bounded by the largest tensor, never by the checkpoint."""

from __future__ import annotations

import ctypes
import errno
import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CkptError
from ..tree import DType, OpenFiles, TensorRef

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


def raw_parts(leaf: Any, cast: DType | None) -> list[TensorRef] | None:
    """Stored tensors whose bytes, one after the other, are the leaf's output bytes.

    A plain contiguous tensor is its own single part. A sharded tensor split along
    dim 0 only (FSDP, DCP and DTensor ``Shard(0)`` all are) is its shards in offset
    order: no torch, no full tensor in memory. None when the bytes need torch
    (a cast, a view, a byte swap, blocks split along other dims).
    """
    if isinstance(leaf, TensorRef):
        return [leaf] if _raw_copy_ok(leaf, cast) else None
    if not getattr(leaf, "sharded", False) or output_dtype(leaf, cast) != leaf.dtype:
        return None
    parts = []
    for shard in sorted(leaf.shards, key=lambda s: s.offsets):
        if any(shard.offsets[1:]) or tuple(shard.sizes[1:]) != tuple(leaf.shape[1:]):
            return None
        block = shard.tensor
        ref = block if isinstance(block, TensorRef) else block.tensor_ref()
        if not _raw_copy_ok(ref, None) or ref.dtype != leaf.dtype:
            return None
        parts.append(ref)
    return parts


def _raw_chunks(ref: TensorRef, start: int = 0) -> Iterator[memoryview]:
    source, base = ref.storage.source, ref.offset * ref.dtype.itemsize
    for at in range(start, ref.nbytes, CHUNK_BYTES):
        yield memoryview(source.read(base + at, min(CHUNK_BYTES, ref.nbytes - at)))


def iter_chunks(leaf: Any, cast: DType | None) -> Iterator[memoryview]:
    """The bytes of one output tensor, in chunks of at most CHUNK_BYTES when copied raw."""
    parts = raw_parts(leaf, cast)
    if parts is not None:
        for ref in parts:
            yield from _raw_chunks(ref)
        return
    tensor = tensor_for_write(leaf, cast)
    yield tensor_bytes(tensor)  # the view keeps no reference: `tensor` lives until here


class OutputFile:
    """An output file written front to back, its pages sent to disk while we go on.

    ``atomic_output`` fsyncs before its rename. Left alone, the kernel holds most of
    a multi-GB output as dirty pages until then, and the fsync waits for all of it.
    Every ``WRITEBACK_BYTES`` we ask the kernel to start writing what we have so far
    (Linux ``sync_file_range``, without waiting), so the disk works while we copy and
    the final fsync waits only for the tail. Elsewhere the fsync does it all, as before.
    """

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0
        self._written_back = 0
        self.inputs = OpenFiles()  # the files we copy from

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inputs.close()
        os.close(self.fd)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        while len(view):
            view = view[os.write(self.fd, view) :]
        self._advance(n)

    def patch(self, offset: int, data: bytes) -> None:
        """Overwrite bytes already written (a header field known only after its data)."""
        if os.pwrite(self.fd, data, offset) != len(data):
            raise OSError(errno.EIO, "short write")

    def crc32(self, offset: int, nbytes: int, buffer: bytearray) -> int:
        """CRC-32 of bytes already written, read back from the page cache through ``buffer``.

        Safe to call from another thread while the file grows: reads are positional.
        """
        view, crc, done = memoryview(buffer), 0, 0
        while done < nbytes:
            n = os.preadv(self.fd, [view[: min(nbytes - done, len(view))]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, "output shorter than written")
            crc = zlib.crc32(view[:n], crc)
            done += n
        return crc

    def _advance(self, n: int) -> None:
        self.pos += n
        if self.pos - self._written_back >= WRITEBACK_BYTES:
            _start_writeback(self.fd, self._written_back, self.pos - self._written_back)
            self._written_back = self.pos

    def copy_from(self, path: str, offset: int, nbytes: int, progress: Progress | None) -> int:
        """Copy ``nbytes`` at ``offset`` of ``path`` kernel-side; return how many were copied.

        Fewer than asked (0 included) where ``copy_file_range`` is unsupported (old
        kernel, another file system): the caller copies the rest through memory.
        """
        if not hasattr(os, "copy_file_range"):
            return 0
        done, src = 0, self.inputs.fd(path)
        while done < nbytes:
            try:
                n = os.copy_file_range(
                    src, self.fd, min(nbytes - done, WRITEBACK_BYTES), offset + done
                )
            except OSError:
                break
            if n == 0:
                raise CkptError("input ends early (truncated)", path=path)
            done += n
            self._advance(n)
            if progress:
                progress(n)
        return done


WRITEBACK_BYTES = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages, do not wait
_sync_file_range: Any = None  # resolved on first use; False where unavailable


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    global _sync_file_range
    if _sync_file_range is None:
        try:
            func = ctypes.CDLL(None, use_errno=True).sync_file_range
            func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sync_file_range = func
        except (AttributeError, OSError):  # not Linux/glibc: the final fsync does it all
            _sync_file_range = False
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # a failure only costs speed


def write_leaf(
    out: OutputFile, leaf: Any, cast: DType | None, progress: Progress | None = None
) -> None:
    """Append one tensor's bytes to ``out``.

    Raw copies go through ``os.copy_file_range`` (kernel-side, no user-space buffer)
    where the platform allows, else through bounded chunks.
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
    source = ref.storage.source
    done = 0
    if source.data is None:
        source.resolve(out.inputs.fd(source.path))
        start = source.offset + ref.offset * ref.dtype.itemsize
        done = out.copy_from(source.path, start, ref.nbytes, progress)
    for chunk in _raw_chunks(ref, done):
        out.write(chunk)
        if progress:
            progress(len(chunk))
