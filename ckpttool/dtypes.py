"""The dtypes ckpttool knows: torch names, item sizes, safetensors codes, storage classes.

Nothing here imports torch; :mod:`ckpttool.tensors` maps these to ``torch.dtype``s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import CkptError
from .sealed import Sealed


@dataclass(frozen=True)
class DType(Sealed):
    """A torch dtype by name (``float32``), with what writers need to know about it.

    One shared object per dtype (:data:`DTYPES`): writers check a dtype is that object.
    """

    name: str
    itemsize: int
    safetensors: str | None  # the safetensors dtype code, None where it has none
    is_floating: bool

    def __repr__(self) -> str:
        return f"torch.{self.name}"


def _dtypes() -> dict[str, DType]:
    table = [
        # name, itemsize, safetensors code, floating
        ("float64", 8, "F64", True),
        ("float32", 4, "F32", True),
        ("float16", 2, "F16", True),
        ("bfloat16", 2, "BF16", True),
        ("float8_e4m3fn", 1, "F8_E4M3", True),
        ("float8_e5m2", 1, "F8_E5M2", True),
        ("float8_e4m3fnuz", 1, "F8_E4M3FNUZ", True),
        ("float8_e5m2fnuz", 1, "F8_E5M2FNUZ", True),
        ("float8_e8m0fnu", 1, "F8_E8M0", True),
        # two fp4 values per byte; not cast by --dtype (torch has no conversion for it)
        ("float4_e2m1fn_x2", 1, None, False),
        ("complex128", 16, None, False),  # the safetensors format has C64 only
        ("complex64", 8, "C64", False),
        ("complex32", 4, None, False),
        ("int64", 8, "I64", False),
        ("int32", 4, "I32", False),
        ("int16", 2, "I16", False),
        ("int8", 1, "I8", False),
        ("uint64", 8, "U64", False),
        ("uint32", 4, "U32", False),
        ("uint16", 2, "U16", False),
        ("uint8", 1, "U8", False),
        ("bool", 1, "BOOL", False),
        ("qint8", 1, None, False),
        ("quint8", 1, None, False),
        ("qint32", 4, None, False),
        # raw bit containers (bit-packed custom formats): bytes without a number type
        ("bits8", 1, None, False),
        ("bits16", 2, None, False),
        ("bits1x8", 1, None, False),
        ("bits2x4", 1, None, False),
        ("bits4x2", 1, None, False),
    ]
    return {name: DType(name, size, st, fl) for name, size, st, fl in table}


DTYPES: dict[str, DType] = _dtypes()


# dtypes whose bytes torch cannot turn into numbers (no conversion kernels): no stats,
# and diff compares their raw bits
NO_NUMBERS = frozenset({"float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2"})


SAFETENSORS_DTYPES: dict[str, DType] = {d.safetensors: d for d in DTYPES.values() if d.safetensors}


# torch.save names a typed storage class per dtype (``torch.FloatStorage``); newer
# dtypes (fp8, uint16...) are saved as ``torch.storage.UntypedStorage`` plus a dtype.
STORAGE_CLASSES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8",
    "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32",
    "UntypedStorage": "uint8",
}


def dtype(name: str) -> DType:
    """Look a dtype up by torch name (``float32`` or ``torch.float32``)."""
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise CkptError(f"unsupported dtype {name!r}")
    return DTYPES[key]


def check_dtype(value: Any) -> DType:
    """``value`` is one of the table's own dtypes (a writer names nothing else), or raise."""
    if not isinstance(value, DType) or DTYPES.get(value.name) is not value:
        raise CkptError(f"corrupt tensor dtype {value!r:.80}")
    return value
