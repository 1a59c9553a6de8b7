"""A DCP folder's checkpoint from its ``.metadata`` parsed at the opcode level.

:mod:`ckpttool.formats.dcp_opcodes` splits the file into a small *skeleton* pickle
(each run of plain entries stands there as one token) and the runs' numbers. The
skeleton is read by the restricted unpickler as any pickle is (every global judged,
the structure checked); each token must then stand exactly once where its entries
stood: a chunk run in a tensor's chunk list, a storage run as a key of
``storage_data``. The entries the skeleton kept are checked as the bulk reader
(:mod:`ckpttool.formats.dcp_metadata`) checks every entry, and the checkpoint is
built as that one builds it: the same tree, the same checks (each data file's name
once, the chunks tiling their tensor, no two spans overlapping). Any doubt, any
error: None, and the readers after this one read the file from the start.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ..tree import Checkpoint, Opaque, ShardedRef
from .dcp_metadata import (
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
from .dcp_opcodes import ChunkRun, StorageRun, parse_file, token

# A .metadata this reader reads at most (a 2048-rank 70B one is 531 MB; walked a frame at a
# time, but its entries are all held, ~60 bytes each, until they are each tensor's chunks)
MAX_METADATA_BYTES = 4 << 30


def read(folder: str, meta_path: str, permissive: bool) -> Checkpoint | None:
    """The checkpoint, or None where the readers after this one must read it."""
    from ..sources import open_input
    from ..unpickler import load_pickle

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
        return _build(folder, meta_path, metadata, parsed.runs, permissive, seen)
    except Exception:  # NotPlain, CkptError, or a TypeError on a hostile value
        return None


def _build(
    folder: str,
    meta_path: str,
    metadata: Any,
    runs: list[ChunkRun | StorageRun | None],  # (each set to None once taken)
    permissive: bool,
    seen: set[str],
) -> Checkpoint:
    from .dcp_chunks import FORMAT, RANK_FILE_RE, bytes_value, data_file, set_element
    from .torch_zip import checkpoint

    entries, storage, planner = metadata_fields(metadata)
    numbers = {token(n): n for n in range(len(runs))}
    used: set[int] = set()

    # storage_data, in order: the skeleton's entries as the bulk reader checks them,
    # and the runs' (a token key, None); each column read through the segments, never
    # copied into one list (millions of entries)
    segments: list[StorageRun] = []
    pending = _no_entries()  # the skeleton's entries since the last run
    total = 0  # entries so far: the next one's row
    infos: dict[int, dict] = {}  # row -> the state of a skeleton entry (a byte value's)
    records = [key for key in storage if type(key) is not bytes]
    key_states = _states(records, IndexRecord, walked=False)
    info_states = _states(list(map(storage.__getitem__, records)), InfoRecord)
    del records
    if info_states and set(map(len, info_states)) != {3}:
        raise NotPlain
    record_rows = iter(zip(key_states, info_states, strict=True))
    for key in storage:
        if type(key) is bytes:
            number = _take(numbers, used, key)
            run = runs[number]
            if type(run) is not StorageRun or storage[key] is not None:
                raise NotPlain
            if pending.fqns:
                segments.append(pending)
                pending = _no_entries()
            segments.append(run)
            total += len(run.fqns)
            runs[number] = None  # (taken once)
            continue
        key_state, info = next(record_rows)
        fqn, offset = _field([key_state], "fqn")[0], key_state.get("offset")
        if offset is not None:
            _sizes([offset], holders=2)
        if offset is None:
            infos[total] = info
        path, start, length = map(info.get, ("relative_path", "offset", "length"))
        # (a run's are so by its patterns)
        if type(fqn) is not str or type(path) is not str:
            raise NotPlain
        if type(start) is not int or type(length) is not int:
            raise NotPlain
        pending.fqns.append(fqn)
        pending.offsets.append(offset)
        pending.paths.append(path)
        pending.starts.append(start)
        pending.lengths.append(length)
        total += 1
    if pending.fqns:
        segments.append(pending)
    fqns, offsets, paths, starts, lengths = (_Column(segments, name) for name in _FIELDS)
    # each tensor's rows of the table (an array: millions of them), and their offsets
    # (in the order saved)
    groups: dict[str, array[int]] = collections.defaultdict(functools.partial(array, "q"))
    keys_of: dict[str, list[Any]] = collections.defaultdict(list)
    collections.deque(  # (loops in C: groups[fqn].append(row), keys_of[fqn].append(offsets))
        map(array.append, map(groups.__getitem__, fqns), itertools.count()), maxlen=0
    )
    collections.deque(map(list.append, map(keys_of.__getitem__, fqns), offsets), maxlen=0)
    if any(len(set(keys)) != len(keys) for keys in keys_of.values()):
        raise NotPlain  # two entries for one chunk: the generic reader keeps the last
    del fqns, offsets
    if not _apart(paths, starts, lengths):
        raise NotPlain  # shared or overlapping spans: the bulk reader sorts them out

    # every data file's name checked once (not once per chunk)
    distinct = list(dict.fromkeys(paths))
    files_of = {rel: data_file(folder, {"relative_path": rel}, meta_path) for rel in distinct}
    ranks = {m.group(1) for rel in distinct if (m := RANK_FILE_RE.match(rel))}
    world_size = len(ranks) or None
    files = sorted(set(files_of.values()))
    # each row's start, length and file, side by side (a tensor's chunks are rows far
    # apart in the order saved: one cache line each, not three objects)
    file_ids = {rel: n for n, rel in enumerate(distinct)}
    names = list(map(files_of.__getitem__, distinct))
    packed: array[int] = array(
        "q",
        itertools.chain.from_iterable(
            zip(starts, lengths, map(file_ids.__getitem__, paths), strict=True)
        ),
    )
    del paths, starts, lengths, segments

    plain_chunk_lists(entries)
    if set(map(type, planner.values())) - {tuple}:
        raise NotPlain
    if set(map(type, itertools.chain.from_iterable(planner.values()))) - {str, int}:
        raise NotPlain
    from ..unpickler import MAX_NESTING

    by_row = (packed, names)
    root: Any = {}
    for fqn, entry in entries.items():
        obj_path = planner.get(fqn) or (fqn,)
        if len(obj_path) > MAX_NESTING or type(fqn) is not str:
            raise NotPlain
        kind = type(entry).__name__
        rows: Sequence[int] = groups.get(fqn) or []
        keys = keys_of.get(fqn) or []
        if kind == "TensorStorageMetadata":
            value: Any = _tensor(fqn, entry, rows, keys, by_row, runs, numbers, used, world_size)
        elif kind == "BytesStorageMetadata" and None in keys:
            info = {(fqn, None): infos[rows[keys.index(None)]]}
            value = bytes_value(folder, fqn, info, permissive, seen, set())
        else:
            raise NotPlain
        root = set_element(root, obj_path, value, len(entries))
    if len(used) != len(runs):
        raise NotPlain  # a run's token where no entry stands
    ckpt = checkpoint(FORMAT, [meta_path, *files], root, seen)
    ckpt.world_size = world_size
    return ckpt


def _apart(paths: Iterable[str], starts: Iterable[int], lengths: Iterable[int]) -> bool:
    """Whether no two spans of a file overlap or start at the same byte (then none is
    shared). In the order saved, each file's spans are one run one after the other as
    DCP writes them; where a chunk list names one empty chunk's span for many ranks a
    file's spans are in several places: then each file's are sorted. (Each argument is
    iterated several times.)"""
    if next(iter(paths), None) is None:
        return True
    # (millions of entries: no list of them is made where an iterator does)
    furthest = max(map(operator.add, starts, lengths))
    if min(lengths) <= 0 or min(starts) < 0 or furthest >= 2**63:
        return False
    next_paths = itertools.islice(paths, 1, None)
    if sum(map(operator.ne, paths, next_paths)) + 1 == len(set(paths)):  # each file one run
        same_file = map(operator.eq, paths, itertools.islice(paths, 1, None))
        ends = map(operator.add, starts, lengths)
        after = map(operator.le, ends, itertools.islice(starts, 1, None))
        if all(map(operator.or_, after, map(operator.not_, same_file))):
            return True
    # spans of positive length overlap nowhere (and share no start) exactly where, in
    # each file, sorted by start, each ends at most where the next starts: each file's
    # starts and ends gathered (arrays, in C), then sorted a file at a time
    starts_of: dict[str, array[int]] = collections.defaultdict(functools.partial(array, "q"))
    ends_of: dict[str, array[int]] = collections.defaultdict(functools.partial(array, "q"))
    collections.deque(map(array.append, map(starts_of.__getitem__, paths), starts), maxlen=0)
    ends = map(operator.add, starts, lengths)
    collections.deque(map(array.append, map(ends_of.__getitem__, paths), ends), maxlen=0)
    for path, file_starts in starts_of.items():
        spans = sorted(zip(file_starts, ends_of[path], strict=True))
        if not all(map(operator.le, map(_END, spans), map(_START, spans[1:]))):
            return False
    return True


_START, _END = operator.itemgetter(0), operator.itemgetter(1)


def _take(numbers: dict[bytes, int], used: set[int], key: bytes) -> int:
    """The run a token stands for, taken once."""
    number = numbers.get(key)
    if number is None or number in used:
        raise NotPlain
    used.add(number)
    return number


_FIELDS = ("fqns", "offsets", "paths", "starts", "lengths")


def _no_entries() -> StorageRun:
    return StorageRun([], [], [], array("q"), array("q"))


class _Column:
    """One field of every segment of the storage table, one after the other: iterated
    as often as needed, never copied into one list."""

    def __init__(self, segments: list[StorageRun], field: str):
        self._parts = [getattr(segment, field) for segment in segments]

    def __iter__(self) -> Iterator[Any]:
        return itertools.chain.from_iterable(self._parts)


def _row3(row: int) -> slice:
    """A row's start, length and file number in the packed table."""
    return slice(3 * row, 3 * row + 3)


def _tensor(
    fqn: str,
    entry: Opaque,
    rows: Sequence[int],  # the storage table's rows of this tensor, in the order saved
    keys: list[Any],  # their offsets
    by_row: tuple[array, list[str]],  # (start, length, file number) by row; the files
    runs: list[ChunkRun | StorageRun | None],  # (each set to None once taken)
    numbers: dict[bytes, int],
    used: set[int],
    world_size: int | None,
) -> ShardedRef:
    from ..tree import check_coverage
    from ..tree.sharding import row_blocks
    from .dcp_chunks import DcpChunks, dcp_tensor

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
    offsets: list[tuple[int, ...]] = []
    sizes: list[tuple[int, ...]] = []
    kept = iter(zip(kept_offsets, kept_sizes, strict=True))
    for chunk in chunks:
        if type(chunk) is bytes:
            number = _take(numbers, used, chunk)
            run = runs[number]
            if type(run) is not ChunkRun:
                raise NotPlain
            offsets += run.offsets
            sizes += run.sizes
            runs[number] = None  # (taken once)
        else:
            o, s = next(kept)
            offsets.append(tuple(o))
            sizes.append(tuple(s))
    at: list[Any] = list(rows)
    if keys != offsets:  # (DCP saves both in rank order: then no lookup)
        at = list(map(dict(zip(keys, rows, strict=True)).get, offsets))
        if None in at:
            raise NotPlain  # a chunk with no stored data: the generic reader says so
    packed, names = by_row
    first = at[0] if at else 0
    table: array | memoryview
    if at == list(range(first, first + len(at))):  # (in the order saved: a view, no copy)
        table = memoryview(packed)[3 * first : 3 * (first + len(at))]
    else:
        table = array("q", itertools.chain.from_iterable(map(packed.__getitem__, map(_row3, at))))
    shards = DcpChunks(names, table, offsets, sizes, dt, fqn)
    if not row_blocks(size, offsets, sizes):
        check_coverage(fqn, size, shards)
    return dcp_tensor(dt, size, shards, props, world_size)
