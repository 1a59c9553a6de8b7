"""``per-rank``: one checkpoint spread over one ``torch.save`` file per rank.

Each file holds its rank's blocks of every ShardedTensor (FSDP
``SHARDED_STATE_DICT``, Composer ``ep{E}-ba{B}-rank{R}.pt``) or DTensor. We take
the tree of the lowest rank, replace each local-shards leaf by a :class:`ShardedRef`
whose blocks point into every rank's file, and check that they tile the global tensor.
Where each block lies is kept as records (:mod:`~ckpttool.formats.per_rank.blocks`): a
checkpoint of hundreds of ranks has hundreds of thousands of blocks.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ... import sharing, sources
from ...errors import CkptError, UnsafeError, error_data, error_from_data
from ...tree import (
    Checkpoint,
    ShardedRef,
    TensorRef,
    check_coverage,
    get_path,
    row_blocks,
    walk,
)
from ...unpickler import LocalShards, own_dtensor_block
from ..local_shards import global_ref, has_local_shards, local_shards, replace_local_shards
from ..torch_save import legacy, torch_zip

if TYPE_CHECKING:
    from ..records import Spill
    from ..skeleton.shard_runs import ShardRun
    from .blocks import RankBlocks

FORMAT = "per-rank"
RANK_RE = re.compile(r"^(.*rank)(\d+)([^\d].*|)$")


# the formats of the files a per-rank checkpoint is made of
PART_FORMATS = (torch_zip.FORMAT, legacy.FORMAT)


def claims(first: Checkpoint) -> bool:
    """Whether a file just read is one rank's part of a per-rank checkpoint: a torch.save
    file whose tree holds local shards (ShardedTensor / DTensor leaves)."""
    return first.format in PART_FORMATS and has_local_shards(first.root)


def part_files(first: Checkpoint, given: list[str]) -> list[str]:
    """The rank files of the checkpoint ``first`` belongs to: those given, or for one
    path (a rank's file, or a folder whose lowest rank ``first`` read) its siblings."""
    return siblings(first.files[0]) if len(given) == 1 else given


def siblings(path: str) -> list[str]:
    """All files named like ``path`` but for the rank number (``…-rank*.pt``), by rank."""
    folder, name = sources.split(path)
    m = RANK_RE.match(name)
    if not m:
        return [path]
    prefix, _, suffix = m.groups()
    # the folder's names matched literally (no glob: a name may hold "[" or "*")
    pattern = re.compile("^" + re.escape(prefix) + r"(\d+)" + re.escape(suffix) + "$")
    found = []
    for candidate in sources.listdir(folder or "."):
        mm = pattern.match(candidate)
        if mm:
            found.append((int(mm.group(1)), sources.join(folder, candidate)))
    return [p for _, p in sorted(found)]


def _content_rank(ckpt: Checkpoint) -> int | None:
    """The rank a file says it is (ShardedTensor process-group state, DTensor mesh)."""
    for _, value in walk(ckpt.root):
        if isinstance(value, LocalShards) and isinstance(value.rank, int):
            return value.rank
    return None


def _name_rank(path: str) -> int | None:
    m = RANK_RE.match(sources.basename(path))
    return int(m.group(2)) if m else None


# Missing rank files named in an error, at most (the rest are counted)
MAX_NAMED_MISSING = 8


def _world_size(root: Any, num_files: int) -> int:
    """The ranks that wrote the checkpoint, as its sharded leaves tell.

    A DTensor may live on a submesh (the ``dp`` dimension of a 2-D mesh) smaller than
    the job: the largest mesh (or the root mesh's rank map, where recorded) counts.
    """
    dtensor_sizes = []
    for _, value in walk(root):
        if isinstance(value, LocalShards):
            if isinstance(value.world_size, int):
                return value.world_size
            if value.kind == "dtensor":
                layout = value.layout
                mesh_shape = layout.get("mesh_shape")
                if not layout.get("world_size") and not isinstance(mesh_shape, tuple):
                    raise CkptError("corrupt DTensor: its spec names no device mesh")
                dtensor_sizes.append(layout.get("world_size") or math.prod(mesh_shape))
    return max(dtensor_sizes) if dtensor_sizes else num_files


def _rank_file_name(path: str, rank: int) -> str:
    m = RANK_RE.match(os.path.basename(path))
    if not m:
        return f"the file of rank {rank}"
    return os.path.join(os.path.dirname(path), f"{m.group(1)}{rank}{m.group(3)}")


ReadFile = Callable[[str], Checkpoint]
ScanFile = Callable[[str], tuple[list[str], list[str], list[str]]]


Verdict = tuple[list[str], list[str], list[str]]  # a file's globals: all, dangerous, unverified
FILES_A_ROUND = 8  # rank files whose findings one process hands the others at a time
Placed = list[tuple[tuple[int, ...], tuple[int, ...]]]  # each DTensor's block: offsets, sizes


class RankFiles:
    """The files of a per-rank checkpoint and where each block of its sharded tensors
    lies (:mod:`~ckpttool.formats.per_rank.blocks`: records, not objects); a file is read
    (metadata only) on first use, its blocks recorded and its tree dropped.

    Its sharded tensors are numbered: the n-th of ``paths`` (the lowest rank's
    local-shards leaves, in the order :func:`~.local_shards.local_shards` finds them) is
    tensor n.
    """

    def __init__(
        self,
        by_rank: dict[int, str],
        read_file: ReadFile,
        loaded: dict[int, Checkpoint],
        base_rank: int,
        verdicts: dict[int, Verdict],
        leaves: list[tuple[tuple, LocalShards]],
    ):
        self.by_rank = by_rank
        self.ranks = sorted(by_rank)
        self._place_of = {rank: i for i, rank in enumerate(self.ranks)}  # (PLACE's ``rank``)
        self._read_file = read_file
        self._loaded = loaded
        self._base_rank = base_rank
        self.verdicts = verdicts  # of the files read, by any process
        self.paths = [path for path, _ in leaves]
        self._likes = [_like(local) for _, local in leaves]
        # (numpy, which the records need, is imported only for a per-rank checkpoint:
        # every torch file is asked whether it is a rank's)
        from ..records import Interned
        from .blocks import Locations, Places

        tuples: Interned[tuple] = Interned()
        self.places = Places(tuples)
        self.locations = Locations(tuples)
        self._lock = threading.Lock()  # (writers' threads resolve blocks)
        self._filled: Any = None  # (group_places)

    def key(self, tensor: int) -> str:
        return ".".join(str(k) for k in self.paths[tensor])

    def block_ref(self, rank: int, tensor: int, offsets: tuple, sizes: tuple) -> TensorRef:
        """The stored tensor of rank ``rank``'s block of ``tensor`` at ``offsets``, its
        file read on first use."""
        if not self.locations.has(rank):
            with self._lock:
                if not self.locations.has(rank):
                    self._record(rank)
        file = self.by_rank[rank]
        if self.locations.disagrees(rank, tensor):
            raise CkptError(f"rank files disagree about tensor {self.key(tensor)!r}", path=file)
        ref = self.locations.ref(rank, file, tensor, offsets, sizes)
        if ref is None:
            raise CkptError(
                f"tensor {self.key(tensor)!r}: no block at offsets {list(offsets)}", path=file
            )
        return ref

    def _record(self, rank: int) -> Placed:
        """Read rank ``rank``'s file, record where its blocks lie and its verdict; where
        its DTensors' blocks lie in their global tensors (each file records its own mesh
        coordinate). A DTensor whose leaf differs from the lowest rank's is refused now
        (its place is needed); another sharded tensor's when its data is asked for."""
        file = self.by_rank[rank]
        ckpt = self._loaded.get(rank) if rank == self._base_rank else self._loaded.pop(rank, None)
        if ckpt is None:
            ckpt = self._read_file(file)
            _check_plain_tensors(self._loaded[self._base_rank].root, ckpt.root, file)
        self.verdicts[rank] = (ckpt.globals, ckpt.dangerous, ckpt.unverified)
        theirs = dict(local_shards(ckpt.root))
        del ckpt
        blocks: list[tuple[int, tuple, Any]] = []
        disagree: set[int] = set()
        placed: Placed = []
        for tensor, (path, like) in enumerate(zip(self.paths, self._likes, strict=True)):
            local = theirs.get(path)
            if not _agrees(local, like):
                if like.kind == "dtensor":
                    raise CkptError(
                        f"rank files disagree about tensor {self.key(tensor)!r}", path=file
                    )
                disagree.add(tensor)
                continue
            assert local is not None
            if local.kind == "dtensor":
                own = own_dtensor_block(self.key(tensor), local, rank, file)
                placed.append((own.offsets, own.sizes))
                blocks.append((tensor, own.offsets, own.tensor))
            else:
                blocks.extend((tensor, s.offsets, s.tensor) for s in local.shards)
        self.locations.add_file(rank, file, blocks, len(self.paths), disagree)
        return placed

    def read_shares(self) -> None:
        """Read the rank files that must be read before any data is: every file where
        there are DTensors (each file records its own mesh coordinate, so it is read to
        place its blocks), every file under several processes (their units will need
        most of them). Record where their blocks lie.

        Under several processes (:mod:`ckpttool.sharing`) each reads its share of the
        files and hands the others what it found, as plain data: each file's verdict,
        its DTensors' places (its distinct places, and which each DTensor has) and
        where its blocks lie (:meth:`Locations.export`). N processes read N files once
        in all, not N times each. A file that fails to read has its error handed over
        too, and every share is read through: then every process raises the same error,
        a dangerous file's first (the verdict comes first, as in one process, where a
        failed read is followed by a scan of every file).
        """
        from ..records import Interned

        dtensors = [t for t, like in enumerate(self._likes) if like.kind == "dtensor"]
        shared = sharing.shared()
        if not dtensors and not shared:
            return  # (ShardedTensor files are read when their blocks' data is)
        share = list(sharing.my_share(len(self.ranks)))
        errors: dict[int, dict] = {}  # rank -> the error its file raised, in any process
        # in rounds of a few files, so that what is handed over is never large
        for first in range(0, sharing.largest_share(len(self.ranks)), FILES_A_ROUND):
            mine: dict[int, tuple | dict] = {}  # rank -> what its file gave, or its error
            for i in share[first : first + FILES_A_ROUND]:
                rank = self.ranks[i]
                pairs: Interned[tuple] = Interned()
                try:
                    ids = [pairs.id(place) for place in self._record(rank)]
                except CkptError as exc:
                    if not shared:
                        raise
                    mine[rank] = {"error": error_data(exc)}  # (the rest are read on)
                    continue
                export = self.locations.export(rank) if shared else None
                mine[rank] = (pairs.values, ids, self.verdicts[rank], export)
            for rank, found in sharing.gather_each(mine):
                if isinstance(found, dict):
                    errors[rank] = found["error"]
                else:
                    self._take(rank, dtensors, *found)
        if errors:  # every process raises the same: a refusal first, then the lowest rank's
            worst = min(errors, key=lambda rank: (errors[rank]["kind"] != "UnsafeError", rank))
            raise error_from_data(errors[worst])

    def _take(
        self,
        rank: int,
        dtensors: list[int],
        distinct: list,
        ids: list[int],
        verdict: Verdict,
        export: dict | None,
    ) -> None:
        """What a process found in rank ``rank``'s file (:meth:`read_shares`)."""
        if len(ids) != len(dtensors):
            raise CkptError("internal error: a process placed another number of DTensors")
        tuples = self.places.tuples
        offsets = [tuples.id(tuple(o)) for o, _ in distinct]
        sizes = [tuples.id(tuple(n)) for _, n in distinct]
        index = self._place_of[rank]
        self.places.add(
            dtensors, [index] * len(ids), [offsets[i] for i in ids], [sizes[i] for i in ids]
        )
        self.verdicts[rank] = verdict
        if export is not None and not self.locations.has(rank):
            self.locations.take(rank, export, len(self.paths))

    def place_sharded_tensors(self, leaves: list[tuple[tuple, LocalShards]]) -> None:
        """Record where every block of each ShardedTensor lies: the lowest rank's file
        names every rank's (``layout``); its own are recorded from its tree. The layouts
        are dropped once recorded (they grow as ranks times tensors)."""
        from ..skeleton import shard_runs

        index = self._place_of
        tuples = self.places.tuples
        base = index[self._base_rank]
        for tensor, (_, local) in enumerate(leaves):
            if local.kind == "dtensor":
                continue
            own = {(s.offsets, s.sizes) for s in local.shards}
            ranks, offsets, sizes = [], [], []
            for item in local.layout or []:
                if isinstance(item, shard_runs.ShardRun):
                    self._place_run(tensor, item, own)
                    continue
                if not isinstance(item, tuple):
                    raise CkptError(f"tensor {self.key(tensor)!r}: corrupt ShardedTensor metadata")
                place_offsets, place_sizes, rank = item
                if math.prod(place_sizes) == 0:
                    continue  # a rank that holds nothing of this tensor
                if (place_offsets, place_sizes) in own:
                    ranks.append(base)
                elif rank in index:
                    ranks.append(index[rank])
                else:
                    self._in_no_file(tensor, place_offsets)
                offsets.append(tuples.id(place_offsets))
                sizes.append(tuples.id(place_sizes))
            self.places.add([tensor] * len(ranks), ranks, offsets, sizes)
            local.layout = None

    def _place_run(self, tensor: int, run: ShardRun, own: set[tuple[tuple, tuple]]) -> None:
        """:meth:`place_sharded_tensors` of a run of the layout read as records (each
        rule the same, over arrays)."""
        import numpy as np

        from .blocks import nonempty

        rows = run.records()
        rows = rows[nonempty(run.tuples)[rows["sizes"]]]  # (a rank that holds nothing)
        ids = np.array(self.places.tuples.ids_of(run.tuples), dtype=np.int64)
        offsets, sizes = ids[rows["offsets"]], ids[rows["sizes"]]
        mine = np.zeros(len(rows), bool)
        for own_offsets, own_sizes in own:
            mine |= (offsets == self.places.tuples.id(own_offsets)) & (
                sizes == self.places.tuples.id(own_sizes)
            )
        # each rank -> its place in ``ranks`` (-1: no file of that rank)
        known = np.array(self.ranks, dtype=np.int64)
        at = np.searchsorted(known, rows["rank"])
        found = (at < len(known)) & (known[np.minimum(at, len(known) - 1)] == rows["rank"])
        missing = ~mine & ~found
        if missing.any():
            self._in_no_file(tensor, run.tuples[rows["offsets"][np.argmax(missing)]])
        ranks = np.where(mine, self._place_of[self._base_rank], at)
        self.places.add([tensor] * len(rows), ranks.tolist(), offsets.tolist(), sizes.tolist())

    def _in_no_file(self, tensor: int, offsets: tuple) -> None:
        raise CkptError(
            f"tensor {self.key(tensor)!r}: the shard at offsets {list(offsets)} is in no file"
        )

    def group_places(self) -> None:
        """Group the places recorded by tensor, once all are."""
        from .blocks import nonempty

        self.places.group(len(self.paths))
        self._filled = nonempty(self.places.tuples.values)  # the sizes tuples that hold any

    def tensor_blocks(self, tensor: int, spill: Spill) -> RankBlocks:
        """Tensor ``tensor``'s blocks (after the places are grouped), their records
        appended to ``spill``: empty ones left out, a DTensor's replicas once, checked
        to tile the tensor."""
        import numpy as np

        from .blocks import RankBlocks, kept_blocks

        like = self._likes[tensor]
        tuples = self.places.tuples.values
        rows = self.places.rows(tensor)
        if like.kind == "dtensor":  # every rank's, in the order of the ranks
            rows = rows[np.argsort(rows["rank"], kind="stable")]
        rows = kept_blocks(rows, self._filled, like.kind == "dtensor")
        at = spill.append(rows)
        blocks = RankBlocks(
            spill, at, len(rows), tuples, self.ranks, functools.partial(RankShard, self, tensor)
        )
        offsets = list(map(tuples.__getitem__, rows["offsets"].tolist()))
        sizes = list(map(tuples.__getitem__, rows["sizes"].tolist()))
        if not row_blocks(like.shape, offsets, sizes):
            check_coverage(self.key(tensor), like.shape, list(blocks))
        return blocks


def _like(local: LocalShards) -> LocalShards:
    """What another rank's leaf is compared with (kind, dtype, shape): without the
    lowest rank's blocks and layout."""
    return LocalShards(local.kind, local.dtype, local.shape, local.device, local.requires_grad)


def _agrees(local: Any, like: LocalShards) -> bool:
    """Another rank's leaf at the place of ``like`` (the lowest rank's) is sharded the same way."""
    return (
        isinstance(local, LocalShards)
        and local.kind == like.kind
        and local.shape == like.shape
        and local.dtype == like.dtype
    )


def _check_plain_tensors(base: Any, other: Any, path: str) -> None:
    """The lowest rank's unsharded tensors stand for every rank's: refuse files where
    another rank's differ in shape or dtype. Each rank then holds its own piece of
    them (FSDP ``LOCAL_STATE_DICT`` with ``use_orig_params``), and nothing says how
    the pieces fit."""
    for key_path, ref in walk(base):
        if not isinstance(ref, TensorRef):
            continue
        try:
            theirs = get_path(other, key_path)
        except CkptError:
            continue  # rank-specific entries (RNG state lists...) may differ in structure
        if isinstance(theirs, TensorRef) and (
            theirs.shape != ref.shape or theirs.dtype != ref.dtype
        ):
            key = ".".join(str(k) for k in key_path)
            raise CkptError(
                f"tensor {key!r} is not sharded but differs between rank files "
                f"({ref.dtype.name} {list(ref.shape)} here, {theirs.dtype.name} "
                f"{list(theirs.shape)} in {os.path.basename(path)}): each rank holds its own "
                "piece and nothing says how they fit (FSDP LOCAL_STATE_DICT?)",
                hint="save with SHARDED_STATE_DICT or FULL_STATE_DICT",
            )


class RankShard:
    """A block that a rank's file holds (a ShardedTensor's, a DTensor's), its stored
    tensor found when its data is needed (:meth:`RankFiles.block_ref`)."""

    __slots__ = ("files", "tensor", "rank", "offsets", "sizes")
    cast_to = None  # read as stored (tree.leaves.Block)

    def __init__(
        self, files: RankFiles, tensor: int, rank: int, offsets: tuple, sizes: tuple
    ) -> None:
        self.files, self.tensor, self.rank = files, tensor, rank
        self.offsets, self.sizes = offsets, sizes

    def where(self) -> str:
        """The rank file and the block in it (nothing read: the file is read only when
        the block's data is needed)."""
        path = self.files.paths[self.tensor]
        return f"{self.files.by_rank[self.rank]}:{path}@{self.offsets}+{self.sizes}"

    def tensor_ref(self) -> TensorRef:
        return self.files.block_ref(self.rank, self.tensor, self.offsets, self.sizes)


def read(
    first: Checkpoint, paths: list[str], read_file: ReadFile, scan_file: ScanFile
) -> Checkpoint:
    """Combine per-rank files into one tree of :class:`ShardedRef` leaves.

    For ShardedTensors only the lowest rank's file is read in full: their metadata
    says where every block of every rank lies, so inspecting needs no other file;
    the others are scanned for dangerous globals and read when their data is asked
    for. A DTensor records only its own rank's mesh coordinate, so with DTensor
    leaves every file is read (metadata only; under several processes, each reads
    its share: :meth:`RankFiles.dtensor_blocks`).

    Args:
        first: The file already read (one of ``paths``).
        paths: Every rank file.
        read_file: Reads one file fully (lazy tensors).
        scan_file: Judges one file's globals; returns (globals, dangerous).

    Raises:
        CkptError: a rank file is missing, or the shards do not cover every
            element of a tensor exactly once.
    """
    loaded: dict[int, Checkpoint] = {}
    verdicts: dict[int, Verdict] = {}
    named = [rank for rank in map(_name_rank, paths) if rank is not None]
    # files named as the ranks of different checkpoints (ep0-rank0.pt, ep1-rank1.pt)
    # are asked too: each must hold sharded tensors
    stems = {(m.group(1), m.group(3)) for p in paths if (m := RANK_RE.match(sources.basename(p)))}
    if len(named) != len(paths) or len(set(named)) != len(named) or len(stems) > 1:
        by_rank: dict[int, str] = {}
        for position, path in enumerate(paths):
            ckpt = first if path == first.files[0] else read_file(path)
            if not has_local_shards(ckpt.root):  # a whole checkpoint of its own
                raise _not_a_rank_file(first, ckpt, paths)
            rank = _content_rank(ckpt)
            rank = position if rank is None else rank
            if rank in by_rank:
                raise CkptError(f"several files claim rank {rank}", path=path)
            by_rank[rank], loaded[rank] = path, ckpt
    else:
        by_rank = dict(zip(named, paths, strict=True))
        first_rank = _name_rank(first.files[0])
        if first_rank is not None:  # always: ``first`` is one of ``paths``
            loaded[first_rank] = first
    base_rank = min(by_rank)
    base = loaded.get(base_rank) or read_file(by_rank[base_rank])
    loaded[base_rank] = base
    try:
        world_size, root = _combine(base, by_rank, base_rank, read_file, loaded, verdicts)
    except CkptError:
        # a dangerous rank file is reported first; but not by a judging that gathers
        # from the other processes (a collective), which may be in another one now:
        # there every file is read by some process, and a failed read's error handed
        # over (RankFiles.read_shares), a dangerous file's raised first
        if not sharing.shared():
            try:
                _judge(by_rank, loaded, verdicts, scan_file)
            except UnsafeError:
                raise
            except CkptError:
                pass  # (only a refusal takes the place of the error)
        raise
    globals_, dangerous, unverified = _judge(by_rank, loaded, verdicts, scan_file)
    return Checkpoint(
        format=FORMAT,
        files=[by_rank[r] for r in sorted(by_rank)],
        root=root,
        world_size=world_size,
        globals=sorted(globals_),
        dangerous=sorted(dangerous),
        unverified=sorted(unverified - dangerous),
    )


def _not_a_rank_file(first: Checkpoint, other: Checkpoint, paths: list[str]) -> CkptError:
    """The error for a file given with the rank files of ``first`` that holds no sharded
    tensors: a checkpoint of its own (``inspect`` reports each in turn)."""
    from ...errors import SeparateCheckpointsError

    name, first_name = sources.basename(other.files[0]), sources.basename(first.files[0])
    return SeparateCheckpointsError(
        f"{name} holds no sharded tensors: it is a whole {other.format} checkpoint, not a "
        f"rank file of the per-rank checkpoint {first_name}",
        files=paths,
        hint="pass the rank files of one checkpoint; `ckpttool inspect` and `ckpttool "
        "verify` take separate checkpoints, each in turn",
    )


def _combine(
    base: Checkpoint,
    by_rank: dict[int, str],
    base_rank: int,
    read_file: ReadFile,
    loaded: dict[int, Checkpoint],
    verdicts: dict[int, Verdict],
) -> tuple[int, Any]:
    """(world size, the lowest rank's tree with every local-shards leaf a ShardedRef)."""
    world_size = _world_size(base.root, len(by_rank))
    if type(world_size) is not int or world_size < 1:
        raise CkptError(f"corrupt sharded tensor: world size {world_size!r:.40}")
    # counted, not listed: a file may claim a billion ranks, and no set of them is built
    have = sum(1 for r in by_rank if 0 <= r < world_size)
    if have < world_size:
        absent = (r for r in range(world_size) if r not in by_rank)
        missing = list(itertools.islice(absent, MAX_NAMED_MISSING))
        names = ", ".join(_rank_file_name(by_rank[base_rank], r) for r in missing)
        if world_size - have > len(missing):
            names += f" and {world_size - have - len(missing)} more"
        raise CkptError(
            f"checkpoint of {world_size} ranks, but rank file(s) missing: {names}",
            hint="pass every rank's file, or a quoted glob",
        )
    from ..records import Spill

    leaves = local_shards(base.root)
    files = RankFiles(by_rank, read_file, loaded, base_rank, verdicts, leaves)
    files.place_sharded_tensors(leaves)
    files.read_shares()
    files.group_places()
    del leaves
    spill = Spill()  # every tensor's blocks, kept (RankBlocks)
    order = itertools.count()

    def sharded_ref(path: tuple, local: LocalShards) -> ShardedRef:
        tensor = next(order)
        if files.paths[tensor] != path:
            raise CkptError(f"internal error: tensor {files.key(tensor)!r} found in another order")
        return global_ref(local, files.tensor_blocks(tensor, spill), world_size)

    return world_size, replace_local_shards(base.root, (), sharded_ref)


def _judge(
    by_rank: dict[int, str],
    loaded: dict[int, Checkpoint],
    verdicts: dict[int, Verdict],
    scan_file: ScanFile,
) -> tuple[set[str], set[str], set[str]]:
    """(globals, dangerous, unverified) of every rank file: read ones know theirs, others
    are scanned. Every file is scanned before any error is raised: a refusal first (the
    verdict comes first), then the lowest rank's error.

    Called last: the scans may still be running in a child process (see prescan.py).
    """
    globals_: set[str] = set()
    dangerous: set[str] = set()
    unverified: set[str] = set()
    errors: list[CkptError] = []
    for rank, path in sorted(by_rank.items()):
        ckpt = loaded.get(rank)
        if ckpt is not None:
            seen, bad, unknown = ckpt.globals, ckpt.dangerous, ckpt.unverified
        elif rank in verdicts:
            seen, bad, unknown = verdicts[rank]
        else:
            try:
                seen, bad, unknown = scan_file(path)
            except CkptError as exc:
                errors.append(exc)
                continue
        globals_.update(seen)
        dangerous.update(bad)
        unverified.update(unknown)
    if errors:
        raise next((e for e in errors if isinstance(e, UnsafeError)), errors[0])
    return globals_, dangerous, unverified
