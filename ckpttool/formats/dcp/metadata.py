"""A large DCP ``.metadata`` read in bulk: one Python call per chunk, not twenty.

A folder saved by 2048 ranks holds millions of chunks, each three small objects
(``ChunkStorageMetadata``, the ``MetadataIndex`` naming its bytes, the
``_StorageInfo`` saying where they are). Read as :class:`~ckpttool.tree.Opaque`
stand-ins, each costs Python calls to create, to BUILD, to check and to read back.
Here the restricted unpickler hands out a :class:`Record` for those three classes
instead: a list that NEWOBJ creates and BUILD appends its state to, both in C, never
calling anything (REDUCE of the class is the stand-in's call, judged as ever). Every
other global is judged and rebuilt exactly as :class:`~ckpttool.unpickler.SafeUnpickler`
does (this is one).

Then the file must prove that it is plain, in bulk (C-speed ``map`` and ``set``
operations over the chunk lists): every record BUILT once with a dict of its own of
the expected fields, of numbers, strings and ``torch.Size``s of numbers, nothing
shared, nothing referenced from elsewhere. The rest of the pickle is checked by
:func:`~ckpttool.unpickler.policy.check_structure` as any pickle is, the chunk lists standing
as checked. Names are checked once per distinct name (256 data files, not 555,264
chunks). A file that is not plain in any way, or any error, and the generic reader
reads it again from the start: it decides, and words any error, exactly as before.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import sys
from itertools import repeat
from operator import itemgetter
from typing import Any

from ...dtypes import DType
from ...tree import Checkpoint, Opaque, Shard, ShardedRef, TorchSize, opaque_class, state_attrs
from ...unpickler import MAX_NESTING, SafeUnpickler, check_structure, python3_name
from ..skeleton.metadata_runs import STORAGE_INFO_ALIASES

METADATA = "torch.distributed.checkpoint.metadata."
CHUNK = METADATA + "ChunkStorageMetadata"
INDEX = METADATA + "MetadataIndex"
STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"


class _RecordClass(type):
    """The class of a :class:`Record`: called by a pickle (REDUCE), it is the stand-in
    :func:`~ckpttool.tree.opaque_class` gives, judged as that one judges; read-only."""

    module: str
    qualname: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return opaque_class(cls.module, cls.qualname, known=True)(*args, **kwargs)

    def __setattr__(cls, name: str, value: Any) -> None:
        raise AttributeError(f"stand-in class {cls.__qualname__} is read-only")

    def __delattr__(cls, name: str) -> None:
        raise AttributeError(f"stand-in class {cls.__qualname__} is read-only")


class Record(list, metaclass=_RecordClass):
    """An object of a DCP metadata class made by NEWOBJ: the states BUILD gave it.

    NEWOBJ is ``list``'s own ``__new__`` (arguments are ignored: the real classes take
    none), BUILD is ``list.append`` (the state is kept, never copied: a shared state
    costs nothing), both in C. No ``__dict__``: nothing a BUILD does reaches an
    attribute. Hashed and compared by identity, as an object is (a ``MetadataIndex``
    is a dict key).
    """

    __slots__ = ()
    __setstate__ = list.append
    __hash__ = object.__hash__  # type: ignore[assignment]
    __eq__ = object.__eq__  # type: ignore[assignment]
    __ne__ = object.__ne__  # type: ignore[assignment]


def _record(full: str) -> Any:
    module, qualname = full.rsplit(".", 1)
    return _RecordClass(
        qualname, (Record,), {"__slots__": (), "module": module, "qualname": qualname}
    )


_RECORDS = {full: _record(full) for full in (CHUNK, INDEX, STORAGE_INFO)}
ChunkRecord, IndexRecord, InfoRecord = (_RECORDS[f] for f in (CHUNK, INDEX, STORAGE_INFO))
# another writer's copy of the storage info dataclass is the same record (the fields
# are the same; the skeleton walker reads it so too)
_RECORDS.update({f"{module}.{name}": InfoRecord for module, name in STORAGE_INFO_ALIASES})


class DcpMetadataUnpickler(SafeUnpickler):
    """:class:`~ckpttool.unpickler.SafeUnpickler` with :class:`Record` for the three
    per-chunk classes (each judged first, as every global is)."""

    def find_class(self, module: str, name: str) -> Any:
        value = super().find_class(module, name)
        record = _RECORDS.get(".".join(python3_name(module, name)))
        if (
            record is not None
            and isinstance(value, type)
            and issubclass(value, Opaque)
            and value.known
            and not value.dangerous
        ):
            return record
        if module == "torch" and name == "Size":
            return _AS_TUPLE
        return value


# torch.Size(values) here: the tuple itself, in C (``() + values``), or a TypeError for
# anything but a tuple (a list too: the generic reader reads such a file). The sizes
# the checkpoint keeps are checked in bulk (ints of int64), as the stand-in checks each.
_AS_TUPLE = functools.partial(operator.add, ())


def _baseline_refcount() -> int:
    """What ``sys.getrefcount`` says of an item of a list, through ``map``, when the
    list alone holds it."""
    probe = [list.__new__(ChunkRecord)]
    return next(iter(set(map(sys.getrefcount, probe))))


_ALONE = _baseline_refcount()


class NotPlain(Exception):
    """The file is not plain: the generic reader reads it."""


def _alone(items: Any, holders: int = 1) -> None:
    """Each of ``items`` is held by ``holders`` references besides the list ``items``
    (its container, where the pickle put it): no other path reaches it."""
    if items and set(map(sys.getrefcount, items)) != {_ALONE + holders}:
        raise NotPlain


_LAST = itemgetter(-1)


def _states(records: list, cls: type, holders: int = 1, walked: bool = True) -> list[dict]:
    """The one dict state of each record, every record of ``cls`` and held once
    (``holders``: 0 where ``records`` is the container the pickle made, not a copy)."""
    if not records:
        return []
    if set(map(type, records)) != {cls}:
        raise NotPlain
    _alone(records, holders)
    # the last BUILD's, as an object keeps (none: an IndexError, the generic reader's)
    states = list(map(_LAST, records))
    if set(map(type, states)) != {dict}:
        raise NotPlain
    if walked:  # (a dict key's state is never walked: it may be shared)
        _alone(states)
    return states


def _sizes(values: list, holders: int = 1, numbers_checked: bool = False) -> None:
    """Every one a ``torch.Size`` (a tuple here) of int64s, each held once (the empty
    one is Python's one empty tuple: it holds nothing)."""
    if not values:
        return
    if set(map(type, values)) != {tuple}:
        raise NotPlain
    _alone(list(filter(None, values)), holders + 1)  # (+1: that list)
    if numbers_checked:
        return
    numbers = list(itertools.chain.from_iterable(values))
    if numbers and (
        set(map(type, numbers)) != {int} or min(numbers) < _INT64_MIN or max(numbers) > _INT64_MAX
    ):
        raise NotPlain


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _field(states: list[dict], name: str) -> list:
    try:
        return list(map(itemgetter(name), states))
    except KeyError:
        raise NotPlain from None


def read(folder: str, meta_path: str, permissive: bool) -> Checkpoint | None:
    """The checkpoint, or None where the generic reader must read it (see the module)."""
    from ...sources import open_input
    from ...unpickler import load_pickle

    seen: set[str] = set()
    try:
        with open_input(meta_path) as f:
            metadata = load_pickle(
                f,
                path=meta_path,
                permissive=permissive,
                seen=seen,
                unpickler_class=DcpMetadataUnpickler,
                check=False,
            )
        return _read(folder, meta_path, metadata, permissive, seen)
    except Exception:  # NotPlain, CkptError, or a TypeError on a hostile value
        return None


def metadata_fields(metadata: Any) -> tuple[dict, dict, dict]:
    """(``state_dict_metadata``, ``storage_data``, ``planner_data``) of a plain
    ``Metadata`` as the restricted unpickler gives it; :class:`NotPlain` for anything else."""
    if not isinstance(metadata, Opaque) or f"{metadata.module}.{metadata.qualname}" != (
        METADATA + "Metadata"
    ):
        raise NotPlain
    meta = state_attrs(metadata.state)
    entries = meta.get("state_dict_metadata")
    storage = meta.get("storage_data")
    planner = meta.get("planner_data")
    if type(entries) is not dict or type(storage) is not dict:
        raise NotPlain
    if planner is None:
        planner = {}
    if type(planner) is not dict:
        raise NotPlain
    _alone([storage], holders=2)  # (its place in the Metadata, and here)
    return entries, storage, planner


def tensor_entry(entry: Opaque) -> tuple[dict, DType, TorchSize, Any]:
    """(properties, dtype, size, chunks) of a plain ``TensorStorageMetadata``;
    :class:`NotPlain` for anything else."""
    from .chunks import tensor_properties

    attrs = entry.attrs()
    props = tensor_properties(attrs.get("properties"))
    dt = props.get("dtype")
    size = attrs.get("size")
    if not isinstance(dt, DType):
        raise NotPlain
    _sizes([size], holders=2)  # (its place in the entry, and here)
    # (a tuple: what the stand-in gives)
    return props, dt, TorchSize(size), attrs["chunks"]  # type: ignore[arg-type]


def plain_chunk_lists(entries: dict) -> list:
    """Every tensor entry's chunk list, each a list held there alone; :class:`NotPlain`
    else."""
    chunk_lists = [
        entry.attrs().get("chunks")
        for entry in entries.values()
        if isinstance(entry, Opaque) and type(entry).__name__ == "TensorStorageMetadata"
    ]
    if set(map(type, chunk_lists)) - {list}:
        raise NotPlain
    _alone(chunk_lists)
    return chunk_lists


def _read(
    folder: str, meta_path: str, metadata: Any, permissive: bool, seen: set[str]
) -> Checkpoint:
    from ..made import checkpoint
    from .chunks import FORMAT, RANK_FILE_RE, bytes_value, data_file, set_element, shared_spans

    entries, storage, planner = metadata_fields(metadata)

    # storage_data: MetadataIndex -> _StorageInfo, each of plain fields
    keys, infos = list(storage), list(storage.values())
    key_states = _states(keys, IndexRecord, walked=False)
    info_states = _states(infos, InfoRecord)
    fqns = _field(key_states, "fqn")
    # (an offset that is no chunk's finds none: the generic reader words that)
    offsets = list(map(dict.get, key_states, itertools.repeat("offset")))
    if set(map(type, fqns)) - {str}:
        raise NotPlain
    if info_states and set(map(len, info_states)) != {3}:
        raise NotPlain  # (transform descriptors: the generic reader refuses them by name)
    rels, starts, lengths = (_field(info_states, f) for f in ("relative_path", "offset", "length"))
    if (set(map(type, rels)) - {str}) or (set(map(type, starts + lengths)) - {int}):
        raise NotPlain
    # each tensor's spans by offsets: a small table per tensor (a lookup in one table
    # of every chunk costs a cache miss per chunk)
    tables: dict[str, dict[Any, dict]] = collections.defaultdict(dict)
    collections.deque(  # (a loop in C: tables[fqn][offset] = info)
        map(operator.setitem, map(tables.__getitem__, fqns), offsets, info_states), maxlen=0
    )
    if sum(map(len, tables.values())) != len(keys):
        raise NotPlain  # two indexes of one chunk: the generic reader keeps the last
    if _disjoint(rels, starts, lengths):
        shared: set[tuple[str, int]] = set()
    else:  # (raises on overlaps, as ever)
        shared = shared_spans(
            dict(zip(zip(fqns, offsets, strict=True), info_states, strict=True)), meta_path
        )

    # every data file's name checked once (not once per chunk)
    distinct = list(dict.fromkeys(rels))
    files_of = {rel: data_file(folder, {"relative_path": rel}, meta_path) for rel in distinct}
    ranks = {m.group(1) for rel in distinct if (m := RANK_FILE_RE.match(rel))}
    world_size = len(ranks) or None
    files = sorted(set(files_of.values()))

    # the rest of the pickle: checked as any pickle is, the chunk lists standing as checked
    chunk_lists = plain_chunk_lists(entries)
    check_structure(metadata, meta_path, ({id(c) for c in chunk_lists} | {id(storage)}, set()))
    if set(map(type, planner.values())) - {tuple}:
        raise NotPlain
    if set(map(type, itertools.chain.from_iterable(planner.values()))) - {str, int}:
        raise NotPlain

    root: Any = {}
    for fqn, entry in entries.items():
        obj_path = planner.get(fqn) or (fqn,)
        if len(obj_path) > MAX_NESTING or type(fqn) is not str:
            raise NotPlain
        kind = type(entry).__name__
        table = tables.get(fqn) or {}
        if kind == "TensorStorageMetadata":
            value = _tensor(folder, fqn, entry, table, files_of, world_size, shared)
        elif kind == "BytesStorageMetadata" and None in table:
            value = bytes_value(folder, fqn, {(fqn, None): table[None]}, permissive, seen, shared)
        else:
            raise NotPlain
        root = set_element(root, obj_path, value, len(entries))
    ckpt = checkpoint(FORMAT, [meta_path, *files], root, seen)
    ckpt.world_size = world_size
    return ckpt


def _disjoint(rels: list[str], starts: list[int], lengths: list[int]) -> bool:
    """Whether the spans, in the order saved, are each file's one run of non-empty spans
    one after the other (as DCP writes them): then none overlaps and none is shared."""
    if not rels:
        return True
    if min(lengths) <= 0 or min(starts) < 0:
        return False
    ends = list(map(int.__add__, starts, lengths))
    same_file = list(map(str.__eq__, rels[:-1], rels[1:]))
    runs = len(same_file) - sum(same_file) + 1
    if runs != len(set(rels)):
        return False  # a file's spans are not one run: the general check sorts them
    after = map(operator.le, ends[:-1], starts[1:])
    return all(map(operator.or_, after, map(operator.ne, rels[:-1], rels[1:])))


_RELATIVE_PATH, _OFFSET, _LENGTH = map(itemgetter, ("relative_path", "offset", "length"))
_ROW, _COL = itemgetter(0), itemgetter(1)


def _tensor(
    folder: str,
    fqn: str,
    entry: Opaque,
    spans: dict,  # offsets -> storage info, of this tensor
    files_of: dict[str, str],
    world_size: int | None,
    shared: set[tuple[str, int]],
) -> ShardedRef:
    from ...tree import check_coverage, row_blocks
    from .chunks import DcpChunk, dcp_tensor

    props, dt, size, chunks = tensor_entry(entry)
    states = _states(chunks, ChunkRecord, holders=0)
    if states and set(map(len, states)) != {2}:
        raise NotPlain
    offsets, sizes = _field(states, "offsets"), _field(states, "sizes")
    # whole rows one after the other (FSDP, DCP): their numbers are ints within the
    # tensor's, but for the rows where empty chunks start, checked here
    rows = (
        len(size) in (1, 2)
        and set(map(type, offsets)) == {tuple}
        and set(map(type, sizes)) == {tuple}
        and row_blocks(size, offsets, sizes)  # (the rows' types too)
        and _INT64_MIN <= min(map(_ROW, offsets))
        and max(map(_ROW, offsets)) <= _INT64_MAX
        # a column's 0 or width compares equal to False, or to a float
        and (len(size) == 1 or set(map(type, map(_COL, offsets + sizes))) == {int})
    )
    _sizes(offsets, numbers_checked=rows)
    _sizes(sizes, numbers_checked=rows)
    infos: list[Any] = list(map(spans.get, offsets))
    if None in infos:
        raise NotPlain  # a chunk with no stored data: the generic reader says so
    # one call per chunk: its DcpChunk and its Shard, the rest in bulk
    offsets_t = list(map(tuple, offsets))
    interned: dict[tuple, tuple] = {}  # (most chunks of a tensor have one size)
    sizes_t = list(map(tuple, sizes))
    sizes_t = list(map(interned.setdefault, sizes_t, sizes_t))
    rels = list(map(_RELATIVE_PATH, infos))
    starts = list(map(_OFFSET, infos))
    many = (
        list(map(shared.__contains__, zip(rels, starts, strict=True))) if shared else repeat(False)
    )
    chunks = list(
        map(
            DcpChunk,
            map(files_of.__getitem__, rels),
            starts,
            map(_LENGTH, infos),
            repeat(dt),
            sizes_t,
            repeat(None),
            repeat(fqn),
            offsets_t,
            many,
        )
    )
    shards = list(map(Shard, offsets_t, sizes_t, chunks))
    if not rows:
        check_coverage(fqn, size, shards)
    return dcp_tensor(dt, size, shards, props, world_size)
