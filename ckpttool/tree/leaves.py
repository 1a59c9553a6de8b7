"""Tensor leaves of the lazy tree: metadata and where the bytes live, never the bytes.

A checkpoint is plain Python containers (dict, list, tuple) whose leaves are
primitives, :class:`TensorRef` (one tensor: metadata plus where its bytes live),
:class:`ShardedRef` (a global tensor made of shards spread over ranks or files),
:class:`SparseRef` (a sparse tensor, made of stored index and value tensors) or
:class:`~ckpttool.tree.opaque.Opaque`. Every leaf checks its shape when it is made.
Nothing here imports torch: :func:`ckpttool.tensors.load_leaf` turns a leaf into a
tensor, when a tensor is actually asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeGuard, Union

from ..dtypes import DType
from ..errors import CkptError
from ..sealed import Sealed
from ..sources import ByteSpan


@dataclass(eq=False)
class StorageRef(Sealed):
    """One storage as torch saved it: ``numel`` elements of ``dtype`` on ``device``.

    Tensors that share a storage (tied weights, views) hold the same StorageRef.
    """

    key: str
    dtype: DType
    numel: int
    device: str
    source: ByteSpan | None = None  # None for a storage whose bytes were never saved (meta)
    big_endian: bool = False  # torch files record the writer's byte order

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


# torch counts elements in an int64; safetensors and torch refuse a shape past it even
# where another dimension is 0
MAX_NUMEL = 2**63 - 1


def check_shape(shape: tuple[int, ...]) -> None:
    """Each dimension and the element count of every non-empty part fit torch's int64.

    Raises:
        CkptError: A shape no torch tensor can have (an output would not load).
    """
    count = 1
    for n in shape:
        count *= max(n, 1)
        if n < 0 or count > MAX_NUMEL:
            raise CkptError(f"corrupt tensor: impossible shape {list(shape)[:8]}")


class _Sized(Sealed):
    """numel and nbytes from ``shape`` and ``dtype`` (global sizes for sharded tensors).

    Every tensor leaf checks its shape when it is made, whichever format read it: a
    shape torch cannot hold must not reach an output that then fails to load.
    """

    shape: tuple[int, ...]
    dtype: DType

    def __post_init__(self) -> None:
        check_shape(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(eq=False)
class TensorRef(_Sized):
    """A tensor whose bytes stay on disk until :meth:`load`.

    ``offset`` and ``stride`` are in elements of ``dtype``, as in ``torch.as_strided``.
    """

    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage: StorageRef | None
    device: str = "cpu"
    requires_grad: bool = False
    kind: str = "tensor"  # "quantized", or a tensor subclass's name
    parameter: bool = False  # saved as an nn.Parameter
    # torch's lazy conjugate / negative views: the stored bytes are the values before it
    conj: bool = False
    neg: bool = False
    # a quantized tensor's scheme and parameters (kind "quantized"): ("per_tensor_affine",
    # scale, zero_point) or (per-channel scheme, scales, zero_points, axis), None if unknown
    quantizer: Any = None

    sharded = False
    cast_to = None  # as a block of a sharded tensor (tree.leaves.Block): read as stored

    def __post_init__(self) -> None:
        super().__post_init__()
        # torch holds strides and the offset in int64 too; an empty tensor's are never
        # checked against its storage, and reading a slice of it passes them to torch
        if abs(self.offset) > MAX_NUMEL or any(abs(s) > MAX_NUMEL for s in self.stride):
            raise CkptError(
                f"corrupt tensor: impossible stride {list(self.stride)[:8]} or offset {self.offset}"
            )

    def tensor_ref(self) -> TensorRef:
        """Itself: a stored tensor is its own :class:`~ckpttool.tree.leaves.Block`."""
        return self

    def is_contiguous(self) -> bool:
        return self.stride == contiguous_stride(self.shape) or self.numel <= 1

    @classmethod
    def whole_storage(cls, storage: StorageRef) -> TensorRef:
        """A storage saved on its own (``torch.save(t.untyped_storage())``), as the flat
        tensor of all its elements: how its bytes are read and written."""
        return cls(storage.dtype, (storage.numel,), (1,), 0, storage, device=storage.device)


def strided_rows(ref: TensorRef, start: int, step: int, count: int) -> TensorRef:
    """The view of rows ``start + k*step`` (k < ``count``) of a stored tensor."""
    return TensorRef(
        ref.dtype,
        (count, *ref.shape[1:]),
        (ref.stride[0] * step, *ref.stride[1:]),
        ref.offset + start * ref.stride[0],
        ref.storage,
        device=ref.device,
    )


class Block(Protocol):
    """One stored block of a sharded tensor (a rank's local shard, a DCP chunk, a ZeRO
    partition's slice): what merging and writing need from it. Its elements are those of
    :meth:`tensor_ref`, read as ``cast_to`` where that is not None (ZeRO buffers, which
    ``zero_to_fp32`` gives in fp32); :func:`ckpttool.tensors.load_leaf` reads it."""

    @property
    def cast_to(self) -> DType | None:
        """The dtype the stored elements are read as, or None for their own."""
        ...

    def tensor_ref(self) -> TensorRef:
        """The stored tensor holding the block's elements (metadata only, no bytes read)."""
        ...


@dataclass(eq=False, slots=True)
class Shard(Sealed):
    """One block of a sharded tensor: ``sizes`` elements starting at ``offsets``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: Block
    rank: int | None = None


@dataclass(eq=False)
class ShardedRef(_Sized):
    """A global tensor made of shards (ShardedTensor, DTensor or DCP chunks)."""

    dtype: DType
    shape: tuple[int, ...]
    shards: Sequence[Shard]  # (a DCP tensor's: formats.dcp.chunks.DcpChunks, made on reading)
    device: str = "cpu"
    kind: str = "sharded_tensor"  # "dtensor", "dcp"
    requires_grad: bool = False
    world_size: int | None = None
    # why the full tensor cannot be assembled (some shards were never saved with it):
    # shown by inspect, refused by name where data is needed (see api.require_data)
    incomplete: str | None = None

    sharded = True


# Sparse layouts torch.save writes, and the stored tensors each is rebuilt from.
SPARSE_PARTS: dict[str, tuple[str, ...]] = {
    "sparse_coo": ("indices", "values"),
    "sparse_csr": ("crow_indices", "col_indices", "values"),
    "sparse_csc": ("ccol_indices", "row_indices", "values"),
    "sparse_bsr": ("crow_indices", "col_indices", "values"),
    "sparse_bsc": ("ccol_indices", "row_indices", "values"),
}


@dataclass(eq=False)
class SparseRef(Sealed):
    """A sparse tensor: its layout, its dense shape and the stored tensors it is made of.

    ``parts`` are named by ``SPARSE_PARTS[layout]``: (indices, values) for COO,
    (compressed indices, plain indices, values) for CSR, CSC, BSR and BSC. Its size
    is what those hold, not the dense shape.
    """

    layout: str
    shape: tuple[int, ...]
    parts: tuple[TensorRef, ...]
    is_coalesced: bool | None = None  # COO only; None when the file does not say
    requires_grad: bool = False
    parameter: bool = False  # saved as an nn.Parameter

    sharded = False

    def __post_init__(self) -> None:
        check_shape(self.shape)  # the dense shape, as for every tensor leaf (see _Sized)

    @property
    def values(self) -> TensorRef:
        return self.parts[-1]

    @property
    def dtype(self) -> DType:
        return self.values.dtype

    @property
    def device(self) -> str:
        return self.values.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


LEAF_TYPES = (TensorRef, ShardedRef, SparseRef)


# A tensor leaf of the tree: what inspect lists, convert writes and load turns into a
# torch.Tensor. Every other leaf is plain data or an Opaque.
Leaf: TypeAlias = Union[TensorRef, ShardedRef, SparseRef]  # noqa: UP007  (a runtime alias)


KeyPath = tuple[Any, ...]
# Any node of the tree: a container (dict, list, tuple), a leaf, an Opaque or plain data
Node: TypeAlias = Any


def is_tensor(value: Any) -> TypeGuard[Leaf]:
    return isinstance(value, LEAF_TYPES)
