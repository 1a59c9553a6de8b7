"""Turn lazy leaves into ``torch.Tensor``s: read the bytes, place them on a device.

The only core module that imports torch, so that ``inspect`` and ``--help`` never do.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .errors import CkptError
from .stand_ins import Device, TorchName
from .tree import DType, Opaque, ShardedRef, TensorRef, is_tensor


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


def _read_cpu(ref: TensorRef) -> torch.Tensor:
    """The tensor's own elements, in a fresh CPU buffer (views are made contiguous)."""
    dt = torch_dtype(ref.dtype)
    if ref.storage is None:
        raise CkptError("tensor has no stored data (saved on the meta device)")
    if ref.kind == "quantized":
        raise CkptError(
            f"cannot read a quantized {ref.dtype.name} tensor (its scale and zero point are "
            "not kept)",
            hint="dequantize it before saving, or --select other tensors",
        )
    itemsize = ref.dtype.itemsize
    if ref.numel == 0:
        return torch.empty(ref.shape, dtype=dt)
    # Read only the span of the storage this tensor covers, not the whole storage.
    span = 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True))
    raw = ref.storage.source.read(ref.offset * itemsize, span * itemsize)
    flat = torch.frombuffer(raw, dtype=torch.uint8)
    if ref.storage.big_endian and itemsize > 1:
        flat = flat.view(-1, itemsize).flip(1).reshape(-1)
    flat = flat.view(dt)
    if ref.is_contiguous():
        return flat.view(ref.shape)
    return torch.as_strided(flat, ref.shape, ref.stride).contiguous()


def load_tensor(ref: TensorRef, map_location: Any = "cpu") -> torch.Tensor:
    """Materialize one lazy tensor on the device ``map_location`` asks for."""
    tensor = _read_cpu(ref)
    if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
        moved = map_location(tensor.untyped_storage(), ref.device)
        if moved is None or isinstance(moved, str):
            return place(tensor, moved or ref.device)
        return torch.empty(0, dtype=tensor.dtype, device=moved.device).set_(
            moved, 0, tensor.shape, tensor.stride()
        )
    return place(tensor, target_device(ref.device, map_location))


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
    out = torch.empty(ref.shape, dtype=torch_dtype(ref.dtype))
    for shard in ref.shards:
        block = shard.tensor.load("cpu")
        if tuple(block.shape) != tuple(shard.sizes):
            raise CkptError(
                f"shard at offsets {list(shard.offsets)} has shape {list(block.shape)}, "
                f"expected {list(shard.sizes)}"
            )
        index = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.sizes, strict=True))
        out[index] = block
        del block
    if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
        map_location = "cpu"
    return place(out, target_device(ref.device, map_location))


def to_torch(node: Any, leaf: Callable[[Any], Any]) -> Any:
    """The tree as plain data that ``torch.load(weights_only=True)`` accepts.

    Each tensor leaf becomes ``leaf(ref)``; an opaque object becomes
    ``{"__class__": "pkg.mod.Class", "state": ..., "args": ..., ...}`` so no key
    disappears; a class saved by reference becomes ``{"__global__": "pkg.mod.Class"}``;
    devices, dtypes and layouts become the torch objects they name. Containers
    shared by several paths stay shared.
    """
    memo: dict[int, Any] = {}

    def build(value: Any) -> Any:
        if is_tensor(value):
            return leaf(value)
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, Mapping):
            out = collections.OrderedDict() if isinstance(value, collections.OrderedDict) else {}
            memo[id(value)] = out
            for k, v in value.items():
                out[build(k)] = build(v)
            return out
        if isinstance(value, list):
            out_list: list[Any] = []
            memo[id(value)] = out_list
            out_list.extend(build(v) for v in value)
            return out_list
        if isinstance(value, (tuple, set, frozenset)):
            result: Any = type(value)(build(v) for v in value)
        elif isinstance(value, type) and issubclass(value, Opaque):
            result = {"__global__": value.class_name()}
        elif isinstance(value, Opaque):
            result = {"__class__": value.class_name()}
            parts = {
                "args": list(value.args),
                "state": value.state,
                "items": value.items,
                "list": value.list,
            }
            for name, part in parts.items():
                if part is not None and (part or name == "state"):
                    result[name] = build(part)
        elif isinstance(value, Device):
            result = torch.device(str(value))
        elif isinstance(value, DType):
            result = torch_dtype(value)
        elif isinstance(value, TorchName):
            result = getattr(torch, value.removeprefix("torch."), str(value))
        else:
            result = value
        memo[id(value)] = result
        return result

    return build(node)
