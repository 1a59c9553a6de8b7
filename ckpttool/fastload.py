"""Tensors read straight into their final memory: a model's parameters, a GPU, a merged tensor.

Used inside a load session (:func:`ckpttool.mapped.loading`). A CPU destination gets
the bytes with ``preadv`` straight from the page cache (or, for a URL, from its
source's ranged reads; see :mod:`ckpttool.spans`); a CUDA one through a few pinned
buffers, the next buffer being read while the last one is copied to the device (as
``safetensors.torch.load_file(device="cuda")`` overlaps them).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from .dtypes import DType
from .errors import CkptError
from .mapped import LoadSession, current_session, map_storage
from .tensors import as_saved, place, storage_bytes, target_device, torch_dtype
from .tree import ShardedRef, StorageRef, TensorRef

STAGING_BUFFERS = 4
STAGING_BYTES = 32 << 20


def bytes_view(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (valid while ``t`` lives)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (same storage)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class CudaStager:
    """Host-to-device copies through ``STAGING_BUFFERS`` pinned buffers on a side stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.buffers = [
            torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
            for _ in range(STAGING_BUFFERS)
        ]
        self.events: list[Any] = [None] * STAGING_BUFFERS
        self.next = 0

    def fill(self, dest: torch.Tensor, session: LoadSession, storage: StorageRef, start: int):
        """Copy the bytes of ``storage`` from ``start`` into the flat uint8 CUDA ``dest``."""
        # dest was allocated on the current stream: the copies must come after that
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        size, done = dest.numel(), 0
        while done < size:
            i = self.next
            self.next = (i + 1) % STAGING_BUFFERS
            if self.events[i] is not None:
                self.events[i].synchronize()  # the copy out of buffer i is done
            n = min(STAGING_BYTES, size - done)
            buffer = self.buffers[i][:n]
            session.reader.read_into(storage.source, start + done, bytes_view(buffer))  # type: ignore[arg-type]
            with torch.cuda.stream(self.stream):
                dest[done : done + n].copy_(buffer, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events[i] = event
            done += n
        dest.record_stream(self.stream)

    def finish(self) -> None:
        """Wait until every copy landed (the buffers are then free to go)."""
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


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
                dest.copy_(leaf.load("cpu"))
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
            block = (ref or shard.tensor).load("cpu")
            if tuple(block.shape) != tuple(shard.sizes):
                raise CkptError(
                    f"shard at offsets {list(shard.offsets)} has shape {list(block.shape)}, "
                    f"expected {list(shard.sizes)}"
                )
            region.copy_(block)
            del block
        return
    with torch.no_grad():
        dest.copy_(leaf.load("cpu"))


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
        return place(leaf.load("cpu"), device)
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
