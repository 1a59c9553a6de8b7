"""Turn lazy leaves into ``torch.Tensor``s: read the bytes, place them on a device.

The only core module that imports torch, so that ``inspect`` and ``--help`` never do.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .dtypes import DTYPES, DType
from .errors import CkptError
from .mapped import current_session, map_storage
from .plain import TorchValue, to_plain
from .torch_values import Device, TorchSize
from .tree import ShardedRef, SparseRef, StorageRef, TensorRef


def torch_dtype(dt: DType) -> torch.dtype:
    value = getattr(torch, dt.name, None)
    if not isinstance(value, torch.dtype):
        raise CkptError(f"this torch ({torch.__version__}) has no dtype {dt.name}")
    return value


def target_device(saved: str, map_location: Any) -> Any:
    """Where a tensor saved on ``saved`` goes, with ``torch.load``'s map_location meanings.

    ``None`` keeps the saved device; a string or ``torch.device`` moves everything
    there; a dict maps saved locations (``{"cuda:1": "cuda:0"}``), others stay.
    A callable is handled by :func:`load_tensor`.
    """
    if map_location is None:
        return saved
    if isinstance(map_location, dict):
        mapped = map_location.get(saved, saved)
        return str(mapped) if isinstance(mapped, torch.device) else mapped
    if isinstance(map_location, (str, torch.device)):
        return map_location
    raise CkptError(f"unsupported map_location {map_location!r}")


# The integer type a quantized tensor's bytes hold.
QUANTIZED_INT = {"qint8": "int8", "quint8": "uint8", "qint32": "int32"}


def _read_cpu(ref: TensorRef) -> torch.Tensor:
    """The tensor's own elements, in a fresh CPU buffer (views are made contiguous)."""
    if ref.kind == "quantized":
        return _read_quantized(ref)
    return _read_elements(ref, torch_dtype(ref.dtype))


def _read_quantized(ref: TensorRef) -> torch.Tensor:
    q = ref.quantizer
    if q is None or ref.dtype.name not in QUANTIZED_INT:
        raise CkptError(
            f"cannot read a quantized {ref.dtype.name} tensor (unknown quantization scheme)",
            hint="--select other tensors",
        )
    ints = _read_elements(ref, getattr(torch, QUANTIZED_INT[ref.dtype.name]))
    with warnings.catch_warnings():  # torch >= 2.13 deprecates making quantized tensors
        warnings.simplefilter("ignore", UserWarning)
        if q[0] == "per_tensor_affine":
            return torch._make_per_tensor_quantized_tensor(ints, q[1], q[2])
        return torch._make_per_channel_quantized_tensor(ints, q[1].load(), q[2].load(), q[3])


def _read_elements(ref: TensorRef, dt: torch.dtype) -> torch.Tensor:
    if ref.storage is None:
        raise CkptError("tensor has no stored data (saved on the meta device)")
    itemsize = ref.dtype.itemsize
    if ref.numel == 0:
        return torch.empty(ref.shape, dtype=dt)
    # Read only the span of the storage this tensor covers, not the whole storage.
    span = 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True))
    flat = storage_bytes(ref.storage, ref.offset * itemsize, span * itemsize)
    if ref.storage.big_endian and itemsize > 1:
        flat = flat.view(-1, itemsize).flip(1).reshape(-1)
    flat = flat.view(dt)
    if ref.is_contiguous():
        tensor = flat.view(ref.shape)
    else:
        tensor = torch.as_strided(flat, ref.shape, ref.stride).contiguous()
    if ref.conj:  # the values torch.load gives, without the lazy bit
        tensor = tensor.conj_physical()
    if ref.neg:
        tensor = tensor.neg()
    return tensor


def storage_bytes(storage: StorageRef | None, start: int, size: int) -> torch.Tensor:
    """``size`` bytes of a storage from ``start``, as a flat uint8 CPU tensor (CkptError
    for a storage whose bytes were never saved).

    Inside a ``load`` session with ``mmap`` on, a copy-on-write view of the mapped file
    where the bytes allow it (little-endian, aligned, in a local file); else one read
    into a buffer of its own (through the file's source: a URL is read by range).
    """
    if storage is None or storage.source is None:
        raise CkptError("tensor has no stored data (saved on the meta device)")
    source = storage.source
    session = current_session()
    if session is not None and session.mmap and not storage.big_endian:
        mapped = map_storage(
            source, start, size, storage.dtype.itemsize, session.maps, session.reader.files
        )
        if mapped is not None:
            return torch.empty(0, dtype=torch.uint8).set_(mapped)
    return torch.frombuffer(source.read(start, size), dtype=torch.uint8)


def plain_on_device(device: Any) -> bool:
    """Whether ``device`` is a CUDA device a session stages to (pinned, overlapped)."""
    return current_session() is not None and str(device).startswith("cuda")


def load_tensor(ref: TensorRef, map_location: Any = "cpu") -> torch.Tensor:
    """Materialize one lazy tensor on the device ``map_location`` asks for."""
    if not callable(map_location) or isinstance(map_location, (str, torch.device, dict)):
        device = target_device(ref.device, map_location)
        if plain_on_device(device):
            from .fastload import load_on_device

            return load_on_device(ref, device)
    tensor = _read_cpu(ref)
    if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
        moved = map_location(tensor.untyped_storage(), ref.device)
        if moved is None or isinstance(moved, str):
            return place(tensor, moved or ref.device)
        return torch.empty(0, dtype=tensor.dtype, device=moved.device).set_(
            moved, 0, tensor.shape, tensor.stride()
        )
    return place(tensor, target_device(ref.device, map_location))


def as_saved(tensor: torch.Tensor, ref: Any) -> torch.Tensor:
    """A loaded tensor as ``torch.load`` gives it: an ``nn.Parameter`` where one was
    saved, ``requires_grad`` where it was set (sharded tensors come back plain)."""
    grad = ref.requires_grad and not ref.sharded
    grad = grad and (tensor.is_floating_point() or tensor.is_complex())  # else torch refuses
    if getattr(ref, "parameter", False):
        return torch.nn.Parameter(tensor, requires_grad=grad)
    return tensor.requires_grad_(True) if grad else tensor


def place(tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """Move a CPU tensor to ``device``, with a clear error when that device is absent."""
    if device is None or str(device) == "cpu":
        return tensor
    try:
        return tensor.to(device)
    except (RuntimeError, AssertionError) as exc:
        raise CkptError(
            f"cannot place tensors on {device} ({str(exc).splitlines()[0]})",
            hint="pass map_location='cpu' (CLI: --map-location cpu)",
        ) from None


def load_sharded(ref: ShardedRef, map_location: Any = "cpu") -> torch.Tensor:
    """Assemble a sharded tensor's full value, one shard in memory at a time."""
    if not callable(map_location) or isinstance(map_location, (str, torch.device, dict)):
        device = target_device(ref.device, map_location)
        if plain_on_device(device) or (current_session() is not None and len(ref.shards) > 1):
            from .fastload import load_on_device

            return load_on_device(ref, device)  # each shard read into its place
    out = None
    for shard in ref.shards:
        block = shard.tensor.load("cpu")
        if tuple(block.shape) != tuple(shard.sizes):
            raise CkptError(
                f"shard at offsets {list(shard.offsets)} has shape {list(block.shape)}, "
                f"expected {list(shard.sizes)}"
            )
        if len(ref.shards) == 1 and tuple(shard.sizes) == tuple(ref.shape):
            out = block  # the whole tensor (also a quantized one, which cannot be assembled)
            break
        if out is None:
            out = torch.empty(ref.shape, dtype=torch_dtype(ref.dtype))
        index = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.sizes, strict=True))
        out[index] = block
        del block
    if out is None:  # no shard: an empty tensor
        out = torch.empty(ref.shape, dtype=torch_dtype(ref.dtype))
    if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
        map_location = "cpu"
    return place(out, target_device(ref.device, map_location))


def load_sparse(ref: SparseRef, map_location: Any = "cpu") -> torch.Tensor:
    """Build a sparse tensor from its parts, its invariants checked as ``torch.load``
    checks them: indices out of range would make later reads go out of bounds."""
    parts = [_read_cpu(part) for part in ref.parts]
    with warnings.catch_warnings():  # "sparse CSR support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        try:
            # (torch's stubs name no positional size after the parts; the function takes it)
            build: Any
            if ref.layout == "sparse_coo":
                build = torch.sparse_coo_tensor
                tensor = build(
                    *parts, ref.shape, is_coalesced=ref.is_coalesced, check_invariants=True
                )
            else:
                build = torch.sparse_compressed_tensor
                tensor = build(
                    *parts, ref.shape, layout=getattr(torch, ref.layout), check_invariants=True
                )
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CkptError(f"corrupt sparse tensor ({ref.layout}): {first}") from None
    if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
        map_location = "cpu"
    return place(tensor, target_device(ref.device, map_location))


# torch has no sparse kernels (coalesce, to_dense, conversions) for these value types
_NO_SPARSE_KERNELS = {"uint16", "uint32", "uint64", *(n for n in DTYPES if n.startswith("float8"))}


def sparse_entries(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse tensor's stored elements, one per position: (indices [ndim, n], values [n]).

    Duplicates (uncoalesced COO) are summed, as torch does. The dense dimensions of a
    hybrid tensor become index dimensions, so any two layouts line up element by
    element. Value types without sparse kernels (uint16-64, fp8) come back widened.
    """
    if str(t.dtype).removeprefix("torch.") in _NO_SPARSE_KERNELS:
        wide = torch.float64 if t.dtype.is_floating_point else torch.int64
        if t.layout != torch.sparse_coo:
            raise CkptError(f"torch cannot compute on a {t.layout} tensor of {t.dtype}")
        values = t._values().to(wide)  # checked when read
        t = torch.sparse_coo_tensor(t._indices(), values, t.shape, check_invariants=False)
    coo = t.to_sparse_coo().coalesce()
    indices, values = coo.indices(), coo.values()
    dense_shape = tuple(values.shape[1:])
    if dense_shape:  # hybrid: each stored block's elements get indices of their own
        inner = torch.stack(torch.unravel_index(torch.arange(math.prod(dense_shape)), dense_shape))
        count = inner.shape[1]
        indices = torch.cat(
            [indices.repeat_interleave(count, dim=1), inner.repeat(1, indices.shape[1])]
        )
        values = values.reshape(-1)
    return indices, values


def torch_value(value: TorchValue) -> Any:
    """The torch object a stand-in names: ``torch.device``, ``torch.dtype``,
    ``torch.Size``, a layout."""
    if isinstance(value, Device):
        return torch.device(str(value))
    if isinstance(value, TorchSize):
        return torch.Size(value)
    if isinstance(value, DType):
        return torch_dtype(value)
    return getattr(torch, value.removeprefix("torch."), str(value))


def to_torch(node: Any, leaf: Callable[[Any], Any]) -> Any:
    """The tree as plain data with real torch objects (see :func:`ckpttool.plain.to_plain`)."""

    def storage(ref: StorageRef) -> torch.TypedStorage:
        # what torch.load returns for a storage saved on its own
        t = leaf(TensorRef.whole_storage(ref))
        return torch.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)

    return to_plain(node, leaf, torch_value, storage=storage)
