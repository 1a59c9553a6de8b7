"""Tensors read straight into their final memory: a model's parameters, a GPU, a merged tensor.

Used inside a load session (:func:`ckpttool.tensors.mapped.loading`). A CPU destination gets
the bytes with ``preadv`` straight from the page cache (or, for a URL, from its
source's ranged reads; see :mod:`ckpttool.sources.spans`); a CUDA one through pinned buffers
that reader threads fill while the buffers filled before are copied to the device
(:class:`CudaStager`), never through a CPU copy of the whole tensor.
"""

from __future__ import annotations

import collections
import ctypes
import math
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .. import sources
from ..dtypes import DType
from ..errors import CkptError
from ..sources import local_fd
from ..tree import ShardedRef, StorageRef, TensorRef
from .mapped import LoadSession, current_session, map_storage
from .stored import as_saved, place, read_cpu, storage_bytes, target_device, torch_dtype

# 8 x 8 MiB: enough for the reader threads and the copies in flight. Pinning is slow
# (~2.6 GB/s on an H100 machine: 8 x 16 MiB cost 49 ms on a process's first load), and
# larger buffers gained nothing once pinned.
STAGING_BUFFERS = 8
STAGING_BYTES = 8 << 20
# threads reading local files into the staging buffers; 1: the caller's thread alone
READ_THREADS = 4
# chunks under this are read by the caller's thread (a thread's hand-off costs more)
THREAD_MIN_BYTES = 1 << 20
# chunks queued for the threads at most (each holds a descriptor until it is read)
MAX_PENDING = 2 * STAGING_BUFFERS


def bytes_view(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (valid while ``t`` lives)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (same storage)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class CudaStager:
    """Host-to-device copies through ``STAGING_BUFFERS`` pinned buffers on a side stream.

    A chunk of a local file is read into a free buffer by one of ``READ_THREADS``
    threads, which then queues its copy to the device: copying out of the page cache
    is what bounds one thread (a few GB/s), and several overlap each other and the
    copies. Chunks of URLs and small chunks are read by the caller's thread. A buffer
    is reused once the copy out of it has landed (its event).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # (buffer, event of the last copy out of it or None): taken by a reader, put back.
        # Made when none is free, up to STAGING_BUFFERS: pinning memory costs about as
        # much as reading it, and a small checkpoint needs one or two.
        self.free: queue.SimpleQueue[tuple[torch.Tensor, Any]] = queue.SimpleQueue()
        self.made = 0
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(READ_THREADS, "ckpttool-read") if READ_THREADS > 1 else None
        self.jobs: collections.deque[Future[None]] = collections.deque()

    def fill(
        self, dest: torch.Tensor, session: LoadSession, storage: StorageRef, start: int
    ) -> None:
        """Copy the bytes of ``storage`` from ``start`` into the flat uint8 CUDA ``dest``."""
        # dest was allocated on the current stream: the copies must come after that
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        dest.record_stream(self.stream)
        source, size = storage.source, dest.numel()
        assert source is not None
        fd = self._local_fd(session, source, start, size)
        for done in range(0, size, STAGING_BYTES):
            part = dest[done : done + STAGING_BYTES]
            if fd is None:  # a URL or bytes in memory: through the session's reader
                self._stage(part, session.reader.read_into, source, start + done)
                continue
            at = source.offset + start + done
            if self.pool is None or part.numel() < THREAD_MIN_BYTES:
                self._stage(part, _read_fd, fd, at, source.path)
                continue
            while len(self.jobs) >= MAX_PENDING:  # bounded: each holds a descriptor
                self.jobs.popleft().result()
            # a descriptor of its own: the session may close its copy (least recently
            # used) while the read is queued, and the number could then name another file
            own = os.dup(fd)
            self.jobs.append(self.pool.submit(self._stage_from_fd, part, own, at, source.path))
        if fd is not None:
            sources.LOCAL.count(size)

    def _local_fd(self, session: LoadSession, source: Any, start: int, size: int) -> int | None:
        """The open descriptor of a local file span (its zip entry's offset resolved, its
        bounds checked), or None where its bytes come another way (URL, in memory)."""
        if source.data is not None or source.path is None:
            return None
        files = session.reader.files
        fd = local_fd(source.path, files)
        if fd is None:
            return None
        if start < 0 or start + size > source.length:
            raise CkptError("read outside of the stored bytes (truncated file?)", path=source.path)
        source.resolve(files)
        return fd

    def _stage(self, part: torch.Tensor, read: Any, *where: Any) -> None:
        """Read ``part``'s bytes into a free buffer (``read(*where, view)``), queue its copy."""
        buffer, event = self._take()
        try:
            if event is not None:
                event.synchronize()  # the last copy out of this buffer is done
            chunk = buffer[: part.numel()]
            read(*where, bytes_view(chunk))
            with torch.cuda.stream(self.stream):
                part.copy_(chunk, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        finally:
            self.free.put((buffer, event))

    def _take(self) -> tuple[torch.Tensor, Any]:
        """A free buffer: one put back, a new one while fewer than STAGING_BUFFERS exist,
        else the next one put back."""
        try:
            return self.free.get_nowait()
        except queue.Empty:
            with self.lock:
                make = self.made < STAGING_BUFFERS
                self.made += make
            if make:
                return torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True), None
            return self.free.get()

    def _stage_from_fd(self, part: torch.Tensor, fd: int, offset: int, path: str | None) -> None:
        try:
            self._stage(part, _read_fd, fd, offset, path)
        finally:
            os.close(fd)

    def finish(self) -> None:
        """Wait until every read and copy landed (the buffers are then free to go).

        Raises:
            CkptError: A read failed (the first one; the others are waited for).
        """
        failure = None
        while self.jobs:
            try:
                self.jobs.popleft().result()
            except Exception as exc:  # noqa: BLE001 (re-raised below, once all are done)
                failure = failure or exc
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Finish, then stop the reader threads."""
        try:
            self.finish()
        finally:
            if self.pool is not None:
                self.pool.shutdown()


def _read_fd(fd: int, offset: int, path: str | None, view: memoryview) -> None:
    try:
        sources.read_fd_into(fd, view, offset, path)
    except OSError as exc:
        raise CkptError(f"cannot read ({exc.strerror or exc})", path=path) from None


def _stager(session: LoadSession, device: torch.device) -> CudaStager:
    key = str(device)
    if key not in session.stagers:
        session.stagers[key] = CudaStager(device)
    return session.stagers[key]


def readable_directly(ref: Any) -> bool:
    """Whether a leaf's stored bytes are its values, in order (no view, no conversion)."""
    return (
        isinstance(ref, TensorRef)
        and ref.kind == "tensor"
        and not (ref.conj or ref.neg)
        and ref.storage is not None
        and ref.storage.source is not None
        and not ref.storage.big_endian
        and ref.is_contiguous()
    )


def _shard_ref(shard: Any) -> TensorRef | None:
    return shard.tensor.tensor_ref()


def read_into(leaf: Any, dest: torch.Tensor, session: LoadSession) -> None:
    """Fill ``dest`` (the leaf's shape, any device) with the leaf's values.

    Bytes go straight into ``dest`` where they can: same dtype, contiguous, plain
    little-endian storage. Otherwise one tensor is read and copied (cast) into it.
    """
    if tuple(dest.shape) != tuple(leaf.shape):
        raise CkptError(f"shape {list(leaf.shape)} does not fit into {list(dest.shape)}")
    if (
        readable_directly(leaf)
        and dest.is_contiguous()
        and dest.dtype == torch_dtype(leaf.dtype)
        and not dest.is_quantized
    ):
        if leaf.numel:
            start = leaf.offset * leaf.dtype.itemsize
            if dest.device.type == "cpu":
                session.reader.read_into(leaf.storage.source, start, bytes_view(dest))
            elif dest.device.type == "cuda":
                _stager(session, dest.device).fill(flat_bytes(dest), session, leaf.storage, start)
            else:
                dest.copy_(read_cpu(leaf))
        return
    if isinstance(leaf, ShardedRef):
        if leaf.incomplete:
            raise CkptError(f"sharded tensor {leaf.incomplete}")
        for shard in leaf.shards:
            if not math.prod(shard.sizes):
                continue
            index = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.sizes, strict=True))
            region = dest[index]
            ref = _shard_ref(shard)
            if ref is not None and tuple(ref.shape) != tuple(shard.sizes):
                raise CkptError(
                    f"shard at offsets {list(shard.offsets)} has shape {list(ref.shape)}, "
                    f"expected {list(shard.sizes)}"
                )
            if ref is not None and region.is_contiguous():
                read_into(ref, region, session)
                continue
            block = read_cpu(ref or shard.tensor.tensor_ref())
            if tuple(block.shape) != tuple(shard.sizes):
                raise CkptError(
                    f"shard at offsets {list(shard.offsets)} has shape {list(block.shape)}, "
                    f"expected {list(shard.sizes)}"
                )
            region.copy_(block)
            del block
        return
    with torch.no_grad():
        dest.copy_(read_cpu(leaf))


def empty_on(shape: tuple[int, ...], dtype: DType, device: Any) -> torch.Tensor:
    """An uninitialised tensor on ``device``, or a CkptError saying the device is absent."""
    try:
        return torch.empty(shape, dtype=torch_dtype(dtype), device=device)
    except (RuntimeError, AssertionError) as exc:
        raise CkptError(
            f"cannot place tensors on {device} ({str(exc).splitlines()[0]})",
            hint="pass map_location='cpu' (CLI: --map-location cpu)",
        ) from None


def load_on_device(leaf: Any, device: Any) -> torch.Tensor:
    """A plain or sharded leaf read into a new tensor on ``device`` (CPU or CUDA)."""
    session = current_session()
    plain = readable_directly(leaf) or isinstance(leaf, ShardedRef)
    if session is None or not plain or (isinstance(leaf, TensorRef) and leaf.kind != "tensor"):
        return place(read_cpu(leaf), device)
    dest = empty_on(leaf.shape, leaf.dtype, device)
    read_into(leaf, dest, session)
    return dest


def shared_storage_tensors(refs: list[TensorRef], map_location: Any) -> dict[int, Any] | None:
    """The tensors of one storage (tied weights, views), as views of one buffer with
    their saved strides, as ``torch.load`` returns them. The buffer is the span of the
    storage they cover: mapped, read, or staged to a CUDA device.

    Returns None where they cannot share one (quantized, lazily conjugated or negated,
    byte-swapped, different devices, a ``map_location`` callable): each is then loaded
    on its own.

    Returns:
        ``{id(ref): tensor}``, each an ``nn.Parameter`` / ``requires_grad`` as saved.
    """
    first = refs[0]
    storage = first.storage
    if storage is None or storage.source is None or storage.big_endian:
        return None
    if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
        return None
    dtype = first.dtype  # one shared object per dtype
    device = str(target_device(first.device, map_location))
    # [low, high): the elements of the storage the tensors cover
    low, high = -1, -1
    for r in refs:
        if r.kind != "tensor" or r.conj or r.neg or r.dtype is not dtype:
            return None
        if r is not first and str(target_device(r.device, map_location)) != device:
            return None
        if 0 not in r.shape:
            end = r.offset + 1 + sum((n - 1) * s for n, s in zip(r.shape, r.stride, strict=True))
            low = r.offset if low < 0 else min(low, r.offset)
            high = max(high, end)
    if high < 0:
        return None
    itemsize = dtype.itemsize
    dt = torch_dtype(dtype)
    session = current_session()
    mapped = None
    if device.startswith("cuda") and session is not None:
        base = empty_on((high - low,), dtype, device)
        _stager(session, base.device).fill(flat_bytes(base), session, storage, low * itemsize)
    else:
        if device == "cpu" and session is not None and session.mmap:
            mapped = map_storage(
                storage.source,
                low * itemsize,
                (high - low) * itemsize,
                storage.dtype.itemsize,
                session.maps,
                session.reader.files,
            )
        if mapped is None:
            base = place(
                storage_bytes(storage, low * itemsize, (high - low) * itemsize).view(dt), device
            )
    where = torch.device("cpu") if mapped is not None else base.device
    out = {}
    for r in refs:
        if 0 in r.shape:
            t = torch.empty(r.shape, dtype=dt, device=where)
        elif mapped is not None:  # the tensor straight on the mapped storage (one call)
            t = torch.empty(0, dtype=dt).set_(mapped, r.offset - low, r.shape, r.stride)
        else:
            t = base.as_strided(r.shape, r.stride, r.offset - low)
        out[id(r)] = as_saved(t, r)
    return out
