"""``inspect --stats``: a tensor's min, max, mean, std and NaN/Inf counts, read a chunk at
a time (the only part of ``inspect`` that reads tensor data, and imports torch)."""

from __future__ import annotations

import math
from typing import Any

from .dtypes import NO_NUMBERS
from .tree import Leaf, ShardedRef, SparseRef, TensorRef

# --stats works on float64 copies of this many elements at a time (8 MiB)
STATS_CHUNK = 1 << 20


def tensor_stats(ref: Leaf) -> dict[str, Any]:
    """min/max/mean/std and NaN/Inf counts of one tensor (reads its bytes).

    A tensor saved without data (meta device) or sharded with blocks missing has none
    to show. A sparse tensor's are those of the dense tensor it stands for, computed
    from its stored values (the elements it does not store are zeros), never densified.
    """
    import torch

    out: dict[str, Any] = {"nan": 0, "inf": 0}
    none = {**out, "min": None, "max": None, "mean": None, "std": None}
    if isinstance(ref, TensorRef) and ref.storage is None:
        return none
    if isinstance(ref, ShardedRef) and ref.incomplete:
        return none
    if ref.dtype.name in NO_NUMBERS:
        return none
    from .tensors import load_leaf

    t = load_leaf(ref, "cpu")
    zeros = 0  # elements a sparse tensor does not store
    if isinstance(ref, SparseRef):
        from .tensors import sparse_entries

        t = sparse_entries(t)[1]
        zeros = ref.numel - t.numel()
    if t.numel() + zeros == 0:
        return none
    if t.is_quantized:  # the values it stands for
        t = t.dequantize()
    if t.dtype == torch.complex32:  # torch warns that its kernels are experimental
        t = t.to(torch.complex64)
    if t.is_complex():
        t = t.abs()
    if t.dtype in (torch.bool, torch.uint16, torch.uint32):  # no min/max kernels for these
        t = t.to(torch.int64)
    if t.dtype == torch.uint64:  # (sparse values come widened to int64)
        return {**out, **_uint64_stats(t)}
    if t.is_floating_point() and not zeros and t.numel() > STATS_CHUNK:
        return {**out, **_chunked_float_stats(t.reshape(-1))}
    if t.is_floating_point():
        t = t.to(torch.float64)
        finite = torch.isfinite(t)
        out["nan"] = int(torch.isnan(t).sum())
        out["inf"] = int(torch.isinf(t).sum())
        t = t[finite]
    if zeros:
        return {**out, **_stats_with_zeros(t, zeros)}
    if t.numel() == 0:
        return none | out
    out["min"] = _number(t.min())
    out["max"] = _number(t.max())
    f = t.to(torch.float64)
    out["mean"] = float(f.mean())
    out["std"] = float(f.std()) if f.numel() > 1 else 0.0
    return out


def _chunked_float_stats(t: Any) -> dict[str, Any]:
    """Stats of a big flat floating-point tensor, a chunk at a time in float64.

    Each chunk's float64 copy stays in the CPU cache (a whole-tensor copy is 8 bytes
    per element through memory, several passes over it); the chunks' means and sums
    of squared deviations are combined exactly as Chan et al.'s parallel variance.
    """
    import torch

    nan = inf = count = 0
    low = high = None
    mean = m2 = 0.0
    for start in range(0, t.numel(), STATS_CHUNK):
        chunk = t[start : start + STATS_CHUNK].to(torch.float64)
        kept = chunk.numel()
        var, mean_t = torch.var_mean(chunk, correction=0)
        chunk_mean: Any = mean_t
        # a NaN or an infinity makes the mean or variance one too: only then count them
        if not (math.isfinite(float(var)) and math.isfinite(float(chunk_mean))):
            finite = torch.isfinite(chunk)
            kept = int(finite.sum())
            chunk_nan = int(torch.isnan(chunk).sum())
            nan, inf = nan + chunk_nan, inf + chunk.numel() - kept - chunk_nan
            chunk = chunk[finite]
            if not kept:
                continue
            var, chunk_mean = torch.var_mean(chunk, correction=0)
        chunk_low, chunk_high = torch.aminmax(chunk)
        chunk_mean, chunk_m2 = float(chunk_mean), float(var) * kept
        low = float(chunk_low) if low is None else min(low, float(chunk_low))
        high = float(chunk_high) if high is None else max(high, float(chunk_high))
        delta, total = chunk_mean - mean, count + kept
        mean += delta * kept / total
        m2 += chunk_m2 + delta * delta * count * kept / total
        count = total
    if not count:
        return {"nan": nan, "inf": inf, "min": None, "max": None, "mean": None, "std": None}
    std = math.sqrt(m2 / (count - 1)) if count > 1 else 0.0
    return {"nan": nan, "inf": inf, "min": low, "max": high, "mean": mean, "std": std}


def _stats_with_zeros(values: Any, zeros: int) -> dict[str, Any]:
    """Stats of ``values`` (real, finite) together with ``zeros`` more zero elements."""
    import torch

    count = values.numel() + zeros
    f = values.to(torch.float64)
    mean = float(f.sum()) / count
    # squared deviations of the stored values, then those of the zeros
    squares = float(((f - mean) ** 2).sum()) + zeros * mean**2
    stored = values.numel() > 0
    return {
        "min": min(_number(values.min()), 0) if stored else 0,
        "max": max(_number(values.max()), 0) if stored else 0,
        "mean": mean,
        "std": math.sqrt(squares / (count - 1)) if count > 1 else 0.0,
    }


def _uint64_stats(t: Any) -> dict[str, Any]:
    """Stats of a uint64 tensor (torch has no kernels for it).

    min/max are exact: flipping the top bit maps uint64 onto int64 in order. mean
    and std are taken over the distances from the minimum, each converted as two
    32-bit halves: near 2**63, float64 would round small differences away.
    """
    import torch

    bits = t.view(torch.int64)
    shifted = bits ^ torch.iinfo(torch.int64).min
    low, high = int(shifted.min()) + 2**63, int(shifted.max()) + 2**63
    # (bits - low) wraps around as uint64 would: the distance, as unsigned bits
    distance = bits - (low - 2**64 if low >= 2**63 else low)
    halves = (distance >> 32) & 0xFFFFFFFF, distance & 0xFFFFFFFF
    f = halves[0].to(torch.float64) * 2.0**32 + halves[1].to(torch.float64)
    return {
        "min": low,
        "max": high,
        "mean": low + float(f.mean()),
        "std": float(f.std()) if f.numel() > 1 else 0.0,
    }


def _number(x: Any) -> int | float:
    value = x.item()
    return value if isinstance(value, (int, float)) else float(value)
