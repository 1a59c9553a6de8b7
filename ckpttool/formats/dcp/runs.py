"""A DCP folder's checkpoint from its ``.metadata`` parsed at the opcode level.

:mod:`ckpttool.formats.skeleton.metadata_runs` splits the file into a small *skeleton* pickle
(each run of plain entries stands there as one token) and the runs' numbers. The
skeleton is read by the restricted unpickler as any pickle is (every global judged,
the structure checked); each token must then stand exactly once where its entries
stood: a chunk run in a tensor's chunk list, a storage run as a key of
``storage_data``. The entries the skeleton kept are checked as the bulk reader
(:mod:`ckpttool.formats.dcp.metadata`) checks every entry, and the checkpoint is
built as that one builds it: the same tree, the same checks (each data file's name
once, the chunks tiling their tensor, no two spans overlapping). Any doubt, any
error: None, and the readers after this one read the file from the start.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from ...tree import Checkpoint, Opaque, ShardedRef
from ..records import CHUNK, ROW, STORAGE, Spill, blocks, group_rows
from ..skeleton.metadata_runs import ChunkRun, Parsed, StorageRun, parse_file, token
from .metadata import (
    ChunkRecord,
    DcpMetadataUnpickler,
    IndexRecord,
    InfoRecord,
    NotPlain,
    _field,
    _sizes,
    _states,
    metadata_fields,
    plain_chunk_lists,
    tensor_entry,
)

# A .metadata this reader reads at most (a 2048-rank 405B one is 836 MB, 1.16 GB with the
# key strings torch pickles afresh; walked a frame at a time, its entries spilled)
MAX_METADATA_BYTES = 4 << 30


def read(folder: str, meta_path: str, permissive: bool) -> Checkpoint | None:
    """The checkpoint, or None where the readers after this one must read it."""
    from ...sources import open_input
    from ...unpickler import load_pickle

    try:
        with open_input(meta_path) as f:
            size = f.seek(0, 2)
            if size > MAX_METADATA_BYTES:
                return None
            f.seek(0)
            parsed = parse_file(f, size)
        if parsed is None:
            return None
        seen: set[str] = set()
        metadata = load_pickle(
            parsed.skeleton,
            path=meta_path,
            permissive=permissive,
            seen=seen,
            unpickler_class=DcpMetadataUnpickler,
        )  # (checked as any pickle: the runs' entries are flat and shared by none)
        return _build(folder, meta_path, metadata, parsed, permissive, seen)
    except Exception:  # NotPlain, CkptError, or a TypeError on a hostile value
        return None


def _build(
    folder: str,
    meta_path: str,
    metadata: Any,
    parsed: Parsed,
    permissive: bool,
    seen: set[str],
) -> Checkpoint:
    from ..made import checkpoint
    from .chunks import FORMAT, RANK_FILE_RE, bytes_value, data_file, set_element

    entries, storage, planner = metadata_fields(metadata)
    runs = parsed.runs  # (each set to None once taken)
    numbers = {token(n): n for n in range(len(runs))}
    used: set[int] = set()
    names, tuples = parsed.names, parsed.tuples

    # storage_data, in order: the runs' records (spilled) and the skeleton's entries,
    # checked as the bulk reader checks every entry, as records beside them
    parts = _Parts()
    pending: list[tuple[int, int, int, int, int]] = []  # the skeleton's since the last run
    infos: dict[str, dict] = {}  # a byte value's stored span
    records = [key for key in storage if type(key) is not bytes]
    key_states = _states(records, IndexRecord, walked=False)
    info_states = _states(list(map(storage.__getitem__, records)), InfoRecord)
    del records
    if info_states and set(map(len, info_states)) != {3}:
        raise NotPlain
    record_rows = iter(zip(key_states, info_states, strict=True))
    for key in storage:
        if type(key) is bytes:
            if storage[key] is not None:
                raise NotPlain
            run = _take(numbers, used, runs, key, StorageRun)
            parts.append(pending, STORAGE)
            parts.append((parsed.storage, run.at, run.count))
            continue
        key_state, info = next(record_rows)
        fqn, offset = _field([key_state], "fqn")[0], key_state.get("offset")
        if offset is not None:
            _sizes([offset], holders=2)
        path, start, length = map(info.get, ("relative_path", "offset", "length"))
        # (a run's are so by its patterns)
        if type(fqn) is not str or type(path) is not str:
            raise NotPlain
        if type(start) is not int or type(length) is not int:
            raise NotPlain
        if not (0 <= start < 2**63 and 0 < length < 2**63):
            raise NotPlain  # (the spans' check says the same of a run's)
        if offset is None:
            infos[fqn] = info  # (a second one for fqn is refused below: the same key)
        key_id = -1 if offset is None else tuples.id(tuple(offset))
        pending.append((names.id(fqn), names.id(path), key_id, start, length))
    parts.append(pending, STORAGE)

    def table() -> Iterator[np.ndarray]:
        return blocks(parts, STORAGE)

    paths = _apart(table, len(names.values))
    if paths is None:
        raise NotPlain  # shared or overlapping spans: the bulk reader sorts them out
    # each tensor's entries side by side (a tensor's entries are far apart in the order
    # saved: one per rank), in the order saved
    by_fqn, first = group_rows(table, "fqn", len(names.values))
    for fqn_id in np.flatnonzero(np.diff(first)).tolist():
        keys = _group(by_fqn, first, fqn_id)["key"]
        if len(np.unique(keys)) != len(keys):
            raise NotPlain  # two entries for one chunk: the generic reader keeps the last

    # every data file's name checked once (not once per chunk)
    distinct = [names.values[n] for n in paths]
    files_of = {rel: data_file(folder, {"relative_path": rel}, meta_path) for rel in distinct}
    ranks = {m.group(1) for rel in distinct if (m := RANK_FILE_RE.match(rel))}
    world_size = len(ranks) or None
    files = sorted(set(files_of.values()))
    file_of: list[str | None] = [None] * len(names.values)  # a name's number -> its file
    for n, rel in zip(paths, distinct, strict=True):
        file_of[n] = files_of[rel]

    plain_chunk_lists(entries)
    if set(map(type, planner.values())) - {tuple}:
        raise NotPlain
    if set(map(type, itertools.chain.from_iterable(planner.values()))) - {str, int}:
        raise NotPlain
    from ...unpickler import MAX_NESTING

    joined = _Joined(parsed, by_fqn, first, Spill(), file_of, world_size)
    root: Any = {}
    for fqn, entry in entries.items():
        obj_path = planner.get(fqn) or (fqn,)
        if len(obj_path) > MAX_NESTING or type(fqn) is not str:
            raise NotPlain
        kind = type(entry).__name__
        if kind == "TensorStorageMetadata":
            value: Any = joined.tensor(fqn, entry, numbers, used)
        elif kind == "BytesStorageMetadata" and fqn in infos:
            value = bytes_value(folder, fqn, {(fqn, None): infos[fqn]}, permissive, seen, set())
        else:
            raise NotPlain
        root = set_element(root, obj_path, value, len(entries))
    if len(used) != len(runs):
        raise NotPlain  # a run's token where no entry stands
    ckpt = checkpoint(FORMAT, [meta_path, *files], root, seen)
    ckpt.world_size = world_size
    return ckpt


def _group(spill: Spill, first: np.ndarray, group: int) -> np.ndarray:
    """Group ``group``'s records of a spill :func:`group_rows` wrote."""
    at, end = int(first[group]), int(first[group + 1])
    return spill.records(STORAGE, at * STORAGE.itemsize, end - at)


def _apart(table: Callable[[], Iterator[np.ndarray]], names: int) -> list[int] | None:
    """The data files' names (their numbers, in order) where no two spans of a file
    overlap or start at the same byte (then none is shared); None where some do. In
    the order saved, each file's spans are one run one after the other as DCP writes
    them; where a chunk list names one empty chunk's span for many ranks a file's
    spans are in several places: then each file's are grouped (on disk) and sorted."""
    paths: set[int] = set()
    changes, ordered = 0, True
    last_path, last_end = -1, 0
    for block in table():
        starts, lengths, path = block["start"], block["length"], block["path"]
        if len(block) == 0:
            continue
        if starts.min() < 0 or lengths.min() <= 0 or (starts > 2**63 - 1 - lengths).any():
            return None
        ends = starts + lengths
        paths.update(np.unique(path).tolist())
        same = np.concatenate(([path[0] == last_path], path[1:] == path[:-1]))
        before = np.concatenate(([last_end], ends[:-1]))
        changes += int(np.count_nonzero(~same))
        ordered = ordered and not bool(np.any(same & (before > starts)))
        last_path, last_end = int(path[-1]), int(ends[-1])
    if not paths:
        return []
    distinct = sorted(paths)
    if changes == len(paths) and ordered:  # each file one run, its spans in order
        return distinct
    by_path, first = group_rows(table, "path", names)
    for path_id in distinct:
        spans = _group(by_path, first, path_id)
        starts, lengths = spans["start"], spans["length"]
        order = np.lexsort((lengths, starts))
        starts, ends = starts[order], (starts + lengths)[order]
        if np.any(ends[:-1] > starts[1:]):
            return None
    return distinct


Run = TypeVar("Run", ChunkRun, StorageRun)


def _take(
    numbers: dict[bytes, int],
    used: set[int],
    runs: list[ChunkRun | StorageRun | None],
    key: bytes,
    kind: type[Run],
) -> Run:
    """The run of ``kind`` a token stands for, taken once (then set to None)."""
    number = numbers.get(key)
    if number is None or number in used:
        raise NotPlain
    used.add(number)
    run = runs[number]
    if type(run) is not kind:
        raise NotPlain
    runs[number] = None
    return run


class _Parts(list):
    """A table's parts in order (:func:`~ckpttool.formats.records.blocks`): the runs'
    records in a spill, and the skeleton's entries between them as records in memory."""

    def append(self, part: Any, dtype: np.dtype | None = None) -> None:
        """A run's ``(spill, offset, count)``; or (``dtype`` given) the skeleton's
        entries so far, a list emptied here."""
        if dtype is None:
            super().append(part)
        elif part:
            super().append(np.array(part, dtype))
            part.clear()


class _Joined:
    """Each tensor's chunks joined to their stored spans, into a spill of
    :data:`~ckpttool.formats.records.ROW` records a tensor's
    :class:`~ckpttool.formats.dcp.chunks.DcpChunks` reads."""

    def __init__(
        self,
        parsed: Parsed,
        by_fqn: Spill,  # the storage records grouped by tensor ...
        first: np.ndarray,  # ... each one's first
        rows: Spill,
        file_of: list[str | None],
        world_size: int | None,
    ):
        self.parsed, self.by_fqn, self.first, self.rows = parsed, by_fqn, first, rows
        self.file_of, self.world_size = file_of, world_size

    def tensor(
        self, fqn: str, entry: Opaque, numbers: dict[bytes, int], used: set[int]
    ) -> ShardedRef:
        from ...tree import check_coverage, row_blocks
        from .chunks import DcpChunks, dcp_tensor

        parsed = self.parsed
        tuples, runs = parsed.tuples, parsed.runs
        props, dt, size, chunks = tensor_entry(entry)
        # the skeleton's chunks, checked as the bulk reader checks every chunk
        records = [c for c in chunks if type(c) is not bytes]
        states = _states(records, ChunkRecord)
        del records
        if states and set(map(len, states)) != {2}:
            raise NotPlain
        kept_offsets, kept_sizes = _field(states, "offsets"), _field(states, "sizes")
        _sizes(kept_offsets)
        _sizes(kept_sizes)
        kept = iter(zip(kept_offsets, kept_sizes, strict=True))
        parts = _Parts()
        pending: list[tuple[int, int]] = []
        for chunk in chunks:
            if type(chunk) is bytes:
                run = _take(numbers, used, runs, chunk, ChunkRun)
                parts.append(pending, CHUNK)
                parts.append((parsed.chunks, run.at, run.count))
            else:
                o, s = next(kept)
                pending.append((tuples.id(tuple(o)), tuples.id(tuple(s))))
        parts.append(pending, CHUNK)
        mine = np.concatenate([np.empty(0, CHUNK), *blocks(parts, CHUNK)])
        fqn_id = parsed.names.ids.get(fqn)
        stored = np.empty(0, STORAGE) if fqn_id is None else _group(self.by_fqn, self.first, fqn_id)
        keys, wanted = stored["key"], mine["offsets"]
        if not np.array_equal(keys, wanted):  # (DCP saves both in rank order: then no lookup)
            order = np.argsort(keys, kind="stable")
            at = np.searchsorted(keys[order], wanted)
            if np.any(at >= len(keys)) or np.any(
                keys[order[np.minimum(at, len(keys) - 1)]] != wanted
            ):
                raise NotPlain  # a chunk with no stored data: the generic reader says so
            stored = stored[order[at]]
        rows = np.empty(len(mine), ROW)
        for name in ("start", "length", "path"):
            rows[name] = stored[name]
        rows["offsets"], rows["sizes"] = wanted, mine["sizes"]
        shards = DcpChunks(
            self.rows, self.rows.append(rows), len(rows), tuples.values, self.file_of, dt, fqn
        )
        offsets = list(map(tuples.values.__getitem__, wanted.tolist()))
        sizes = list(map(tuples.values.__getitem__, mine["sizes"].tolist()))
        if not row_blocks(size, offsets, sizes):
            check_coverage(fqn, size, shards)
        return dcp_tensor(dt, size, shards, props, self.world_size)
