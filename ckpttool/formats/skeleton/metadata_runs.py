"""A DCP ``.metadata`` parsed at the opcode level: its millions of chunks as regex steps.

A folder saved by thousands of ranks has a ``.metadata`` of millions of chunks, and
each chunk is pickled the same way, opcode for opcode: the ``ChunkStorageMetadata``
of a tensor's chunk list (``BINGET`` of the class, ``EMPTY_TUPLE NEWOBJ MEMOIZE
EMPTY_DICT MEMOIZE MARK``, the key ``'offsets'`` by ``BINGET``, ``torch.Size`` by
``BINGET``, its ints, ``TUPLEn MEMOIZE TUPLE1 MEMOIZE REDUCE MEMOIZE``, the same for
``'sizes'``, ``SETITEMS BUILD``), and the ``MetadataIndex`` -> ``_StorageInfo`` pair
of ``storage_data`` likewise. Such a run of entries is matched here by one compiled
``re`` pattern (in C) and its numbers taken with ``findall``: no Python object is
built per chunk but the numbers themselves, and those go to records of a spill
(:mod:`ckpttool.formats.records`: past a few MB, a temporary file), each tuple and
name a number. A storage entry names its tensor and data file by reference or by a
new string (torch pickles each rank's key strings afresh: at 2048 ranks, millions);
a run takes either, and of the new strings keeps only those named again.

Everything else, the *skeleton* (the header, each tensor's entry, the first entry
that names a class or a key, an entry a frame boundary cuts), is walked opcode by
opcode in Python, and copied to a small pickle in which each run stands as one
token (a ``bytes`` value, which a ``.metadata`` never holds otherwise). That pickle
is then read by the restricted unpickler as any is: every global judged by name,
every structure checked. :mod:`ckpttool.formats.dcp.runs` puts the two together.

Safety is structural: every byte of the file is accounted for by an opcode walked
here or an entry of a run; the memo is numbered exactly (the skeleton's ``BINGET``
indices are renumbered past the runs, and refused where they name an object of a
run); an entry's ``BINGET`` may name only a class, a key string, ``torch.Size`` or
a string (a data file's or a key's name), never another chunk's object, so nothing
is shared; ints are the pickler's own shortest encodings of numbers in [0, 2**63);
frames tile the file and each boundary falls between opcodes. Anything else, and
:func:`parse` gives None: the readers after it read the file from the start.
"""

from __future__ import annotations

import bisect
import collections
import io
import itertools
import operator
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from ..records import CHUNK, STORAGE, Interned, Spill
from .opcodes import (
    DICT,
    FROM_BYTES,
    INT,
    INT_WIDTH,
    LIST,
    MAX_CACHED,
    OTHER,
    POP,
    POP_PUSH,
    PUSHES,
    TOKEN,
    NotRegular,
    cached,
    int_opcodes,
    int_value,
    ints,
)

METADATA_MODULE = "torch.distributed.checkpoint.metadata"
FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
CHUNK_CLASS = ("G", METADATA_MODULE, "ChunkStorageMetadata")
INDEX_CLASS = ("G", METADATA_MODULE, "MetadataIndex")
INFO_CLASS = ("G", FILESYSTEM_MODULE, "_StorageInfo")
SIZE_CLASS = ("G", "torch", "Size")
# other writers' copies of torch's _StorageInfo (the same fields), read as it: OLMo-core's
STORAGE_INFO_ALIASES = frozenset({("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo")})
# The globals a skeleton may name (all judged again by the restricted unpickler).
_METADATA_NAMES = frozenset(
    """Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata
    MetadataIndex TensorProperties StorageMeta _MEM_FORMAT_ENCODING""".split()
)
_NAMED = STORAGE_INFO_ALIASES | {
    (FILESYSTEM_MODULE, "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
}  # fmt: skip

# Walked opcode by opcode at most this many (each costs a Python step: a file whose
# entries are not runs is the bulk reader's)
MAX_STEPS = 2_000_000
MAX_PATTERNS = 32  # distinct (class, keys, Size) memo slots runs are compiled for
MAX_STRING = 1 << 20  # a BINUNICODE of the skeleton
RECENT_STRINGS = 1 << 12  # new strings of the runs held until named (see _StringSlots)

# a torch.Size's tuple: empty, TUPLE1-3 of numbers (INT), or MARK, 4 to 64, TUPLE
_TUPLE = (
    rb"(?:\)|" + INT + rb"\x85\x94|" + INT * 2 + rb"\x86\x94|" + INT * 3 + rb"\x87\x94"
    rb"|\((?:" + INT + rb"){4,64}t\x94)"
)
_SIZE_END = rb"\x85\x94R\x94"  # TUPLE1 MEMOIZE REDUCE MEMOIZE: torch.Size((...))
_NEW = rb"\)\x81\x94\}\x94\("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK
_REF = rb"h.|j...."  # BINGET, LONG_BINGET
_STRING = rb"\x8c(.)(.{0,255}?)\x94"  # SHORT_BINUNICODE MEMOIZE (its length checked after)
_HINT = rb"(?:" + INT + rb"|N)"  # MetadataIndex.index: a hint, or None (never kept)

_CHUNK_SLOTS = ("class", "offsets", "size", "sizes", "size2")
_STORAGE_SLOTS = ("class", "fqn", "index", "offset", "size", "info", "path", "offset2", "length")


def _chunk_entry(get: Callable[[int], bytes], cap: bytes) -> bytes:
    """A ChunkStorageMetadata; ``get(i)`` matches the i-th fixed memo reference, ``cap``
    opens one group from its offsets' tuple to its sizes' (one bytes object per chunk:
    :func:`_pair` splits the distinct ones)."""
    return (
        get(0) + _NEW + get(1) + get(2) + cap + _TUPLE + _SIZE_END
        + get(3) + get(4) + _TUPLE + rb")" + _SIZE_END + rb"ub"
    )  # fmt: skip


_TUPLE_AT = re.compile(_TUPLE, re.DOTALL)


def _pair(raw: bytes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of a chunk from the bytes ``_chunk_entry``'s group matched: a
    torch.Size's tuple, its end, two memo references, the other tuple."""
    first = _TUPLE_AT.match(raw)
    if first is None:  # (never: the group matched so)
        raise NotRegular
    pos = first.end() + 4  # TUPLE1 MEMOIZE REDUCE MEMOIZE
    for _ in range(2):
        pos += 2 if raw[pos] == 0x68 else 5  # BINGET, LONG_BINGET
    return _numbers(first.group()), _numbers(raw[pos:])


def _storage_entry(get: Callable[[int], bytes], cap: bytes, new_names: bool = True) -> bytes:
    """A MetadataIndex (fqn, index, offset: the order its ``__init__`` sets them) and its
    _StorageInfo (relative_path, offset, length): the names by reference or (where
    ``new_names``) new, the rest numbers (the index, a number or None, is not kept)."""
    name = rb"(?:" + cap + _REF + rb")" + (rb"|" + _STRING if new_names else b"") + rb")"
    return (
        get(0) + _NEW + get(1) + name + get(2) + _HINT
        + get(3) + get(4) + cap + _TUPLE + rb")" + _SIZE_END + rb"ub"
        + get(5) + _NEW + get(6) + name + get(7) + cap + INT + rb")" + get(8) + cap + INT
        + rb")ub"
    )  # fmt: skip


def _fixed(slots: tuple[int, ...]) -> Callable[[int], bytes]:
    def get(i: int) -> bytes:
        slot = slots[i]
        long = re.escape(b"j" + slot.to_bytes(4, "little"))
        if slot < 256:
            return rb"(?:" + re.escape(b"h" + bytes([slot])) + rb"|" + long + rb")"
        return long

    return get


def _probe(i: int) -> bytes:
    return b"(?P<s%d>" % i + _REF + rb")"


_CHUNK_PROBE = re.compile(_chunk_entry(_probe, rb"(?:"), re.DOTALL)
_STORAGE_PROBE = re.compile(_storage_entry(_probe, rb"(?:"), re.DOTALL)


@dataclass
class _Runs:
    """The patterns of one set of fixed memo slots: a run's extent, its entries' numbers;
    for storage entries, the same where every name is a reference (fewer groups)."""

    run: re.Pattern[bytes]
    entry: re.Pattern[bytes]
    refs_run: re.Pattern[bytes] | None = None
    refs_entry: re.Pattern[bytes] | None = None
    whole_entry: re.Pattern[bytes] | None = None  # ``entry``, its whole match a group first


def _compile(build: Callable[..., bytes], slots: tuple[int, ...]) -> _Runs:
    get = _fixed(slots)

    def run(*args: bool) -> re.Pattern[bytes]:
        return re.compile(rb"(?:" + build(get, rb"(?:", *args) + rb")++", re.DOTALL)

    def entry(*args: bool) -> re.Pattern[bytes]:
        return re.compile(build(get, rb"(", *args), re.DOTALL)

    if build is _chunk_entry:
        return _Runs(run(), entry())
    whole = re.compile(rb"(" + build(get, rb"(") + rb")", re.DOTALL)
    return _Runs(run(), entry(), run(False), entry(False), whole)


@dataclass
class ChunkRun:
    """Consecutive chunks of one tensor's chunk list: ``count`` records of
    :data:`~ckpttool.formats.records.CHUNK` at ``at`` of the chunk spill."""

    at: int
    count: int


@dataclass
class StorageRun:
    """Consecutive entries of ``storage_data``: ``count`` records of
    :data:`~ckpttool.formats.records.STORAGE` at ``at`` of the storage spill."""

    at: int
    count: int


@dataclass
class Parsed:
    """A ``.metadata`` split: the skeleton pickle, the runs its tokens stand for, the
    runs' records (spilled) and the tuples and names their numbers stand for."""

    skeleton: bytes
    runs: list[ChunkRun | StorageRun | None] = field(default_factory=list)  # (None: taken)
    chunks: Spill = field(default_factory=Spill)
    storage: Spill = field(default_factory=Spill)
    tuples: Interned[tuple[int, ...]] = field(default_factory=Interned)
    names: Interned[str] = field(default_factory=Interned)


def token(run: int) -> bytes:
    """The value that stands for run number ``run`` in the skeleton."""
    return b"ckpttool-run:" + run.to_bytes(8, "little")


_TOKEN_OPCODE = b"C\x15"  # SHORT_BINBYTES of len(token(n))


def parse(data: bytes) -> Parsed | None:
    """The skeleton and runs of a ``.metadata`` (see the module), or None."""
    try:
        parsed = _Parser(_frames(data)).parse()
    except (NotRegular, IndexError, KeyError, ValueError, UnicodeDecodeError, OverflowError):
        return None
    parsed.skeleton = data[:2] + parsed.skeleton  # (PROTO)
    return parsed


def parse_file(f: io.BufferedIOBase, size: int) -> Parsed | None:
    """:func:`parse` of the ``size`` bytes of ``f`` (at its start), read a frame at a
    time: the walk holds one frame (64 KB as the pickler writes them), never the file
    (a 2048-rank 405B-shaped one is 836 MB). An unframed file is read whole."""
    try:
        head = f.read(3)
        if len(head) < 3 or head[0] != 0x80 or head[1] not in (4, 5):
            return None
        parsed = _Parser(_file_frames(f, size, head)).parse()
    except (NotRegular, IndexError, KeyError, ValueError, UnicodeDecodeError, OverflowError):
        return None
    parsed.skeleton = bytes(head[:2]) + parsed.skeleton  # (PROTO)
    return parsed


def _file_frames(f: io.BufferedIOBase, size: int, head: bytes) -> Iterator[bytes]:
    """The opcodes of the file ``f`` (its first 3 bytes ``head`` read), frame by frame:
    framed throughout (each FRAME right after the last one's bytes, to the end), or not
    at all (then one piece, and a FRAME opcode is refused where it appears)."""
    if head[2] != 0x95:
        rest = f.read(size - 3)
        if len(rest) != size - 3:
            raise NotRegular
        yield head[2:] + rest
        return
    header, total, count = head[2:] + f.read(8), 2, 0
    while header:
        n = int.from_bytes(header[1:9], "little")
        total += 9 + n
        count += 1
        if len(header) != 9 or header[0] != 0x95 or n <= 0 or total > size:
            raise NotRegular
        if count > size // 4096 + 16:
            raise NotRegular  # (frames of a few bytes: a walk of the file, not of frames)
        frame = f.read(n)
        if len(frame) != n:
            raise NotRegular
        yield frame
        header = f.read(9)


def _frames(data: bytes) -> Iterator[bytes]:
    """The opcodes of ``data`` frame by frame, as :func:`_file_frames` gives a file's."""
    if len(data) < 3 or data[0] != 0x80 or data[1] not in (4, 5):
        raise NotRegular
    stream = io.BytesIO(data)
    stream.seek(3)
    return _file_frames(stream, len(data), data[:3])


class _Parser:
    def __init__(self, frames: Iterator[bytes]):
        self.frames = frames
        self.data, self.pos = b"", 0  # the frame being walked, and where in it
        self.stack: list[tuple] = []
        self.marks: list[int] = []
        self.kinds: dict[int, tuple] = {}  # the skeleton's memo slots
        self.strings = _StringSlots()  # the strings' memo slots, the runs' too
        self.slots = 0  # memo slots so far, the runs' included
        self.removed_at: list[int] = []  # first slot of each run
        self.removed_before: list[int] = []  # slots of the runs before it
        self.removed = 0
        self.pieces: list[Any] = []
        self.copied = 0  # the frame's bytes up to here are in pieces
        self.out = Parsed(b"")  # the runs, their records, their tuples and names
        self.runs = self.out.runs
        self.patterns: dict[tuple, _Runs] = {}
        self.sizes: dict[bytes, tuple[int, ...]] = {}  # a torch.Size's bytes -> its ints
        self.names: dict[bytes, str] = {}
        self.numbers: dict[bytes, int] = {}  # a length's int opcode -> its number
        self.pairs: dict[bytes, tuple] = {}  # a chunk's bytes -> (offsets, sizes)
        self.refs: dict[bytes, str] = {}  # a BINGET of a string -> the string

    def parse(self) -> Parsed:
        """Walk every frame (no opcode crosses a frame's end: a run is matched, an
        opcode's argument read, within it); the skeleton copied out of each as it goes,
        so a frame is dropped once walked."""
        step = self._step
        steps = 0
        for data in self.frames:
            self.data, self.pos, self.copied = data, 0, 0
            end = len(data)
            while self.pos < end:
                steps += 1
                if steps > MAX_STEPS:
                    raise NotRegular
                op = data[self.pos]
                if (op == 0x68 or op == 0x6A) and self.marks and self._run(end):
                    continue
                if step(op, end):
                    if self.pos != end or next(self.frames, None) is not None:
                        raise NotRegular  # (STOP ends the file)
                    self._copy_to(end)
                    self.out.skeleton = b"".join(self.pieces)
                    return self.out
            self._copy_to(end)
        raise NotRegular

    # --------------------------------------------------------------- one opcode

    def _pop(self, n: int) -> list[tuple]:
        """The top ``n`` values (above the last MARK), none a token."""
        stack = self.stack
        if len(stack) - (self.marks[-1] if self.marks else 0) < n:
            raise NotRegular
        items = stack[len(stack) - n :] if n else []
        del stack[len(stack) - n :]
        if TOKEN in items:
            raise NotRegular  # a run's objects used one by one: not a plain list
        return items

    def _to_mark(self) -> list[tuple]:
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def _arg(self, n: int, limit: int) -> int:
        """The end of an opcode with ``n`` bytes of argument: within the frame."""
        end = self.pos + 1 + n
        if end > limit:
            raise NotRegular
        return end

    def _step(self, op: int, limit: int) -> bool:
        """Walk the opcode at ``pos``; True at STOP."""
        data, stack = self.data, self.stack
        end = self._arg(0, limit)
        if op in PUSHES:
            stack.append(PUSHES[op])
        elif op == 0x94:  # MEMOIZE
            (top,) = self._pop(1)
            stack.append(top)
            self.kinds[self.slots] = top
            if top[0] == "S":
                self.strings.keep(self.slots, top[1])
            self.slots += 1
        elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
            end = self._arg(1 if op == 0x68 else 4, limit)
            slot = int.from_bytes(data[self.pos + 1 : end], "little")
            kind = self.kinds.get(slot)
            self._copy_to(self.pos)
            if kind is not None:
                new = slot - self._removed_before(slot)
                self.pieces.append(
                    b"h" + bytes([new]) if new < 256 else b"j" + new.to_bytes(4, "little")
                )
            elif (text := self.strings.get(slot)) is not None:  # a run's string: as itself
                kind = ("S", text)
                raw = text.encode("utf-8", "surrogatepass")
                self.pieces.append(
                    b"\x8c" + bytes([len(raw)]) + raw
                    if len(raw) < 256
                    else b"X" + len(raw).to_bytes(4, "little") + raw
                )
            else:  # none, or a run's object
                raise NotRegular
            stack.append(kind)
            self.copied = end
        elif op in INT_WIDTH or op == 0x47:  # BININT*, BINFLOAT
            end = self._arg(INT_WIDTH.get(op, 8), limit)
            stack.append(OTHER)
        elif op == 0x8A:  # LONG1
            end = self._arg(data[self._arg(1, limit) - 1] + 1, limit)
            stack.append(OTHER)
        elif op == 0x8C or op == 0x58:  # SHORT_BINUNICODE, BINUNICODE
            width = 1 if op == 0x8C else 4
            n = int.from_bytes(data[self.pos + 1 : self._arg(width, limit)], "little")
            if n > MAX_STRING:
                raise NotRegular
            end = self._arg(width + n, limit)
            text = bytes(data[end - n : end]).decode("utf-8", "surrogatepass")
            stack.append(("S", text))
        elif op == 0x28:  # MARK
            self.marks.append(len(stack))
        elif op in POP_PUSH:
            self._pop(POP_PUSH[op])
            stack.append(OTHER)
        elif op in POP:
            self._pop(POP[op])
            if len(stack) - (self.marks[-1] if self.marks else 0) < 1 or stack[-1] == TOKEN:
                raise NotRegular
        elif op == 0x74:  # TUPLE
            if not self.marks or TOKEN in self._to_mark():
                raise NotRegular
            stack.append(OTHER)
        elif op == 0x75 or op == 0x65:  # SETITEMS, APPENDS: a run's token may be there
            if not self.marks or len(self._to_mark()) % (2 if op == 0x75 else 1):
                raise NotRegular
            if len(stack) <= (self.marks[-1] if self.marks else 0) or stack[-1] == TOKEN:
                raise NotRegular
        elif op == 0x93:  # STACK_GLOBAL
            module, name = self._pop(2)
            if module[0] != "S" or name[0] != "S" or not _allowed(module[1], name[1]):
                raise NotRegular
            pair = (module[1], name[1])
            stack.append(INFO_CLASS if pair in STORAGE_INFO_ALIASES else ("G", *pair))
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or self.marks:
                raise NotRegular
            self.pos = end
            return True
        else:  # anything else: not what a .metadata is made of
            raise NotRegular
        self.pos = end
        return False

    def _copy_to(self, pos: int) -> None:
        """The frame's bytes from ``copied`` to ``pos`` into the skeleton (a copy: the
        frame is dropped once walked)."""
        if pos > self.copied:
            self.pieces.append(self.data[self.copied : pos])

    def _removed_before(self, slot: int) -> int:
        i = bisect.bisect_right(self.removed_at, slot)
        return self.removed_before[i - 1] if i else 0

    # --------------------------------------------------------------- runs

    def _run(self, limit: int) -> bool:
        """A run of chunks (in a list) or storage entries (in a dict) at ``pos``, up to
        ``limit``: matched, taken, and replaced by a token. False: none here."""
        data, pos, stack = self.data, self.pos, self.stack
        below = self.marks[-1] - 1
        if below < 0:
            return False
        container = stack[below]
        width = 5 if data[pos] == 0x6A else 2
        kind = self.kinds.get(int.from_bytes(data[pos + 1 : pos + width], "little"))
        probe: re.Pattern[bytes]
        slots: tuple[str, ...]
        wanted: tuple[tuple, ...]
        build: Callable[..., bytes]
        if kind == CHUNK_CLASS and container == LIST:
            probe, slots, wanted, build = _CHUNK_PROBE, _CHUNK_SLOTS, _CHUNK_KINDS, _chunk_entry
        elif kind == INDEX_CLASS and container == DICT and (len(stack) - below - 1) % 2 == 0:
            probe, slots, wanted, build = (
                _STORAGE_PROBE,
                _STORAGE_SLOTS,
                _STORAGE_KINDS,
                _storage_entry,
            )
        else:
            return False
        m = probe.match(data, pos, limit)
        if m is None:
            return False
        fixed = tuple(_ref(m.group(f"s{i}")) for i in range(len(slots)))
        if tuple(map(self.kinds.get, fixed)) != wanted:
            return False
        patterns = self.patterns.get((build, fixed))
        if patterns is None:
            if len(self.patterns) >= MAX_PATTERNS:
                raise NotRegular
            patterns = self.patterns[(build, fixed)] = _compile(build, fixed)
        run = patterns.refs_run and patterns.refs_run.match(data, pos, limit)
        if run:  # (the commonest: every name named before)
            self._take_storage_refs(patterns.refs_entry.findall(data, pos, run.end()))  # type: ignore[union-attr]
        else:
            if build is _chunk_entry:
                run = patterns.run.match(data, pos, limit)
                if run is None:  # (the probe matched one entry)
                    raise NotRegular
                self._take_chunks(patterns.entry.findall(data, pos, run.end()))
            else:  # an entry with a new name: the next ones may name it ...
                run = patterns.entry.match(data, pos, limit)
                if run is None:
                    raise NotRegular
                columns: list[tuple[bytes, ...]] = [(group,) for group in run.groups(b"")]
                if patterns.refs_entry.match(data, run.end(), limit) is None:  # type: ignore[union-attr]
                    # ... or bring new names too (torch pickles each rank's key strings
                    # afresh): one run of them all, not a run (and a token in the
                    # skeleton) per entry
                    run, columns = self._entries_with_names(patterns, pos, limit)
                self._take_storage(columns)
        if build is _chunk_entry:
            stack.append(TOKEN)
        else:
            stack.extend((TOKEN, TOKEN))
        self._copy_to(pos)
        number = len(self.runs) - 1
        self.pieces.append(
            _TOKEN_OPCODE + token(number) + (b"N" if build is _storage_entry else b"")
        )
        self.copied = self.pos = run.end()
        return True

    def _entries_with_names(
        self, patterns: _Runs, pos: int, limit: int
    ) -> tuple[re.Match[bytes], list[tuple[bytes, ...]]]:
        """The run of storage entries at ``pos``, names new or named before, and each of
        the entry pattern's groups as a column: the entries must tile the run (a lazy
        string match that split it otherwise is no run here)."""
        run = patterns.run.match(self.data, pos, limit)
        if run is None or patterns.whole_entry is None:
            raise NotRegular
        found = patterns.whole_entry.findall(self.data, pos, run.end())
        whole, *columns = zip(*found, strict=True)
        if sum(map(len, whole)) != run.end() - pos:  # (matches apart: a gap between two)
            raise NotRegular
        return run, columns

    def _remove(self, slots: int) -> int:
        """Count ``slots`` memo slots of a run (never named by the skeleton); the first."""
        first = self.slots
        self.removed_at.append(first)
        self.removed += slots
        self.removed_before.append(self.removed)
        self.slots += slots
        return first

    def _tuples(self, raw: tuple[bytes, ...]) -> list[tuple[int, ...]]:
        return cached(self.sizes, raw, _numbers)

    def _take_chunks(self, items: list[bytes]) -> None:
        offsets, sizes = zip(*cached(self.pairs, items, _pair), strict=True)
        # 2 slots (the object, its dict) and 3 per torch.Size (2 for an empty one)
        empty = offsets.count(()) + sizes.count(())
        self._remove(8 * len(items) - empty)
        records = np.empty(len(items), CHUNK)
        records["offsets"] = self.out.tuples.ids_of(offsets)
        records["sizes"] = self.out.tuples.ids_of(sizes)
        self.runs.append(ChunkRun(self.out.chunks.append(records), len(items)))

    def _take_storage_refs(self, items: list[tuple[bytes, ...]]) -> None:
        """Storage entries whose names are all named before the run (none is new)."""
        fqn_ref, offsets, path_ref, starts, lengths = zip(*items, strict=True)
        # 2 + 2 slots: the objects and their dicts; 3 per torch.Size (2 for an empty one)
        self._remove(7 * len(items) - offsets.count(b")"))
        # (a slot holds one value for good: a reference's string is looked up once)
        fqns = cached(self.refs, fqn_ref, self._string_at)
        paths = cached(self.refs, path_ref, self._string_at)
        self._add_storage_run(fqns, offsets, paths, starts, lengths)

    def _add_storage_run(
        self, fqns: list, offsets: tuple, paths: list, starts: tuple, lengths: tuple
    ) -> None:
        """A run of storage entries, its records spilled: names and offsets by number,
        starts and lengths from their bytes."""
        out = self.out
        records = np.empty(len(fqns), STORAGE)
        records["fqn"] = out.names.ids_of(fqns)
        records["path"] = out.names.ids_of(paths)
        records["key"] = out.tuples.ids_of(self._tuples(offsets))
        records["start"] = ints(starts)
        records["length"] = self._lengths(lengths)
        self.runs.append(StorageRun(out.storage.append(records), len(fqns)))

    def _string_at(self, raw: bytes) -> str:
        """The string a BINGET / LONG_BINGET names (defined before it)."""
        text = self.strings.get(_ref(raw))
        if text is None:
            raise NotRegular  # a reference to something that is not a string
        return text

    def _lengths(self, raw: tuple[bytes, ...]) -> list[int]:
        return cached(self.numbers, raw, int_value)

    def _take_storage(self, columns: list[tuple[bytes, ...]]) -> None:
        """Storage entries with new names, each group of the entry pattern a column."""
        fqn_ref, fqn_len, fqn_new, offsets, path_ref, path_len, path_new, starts, lengths = columns
        new_fqn = list(map(bool, fqn_len))
        new_path = list(map(bool, path_len))
        size_slots = list(map(operator.sub, repeat(3), map(b")".__eq__, offsets)))
        counts = map(
            operator.add,
            map(operator.add, new_fqn, size_slots),
            map(operator.add, new_path, repeat(4)),
        )
        bases = list(itertools.accumulate(counts, initial=self.slots))
        self._remove(bases[-1] - self.slots)
        del bases[-1]
        # where each entry's fqn and path strings are (their new slot, or named before)
        fqn_at = list(map(operator.add, bases, repeat(2)))
        path_at = list(
            map(
                operator.add,
                map(operator.add, fqn_at, new_fqn),
                map(operator.add, size_slots, repeat(2)),
            )
        )
        # every new string of the run registered before any reference is looked up (an
        # entry may name a string an earlier one brought, in either column)
        fqns = self._new_names(fqn_len, fqn_new, new_fqn, fqn_at)
        paths = self._new_names(path_len, path_new, new_path, path_at)
        self._named(fqns, fqn_ref, new_fqn, fqn_at)
        self._named(paths, path_ref, new_path, path_at)
        self._add_storage_run(fqns, offsets, paths, starts, lengths)

    def _new_names(
        self, lens: tuple[bytes, ...], texts: tuple[bytes, ...], new: list[bool], at: list[int]
    ) -> list[Any]:
        """Each entry's name where it is a new string (its slot ``at`` registered here),
        None where it names one (see :meth:`_named`)."""
        names: list[Any] = [None] * len(new)
        if any(new):
            kept_lens = list(itertools.compress(lens, new))
            kept = list(itertools.compress(texts, new))
            if list(map(ord, kept_lens)) != list(map(len, kept)):
                raise NotRegular  # (the lazy match took another length: not this string)
            decoded = self.names
            if len(decoded) > MAX_CACHED:
                decoded.clear()
            for raw in set(kept).difference(decoded):
                decoded[raw] = raw.decode("utf-8", "surrogatepass")
            new_texts = list(map(decoded.__getitem__, kept))
            self.strings.add(itertools.compress(at, new), new_texts)
            where = itertools.compress(range(len(new)), new)
            collections.deque(map(names.__setitem__, where, new_texts), maxlen=0)
        return names

    def _named(
        self, names: list[Any], refs: tuple[bytes, ...], new: list[bool], at: list[int]
    ) -> None:
        """Fill in the names the entries name (``refs``): strings that come before."""
        if all(new):
            return
        old = list(map(operator.not_, new))
        by_ref = tuple(itertools.compress(refs, old))
        if not all(map(operator.lt, _refs(by_ref), itertools.compress(at, old))):
            raise NotRegular  # names what comes later
        named = cached(self.refs, by_ref, self._string_at)  # (a slot's string for good)
        where = itertools.compress(range(len(new)), old)
        collections.deque(map(names.__setitem__, where, named), maxlen=0)


class _StringSlots:
    """The memo slots that hold strings, and their strings: those of the skeleton and
    those named again kept; of the runs' other new strings only the last
    ``RECENT_STRINGS``. (Every rank's storage entries name their tensors with string
    objects of their own, pickled afresh, never named again: a 2048-rank ``.metadata``
    has millions; a data file's name, named by every later entry of its rank, is kept
    once named.) A reference to a string no longer held is no file this reader
    vouches for."""

    def __init__(self) -> None:
        self._kept: dict[int, str] = {}
        self._recent: dict[int, str] = {}  # (in the order added: the oldest first)

    def keep(self, slot: int, text: str) -> None:
        self._kept[slot] = text

    def add(self, slots: Iterable[int], texts: list[str]) -> None:
        recent = self._recent
        recent.update(zip(slots, texts, strict=True))
        if len(recent) > RECENT_STRINGS:
            for slot in list(itertools.islice(recent, len(recent) - RECENT_STRINGS)):
                del recent[slot]

    def get(self, slot: int) -> str | None:
        text = self._kept.get(slot)
        if text is None:
            text = self._recent.pop(slot, None)
            if text is not None:
                self._kept[slot] = text  # named again: it may be named more
        return text


_CHUNK_KINDS = (CHUNK_CLASS, ("S", "offsets"), SIZE_CLASS, ("S", "sizes"), SIZE_CLASS)
_STORAGE_KINDS = (
    INDEX_CLASS,
    ("S", "fqn"),
    ("S", "index"),
    ("S", "offset"),
    SIZE_CLASS,
    INFO_CLASS,
    ("S", "relative_path"),
    ("S", "offset"),
    ("S", "length"),
)


def _allowed(module: str, name: str) -> bool:
    from ...dtypes import DTYPES

    if module == METADATA_MODULE:
        return name in _METADATA_NAMES
    return (module, name) in _NAMED or (module == "torch" and name in DTYPES)


def _ref(raw: bytes) -> int:
    return int.from_bytes(raw, "little") >> 8  # (BINGET or LONG_BINGET: one opcode byte)


def _refs(raws: Iterable[bytes]) -> map:
    """Memo slots of BINGET / LONG_BINGET opcodes (0 for b'')."""
    return map(operator.rshift, map(FROM_BYTES, raws, repeat("little")), repeat(8))


def _numbers(raw: bytes) -> tuple[int, ...]:
    """The ints of a torch.Size's tuple as ``_TUPLE`` matched it."""
    if raw == b")":
        return ()
    return int_opcodes(raw[1:-2] if raw[:1] == b"(" else raw[:-2])
