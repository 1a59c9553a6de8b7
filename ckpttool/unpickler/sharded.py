"""ShardedTensor and DTensor objects of a pickle, read as the blocks one rank holds.

A rank's file holds its local shards (ShardedTensor) or its local tensor and device
mesh (DTensor); :class:`LocalShards` records them with their global shape and
offsets, placed by the mesh coordinates and placements where DTensor says where
they lie. :mod:`ckpttool.formats.per_rank` combines every rank's into one
:class:`~ckpttool.tree.ShardedRef`.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from ..dtypes import DType, check_dtype
from ..errors import CkptError
from ..sealed import Sealed
from ..tree import INT_ONLY, Opaque, Shard, TensorRef, WrapperStub, int_tuple, state_attrs

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
            (offsets, sizes, rank), or a run of them as records: a
            :class:`~ckpttool.formats.skeleton.shard_runs.ShardRun`); DTensor: mesh shape,
            coordinate, placements.
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
    layout: list = []
    for shard_meta in meta.get("shards_metadata", []):
        if type(shard_meta) is bytes:  # a run of them read as records: its token
            layout.append(shard_meta)  # (formats.skeleton.shard_runs.Parsed.resolve)
            continue
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


def dtensor_block(
    key: Any, shape: Any, mesh_shape: Any, coordinate: Any, placements: Any
) -> tuple[tuple, tuple]:
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
