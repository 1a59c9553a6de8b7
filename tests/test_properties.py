"""Property tests: random nested checkpoints over every dtype torch and safetensors share,
with 0-dim, empty, transposed, sliced, offset and storage-sharing tensors, survive
``convert --to safetensors``, ``convert --to pt`` and ``merge`` bit for bit.

Tensor contents are random BITS (NaNs, infinities and odd float8 patterns included), so
equality is checked on the bytes, never with ``==``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from helpers import assert_identical, safetensors_header, same_bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ckpttool.convert import convert
from ckpttool.errors import UsageError
from ckpttool.merge import merge

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bool,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
]
LAYOUTS = ["contiguous", "transposed", "sliced", "offset"]
SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def random_bits(dtype: torch.dtype, numel: int, g: torch.Generator) -> torch.Tensor:
    """``numel`` elements of random bits (bool: only 0 and 1, anything else is undefined)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g, dtype=torch.uint8).view(torch.bool)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], layout: str, seed: int):
    """A tensor of ``shape`` laid out as asked: its own storage, a transposed or strided
    view of a larger one, or a view at a storage offset."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for n in shape:
        numel *= n
    if layout == "transposed" and len(shape) >= 2:
        base = random_bits(dtype, numel, g).reshape(shape[::-1])
        return base.permute(*reversed(range(len(shape))))
    if layout == "sliced" and shape:
        big = tuple(2 * n + 1 for n in shape)
        total = 1
        for n in big:
            total *= n
        base = random_bits(dtype, total, g).reshape(big)
        return base[tuple(slice(1, 1 + 2 * n, 2) for n in shape)]
    if layout == "offset":
        return random_bits(dtype, numel + 3, g)[3:].reshape(shape)
    return random_bits(dtype, numel, g).reshape(shape)


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    return make_tensor(dtype, shape, draw(st.sampled_from(LAYOUTS)), draw(st.integers(0, 2**31)))


def flatten(node, path: tuple = ()) -> dict[str, torch.Tensor]:
    """Every tensor under ``node``, named by its key path joined with ``.`` (depth first)."""
    if isinstance(node, torch.Tensor):
        return {".".join(map(str, path)): node}
    items = node.items() if isinstance(node, dict) else enumerate(node)
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        if isinstance(value, (torch.Tensor, dict, list)):
            out.update(flatten(value, (*path, key)))
    return out


NAMES = st.text(alphabet="abcdefgh", min_size=1, max_size=3)


@st.composite
def state_trees(draw) -> dict:
    """Nested dicts (and lists) of tensors beside plain values, plus tensors that share
    storage with earlier ones: the same tensor again, or a view of it."""
    tree = draw(
        st.recursive(
            st.dictionaries(NAMES, tensors() | st.integers(0, 9), min_size=1, max_size=4),
            lambda inner: (
                st.dictionaries(NAMES, inner | tensors(), min_size=1, max_size=3)
                | st.lists(inner | tensors(), min_size=1, max_size=2)
            ),
            max_leaves=10,
        )
    )
    if not isinstance(tree, dict):
        tree = {"root": tree}
    existing = list(flatten(tree).values())
    if existing:
        for i in range(draw(st.integers(0, 3))):
            source = draw(st.sampled_from(existing))
            kind = draw(st.sampled_from(["same", "unsqueeze", "transpose"]))
            if kind == "same":
                tree[f"zz{i}"] = source
            elif kind == "unsqueeze":
                tree[f"zz{i}"] = source.unsqueeze(0)
            else:
                tree[f"zz{i}"] = source.transpose(0, -1) if source.dim() else source
    return tree


def convert_round_trip(tree: dict, to: str) -> None:
    want = flatten(tree)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.pt", Path(tmp) / f"out.{to}"
        torch.save(tree, src)
        if not want:
            with pytest.raises(UsageError, match="no tensors"):
                convert([str(src)], to, str(out), select="all")
            return
        result = convert([str(src)], to, str(out), select="all")
        assert result.num_tensors == len(want)
        # one tensor under two names (the tree holds it twice) is one weight: once
        first: dict[tuple, str] = {}
        tied: dict[str, str] = {}
        for name, t in want.items():
            key = (t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride(), t.dtype)
            if key in first:
                tied[name] = first[key]
            else:
                first[key] = name
        written = {k: t for k, t in want.items() if k not in tied}
        assert result.nbytes == sum(t.numel() * t.element_size() for t in written.values())
        if to == "safetensors":
            header = safetensors_header(out)
            assert header.pop("__metadata__") == {"format": "pt", "source": "in.pt", **tied}
            assert list(header) == list(written)
            got = load_file(out)
            got.update({alias: got[kept] for alias, kept in tied.items()})
        else:
            got = torch.load(out, weights_only=True)
            assert list(got) == list(want)
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert same_bits(got[name], tensor), name
            assert got[name].is_contiguous()


@SETTINGS
@given(tree=state_trees())
def test_convert_to_safetensors_round_trip(tree):
    convert_round_trip(tree, "safetensors")


@SETTINGS
@given(tree=state_trees())
def test_convert_to_pt_round_trip(tree):
    convert_round_trip(tree, "pt")


PLAIN = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=4)
)
KEYS = st.text(alphabet="abc.", max_size=3) | st.integers(0, 5)


@st.composite
def snapshots(draw) -> dict:
    """Training-snapshot-like structures: dicts with str or int keys, lists, tuples."""
    node = st.recursive(
        tensors() | PLAIN,
        lambda inner: (
            st.dictionaries(KEYS, inner, max_size=3)
            | st.lists(inner, max_size=3)
            | st.tuples(inner, inner)
        ),
        max_leaves=12,
    )
    return draw(st.dictionaries(KEYS, node, min_size=1, max_size=4))


@SETTINGS
@given(snapshot=snapshots())
def test_merge_round_trip_keeps_structure(snapshot):
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.pt", Path(tmp) / "merged.pt"
        torch.save(snapshot, src)
        result = merge(str(src), str(out))
        assert result.stand_ins == []
        assert_identical(torch.load(out, weights_only=True), snapshot)


@st.composite
def dtensor_layouts(draw):
    """A global shape, a mesh, a coordinate in it and one placement per mesh dim:
    Replicate, Shard(d) or _StridedShard(d, split_factor)."""
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    coordinate = [draw(st.integers(0, n - 1)) for n in mesh]
    dims = st.integers(0, len(shape) - 1)
    placement = st.one_of(
        st.just(("replicate", None)),
        st.tuples(st.just("shard"), dims),
        st.tuples(st.just("strided_shard"), dims, st.integers(1, 3)),
    )
    placements = [draw(placement) for _ in mesh]
    return shape, mesh, coordinate, placements


@settings(max_examples=300, deadline=None)
@given(layout=dtensor_layouts())
def test_dtensor_block_places_as_torch_does(layout):
    """The per-rank reader's placement math against torch's own, with no process group:
    the same block, or a refusal where the rank's rows are not one block."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    from ckpttool.errors import CkptError
    from ckpttool.unpickler.sharded import dtensor_block

    shape, mesh, coordinate, placements = layout
    theirs = [
        Replicate() if kind == "replicate"
        else Shard(args[0]) if kind == "shard"
        else _StridedShard(args[0], split_factor=args[1])
        for kind, *args in placements
    ]  # fmt: skip
    want_sizes, want_offsets = _compute_local_shape_and_global_offset(
        shape, mesh, coordinate, theirs
    )
    try:
        offsets, sizes = dtensor_block("t", shape, mesh, coordinate, placements)
    except CkptError as exc:
        assert "not one block" in str(exc)
        assert any(kind == "strided_shard" for kind, *_ in placements)
        return
    assert sizes == tuple(want_sizes)
    nonempty = [d for d in range(len(shape)) if sizes[d]]
    assert [offsets[d] for d in nonempty] == [want_offsets[d] for d in nonempty]


def test_dtensor_block_work_does_not_grow_with_the_shape_a_file_claims():
    """Rows are tracked as runs, so a global shape of 10^15 rows costs nothing; a split
    factor no tensor-parallel run has is refused as corrupt (its work would be
    split x runs per mesh dim)."""
    from ckpttool.errors import CkptError
    from ckpttool.unpickler.sharded import dtensor_block

    fsdp_over_tp = [("strided_shard", 0, 4), ("shard", 0)]
    assert dtensor_block("t", (10**15, 3), (2, 4), (1, 3), fsdp_over_tp) == (
        (875 * 10**12, 0), (125 * 10**12, 3)
    )  # fmt: skip
    with pytest.raises(CkptError, match="corrupt _StridedShard split factor 60000"):
        dtensor_block("t", (10**15,), (2, 2), (1, 1), [("strided_shard", 0, 60000)] * 2)


@st.composite
def nested_tilings(draw):
    """A shape and blocks that tile it as sharding does: cuts along dim 0, and within
    each row group its own cuts along dim 1 (a grid when they agree)."""
    rows, cols = draw(st.integers(1, 12)), draw(st.integers(1, 12))

    def cuts(n):
        inner = draw(st.lists(st.integers(1, n - 1), max_size=4, unique=True)) if n > 1 else []
        points = [0, *sorted(inner), n]
        return list(zip(points, points[1:], strict=False))

    blocks = [((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in cuts(rows) for c0, c1 in cuts(cols)]
    return (rows, cols), draw(st.permutations(blocks))


@settings(max_examples=200, deadline=None)
@given(tiling=nested_tilings(), damage=st.sampled_from(["none", "drop", "duplicate", "shift"]))
def test_coverage_check_accepts_tilings_and_refuses_damaged_ones(tiling, damage):
    from ckpttool.errors import CkptError
    from ckpttool.tree.sharding import Shard, check_coverage

    shape, blocks = tiling
    shards = [Shard(offsets, sizes, None) for offsets, sizes in blocks]
    if damage == "none":
        check_coverage("t", shape, shards)
        return
    if damage == "drop":
        shards.pop()
    elif damage == "duplicate":
        shards.append(shards[0])
    else:  # one block moved a row down: it leaves the tensor or overlaps another
        first = shards[0]
        shards[0] = Shard((first.offsets[0] + 1, first.offsets[1]), first.sizes, None)
    with pytest.raises(CkptError, match="shards (cover|overlap)|outside the tensor"):
        check_coverage("t", shape, shards)


def test_coverage_check_of_a_large_grid_takes_the_fast_path():
    """A 128 x 128 grid of blocks (a 2-D parallel run at scale): more shards than the
    quadratic check accepts, so passing proves the n log n path took it."""
    from ckpttool.tree.sharding import MAX_IRREGULAR_SHARDS, Shard, check_coverage

    n = 128
    shards = [Shard((i * 2, j * 3), (2, 3), None) for i in range(n) for j in range(n)]
    assert len(shards) > MAX_IRREGULAR_SHARDS
    check_coverage("t", (2 * n, 3 * n), shards)


@pytest.mark.parametrize(
    "shape, mesh, coordinate, placements",
    [((5,), (0,), (0,), [("shard", 0)]),  # an empty mesh dimension
     ((5,), (2,), (2,), [("shard", 0)]),  # a coordinate outside the mesh
     ((5,), (2,), (-1,), [("shard", 0)]),
     ((), (2,), (0,), [("shard", 0)]),  # a scalar cannot be sharded
     ((5,), (2,), (1,), [("shard", True)])],
)  # fmt: skip
def test_dtensor_block_refuses_corrupt_layouts(shape, mesh, coordinate, placements):
    """What a file says about its mesh is checked before any arithmetic on it: a
    corrupt one is a one-line error, not a ZeroDivisionError or a wrong block."""
    from ckpttool.errors import CkptError
    from ckpttool.unpickler.sharded import dtensor_block

    with pytest.raises(CkptError, match="DTensor"):
        dtensor_block("t", shape, mesh, coordinate, placements)
