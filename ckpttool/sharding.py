"""Shard geometry: where each block of a sharded tensor lies, and whether blocks tile it.

Blocks come from ShardedTensor and DTensor pickles (their per-rank state is read here
into :class:`LocalShards`, combined by :mod:`ckpttool.formats.per_rank`), DCP chunks,
DeepSpeed partitions and Megatron shards. Every block is a :class:`Block`: it loads
its elements and names the stored tensor that holds them (``tensor_ref``), which is
how a writer copies a sharded tensor's bytes without torch (:func:`raw_parts`).
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, Protocol

from .dtypes import DType, check_dtype
from .errors import CkptError
from .sealed import Sealed
from .torch_values import INT_ONLY, WrapperStub, int_tuple
from .tree import Leaf, Opaque, ShardedRef, TensorRef, state_attrs


class Block(Protocol):
    """One stored block of a sharded tensor (a rank's local shard, a DCP chunk, a ZeRO
    partition's slice): what merging and writing need from it."""

    def load(self, map_location: Any = "cpu") -> Any:
        """The block's elements as a ``torch.Tensor`` of its shard's sizes."""
        ...

    def tensor_ref(self) -> TensorRef:
        """The stored tensor holding the block's elements (metadata only, no bytes read)."""
        ...


@dataclass(eq=False)
class Shard(Sealed):
    """One block of a sharded tensor: ``sizes`` elements starting at ``offsets``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: Block
    rank: int | None = None


def check_coverage(key: str, shape: tuple, shards: list[Shard]) -> None:
    """Every element of the global tensor is in exactly one shard."""
    if _row_blocks(shape, shards):
        return
    nonempty = [s for s in shards if math.prod(s.sizes)]  # empty ranks hold nothing
    if _tiles(shape, nonempty, 0):
        return
    total = math.prod(shape)
    covered = 0
    for s in shards:
        if (
            len(s.offsets) != len(shape)
            or len(s.sizes) != len(shape)
            or any(
                o < 0 or n < 0 or o + n > dim
                for o, n, dim in zip(s.offsets, s.sizes, shape, strict=True)
            )
        ):
            raise CkptError(
                f"tensor {key!r}: a shard lies outside the tensor of shape {list(shape)}"
            )
        covered += math.prod(s.sizes)
    if covered > total:
        raise CkptError(f"tensor {key!r}: shards overlap ({covered} elements for {total})")
    if covered < total:
        raise CkptError(
            f"tensor {key!r}: shards cover {covered} of {total} elements "
            "(incomplete checkpoint: a rank file is missing?)"
        )
    if len(nonempty) > MAX_IRREGULAR_SHARDS:  # the pairwise check below is quadratic
        raise CkptError(
            f"tensor {key!r}: {len(nonempty)} shards that do not form a grid (corrupt checkpoint?)"
        )
    for i, a in enumerate(nonempty):
        for b in nonempty[i + 1 :]:
            if all(
                max(ao, bo) < min(ao + an, bo + bn)
                for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
            ):
                raise CkptError(f"tensor {key!r}: shards overlap")


MAX_IRREGULAR_SHARDS = 4096


def _row_blocks(shape: tuple, shards: list[Shard]) -> bool:
    """The commonest layout (FSDP, DCP, DTensor ``Shard(0)``), checked in bulk: every
    shard whole rows, the non-empty ones' row ranges following each other from 0 to
    the end. A 2048-rank checkpoint has millions of shards. False means only "not this
    case": :func:`_tiles` and the general check decide."""
    if not shape or not shards:
        return False
    return row_blocks(shape, list(map(_OFFSETS, shards)), list(map(_SIZES, shards)))


def row_blocks(shape: tuple, offsets: list[tuple], sizes: list[tuple]) -> bool:
    """:func:`_row_blocks` of the blocks at ``offsets`` of ``sizes`` (tuples)."""
    if not shape or not offsets or not math.prod(shape[1:]):
        return False
    tail = tuple(shape[1:])
    # (2-D, the commonest: the second number, no slice made per block)
    rest = operator.itemgetter(1) if len(tail) == 1 else _TAIL
    if (
        set(map(len, offsets)) != {len(shape)}
        or set(map(len, sizes)) != {len(shape)}
        or set(map(rest, sizes)) != {tail[0] if len(tail) == 1 else tail}
        or set(map(rest, offsets)) != {0 if len(tail) == 1 else (0,) * len(tail)}
        or set(map(type, itertools.chain(map(_ROW, offsets), map(_ROW, sizes)))) != {int}
    ):
        return False
    counts = list(map(_ROW, sizes))
    rows = sorted(
        itertools.compress(zip(map(_ROW, offsets), counts, strict=True), counts)
    )  # non-empty
    if not rows or min(counts) < 0:
        return False
    starts = list(map(_ROW, rows))
    ends = list(map(operator.add, starts, map(_COUNT, rows)))
    return starts[0] == 0 and ends[-1] == shape[0] and ends[:-1] == starts[1:]


_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")
_TAIL, _ROW, _COUNT = (operator.itemgetter(i) for i in (slice(1, None), 0, 1))


def _tiles(shape: tuple, shards: list[Shard], dim: int) -> bool:
    """The layouts sharding produces, checked in n log n: along ``dim`` the shards'
    ranges follow each other from 0 to the end, shards with the same range form a
    group, and each group tiles the dims after it the same way. Blocks of rows (FSDP,
    DCP, DTensor ``Shard(0)``) and grids (tensor parallel x FSDP) are such layouts.
    False means only "not this case": the general check decides."""
    if dim == len(shape):
        return len(shards) == 1
    groups: dict[tuple[int, int], list[Shard]] = {}
    for s in shards:
        if len(s.offsets) != len(shape) or len(s.sizes) != len(shape):
            return False
        groups.setdefault((s.offsets[dim], s.sizes[dim]), []).append(s)
    end = 0
    for start, size in sorted(groups):
        if start != end or size <= 0:
            return False
        end += size
    return end == shape[dim] and all(_tiles(shape, g, dim + 1) for g in groups.values())


SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


DTENSOR_CLASSES = frozenset(
    {
        "torch.distributed.tensor.DTensor",
        "torch.distributed._tensor.api.DTensor",
        "torch.distributed.tensor._api.DTensor",
    }
)


class LocalShards(Sealed):
    """One rank's part of a ShardedTensor or DTensor, before ranks are combined.

    Attributes:
        kind: ``sharded_tensor`` or ``dtensor``.
        dtype, shape, device: the global tensor's.
        shards: this rank's blocks, as :class:`~ckpttool.tree.Shard`.
        layout: global description of every block (ShardedTensor: list of
            (offsets, sizes, rank)); DTensor: mesh shape, coordinate, placements.
        rank, world_size: when the file says so.
    """

    def __init__(
        self,
        kind: str,
        dtype: DType,
        shape: tuple[int, ...],
        device: str,
        requires_grad: bool = False,
    ) -> None:
        self.kind = kind
        self.dtype = dtype
        self.shape = shape
        self.device = device
        self.requires_grad = requires_grad
        self.shards: list = []
        self.layout: Any = None
        self.rank: int | None = None
        self.world_size: int | None = None


def sharded_tensor_local(stub: WrapperStub, state: Any) -> LocalShards:
    """A ShardedTensor's pickled state: (local shards, metadata, process group state, ...)."""

    if not isinstance(state, tuple) or len(state) < 2:
        raise CkptError("corrupt ShardedTensor state")
    local_shards, metadata = state[0], state[1]
    meta = state_attrs(metadata)
    out = LocalShards(
        "sharded_tensor", check_dtype(stub.dtype), stub.shape, stub.device, stub.requires_grad
    )
    layout = []
    for shard_meta in meta.get("shards_metadata", []):
        m = state_attrs(shard_meta)
        layout.append(
            (
                int_tuple(m.get("shard_offsets"), "shard offsets"),
                int_tuple(m.get("shard_sizes"), "shard sizes"),
                _placement_rank(m.get("placement")),
            )
        )
    out.layout = layout
    for shard in local_shards or []:
        s = state_attrs(shard)
        m = state_attrs(s.get("metadata"))
        offsets = int_tuple(m.get("shard_offsets"), "shard offsets")
        sizes = int_tuple(m.get("shard_sizes"), "shard sizes")
        tensor = s.get("tensor")
        if not isinstance(tensor, TensorRef) or tensor.shape != sizes:
            raise CkptError("corrupt ShardedTensor: a local shard does not match its metadata")
        out.shards.append(Shard(offsets, sizes, tensor, _placement_rank(m.get("placement"))))
    if len(state) > 2:
        pg = state_attrs(state[2])
        out.rank = pg.get("global_rank")
        out.world_size = pg.get("global_world_size")
    if out.device == "cpu" and out.shards:
        out.device = out.shards[0].tensor.device
    return out


def _placement_rank(placement: Any) -> int | None:
    """``_remote_device('rank:1/cuda:1')`` -> 1."""
    if isinstance(placement, Opaque):
        a = placement.attrs()
        if isinstance(a.get("_worker_name"), str) and a["_worker_name"].startswith("rank:"):
            return int(a["_worker_name"][5:])
        if isinstance(a.get("_rank"), int):
            return a["_rank"]
        for arg in placement.args:
            if isinstance(arg, str) and arg.startswith("rank:"):
                return int(arg[5:].split("/", 1)[0])
    return None


def dtensor_local(stub: WrapperStub, state: Any) -> LocalShards:
    """A DTensor's pickled state: ``{"_local_tensor", "_spec": DTensorSpec(mesh, placements)}``."""
    s = state_attrs(state)
    local = s.get("_local_tensor")
    spec = state_attrs(s.get("_spec"))
    mesh = state_attrs(spec.get("mesh"))
    if not isinstance(local, TensorRef):
        raise CkptError("corrupt DTensor: no local tensor")
    out = LocalShards(
        "dtensor", check_dtype(stub.dtype), stub.shape, local.device, stub.requires_grad
    )
    placements: list[tuple[Any, ...]] = []
    for p in spec.get("placements") or ():
        cls = type(p).__name__ if isinstance(p, Opaque) else ""
        a = state_attrs(p)
        if cls == "Shard":
            placements.append(("shard", a.get("dim")))
        elif cls == "_StridedShard":  # FSDP2 over TP on the same dim
            placements.append(("strided_shard", a.get("dim"), a.get("split_factor")))
        elif cls == "Replicate":
            placements.append(("replicate", None))
        else:
            placements.append((cls.lower() or "unknown", None))
    out.layout = {
        "mesh_shape": _mesh_shape(mesh),
        "coordinate": tuple(mesh.get("_coordinate_on_dim") or ()),
        "placements": placements,
        "world_size": _mesh_world_size(mesh),
    }
    out.rank = mesh.get("_rank") if isinstance(mesh.get("_rank"), int) else None
    out.shards.append(_LocalBlock(local))
    return out


class _LocalBlock(Sealed):
    """A DTensor's local tensor before its offsets are known (set when ranks are combined)."""

    def __init__(self, tensor: TensorRef):
        self.tensor = tensor


def _mesh_world_size(mesh: dict) -> int | None:
    """The ranks of the whole job, when the mesh records them (torch >= 2.9: the root
    mesh's rank map, also in a submesh such as the ``dp`` dimension of a 2-D mesh)."""
    ranks = mesh.get("_flatten_rank_map")
    if isinstance(ranks, tuple) and ranks:
        return len(ranks)
    rank_map = mesh.get("_rank_map")
    if isinstance(rank_map, TensorRef) and rank_map.numel:
        return rank_map.numel
    return None


def _mesh_shape(mesh: dict) -> tuple[int, ...] | None:
    """The mesh's size along each of its dimensions.

    torch >= 2.9 records a layout: one axis per mesh dimension, each a CuTe-style
    shape whose product is that dimension's size (``()`` for a size-1 dimension, two
    numbers for one flattened from non-adjacent dimensions). Older torch pickles the
    mesh tensor of ranks itself."""
    layout = state_attrs(mesh.get("_layout"))
    axes = layout.get("axes") if layout else None
    if isinstance(axes, tuple) and axes:
        shapes = [state_attrs(axis).get("shape") for axis in axes]
        if all(isinstance(s, tuple) and INT_ONLY.issuperset(map(type, s)) for s in shapes):
            return tuple(math.prod(s) for s in shapes if s is not None)
    mesh_tensor = mesh.get("mesh")
    if isinstance(mesh_tensor, TensorRef):
        return mesh_tensor.shape
    return None


def own_dtensor_block(
    key: str, local: LocalShards, rank: int | None, file: str | None = None
) -> Shard:
    """A DTensor rank's own block, placed by its mesh coordinate."""
    layout = local.layout
    offsets, sizes = dtensor_block(
        key, local.shape, layout["mesh_shape"], layout["coordinate"], layout["placements"]
    )
    own = local.shards[0].tensor
    if own.shape != sizes:
        raise CkptError(
            f"tensor {key!r}: local tensor of shape {list(own.shape)} does not match its "
            f"placement (expected {list(sizes)})",
            path=file,
        )
    return Shard(offsets, sizes, own, rank)


def dtensor_block(key, shape, mesh_shape, coordinate, placements) -> tuple[tuple, tuple]:
    """The (offsets, sizes) a DTensor rank holds, as torch's
    ``_compute_local_shape_and_global_offset`` places it.

    Mesh dimensions shard left to right, each splitting what the previous ones left,
    like ``torch.chunk``. ``_StridedShard(d, split_factor=k)`` (FSDP2 over tensor
    parallel) splits into k parts first and takes this rank's chunk of each: it stands
    for a split that happens after it, so the rows it picks are strided, and the
    later ``Shard(d)`` picks a contiguous block out of them. Each dim's picked rows
    are tracked as runs of global indices (never one number per row: the shape is
    the file's word); a rank's block must end up one run.
    """
    if (
        not mesh_shape
        or len(coordinate) != len(mesh_shape)
        or len(placements) != len(mesh_shape)
        or not all(type(n) is int and type(c) is int and 0 <= c < n
                   for n, c in zip(mesh_shape, coordinate, strict=True))
    ):  # fmt: skip
        raise CkptError(f"tensor {key!r}: DTensor without a usable device mesh")
    picked: dict[int, list[range]] = {}  # dim -> the global rows held, in local order
    for mesh_dim, (kind, dim, *args) in enumerate(placements):
        if kind == "replicate":
            continue
        if kind not in ("shard", "strided_shard") or type(dim) is not int or not shape:
            raise CkptError(f"tensor {key!r}: DTensor placement {kind!r} cannot be merged")
        dim = dim % len(shape)
        runs = picked.get(dim, [range(shape[dim])])
        n, c = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if kind == "shard":
            picked[dim] = _chunk(runs, n, c)
            continue
        split = args[0] if args else None
        # the work is split x runs; a real split factor is a tensor-parallel size
        if not isinstance(split, int) or not 1 <= split <= MAX_RUNS // max(len(runs), 1):
            raise CkptError(f"tensor {key!r}: corrupt _StridedShard split factor {split!r}")
        picked[dim] = [r for part in range(split) for r in _chunk(_chunk(runs, split, part), n, c)]
    offsets, sizes = [0] * len(shape), list(shape)
    for dim, runs in picked.items():
        sizes[dim] = sum(len(r) for r in runs)
        offsets[dim] = runs[0].start if runs else shape[dim]
        if any(a.stop != b.start for a, b in itertools.pairwise(runs)):
            raise CkptError(
                f"tensor {key!r}: a rank's DTensor rows along dim {dim} are not one block of "
                "the global tensor (a _StridedShard layout ckpttool cannot merge)"
            )
    return tuple(offsets), tuple(sizes)


MAX_RUNS = 1 << 16  # runs of rows a rank may hold along one dim (and split x runs)


def _chunk(runs: list[range], n: int, c: int) -> list[range]:
    """Part ``c`` of the rows in ``runs`` split in ``n`` as ``torch.chunk`` splits (the
    last parts may be short or empty), as runs; empty runs are dropped."""
    size = -(-sum(len(r) for r in runs) // n)
    start, stop = c * size, (c + 1) * size
    out, pos = [], 0
    for run in runs:
        lo, hi = max(start - pos, 0), min(stop - pos, len(run))
        if lo < hi:
            out.append(run[lo:hi])
        pos += len(run)
    return out


def _raw_copy_ok(leaf: Any) -> bool:
    """Bytes can be copied as stored: a contiguous on-disk tensor, no byte swap."""
    return (
        isinstance(leaf, TensorRef)
        and leaf.kind != "quantized"
        and not (leaf.conj or leaf.neg)
        and leaf.storage is not None
        and leaf.storage.source is not None
        and not leaf.storage.big_endian
        and leaf.is_contiguous()
    )


def raw_parts(leaf: Leaf) -> list[TensorRef] | None:
    """Stored tensors whose bytes, one after the other, are the leaf's bytes.

    A plain contiguous tensor is its own single part. A sharded tensor whose shards are
    each one run of its row-major elements (split along dim 0, as FSDP, DCP and DTensor
    ``Shard(0)`` split; or cut from a flat buffer, as DeepSpeed ZeRO's partitions) is
    its shards in element order: no torch, no full tensor in memory. None when the
    bytes need torch (a view, a byte swap, blocks split along other dims).
    """
    if isinstance(leaf, TensorRef):
        return [leaf] if _raw_copy_ok(leaf) else None
    if not isinstance(leaf, ShardedRef):
        return None
    runs = []
    for shard in leaf.shards:
        start = _flat_start(leaf.shape, shard.offsets, shard.sizes)
        if start is None:
            return None
        runs.append((start, shard))
    parts, end = [], 0
    for start, shard in sorted(runs, key=lambda run: run[0]):
        ref = shard.tensor.tensor_ref()
        if start != end or not _raw_copy_ok(ref) or ref.dtype != leaf.dtype:
            return None
        parts.append(ref)
        end += ref.numel
    return parts if end == leaf.numel else None


def _flat_start(shape: tuple, offsets: tuple, sizes: tuple) -> int | None:
    """The row-major index of a block's first element, if its elements are one run of the
    tensor's (a few leading indices fixed, a range along one dim, the dims after it whole)."""
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        return None
    whole = len(shape)  # the dims from here on are whole
    while whole and offsets[whole - 1] == 0 and sizes[whole - 1] == shape[whole - 1]:
        whole -= 1
    if any(n != 1 for n in sizes[: max(whole - 1, 0)]):
        return None
    start, stride = 0, 1
    for dim in reversed(range(len(shape))):
        start += offsets[dim] * stride
        stride *= shape[dim]
    return start
