"""A stored tensor's bytes as a CPU ``torch.Tensor``, and the small conversions every
tensor path shares (dtypes, devices, ``nn.Parameter`` as saved).

The floor of :mod:`ckpttool.tensors`: the direct readers (``direct``) fall back to it,
and the dispatch over leaves (``materialize``) builds on both.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..dtypes import DType
from ..errors import CkptError
from ..tree import StorageRef, TensorRef
from .mapped import current_session, map_storage


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


def read_cpu(ref: TensorRef) -> torch.Tensor:
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
        return torch._make_per_channel_quantized_tensor(ints, read_cpu(q[1]), read_cpu(q[2]), q[3])


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
