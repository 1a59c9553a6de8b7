"""``diff``: compare two checkpoints of any formats, tensor by tensor.

Tensors are compared one pair at a time, in chunks, so memory stays bounded
whatever the checkpoint size. Tolerances of 0 mean bitwise equality.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

from .api import flatten_tensors, read, select_node
from .dtypes import NO_NUMBERS
from .errors import UsageError, translate_errors
from .progress import ProgressFactory
from .sources import OpenFiles, read_span_into
from .tree import (
    NoSuchPrefixError,
    SparseRef,
    TensorRef,
    contiguous_stride,
    model_key,
    raw_parts,
    resolve_prefix,
    tied_names,
)
from .tree import strip_prefix as strip_layout_prefix

# float64 temporaries of a chunk stay around 40 MiB
CHUNK_ELEMENTS = 1 << 20
# stored bytes are compared in blocks of this size (a multiple of every element size)
BLOCK_BYTES = 16 << 20


class RawReader:
    """Reads the stored bytes of tensors into one reused buffer.

    Each chunk lands in the same ``bytearray`` (no allocation, no page faults per
    chunk) and files stay open while a diff runs: comparing two 1 GiB checkpoints
    is then two page-cache reads and a ``memcmp``.
    """

    def __init__(self, block_bytes: int):
        self.buffer = bytearray(block_bytes)
        self.files = OpenFiles()

    def spans(self, parts: list[Any]) -> Iterator[tuple[Any, int, int]]:
        """(source, start, nbytes) of each part: its bytes within its ByteSpan."""
        for ref in parts:
            yield ref.storage.source, ref.offset * ref.dtype.itemsize, ref.nbytes

    def blocks(self, parts: list[Any]) -> Iterator[int]:
        """Fill the buffer again and again with the parts' bytes; yield how much is in it."""
        view, filled = memoryview(self.buffer), 0
        for source, start, nbytes in self.spans(parts):
            done = 0
            while done < nbytes:
                n = min(nbytes - done, len(view) - filled)
                read_span_into(source, start + done, view[filled : filled + n], self.files)
                done, filled = done + n, filled + n
                if filled == len(view):
                    yield filled
                    filled = 0
        if filled:
            yield filled


def _differing_raw_blocks(
    a: Any, b: Any, readers: tuple[RawReader, RawReader]
) -> Iterator[tuple[memoryview, memoryview]] | None:
    """The blocks whose bytes differ, read straight from the files without torch, when
    both tensors allow it (plain tensors, and sharded ones split along dim 0, whatever
    their shard sizes); None when they need torch to load. Blocks end on element
    boundaries: both streams hold the same number of bytes, cut at the same places.
    """

    parts_a, parts_b = raw_parts(a), raw_parts(b)
    if parts_a is None or parts_b is None:
        return None
    ra, rb = readers

    def differing() -> Iterator[tuple[memoryview, memoryview]]:
        for na, nb in zip(ra.blocks(parts_a), rb.blocks(parts_b), strict=True):
            # bytearray == bytearray is a memcmp; comparing memoryviews is 40x slower
            if na == nb == len(ra.buffer):
                same = ra.buffer == rb.buffer
            else:
                same = ra.buffer[:na] == rb.buffer[:nb]
            if not same:
                yield memoryview(ra.buffer)[:na], memoryview(rb.buffer)[:nb]

    return differing()


def compare_tensors(
    a: Any, b: Any, atol: float, rtol: float, readers: tuple[RawReader, RawReader]
) -> dict[str, Any]:
    """Max absolute difference and count of elements outside tolerance.

    Only blocks whose bytes differ are looked at with torch; two identical tensors
    are compared without importing it.
    """
    blocks = _differing_raw_blocks(a, b, readers)
    first = None if blocks is None else next(blocks, None)
    if blocks is not None and first is None:
        return {"max_abs_diff": 0.0, "num_different": 0}
    import torch

    if blocks is not None:
        from .tensors import torch_dtype

        raw_blocks = itertools.chain([first] if first is not None else [], blocks)
        dtype = torch_dtype(a.dtype)
        pairs: Iterator[tuple[Any, Any]] = (
            (torch.frombuffer(va, dtype=dtype), torch.frombuffer(vb, dtype=dtype))
            for va, vb in raw_blocks
        )
    elif isinstance(a, SparseRef) or isinstance(b, SparseRef):
        pairs = iter([_sparse_values(a, b)])
    else:
        pairs = iter([(_values(a), _values(b))])
    max_diff, different = 0.0, 0
    for ta, tb in pairs:
        for start in range(0, ta.numel(), CHUNK_ELEMENTS):
            x, y = ta[start : start + CHUNK_ELEMENTS], tb[start : start + CHUNK_ELEMENTS]
            chunk_max, chunk_different = _compare_chunk(x, y, atol, rtol)
            max_diff, different = max(max_diff, chunk_max), different + chunk_different
    return {"max_abs_diff": max_diff, "num_different": different}


def _values(ref: Any) -> Any:
    """A tensor's elements, flat; a quantized tensor's are the values it stands for."""
    from .tensors import load_leaf

    t = load_leaf(ref, "cpu")
    return (t.dequantize() if t.is_quantized else t).reshape(-1)


def _sparse_values(a: Any, b: Any) -> tuple[Any, Any]:
    """Two tensors of which one or both are sparse, as flat values over the positions
    either stores (an unstored element is 0): compared as the dense tensors would be,
    in memory for what they store, not for their dense size."""
    import torch

    from .tensors import load_leaf, sparse_entries

    ta, tb = load_leaf(a, "cpu"), load_leaf(b, "cpu")
    if ta.layout == torch.strided or tb.layout == torch.strided or not ta.dim():
        x, y = _dense(ta), _dense(tb)  # the dense one is that big anyway; 0-d is one element
    else:
        (ia, va), (ib, vb) = sparse_entries(ta), sparse_entries(tb)
        # every position either stores, once; `where` maps each one's values onto it
        union, where = torch.unique(torch.cat([ia, ib], dim=1), dim=1, return_inverse=True)
        x = va.new_zeros(union.shape[1]).index_put_((where[: va.numel()],), va)
        y = vb.new_zeros(union.shape[1]).index_put_((where[va.numel() :],), vb)
    common = torch.promote_types(x.dtype, y.dtype)  # fp8 / uint values come widened
    return x.to(common), y.to(common)


def _dense(t: Any) -> Any:
    """All of a tensor's elements, flat; a sparse one's unstored elements are 0."""
    import torch

    from .tensors import sparse_entries

    if t.layout == torch.strided:
        return t.reshape(-1)
    indices, values = sparse_entries(t)
    strides = torch.tensor(contiguous_stride(tuple(t.shape)), dtype=torch.int64)
    flat = values.new_zeros(t.numel())
    return flat.index_put_(((indices * strides.unsqueeze(1)).sum(0),), values)


def _compare_chunk(
    x: Any, y: Any, atol: float, rtol: float, by_value: bool = False
) -> tuple[float, int]:
    """(max |x - y|, elements outside tolerance) of two flat chunks of the same dtype.

    Tolerances of 0 compare bytes (-0.0 != 0.0), unless ``by_value``: then values.
    """
    import torch

    bitwise = atol == 0 and rtol == 0 and not by_value
    different = 0
    if bitwise:  # element differs when any of its bytes does (-0.0 != 0.0)
        size = x.element_size()
        bits = x.view(torch.uint8).view(-1, size) != y.view(torch.uint8).view(-1, size)
        different = int(bits.any(dim=1).sum())
        del bits
        if not different:
            return 0.0, 0  # identical chunk: no float64 temporaries needed
    if str(x.dtype).removeprefix("torch.") in NO_NUMBERS:  # fp4 pairs, bits8...: no
        # conversion kernels; their differences are those of the raw integers
        raw = {1: torch.uint8, 2: torch.int16}[x.element_size()]
        x, y = x.view(raw), y.view(raw)
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
    max_diff = float(delta.max()) if delta.numel() else 0.0
    if not bitwise:
        # no tolerance covers an infinite difference (rtol * |inf| would)
        # (by value with 0 and 0: any nonzero difference counts)
        different = int(((delta > atol + rtol * y.abs()) | delta.isinf()).sum())
    return max_diff, different


def _selected_tensors(ckpt: Any, select: str, strip: str) -> tuple[dict[str, Any], str | None]:
    """The tensors to compare, and the prefix stripped from their names: the model state
    dict, or every tensor where there is none or no single one (an optimizer state file,
    a GAN's two nets): ``diff`` may not ignore any tensor that could differ."""
    if select == "auto" and model_key(ckpt) is None:
        select = "all"
    path, node = select_node(ckpt, select, "none")
    prefix = None
    if isinstance(node, Mapping) and all(isinstance(k, str) for k in node):
        if select != "all" or strip not in ("auto", "none"):  # (all: root keys are no names)
            prefix = resolve_prefix(node, strip)
            node = strip_layout_prefix(node, prefix)
    return flatten_tensors(node, str(path[-1]) if path else ""), prefix


def _both_sides(
    a: Any, b: Any, selects: tuple[str, str], strips: tuple[str, str], pair: bool = True
) -> tuple[tuple[dict[str, Any], dict[str, Any]], tuple[str | None, str | None]]:
    """The tensors of both sides and the prefix stripped from each.

    A prefix given for both sides must match the keys of one at least (a checkpoint is
    often compared with its export that has none: ``module.x`` against ``x``); the other
    keeps its keys. ``auto`` also pairs two layouts: where one side's every name starts
    with one first part (Lightning's ``model.``) that the other's do not, and stripping
    it makes more names meet, it is stripped (unless ``pair`` is False)."""
    sides: list[dict[str, Any]] = []
    prefixes: list[str | None] = []
    errors: list[NoSuchPrefixError] = []
    shared = strips[0] == strips[1]
    for ckpt, select, strip in zip((a, b), selects, strips, strict=True):
        try:
            tensors, prefix = _selected_tensors(ckpt, select, strip)
        except NoSuchPrefixError as exc:
            if not shared:
                raise  # a prefix for this side alone must match it
            errors.append(exc)
            tensors, prefix = _selected_tensors(ckpt, select, "none")
        sides.append(tensors)
        prefixes.append(prefix)
    if len(errors) == 2:
        raise errors[0]
    for side, strip in enumerate(strips):
        other = 1 - side
        if pair and strip == "auto" and prefixes[side] is None:
            head = _common_head(sides[side])
            if head and _common_head(sides[other]) != head:
                stripped = {name[len(head) :]: t for name, t in sides[side].items()}
                if len(stripped.keys() & sides[other].keys()) > len(
                    sides[side].keys() & sides[other].keys()
                ):
                    sides[side], prefixes[side] = stripped, head
    return (sides[0], sides[1]), (prefixes[0], prefixes[1])


def _common_head(tensors: dict[str, Any]) -> str | None:
    """The first part (``model.``) every name of ``tensors`` starts with, where one does."""
    heads = {name.partition(".")[0] for name in tensors if "." in name}
    if len(heads) != 1 or any("." not in name for name in tensors):
        return None
    return heads.pop() + "."


@translate_errors
def diff(
    a: Any,
    b: Any,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    select: str = "auto",
    strip_prefix: str = "auto",
    unsafe: bool = False,
    progress: ProgressFactory | None = None,
    select_a: str | None = None,
    select_b: str | None = None,
    strip_prefix_a: str | None = None,
    strip_prefix_b: str | None = None,
    arch: str | None = None,
) -> dict[str, Any]:
    """Compare the selected tensors of two checkpoints.

    Tensors of the same shape and different dtypes (an fp32 model and its bf16 export)
    have their values compared too, both cast to the wider dtype: with a tolerance,
    they are equal when every element is within it; bitwise (0 and 0) they never are.

    Args:
        a, b: Inputs of any readable format (paths, folders, lists of rank files).
        atol, rtol: Allowed ``|a - b| <= atol + rtol * |b|``; 0 and 0 mean bitwise.
        select, strip_prefix: As in :func:`ckpttool.convert.convert`, applied to both.
        select_a, select_b, strip_prefix_a, strip_prefix_b: For one side, where its
            layout is not the other's (a Lightning ``state_dict`` against its export).
        progress: ``(total bytes, description) -> context manager`` giving a callable
            that is told how many bytes of A were compared (a progress bar).
        arch: Compare across a mapping (``torchtitan:llama3``, or an architecture):
            the side in that mapping's source layout is mapped to the HF names, with
            the other side's ``config.json`` (a Hugging Face model folder), and the
            tensors compared as mapped, RoPE rows and all.

    Returns:
        ``{"equal", "only_in_a", "only_in_b", "mismatched", "different", "compared",
        "atol", "rtol", "counts", "prefixes", "tied"}``; ``counts`` has the number of
        each kind of difference, ``prefixes`` the prefix stripped from each side
        (``{"a", "b"}``), ``tied`` the names one side alone has as a tie of a weight
        both have (``{"name", "side", "to"}``: no difference).
        A dtype mismatch compared across dtypes has ``max_abs_diff``, ``num_different``
        and ``within_tolerance`` (never True when bitwise).
    """
    if atol < 0 or rtol < 0:
        raise UsageError("--atol and --rtol must be >= 0")
    selects = (select_a or select, select_b or select)
    strips = (strip_prefix_a or strip_prefix, strip_prefix_b or strip_prefix)
    # (across a mapping, the names are the mapping's to pair: no first part is guessed)
    (ta, tb), prefixes = _both_sides(
        read(a, unsafe=unsafe), read(b, unsafe=unsafe), selects, strips, pair=arch is None
    )
    mapping = None
    if arch is not None:
        from .mappings import pair_through

        ta, tb, mapping = pair_through((a, b), ta, tb, arch)
    # a name only one side has, tied there to a weight both sides have (a tied head
    # that save_pretrained left out): the same weight, a note, no difference
    tied = [
        {"name": name, "side": side, "to": kept}
        for side, mine, theirs in (("a", ta, tb), ("b", tb, ta))
        for name, kept in tied_names(mine).items()
        if name not in theirs and kept in theirs
    ]
    one_side = {(t["side"], t["name"]) for t in tied}
    only_a = [k for k in ta if k not in tb and ("a", k) not in one_side]
    only_b = [k for k in tb if k not in ta and ("b", k) not in one_side]
    mismatched, different, compared = [], [], 0
    readers = (RawReader(BLOCK_BYTES), RawReader(BLOCK_BYTES))
    bitwise = atol == 0 and rtol == 0
    total = sum(x.nbytes for name, x in ta.items() if name in tb)
    with progress(total, "comparing") if progress else contextlib.nullcontext() as advance:
        try:
            for name, x in ta.items():
                y = tb.get(name)
                if y is None:
                    continue
                compared += 1
                if tuple(x.shape) != tuple(y.shape):
                    mismatched.append(_mismatch("shape", name, x, y))
                elif x.dtype != y.dtype:
                    entry = _mismatch("dtype", name, x, y)
                    if _comparable(x) and _comparable(y):
                        entry.update(compare_across_dtypes(x, y, atol, rtol))
                    # bitwise, two dtypes are never equal; with a tolerance, they are
                    # when every value is within it (is the bf16 export right?)
                    entry["within_tolerance"] = not bitwise and entry.get("num_different") == 0
                    mismatched.append(entry)
                else:
                    result = compare_tensors(x, y, atol, rtol, readers)
                    if result["num_different"]:
                        different.append({"name": name, **result})
                if advance:
                    advance(x.nbytes)
        finally:
            for reader in readers:
                reader.files.close()
    dtypes = [m for m in mismatched if m["kind"] == "dtype"]
    counts = {
        "only_in_a": len(only_a),
        "only_in_b": len(only_b),
        "dtype": sum(1 for m in dtypes if not m["within_tolerance"]),
        "shape": len(mismatched) - len(dtypes),
        "values": len(different),
        "dtype_within_tolerance": sum(1 for m in dtypes if m["within_tolerance"]),
    }
    return {
        "equal": not (only_a or only_b or different)
        and all(m.get("within_tolerance") for m in mismatched),
        "only_in_a": only_a,
        "only_in_b": only_b,
        "mismatched": mismatched,
        "different": different,
        "compared": compared,
        "atol": atol,
        "rtol": rtol,
        "counts": counts,
        "prefixes": {"a": prefixes[0], "b": prefixes[1]},
        "tied": tied,
        **({"mapping": mapping} if mapping is not None else {}),
    }


def _mismatch(kind: str, name: str, x: Any, y: Any) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "a": {"dtype": x.dtype.name, "shape": list(x.shape)},
        "b": {"dtype": y.dtype.name, "shape": list(y.shape)},
    }


def _comparable(ref: Any) -> bool:
    """Whether a tensor has numbers to compare across dtypes (not fp4 pairs, bits, or a
    sharded tensor with shards missing, or a tensor saved without data)."""
    if ref.dtype.name in NO_NUMBERS or getattr(ref, "incomplete", None):
        return False
    return not (isinstance(ref, TensorRef) and ref.storage is None)


def compare_across_dtypes(a: Any, b: Any, atol: float, rtol: float) -> dict[str, Any]:
    """Max absolute difference and elements outside tolerance of two tensors of the same
    shape and different dtypes, both cast to the wider one (as ``torch.promote_types``);
    complex against real compares the real tensor as complex with imaginary part 0."""
    import torch

    if isinstance(a, SparseRef) or isinstance(b, SparseRef):
        x, y = _sparse_values(a, b)
    else:
        x, y = _values(a), _values(b)
    try:
        common = torch.promote_types(x.dtype, y.dtype)
    except RuntimeError:  # float8 types do not promote: float64 holds them all exactly
        common = torch.float64
    if common in (torch.uint16, torch.uint32, torch.uint64):  # no kernels: widen
        common = torch.int64 if common != torch.uint64 else torch.float64
    max_diff, different = 0.0, 0
    for start in range(0, x.numel(), CHUNK_ELEMENTS):
        cx = x[start : start + CHUNK_ELEMENTS].to(common)
        cy = y[start : start + CHUNK_ELEMENTS].to(common)
        # values, not bytes: bitwise here means "the same number" (-0.0 == 0.0 is not
        # asked; the dtypes differ, so the bytes do anyway)
        chunk_max, chunk_different = _compare_chunk(cx, cy, atol, rtol, by_value=True)
        max_diff, different = max(max_diff, chunk_max), different + chunk_different
    return {"max_abs_diff": max_diff, "num_different": different}
