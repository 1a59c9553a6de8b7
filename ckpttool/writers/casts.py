"""``--dtype`` casts of stored tensor bytes, without torch: the same bytes however the
elements are cut.

A cast converts each element on its own, so a tensor cast whole, window by window or
unit by unit on many ranks must give the same bytes; torch's own ``.to()`` does not
promise that for NaN (its vector and scalar loops, and its x86 and ARM builds, write
different NaN bits), and importing it costs a rank ~300 MiB. Here every cast is
numpy arithmetic on the bits, one rule per step, the rule of torch 2.x's vectorized x86
loops (what ``.to()`` of a CPU tensor writes for all but a few tail elements there):

1. The source element becomes a float32 exactly: float16 and bfloat16 and every float8
   widen without rounding (a float16 or float8_e5m2 NaN keeps its payload, quieted;
   float8_e4m3fn's NaN keeps its mantissa; the fnuz formats' and float8_e8m0fnu's one
   NaN is ``0x7F800001``); float64 rounds to nearest even (as torch does on its way to
   every 16-bit type: float64 to float16 is float64 -> float32 -> float16).
2. The float32 becomes the target: float32 as it is; float16 rounded to nearest even
   (overflow to infinity), a NaN ``sign | 0x7E00 | payload >> 13``; bfloat16 rounded to
   nearest even on the upper 16 bits, every NaN ``0xFFFF`` from a float32 or float64
   source and ``0x7FC0`` from a float16 or float8 one (torch's float32 and float64 loops
   are vectorized, the others convert element by element through ``c10::BFloat16``).

Tensors whose bytes need torch anyway (views, byte swaps) are cast by the same rule
(:func:`cast_bytes` on their contiguous bytes).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from ..dtypes import DTYPES, DType
from ..errors import CkptError

CAST_ELEMENTS = 4 << 20  # elements read and cast at a time (a 16 MiB float32 window)
TARGETS = ("float32", "float16", "bfloat16")  # what --dtype offers


def cast_bytes(data: Any, source: DType, target: DType) -> memoryview:
    """The elements in ``data`` (a bytes-like object of ``source`` elements, little
    endian) cast to ``target`` (see the module's rules).

    Raises:
        CkptError: A cast this module has no rule for (a caller's error: ``--dtype``
            casts floating-point tensors to float32, float16 or bfloat16 only).
    """
    import numpy as np

    if target.name not in TARGETS or source.name not in _WIDEN:
        raise CkptError(f"internal error: no cast from {source.name} to {target.name}")
    if source == target:
        return memoryview(data).cast("B")
    bits = _WIDEN[source.name](np, data)  # float32 bits, uint32
    if target.name == "float32":
        return memoryview(bits).cast("B")
    if target.name == "float16":
        return memoryview(_to_float16(np, bits)).cast("B")
    wide = source.name in ("float32", "float64")
    return memoryview(_to_bfloat16(np, bits, 0xFFFF if wide else 0x7FC0)).cast("B")


def cast_stored(
    parts: list, source: DType, target: DType, start: int, length: int
) -> Iterator[memoryview]:
    """Bytes ``[start, start + length)`` of the stored elements ``parts`` (tensor
    references whose bytes, one after the other, are the elements) cast to ``target``,
    in pieces: only the elements they hold are read, :data:`CAST_ELEMENTS` at a time."""
    size_in, size_out = source.itemsize, target.itemsize
    first, end = start // size_out, -(-(start + length) // size_out)
    for at in range(first, end, CAST_ELEMENTS):
        n = min(CAST_ELEMENTS, end - at)
        cast = cast_bytes(read_stored(parts, at * size_in, n * size_in), source, target)
        lo = max(start - at * size_out, 0)
        hi = min(start + length - at * size_out, n * size_out)
        yield cast[lo:hi]


def read_stored(parts: list, start: int, nbytes: int) -> bytearray:
    """``nbytes`` from ``start`` of the stored parts' bytes, one after the other."""
    data, pos, end = bytearray(), 0, start + nbytes
    for ref in parts:
        lo, hi = max(start, pos), min(end, pos + ref.nbytes)
        if hi > lo:
            source = ref.storage.source if ref.storage is not None else None
            if source is None:
                raise CkptError("tensor has no stored data (saved on the meta device)")
            source.resolve()
            data += source.read(ref.offset * ref.dtype.itemsize + lo - pos, hi - lo)
        pos += ref.nbytes
        if pos >= end:
            break
    if len(data) != nbytes:
        raise CkptError("read outside of the stored bytes (truncated file?)")
    return data


# step 1: to float32 bits -------------------------------------------------------------

F32_QUIET = 0x00400000


def _quieted(np: Any, bits: Any) -> Any:
    """float32 bits with every NaN's quiet bit set (what x86's conversions do)."""
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    bits[nan] |= F32_QUIET
    return bits


def _from_float64(np: Any, data: Any) -> Any:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.frombuffer(data, dtype="<f8").astype("<f4").view("<u4")


def _from_float32(np: Any, data: Any) -> Any:
    return np.frombuffer(data, dtype="<u4").copy()


def _from_float16(np: Any, data: Any) -> Any:
    half = np.frombuffer(data, dtype="<f2")
    return _quieted(np, half.astype("<f4").view("<u4"))


def _from_bfloat16(np: Any, data: Any) -> Any:
    return np.frombuffer(data, dtype="<u2").astype("<u4") << 16


def _from_table(name: str) -> Any:
    def widen(np: Any, data: Any) -> Any:
        table = np.array(_float8_table(name), dtype="<u4")
        return table[np.frombuffer(data, dtype="u1")]

    return widen


@functools.cache
def _float8_table(name: str) -> tuple[int, ...]:
    """float32 bits of each of the 256 values of the float8 format ``name`` (torch's
    values, NaN bits included: tested against torch for every byte)."""
    import struct

    def f32(value: float) -> int:
        return int.from_bytes(struct.pack("<f", value), "little")

    table = []
    for byte in range(256):
        sign, rest = byte >> 7, byte & 0x7F
        if name == "float8_e8m0fnu":
            table.append(0x7F800001 if byte == 0xFF else f32(2.0 ** (byte - 127)))
            continue
        if name == "float8_e5m2":  # the upper half of a float16
            half = int.from_bytes(struct.pack("<H", byte << 8), "little")
            value = struct.unpack("<e", half.to_bytes(2, "little"))[0]
            if value != value:
                table.append((sign << 31) | 0x7F800000 | F32_QUIET | ((byte & 3) << 21))
            else:
                table.append(f32(value))
            continue
        mbits, bias = {"float8_e4m3fn": (3, 7), "float8_e4m3fnuz": (3, 8)}.get(name, (2, 16))
        exp, mant = rest >> mbits, rest & ((1 << mbits) - 1)
        if name.endswith("fnuz") and byte == 0x80:
            table.append(0x7F800001)  # the one NaN (there is no -0)
        elif name == "float8_e4m3fn" and rest == 0x7F:
            table.append((sign << 31) | 0x7F800000 | (mant << 20))
        else:
            scale = 2.0 ** (1 - bias) if exp == 0 else 2.0 ** (exp - bias)
            value = (mant / (1 << mbits) + (exp != 0)) * scale
            table.append(f32(-value if sign else value))
    return tuple(table)


_WIDEN = {
    "float64": _from_float64,
    "float32": _from_float32,
    "float16": _from_float16,
    "bfloat16": _from_bfloat16,
    **{name: _from_table(name) for name in DTYPES if name.startswith("float8_")},
}


# step 2: from float32 bits -----------------------------------------------------------


def _to_float16(np: Any, bits: Any) -> Any:
    with np.errstate(over="ignore", invalid="ignore"):
        half = bits.view("<f4").astype("<f2").view("<u2")
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        payload = ((bits[nan] >> 16) & 0x8000) | 0x7E00 | ((bits[nan] >> 13) & 0x3FF)
        half[nan] = payload.astype("<u2")
    return half


def _to_bfloat16(np: Any, bits: Any, nan_bits: int) -> Any:
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded[nan] = nan_bits
    return rounded.astype("<u2")
