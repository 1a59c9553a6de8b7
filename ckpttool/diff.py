"""``diff``: compare two checkpoints of any formats, tensor by tensor.

Tensors are compared one pair at a time, in chunks, so memory stays bounded
whatever the checkpoint size. Tolerances of 0 mean bitwise equality.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .api import flatten_tensors, read, select_node
from .errors import UsageError

# float64 temporaries of a chunk stay around 40 MiB
CHUNK_ELEMENTS = 1 << 20


def _blocks(chunks: Iterator[memoryview], size: int = 16 << 20) -> Iterator[bytes]:
    """Re-cut a byte stream into blocks of ``size`` (the last may be shorter)."""
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)


def _same_raw_bytes(a: Any, b: Any) -> bool:
    """Bitwise comparison straight from the files, without torch, when both allow it
    (plain tensors, and sharded ones split along dim 0, whatever their shard sizes)."""
    from .writers import iter_chunks, raw_parts

    if raw_parts(a, None) is None or raw_parts(b, None) is None:
        return False
    blocks_a, blocks_b = _blocks(iter_chunks(a, None)), _blocks(iter_chunks(b, None))
    return all(x == y for x, y in zip(blocks_a, blocks_b, strict=True))


def compare_tensors(a: Any, b: Any, atol: float, rtol: float) -> dict[str, Any]:
    """Max absolute difference and count of elements outside tolerance."""
    if _same_raw_bytes(a, b):
        return {"max_abs_diff": 0.0, "num_different": 0}
    import torch

    ta, tb = a.load("cpu").reshape(-1), b.load("cpu").reshape(-1)
    bitwise = atol == 0 and rtol == 0
    max_diff, different = 0.0, 0
    for start in range(0, ta.numel(), CHUNK_ELEMENTS):
        x, y = ta[start : start + CHUNK_ELEMENTS], tb[start : start + CHUNK_ELEMENTS]
        if bitwise:  # element differs when any of its bytes does (-0.0 != 0.0)
            size = x.element_size()
            bits = x.view(torch.uint8).view(-1, size) != y.view(torch.uint8).view(-1, size)
            changed = int(bits.any(dim=1).sum())
            del bits
            if not changed:
                continue  # identical chunk: no float64 temporaries needed
            different += changed
        if x.is_complex():
            x, y = torch.view_as_real(x).to(torch.float64), torch.view_as_real(y).to(torch.float64)
        else:
            x, y = x.to(torch.float64), y.to(torch.float64)
        both_nan = torch.isnan(x) & torch.isnan(y)
        delta = (x - y).abs()
        delta = torch.where(both_nan | (x == y), torch.zeros_like(delta), delta)
        # NaN against a number, or inf against anything else: an infinite difference
        # (nan_to_num would otherwise turn inf into the largest finite float)
        delta = torch.nan_to_num(delta, nan=float("inf"), posinf=float("inf"))
        if delta.numel():
            max_diff = max(max_diff, float(delta.max()))
        if not bitwise:
            # no tolerance covers an infinite difference (rtol * |inf| would)
            different += int(((delta > atol + rtol * y.abs()) | delta.isinf()).sum())
    return {"max_abs_diff": max_diff, "num_different": different}


def diff(
    a: Any,
    b: Any,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    select: str = "auto",
    strip_prefix: str = "auto",
    unsafe: bool = False,
) -> dict[str, Any]:
    """Compare the selected tensors of two checkpoints.

    Args:
        a, b: Inputs of any readable format (paths, folders, lists of rank files).
        atol, rtol: Allowed ``|a - b| <= atol + rtol * |b|``; 0 and 0 mean bitwise.
        select, strip_prefix: As in :func:`ckpttool.convert.convert`, applied to both.

    Returns:
        ``{"equal", "only_in_a", "only_in_b", "mismatched", "different", "compared"}``.
    """
    if atol < 0 or rtol < 0:
        raise UsageError("--atol and --rtol must be >= 0")
    ta = flatten_tensors(select_node(read(a, unsafe=unsafe), select, strip_prefix)[1])
    tb = flatten_tensors(select_node(read(b, unsafe=unsafe), select, strip_prefix)[1])
    only_a = [k for k in ta if k not in tb]
    only_b = [k for k in tb if k not in ta]
    mismatched, different, compared = [], [], 0
    for name, x in ta.items():
        y = tb.get(name)
        if y is None:
            continue
        compared += 1
        if x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape):
            mismatched.append(
                {
                    "name": name,
                    "a": {"dtype": x.dtype.name, "shape": list(x.shape)},
                    "b": {"dtype": y.dtype.name, "shape": list(y.shape)},
                }
            )
            continue
        result = compare_tensors(x, y, atol, rtol)
        if result["num_different"]:
            different.append({"name": name, **result})
    return {
        "equal": not (only_a or only_b or mismatched or different),
        "only_in_a": only_a,
        "only_in_b": only_b,
        "mismatched": mismatched,
        "different": different,
        "compared": compared,
        "atol": atol,
        "rtol": rtol,
    }
