"""Stand-ins for torch's tensor rebuild functions (``torch._utils._rebuild_*``).

Each returns a lazy :class:`~ckpttool.tree.TensorRef` (or :class:`SparseRef`, or a
sharded tensor's :class:`~ckpttool.tree.sharding.LocalShards`) after checking that the
metadata fits the storage it points into: no bytes are read here.
"""

from __future__ import annotations

import math
from typing import Any

from ..dtypes import check_dtype
from ..errors import CkptError
from ..tree import (
    SPARSE_PARTS,
    Opaque,
    SparseRef,
    StorageRef,
    TensorRef,
    TorchName,
    WrapperStub,
    check_shape,
    check_view,
    contiguous_stride,
    int_tuple,
    opaque_class,
)
from .sharded import DTENSOR_CLASSES, SHARDED_TENSOR, dtensor_local, sharded_tensor_local


def rebuild_tensor(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
    *_: Any,
    dtype: Any = None,
) -> Any:
    """Stand-in for ``torch._utils._rebuild_tensor_v2``: a lazy TensorRef, bounds-checked.

    ``metadata`` carries the conjugate / negative bits of a lazy view (``{"conj": True}``).
    """
    if not isinstance(storage, StorageRef):
        raise CkptError("corrupt pickle: tensor without a storage")
    shape = int_tuple(size, "shape")
    strides = int_tuple(stride, "stride") if stride is not None else contiguous_stride(shape)
    if not isinstance(storage_offset, int) or storage_offset < 0 or len(strides) != len(shape):
        raise CkptError("corrupt tensor metadata (offset or stride)")
    if any(s < 0 for s in shape) or any(s < 0 for s in strides):
        raise CkptError("corrupt tensor metadata (negative size or stride)")
    dt = dtype or storage.dtype
    check_shape(shape)
    # The last element must lie inside the storage, or reading would run past it.
    if all(shape):
        last = storage_offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        if (last + 1) * dt.itemsize > storage.nbytes:
            raise CkptError(
                f"tensor of shape {list(shape)} does not fit its storage of "
                f"{storage.nbytes} bytes (corrupt or truncated file)"
            )
        check_view(shape, dt, storage.nbytes)
    return TensorRef(
        dtype=dt,
        shape=shape,
        stride=strides,
        offset=storage_offset,
        storage=storage,
        device=storage.device,
        requires_grad=bool(requires_grad),
        conj=isinstance(metadata, dict) and metadata.get("conj") is True,
        neg=isinstance(metadata, dict) and metadata.get("neg") is True,
    )


def rebuild_tensor_v1(storage: Any, storage_offset: Any, size: Any, stride: Any) -> Any:
    return rebuild_tensor(storage, storage_offset, size, stride)


def rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    metadata: Any = None,
    *_: Any,
) -> Any:
    return rebuild_tensor(
        storage,
        storage_offset,
        size,
        stride,
        requires_grad,
        hooks,
        metadata,
        dtype=check_dtype(dtype),
    )


def rebuild_parameter(data: Any, requires_grad: Any = False, *_: Any) -> Any:
    if isinstance(data, (TensorRef, SparseRef)):
        data.parameter = True
        data.requires_grad = bool(requires_grad)
    return data


def rebuild_qtensor(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    quantizer_params: Any = None,
    *rest: Any,
) -> Any:
    """Stand-in for ``torch._utils._rebuild_qtensor``: a tensor of the quantized dtype
    (its stored bytes are the integer representation) with its quantizer."""
    requires_grad = rest[0] if rest else False
    ref = rebuild_tensor(storage, storage_offset, size, stride, requires_grad)
    ref.kind = "quantized"
    ref.quantizer = _quantizer(quantizer_params)
    if ref.quantizer is not None and len(ref.quantizer) == 4:
        _, scales, zero_points, axis = ref.quantizer
        if not (0 <= axis < len(ref.shape)) or not (
            scales.numel == zero_points.numel == ref.shape[axis]
            and len(scales.shape) == len(zero_points.shape) == 1
        ):
            raise CkptError(
                f"corrupt quantized tensor: {scales.numel} scales and {zero_points.numel} zero "
                f"points for axis {axis} of shape {list(ref.shape)}"
            )
    return ref


PER_CHANNEL_QSCHEMES = ("per_channel_affine", "per_channel_affine_float_qparams")


def _quantizer(params: Any) -> tuple | None:
    """The quantizer torch pickles: (qscheme, scale, zero point) or (qscheme, scales,
    zero points, axis); the qscheme is a ``torch.per_*`` global. None if not one of these."""
    if not isinstance(params, tuple) or not params:
        return None
    scheme = params[0]
    is_torch_name = (
        isinstance(scheme, type) and issubclass(scheme, Opaque) and scheme.module == "torch"
    )
    name = scheme.qualname if is_torch_name else None
    if name == "per_tensor_affine" and len(params) == 3:
        scale, zero_point = params[1:]
        if isinstance(scale, (int, float)) and isinstance(zero_point, int):
            return (name, float(scale), zero_point)
    if name in PER_CHANNEL_QSCHEMES and len(params) == 4:
        scales, zero_points, axis = params[1:]
        if isinstance(scales, TensorRef) and isinstance(zero_points, TensorRef):
            if isinstance(axis, int):
                return (name, scales, zero_points, axis)
    return None


def rebuild_meta(dtype: Any, size: Any, stride: Any, requires_grad: Any = False) -> Any:
    shape = int_tuple(size, "shape")
    check_shape(shape)
    return TensorRef(
        dtype=check_dtype(dtype),
        shape=shape,
        stride=int_tuple(stride, "stride"),
        offset=0,
        storage=None,
        device="meta",
        requires_grad=bool(requires_grad),
    )


def rebuild_sparse_tensor(layout: Any, data: Any) -> Any:
    """Stand-in for ``torch._utils._rebuild_sparse_tensor``: a :class:`SparseRef` of the
    stored index and value tensors. torch checks their invariants when it is read."""
    name = layout.removeprefix("torch.") if isinstance(layout, TorchName) else None
    if name not in SPARSE_PARTS:  # a layout this version does not know: kept inert
        return opaque_class("torch._utils", "_rebuild_sparse_tensor").make(layout, data)
    count = len(SPARSE_PARTS[name])
    is_coalesced = None
    # COO data is (indices, values, size) before torch 2.1, then is_coalesced too
    if name == "sparse_coo" and isinstance(data, tuple) and len(data) == count + 2:
        data, is_coalesced = data[:-1], data[-1]
    if (
        not isinstance(data, tuple)
        or len(data) != count + 1
        or not all(isinstance(part, TensorRef) for part in data[:count])
        or not isinstance(is_coalesced, (bool, type(None)))
    ):
        raise CkptError(f"corrupt sparse tensor ({name})")
    parts, size = data[:count], int_tuple(data[count], "shape")
    if any(n < 0 for n in size) or math.prod(size) >= 2**63:  # torch's numel is an int64
        raise CkptError(f"corrupt sparse tensor: impossible shape {list(size)}")
    if any(part.dtype.name not in ("int32", "int64") for part in parts[:-1]):
        raise CkptError(f"corrupt sparse tensor ({name}): its indices are not integers")
    if name != "sparse_coo" and len(size) < 2:
        raise CkptError(f"corrupt sparse tensor ({name}): shape {list(size)} has no 2 dims")
    if name == "sparse_coo":
        indices, values = parts
        nnz = indices.shape[1] if len(indices.shape) == 2 else -1
        if nnz < 0 or not values.shape or values.shape[0] != nnz:
            raise CkptError("corrupt sparse tensor: its indices and values do not match")
        if indices.shape[0] + len(values.shape) - 1 != len(size):
            raise CkptError(f"corrupt sparse tensor: indices do not fit its shape {list(size)}")
    return SparseRef(name, size, parts, is_coalesced)


PLAIN_TENSOR_CLASSES = ("torch.Tensor", "torch._tensor.Tensor", "torch.nn.parameter.Parameter")


def rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """Stand-in for ``torch._tensor._rebuild_from_type_v2`` (tensor subclasses)."""
    base = func(*args)
    name = (
        new_type.class_name() if isinstance(new_type, type) and issubclass(new_type, Opaque) else ""
    )
    if isinstance(base, WrapperStub) and name == SHARDED_TENSOR:
        return sharded_tensor_local(base, state)
    if isinstance(base, WrapperStub) and name in DTENSOR_CLASSES:
        return dtensor_local(base, state)
    if isinstance(base, SparseRef) and name in PLAIN_TENSOR_CLASSES:
        return base
    if isinstance(base, TensorRef):
        if name == "torch.nn.parameter.Parameter":
            base.parameter = True
        elif name and name not in PLAIN_TENSOR_CLASSES:
            base.kind = name
        return base
    if name:
        # another tensor subclass (torchao's NF4Tensor, Float8Tensor...): an object of
        # its class holding its attributes, whose inner tensors are the data
        obj = new_type.make()
        obj.state = state
        return obj
    return opaque_class("torch._tensor", "_rebuild_from_type_v2").make(new_type, state)


def rebuild_wrapper_subclass(
    cls: Any,
    dtype: Any,
    size: Any,
    stride: Any,
    storage_offset: Any,
    layout: Any,
    device: Any,
    requires_grad: Any = False,
) -> Any:
    return WrapperStub(cls, dtype, size, stride, storage_offset, layout, device, requires_grad)
