"""numpy arrays and scalars in a pickle, read as tensors and numbers without numpy."""

from __future__ import annotations

import struct
from typing import Any

from ..dtypes import DTYPES, DType
from ..errors import CkptError
from ..sources import ByteSpan
from ..tree import Opaque, StorageRef, TensorRef, contiguous_stride, int_tuple, opaque_class

# numpy dtype codes (``numpy.dtype("f4")``) -> (torch dtype, struct format for scalars)
NUMPY_CODES = {
    "f8": ("float64", "d"),
    "f4": ("float32", "f"),
    "f2": ("float16", "e"),
    "i8": ("int64", "q"),
    "i4": ("int32", "i"),
    "i2": ("int16", "h"),
    "i1": ("int8", "b"),
    "u8": ("uint64", "Q"),
    "u4": ("uint32", "I"),
    "u2": ("uint16", "H"),
    "u1": ("uint8", "B"),
    "b1": ("bool", "?"),
    "c8": ("complex64", None),
    "c16": ("complex128", None),
}


def _numpy_dtype(obj: Any) -> tuple[DType, str | None, bool] | None:
    """(dtype, struct format, big endian) of a pickled ``numpy.dtype``, None if not numeric."""
    if not isinstance(obj, Opaque) or not obj.args or not isinstance(obj.args[0], str):
        return None
    code = NUMPY_CODES.get(obj.args[0])
    if code is None:
        return None
    order = obj.state[1] if isinstance(obj.state, tuple) and len(obj.state) > 1 else "<"
    return DTYPES[code[0]], code[1], order == ">"


class NumpyArrayRef(TensorRef):
    """A pickled ``numpy.ndarray``, read as a tensor (no numpy import, bytes kept in memory).

    Built empty by ``_reconstruct`` and filled by the pickle's BUILD, as numpy does.
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(DTYPES["uint8"], (0,), (1,), 0, None, kind="numpy.ndarray")
        self._args = args

    def __setstate__(self, state: Any) -> None:
        described = None
        if isinstance(state, tuple) and len(state) >= 4:
            shape, np_dtype, fortran, raw = state[-4:]
            described = _numpy_dtype(np_dtype)
        if described is None or not isinstance(raw, (bytes, bytearray)):
            # strings, objects, records: not a tensor. The object becomes what any other
            # class's does, an inert placeholder keeping the state (the layouts match,
            # both are plain objects with a __dict__)
            args = self._args
            self.__dict__.clear()
            self.__class__ = opaque_class("numpy", "ndarray", known=True)  # type: ignore[assignment]
            self.args, self.state = args, state
            return
        dtype, _, big_endian = described
        shape = int_tuple(shape, "shape")
        stride = contiguous_stride(shape[::-1])[::-1] if fortran else contiguous_stride(shape)
        numel = len(raw) // dtype.itemsize
        self.dtype, self.shape, self.stride = dtype, shape, stride
        self.storage = StorageRef("numpy", dtype, numel, "cpu", ByteSpan(data=raw), big_endian)
        if self.numel > numel:
            raise CkptError("corrupt numpy array: fewer bytes than its shape needs")


def numpy_frombuffer(buffer: Any, np_dtype: Any, shape: Any, order: Any = "C") -> Any:
    """``numpy._core.numeric._frombuffer``: how numpy pickles a contiguous array with
    protocol 5 (``torch.save(..., pickle_protocol=5)``), its bytes in-band."""
    array = NumpyArrayRef()
    array.__setstate__((1, shape, np_dtype, order == "F", buffer))
    return array


def numpy_scalar(np_dtype: Any, raw: Any = None) -> Any:
    described = _numpy_dtype(np_dtype)
    if described is None or described[1] is None or not isinstance(raw, (bytes, bytearray)):
        return opaque_class("numpy", "generic", known=True).make(np_dtype, raw)
    dtype, fmt, big_endian = described
    if fmt is None:
        return opaque_class("numpy", "generic", known=True).make(np_dtype, raw)
    try:
        return struct.unpack((">" if big_endian else "<") + fmt, raw)[0]
    except struct.error:
        raise CkptError("corrupt numpy scalar") from None
