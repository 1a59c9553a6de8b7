"""Turn lazy leaves into ``torch.Tensor``s: :func:`load_leaf` is the one dispatch over
leaf kinds (stored, sharded, sparse, a block of a sharded tensor), and :func:`to_torch`
turns a whole tree into torch objects."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..dtypes import DTYPES, DType
from ..errors import CkptError
from ..tree import (
    Block,
    Device,
    Leaf,
    Node,
    ShardedRef,
    SparseRef,
    StorageRef,
    TensorRef,
    TorchSize,
    TorchValue,
    to_plain,
)
from .direct import load_on_device
from .mapped import current_session
from .stored import place, read_cpu, target_device, torch_dtype


def plain_on_device(device: Any) -> bool:
    """Whether ``device`` is a CUDA device a session stages to (pinned, overlapped)."""
    return current_session() is not None and str(device).startswith("cuda")


def load_leaf(leaf: Leaf | Block, map_location: Any = "cpu") -> torch.Tensor:
    """Any tensor leaf of the tree, or a block of a sharded one, as a ``torch.Tensor``:
    the one place where a leaf's metadata becomes a tensor.

    Raises:
        CkptError: The bytes cannot be read, or a sharded tensor was saved incomplete.
    """
    if isinstance(leaf, TensorRef):
        return load_tensor(leaf, map_location)
    if isinstance(leaf, ShardedRef):
        if leaf.incomplete:
            raise CkptError(f"sharded tensor {leaf.incomplete}")
        return load_sharded(leaf, map_location)
    if isinstance(leaf, SparseRef):
        return load_sparse(leaf, map_location)
    # a block of a sharded tensor (tree.leaves.Block): its stored tensor, maybe cast
    if leaf.cast_to is None:
        return load_tensor(leaf.tensor_ref(), map_location)
    return load_tensor(leaf.tensor_ref(), "cpu").to(torch_dtype(leaf.cast_to))


def load_tensor(ref: TensorRef, map_location: Any = "cpu") -> torch.Tensor:
    """Materialize one lazy tensor on the device ``map_location`` asks for."""
    if not callable(map_location) or isinstance(map_location, (str, torch.device, dict)):
        device = target_device(ref.device, map_location)
        if plain_on_device(device):
            return load_on_device(ref, device)
    tensor = read_cpu(ref)
    if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
        moved = map_location(tensor.untyped_storage(), ref.device)
        if moved is None or isinstance(moved, str):
            return place(tensor, moved or ref.device)
        return torch.empty(0, dtype=tensor.dtype, device=moved.device).set_(
            moved, 0, tensor.shape, tensor.stride()
        )
    return place(tensor, target_device(ref.device, map_location))


def load_sharded(ref: ShardedRef, map_location: Any = "cpu") -> torch.Tensor:
    """Assemble a sharded tensor's full value, one shard in memory at a time."""
    if not callable(map_location) or isinstance(map_location, (str, torch.device, dict)):
        device = target_device(ref.device, map_location)
        if plain_on_device(device) or (current_session() is not None and len(ref.shards) > 1):
            return load_on_device(ref, device)  # each shard read into its place
    out = None
    for shard in ref.shards:
        block = load_leaf(shard.tensor, "cpu")
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
    parts = [read_cpu(part) for part in ref.parts]
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


def to_torch(node: Node, leaf: Callable[[Any], Any]) -> Any:
    """The tree as plain data with real torch objects (see :func:`ckpttool.tree.to_plain`)."""

    def storage(ref: StorageRef) -> torch.TypedStorage:
        # what torch.load returns for a storage saved on its own
        t = leaf(TensorRef.whole_storage(ref))
        return torch.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)

    return to_plain(node, leaf, torch_value, storage=storage)
