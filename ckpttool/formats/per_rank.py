"""``per-rank``: one checkpoint spread over one ``torch.save`` file per rank.

Each file holds its rank's blocks of every ShardedTensor (FSDP
``SHARDED_STATE_DICT``, Composer ``ep{E}-ba{B}-rank{R}.pt``) or DTensor. We take
the tree of rank 0, replace each local-shards leaf by a :class:`ShardedRef` that
gathers the blocks of every rank, and check that they tile the global tensor.
"""

from __future__ import annotations

import glob
import math
import os
import re
from typing import Any

from ..errors import CkptError
from ..tree import Checkpoint, Shard, ShardedRef, get_path, walk
from ..unpickler import LocalShards

FORMAT = "per-rank"
RANK_RE = re.compile(r"^(.*rank)(\d+)([^\d].*|)$")


def has_local_shards(root: Any) -> bool:
    return any(isinstance(v, LocalShards) for _, v in walk(root))


def siblings(path: str) -> list[str]:
    """All files named like ``path`` but for the rank number (``…-rank*.pt``), by rank."""
    folder, name = os.path.split(path)
    m = RANK_RE.match(name)
    if not m:
        return [path]
    prefix, _, suffix = m.groups()
    pattern = re.compile("^" + re.escape(prefix) + r"(\d+)" + re.escape(suffix) + "$")
    found = []
    for candidate in glob.glob(os.path.join(glob.escape(folder or "."), glob.escape(prefix) + "*")):
        mm = pattern.match(os.path.basename(candidate))
        if mm:
            found.append((int(mm.group(1)), os.path.join(folder, os.path.basename(candidate))))
    return [p for _, p in sorted(found)]


def _file_rank(ckpt: Checkpoint, position: int) -> int:
    for _, value in walk(ckpt.root):
        if isinstance(value, LocalShards) and isinstance(value.rank, int):
            return value.rank
    m = RANK_RE.match(os.path.basename(ckpt.files[0]))
    return int(m.group(2)) if m else position


def _world_size(ckpts: list[Checkpoint]) -> int:
    sizes = [len(ckpts)]
    for _, value in walk(ckpts[0].root):
        if isinstance(value, LocalShards):
            if isinstance(value.world_size, int):
                sizes.append(value.world_size)
            if value.kind == "dtensor" and value.layout.get("mesh_shape"):
                sizes.append(math.prod(value.layout["mesh_shape"]))
            break
    return max(sizes)


def _rank_file_name(path: str, rank: int) -> str:
    m = RANK_RE.match(os.path.basename(path))
    if not m:
        return f"the file of rank {rank}"
    return os.path.join(os.path.dirname(path), f"{m.group(1)}{rank}{m.group(3)}")


def combine(ckpts: list[Checkpoint]) -> Checkpoint:
    """Merge the per-rank checkpoints into one tree of :class:`ShardedRef` leaves.

    Raises:
        CkptError: a rank file is missing, the files disagree, or the shards do
            not cover every element of a tensor exactly once.
    """
    ranked = sorted(((_file_rank(c, i), c) for i, c in enumerate(ckpts)), key=lambda rc: rc[0])
    ranks = [r for r, _ in ranked]
    if len(set(ranks)) != len(ranks):
        raise CkptError(f"several files claim the same rank: {ranks}", path=ckpts[0].files[0])
    world_size = _world_size([c for _, c in ranked])
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing:
        names = ", ".join(_rank_file_name(ranked[0][1].files[0], r) for r in missing)
        raise CkptError(
            f"checkpoint of {world_size} ranks, but rank file(s) missing: {names}",
            hint="pass every rank's file, or a quoted glob",
        )
    roots = [c.root for _, c in ranked]

    def build(node: Any, path: tuple) -> Any:
        if isinstance(node, LocalShards):
            return _combine_leaf(path, [get_path(r, path) for r in roots], world_size)
        if isinstance(node, dict):
            out = type(node)() if type(node) is not dict else {}
            for k, v in node.items():
                out[k] = build(v, path + (k,))
            return out
        if isinstance(node, list):
            return [build(v, path + (i,)) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return tuple(build(v, path + (i,)) for i, v in enumerate(node))
        return node

    root = build(roots[0], ())
    files = [c.files[0] for _, c in ranked]
    return Checkpoint(
        format=FORMAT,
        files=files,
        root=root,
        world_size=world_size,
        globals=sorted({g for c in ckpts for g in c.globals}),
        dangerous=sorted({g for c in ckpts for g in c.dangerous}),
    )


def _combine_leaf(path: tuple, parts: list[Any], world_size: int) -> ShardedRef:
    key = ".".join(str(k) for k in path)
    first = parts[0]
    for part in parts:
        if (
            not isinstance(part, LocalShards)
            or part.kind != first.kind
            or part.shape != first.shape
            or part.dtype != first.dtype
        ):
            raise CkptError(f"rank files disagree about tensor {key!r}")
    if first.kind == "dtensor":
        shards = _dtensor_shards(key, parts)
    else:
        shards = _sharded_tensor_shards(key, parts)
    check_coverage(key, first.shape, shards)
    return ShardedRef(
        dtype=first.dtype,
        shape=first.shape,
        shards=shards,
        device=first.device,
        kind=first.kind,
        requires_grad=first.requires_grad,
        world_size=world_size,
    )


def _sharded_tensor_shards(key: str, parts: list[LocalShards]) -> list[Shard]:
    provided: dict[tuple, Shard] = {}
    for part in parts:
        for shard in part.shards:
            provided.setdefault((shard.offsets, shard.sizes), shard)
    for offsets, sizes, rank in parts[0].layout or []:
        if (offsets, sizes) not in provided and math.prod(sizes) > 0:
            raise CkptError(
                f"tensor {key!r}: the shard at offsets {list(offsets)} (rank {rank}) is in no file"
            )
    return [s for s in provided.values() if math.prod(s.sizes) > 0]


def _dtensor_shards(key: str, parts: list[LocalShards]) -> list[Shard]:
    shards: dict[tuple, Shard] = {}
    for part in parts:
        layout = part.layout
        offsets, sizes = dtensor_block(
            key, part.shape, layout["mesh_shape"], layout["coordinate"], layout["placements"]
        )
        local = part.shards[0].tensor
        if local.shape != sizes:
            raise CkptError(
                f"tensor {key!r}: local tensor of shape {list(local.shape)} does not match its "
                f"placement (expected {list(sizes)})"
            )
        if math.prod(sizes) > 0:  # replicated blocks appear once per replica: keep one
            shards.setdefault((offsets, sizes), Shard(offsets, sizes, local, part.rank))
    return list(shards.values())


def dtensor_block(key, shape, mesh_shape, coordinate, placements) -> tuple[tuple, tuple]:
    """The (offsets, sizes) a DTensor rank holds; ``Shard(d)`` splits like ``torch.chunk``."""
    if not mesh_shape or len(coordinate) != len(mesh_shape) or len(placements) != len(mesh_shape):
        raise CkptError(f"tensor {key!r}: DTensor without a usable device mesh")
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, (kind, dim) in enumerate(placements):
        if kind == "replicate":
            continue
        if kind != "shard" or not isinstance(dim, int):
            raise CkptError(f"tensor {key!r}: DTensor placement {kind!r} cannot be merged")
        dim = dim % len(shape)
        n, c = mesh_shape[mesh_dim], coordinate[mesh_dim]
        chunk = -(-sizes[dim] // n)
        start = min(c * chunk, sizes[dim])
        length = max(0, min(chunk, sizes[dim] - start))
        offsets[dim] += start
        sizes[dim] = length
    return tuple(offsets), tuple(sizes)


def check_coverage(key: str, shape: tuple, shards: list[Shard]) -> None:
    """Every element of the global tensor is in exactly one shard."""
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
    for i, a in enumerate(shards):
        for b in shards[i + 1 :]:
            if all(
                max(ao, bo) < min(ao + an, bo + bn)
                for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
            ):
                raise CkptError(f"tensor {key!r}: shards overlap")
    if covered != total:
        raise CkptError(
            f"tensor {key!r}: shards cover {covered} of {total} elements (a rank file is missing?)"
        )
