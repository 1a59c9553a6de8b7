"""A ShardedTensor rank file's pickle parsed at the opcode level: every rank's shard
metadata as records, not objects.

FSDP's ``SHARDED_STATE_DICT`` saved per rank (Composer's legacy sharded checkpoints)
holds ShardedTensors whose metadata names every rank's shard: one rank's ``data.pkl``
holds ranks x tensors ``ShardMetadata`` objects (at 256 ranks of a 70B shape, 555 K,
over 100 MB of pickle). Unpickled, each is an object, its state dict, two lists, a
``_remote_device`` and its state, a ``torch.device``, all kept by the unpickler's memo
until the end: about 1.5 KB each, 883 MiB for that one file. torch.save (protocol 2,
its default) writes each the same way, opcode for opcode::

    BINGET <ShardMetadata> EMPTY_TUPLE NEWOBJ PUT NONE EMPTY_DICT PUT MARK
      BINGET 'shard_offsets' EMPTY_LIST PUT <its ints: none, INT APPEND, MARK INTs APPENDS>
      BINGET 'shard_sizes' EMPTY_LIST PUT <ints>
      BINGET 'placement' BINGET <_remote_device> EMPTY_TUPLE NEWOBJ PUT EMPTY_DICT PUT MARK
        BINGET '_worker_name' NONE BINGET '_rank' INT
        BINGET '_device' BINGET <torch.device> BINUNICODE 'cpu' PUT TUPLE1 PUT REDUCE PUT
          (or BINUNICODE 'cuda' PUT INT TUPLE2 ...: the device's index)
      SETITEMS BUILD SETITEMS TUPLE2 PUT BUILD

so a run of them in a list (``shards_metadata``) is matched by one compiled ``re``
pattern (in C), a bounded number at a time, and its numbers taken with ``findall``:
each entry a record of a spill (its offsets and sizes numbered, its rank), the run one
token in a *skeleton* pickle. Everything else is walked opcode by opcode in Python
(a few hundred opcodes a tensor) and copied to that skeleton, which the restricted
unpickler reads as it reads any pickle: every global judged, every structure checked.
:meth:`Parsed.resolve` then puts each run where its token landed, in a ShardedTensor's
layout (:class:`~ckpttool.unpickler.LocalShards`).

The pickle is read a window at a time (never whole: a 2048-rank file's is GBs).

Safety is structural, as in :mod:`ckpttool.formats.skeleton.metadata_runs`: every byte is an
opcode walked here or an entry of a run; memo slots are numbered exactly as the
pickler numbers them (each ``PUT`` the next; an entry's ten checked to be those) and
the skeleton's renumbered past the runs; a run refers only to the three classes and six
key strings it must, by slots whose contents the walk knows, never to another object.
A ``GET`` of a run's object (a ShardingSpec's placements are the metadata's
``_remote_device`` objects) becomes a ``GET`` of a marker value, allowed as an element
of a list only. Tokens and the marker hold a nonce of this parse, and the walk refuses
bytes opcodes, so no value of the file can pass for one; a token used but as an
element of a list, a token not found in a ShardedTensor's layout afterwards or the
marker anywhere in the tree, any opcode a torch.save pickle does not hold: the file is
not this parser's, and it is read as any pickle (:func:`parse` gives None, or
:meth:`Parsed.resolve` False). The caller (:mod:`ckpttool.formats.torch_save.zip_pickle`) also
reads the file whole where the skeleton's read has anything to report.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...tree import walk
from ...unpickler import LocalShards
from ..records import Interned, Spill
from . import opcodes as ops
from .opcodes import INT, LIST, OP, OTHER, POP, POP_PUSH, PUSHES, TOKEN

SHARD_MODULE = "torch.distributed._shard.metadata"
# the globals of an entry, slot by slot of the pattern (see _entry), with its keys
_FIXED_KINDS = (
    ("G", SHARD_MODULE, "ShardMetadata"),
    ("S", "shard_offsets"),
    ("S", "shard_sizes"),
    ("S", "placement"),
    ("G", "torch.distributed.remote_device", "_remote_device"),
    ("S", "_worker_name"),
    ("S", "_rank"),
    ("S", "_device"),
    ("G", "torch", "device"),
)
# what a file must name (in its first bytes: its first ShardedTensor's local shard, a
# few KB in) for the walk to be worth its time; any other pickle costs one small read
MARKER = b"c" + SHARD_MODULE.encode() + b"\nShardMetadata\n"
MARKER_WITHIN = 64 << 10

# a rank's record: its offsets and sizes (numbered by ``Parsed.tuples``), its rank
SHARD = np.dtype([("offsets", "<i4"), ("sizes", "<i4"), ("rank", "<i8")])

WINDOW = 4 << 20  # bytes of the pickle read at a time
MAX_STRING = 1 << 20  # a BINUNICODE of the skeleton (and the margin a window keeps)
MAX_KEY = 64  # a string's memo slot is known by its text up to this long (keys are short)
MAX_GLOBAL = 512  # a GLOBAL's "module\nname\n"
MARGIN = MAX_STRING + (64 << 10)  # an opcode or a run's entry fits in this much
MAX_STEPS = 50_000_000  # skeleton opcodes walked, at most
MAX_PATTERNS = 16  # distinct sets of fixed slots runs are compiled for
RUN_ENTRIES = 4096  # entries a run's match takes at a time (a run may be many)
ENTRY_SLOTS = 10  # memo slots an entry fills

# a list of ints' body: none, one (APPEND) or 2 to 64 (MARK ... APPENDS)
_LIST_BODY = rb"|" + INT + rb"a|\((?:" + INT + rb"){2,64}e"
# a placement's device: torch.device's type (BINUNICODE, "cpu", "cuda"...), its PUT, and
# TUPLE1 or its index and TUPLE2 (``torch.device("cuda", 3)``)
_DEVICE = rb"X(?:" + b"|".join(b"%c\\x00\\x00\\x00[a-z]{%d}" % (n, n) for n in range(2, 9)) + rb")"
_DEVICE_ARGS = rb"(?:\x85|" + INT + rb"\x86)"
# an entry's groups: the PUTs are these (the rest: offsets, sizes, rank)
_PUT_GROUPS = (0, 1, 2, 4, 6, 7, 9, 10, 11, 12)
_OFFSETS, _SIZES, _RANK = 3, 5, 8


def _entry(get: Callable[[int], bytes], cap: bytes) -> bytes:
    """A ShardMetadata as torch.save pickles it (see the module); ``get(i)`` matches a
    reference to its i-th fixed slot, ``cap`` opens each group (PUT slots as the
    pickler writes them past slot 255: a run lies past the first entries; the lists'
    bodies; the rank)."""
    put = rb"r" + cap + rb"....)"
    lst = rb"\]" + put + cap + _LIST_BODY + rb")"
    return (
        get(0) + rb"\)\x81" + put + rb"N\}" + put + rb"\("
        + get(1) + lst + get(2) + lst
        + get(3) + get(4) + rb"\)\x81" + put + rb"\}" + put + rb"\("
        + get(5) + rb"N" + get(6) + cap + INT + rb")"
        + get(7) + get(8) + _DEVICE + put + _DEVICE_ARGS + put + rb"R" + put
        + rb"ub" + rb"u\x86" + put + rb"b"
    )  # fmt: skip


def _ref_of(slot: int) -> bytes:
    long = re.escape(b"j" + slot.to_bytes(4, "little"))
    if slot < 256:
        return rb"(?:" + re.escape(b"h" + bytes([slot])) + rb"|" + long + rb")"
    return long


_PROBE = re.compile(_entry(lambda i: b"(?P<s%d>h.|j....)" % i, rb"(?:"), re.DOTALL)


@dataclass
class _Patterns:
    run: re.Pattern[bytes]  # up to RUN_ENTRIES entries
    entry: re.Pattern[bytes]


def _compile(slots: tuple[int, ...]) -> _Patterns:
    def get(i: int) -> bytes:
        return _ref_of(slots[i])

    return _Patterns(
        re.compile(rb"(?:" + _entry(get, rb"(?:") + rb"){1,%d}+" % RUN_ENTRIES, re.DOTALL),
        re.compile(_entry(get, rb"("), re.DOTALL),
    )


@dataclass
class ShardRun:
    """Consecutive ShardMetadata of one list: ``count`` records of :data:`SHARD` at
    ``at`` of ``spill``, their offsets and sizes numbered by ``tuples``."""

    spill: Spill
    at: int
    count: int
    tuples: list[tuple[int, ...]]

    def records(self) -> np.ndarray:
        return self.spill.records(SHARD, self.at, self.count)


@dataclass
class Parsed:
    """A pickle split: the skeleton and the runs its tokens stand for.

    A token is a bytes value no torch.save pickle holds (the walk refuses bytes opcodes;
    a value of ``_codecs.encode`` cannot guess the nonce): ``token(n)`` stands for run
    n, :attr:`marker` for a run's object named again (the skeleton's first memo slot)."""

    skeleton: bytes
    nonce: bytes = field(default_factory=lambda: secrets.token_bytes(8))
    runs: list[ShardRun] = field(default_factory=list)
    spill: Spill = field(default_factory=Spill)
    tuples: Interned[tuple[int, ...]] = field(default_factory=Interned)

    @property
    def marker(self) -> bytes:
        return b"ckpttool-named:" + self.nonce

    def token(self, run: int) -> bytes:
        return b"ckpttool-run:" + self.nonce + run.to_bytes(8, "little")

    def resolve(self, root: Any) -> bool:
        """Put each run where its token is: in a ShardedTensor's layout. False where a
        token is elsewhere or twice, or the marker (a run's object named again) is in
        the tree: the file is then read as a whole. (A ShardingSpec, where the marker
        stands in a real file, is not kept in the tree.)"""
        runs = {self.token(n): run for n, run in enumerate(self.runs)}
        placed = 0
        for _, value in walk(root):
            if type(value) is bytes and value.startswith(b"ckpttool-"):
                return False
            if isinstance(value, LocalShards) and value.kind == "sharded_tensor" and value.layout:
                layout = value.layout
                for i, item in enumerate(layout):
                    if type(item) is bytes:
                        run = runs.pop(item, None)
                        if run is None:
                            return False
                        layout[i] = run
                        placed += 1
        return placed == len(self.runs)


Read = Callable[[int], bytes]


def parse(read: Read, records: bool = True) -> Parsed | None:
    """The skeleton and runs of the pickle ``read(n)`` gives (n bytes at a time, fewer at
    its end), or None: not a pickle this parser vouches for (no ShardMetadata named at
    its start, no run in it, or any irregularity: the readers after it read it).
    Without ``records`` the runs are checked but their numbers not kept (a scan of the
    file's globals needs the skeleton only)."""
    try:
        first = read(MARKER_WITHIN)
        if first[:2] != b"\x80\x02" or MARKER not in first:
            return None
        if len(first) == MARKER_WITHIN:
            first += read(WINDOW - MARKER_WITHIN)
        parsed = _Walker(read, first, records).parse()
    except (ops.NotRegular, IndexError, KeyError, ValueError, UnicodeDecodeError, OverflowError):
        return None
    return parsed if parsed.runs else None


_RUN_REF = ("T", "ref")  # an object of a run, named again
_INT_WIDTH = {OP["BININT1"]: 1, OP["BININT2"]: 2, OP["BININT"]: 4, OP["BINFLOAT"]: 8}
_POP_PUSH = {**POP_PUSH, OP["BINPERSID"]: 1}  # (a rank file's storages: persistent ids)
_REF = re.compile(rb"h(.)|j(....)", re.DOTALL)  # a GET


class _Walker:
    def __init__(self, read: Read, first: bytes, records: bool):
        self.read = read
        self.records = records
        self.data, self.pos, self.copied = first, 2, 2  # (after PROTO 2)
        self.eof = len(first) < WINDOW
        self.parsed = Parsed(b"")
        # PROTO, the marker in slot 0 (POP: off the stack), the rest renumbered past it
        marker = self.parsed.marker
        self.out = bytearray(first[:2] + b"C" + bytes([len(marker)]) + marker + b"q\x000")
        self.stack: list[tuple] = []
        self.marks: list[int] = []
        self.kinds: dict[int, tuple] = {}  # the skeleton's slots that hold a global or string
        self.slots = 0  # memo slots so far, the runs' included
        self.removed_at: list[int] = []  # first slot of each run
        self.removed_end: list[int] = []  # the slot after its last
        self.removed_before: list[int] = []  # slots of the runs up to and with it
        self.removed = 0
        self.patterns: dict[tuple[int, ...], _Patterns] = {}
        self.lists: dict[bytes, tuple[int, ...]] = {}  # a list's bytes -> its ints
        self.ints: dict[bytes, int] = {}  # an int opcode -> its number

    def parse(self) -> Parsed:
        steps = 0
        refill_at = len(self.data) - MARGIN if not self.eof else len(self.data)
        while True:
            if self.pos > refill_at:
                self._refill()
                refill_at = len(self.data) - MARGIN if not self.eof else len(self.data)
            steps += 1
            if steps > MAX_STEPS:
                raise ops.NotRegular
            op = self.data[self.pos]
            if (op == 0x68 or op == 0x6A) and self.marks and self._run():
                continue
            if self._step(op):
                if self.pos != len(self.data) or not self.eof and self.read(1):
                    raise ops.NotRegular  # (STOP ends data.pkl)
                self._copy_to(self.pos)
                self.parsed.skeleton = bytes(self.out)
                return self.parsed

    def _refill(self) -> None:
        self._copy_to(self.pos)
        more = self.read(WINDOW)
        self.eof = len(more) < WINDOW
        self.data = self.data[self.pos :] + more
        self.pos = self.copied = 0

    def _copy_to(self, pos: int) -> None:
        if pos > self.copied:
            self.out += self.data[self.copied : pos]
        self.copied = pos

    def _pop(self, n: int) -> None:
        stack = self.stack
        if len(stack) - (self.marks[-1] if self.marks else 0) < n:
            raise ops.NotRegular
        if any(kind[0] == "T" for kind in stack[len(stack) - n :]):
            raise ops.NotRegular  # a run's objects used one by one: not a plain list
        del stack[len(stack) - n :]

    def _arg(self, n: int) -> int:
        end = self.pos + 1 + n
        if end > len(self.data):
            raise ops.NotRegular
        return end

    def _memo_op(self, op: int, slot: int, end: int) -> int:
        """A PUT (the next slot, as the pickler numbers them) or a GET (of a slot of the
        skeleton), renumbered past the runs' slots; where the walk goes on."""
        if self.pos > self.copied:
            self.out += self.data[self.copied : self.pos]
        if op == 0x71 or op == 0x72:  # BINPUT, LONG_BINPUT
            if slot != self.slots or not self.stack or self.stack[-1][0] == "T":
                raise ops.NotRegular
            top = self.stack[-1]
            if top[0] == "G" or top[0] == "S" and len(top[1]) <= MAX_KEY:
                self.kinds[slot] = top
            self.slots += 1
            new, code = slot - self.removed + 1, (b"q", b"r")
        else:
            if slot >= self.slots:
                raise ops.NotRegular
            i = bisect.bisect_right(self.removed_at, slot)
            if i and slot < self.removed_end[i - 1]:
                self.copied = self.pos
                # a run's object named again: the ShardingSpec's placements are the
                # metadata's _remote_device objects. The marker stands for it, as an
                # element of a list only (ckpttool keeps no ShardingSpec: Parsed.resolve
                # refuses a marker in the tree); the GETs of those that follow, at once
                return self._run_refs(self.pos)
            new, code = slot - (self.removed_before[i - 1] if i else 0) + 1, (b"h", b"j")
            self.stack.append(self.kinds.get(slot, OTHER))
        self.out += code[0] + bytes([new]) if new < 256 else code[1] + new.to_bytes(4, "little")
        self.copied = end
        return end

    def _run_refs(self, pos: int) -> int:
        """Where the GETs from ``pos`` on that name objects of runs end (the first does),
        each copied as a GET of the marker."""
        data, at, end, match = self.data, self.removed_at, self.removed_end, _REF.match
        count = 0
        while (ref := match(data, pos)) is not None:
            slot = int.from_bytes(ref.group(1) or ref.group(2), "little")
            i = bisect.bisect_right(at, slot)
            if not i or slot >= end[i - 1]:
                break
            count += 1
            pos = ref.end()
        self.stack.extend(itertools.repeat(_RUN_REF, count))
        self.out += b"h\x00" * count
        self.copied = pos
        return pos

    def _step(self, op: int) -> bool:
        """Walk the opcode at ``pos``; True at STOP."""
        data, stack = self.data, self.stack
        end = self.pos + 1
        if op == 0x72 or op == 0x6A:  # LONG_BINPUT, LONG_BINGET (the commonest)
            end = self._arg(4)
            end = self._memo_op(op, int.from_bytes(data[self.pos + 1 : end], "little"), end)
        elif op == 0x71 or op == 0x68:  # BINPUT, BINGET
            end = self._memo_op(op, data[self.pos + 1], self._arg(1))
        elif op in PUSHES:
            stack.append(PUSHES[op])
        elif op in _INT_WIDTH:
            end = self._arg(_INT_WIDTH[op])
            stack.append(OTHER)
        elif op == 0x8A:  # LONG1
            end = self._arg(data[self._arg(1) - 1] + 1)
            stack.append(OTHER)
        elif op == 0x58:  # BINUNICODE
            n = int.from_bytes(data[self.pos + 1 : self._arg(4)], "little")
            if n > MAX_STRING:
                raise ops.NotRegular
            end = self._arg(4 + n)
            stack.append(("S", data[end - n : end].decode("utf-8", "surrogatepass")))
        elif op == 0x63:  # GLOBAL: "module\nname\n"
            first = data.index(b"\n", self.pos + 1, self.pos + MAX_GLOBAL)
            second = data.index(b"\n", first + 1, self.pos + MAX_GLOBAL)
            module = data[self.pos + 1 : first].decode("utf-8")
            stack.append(("G", module, data[first + 1 : second].decode("utf-8")))
            end = second + 1
        elif op == 0x28:  # MARK
            self.marks.append(len(stack))
        elif op in _POP_PUSH:
            self._pop(_POP_PUSH[op])
            stack.append(OTHER)
        elif op == 0x61 and stack and stack[-1] == _RUN_REF:  # APPEND of a run's object
            stack.pop()
            if len(stack) - (self.marks[-1] if self.marks else 0) < 1 or stack[-1] != LIST:
                raise ops.NotRegular
        elif op in POP:
            self._pop(POP[op])
            if len(stack) - (self.marks[-1] if self.marks else 0) < 1 or stack[-1][0] == "T":
                raise ops.NotRegular
        elif op == 0x74 or op == 0x75 or op == 0x65:  # TUPLE, SETITEMS, APPENDS
            if not self.marks:
                raise ops.NotRegular
            start = self.marks.pop()
            runs = any(kind[0] == "T" for kind in stack[start:])
            count = len(stack) - start
            del stack[start:]
            if runs and op != 0x65 or op == 0x75 and count % 2:
                raise ops.NotRegular  # (a run is an element of a list, nothing else)
            if op == 0x74:
                stack.append(OTHER)
            elif len(stack) <= (self.marks[-1] if self.marks else 0) or stack[-1][0] == "T":
                raise ops.NotRegular
            elif runs and stack[-1] != LIST:
                raise ops.NotRegular
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or self.marks:
                raise ops.NotRegular
            self.pos = end
            return True
        else:  # anything else (bytes opcodes among them): not a torch.save pickle's
            raise ops.NotRegular
        self.pos = end
        return False

    def _run(self) -> bool:
        """A run of ShardMetadata in a list at ``pos``: matched, taken, replaced by a
        token. False: none here."""
        data, pos, stack = self.data, self.pos, self.stack
        below = self.marks[-1] - 1
        if below < 0 or stack[below] != LIST:
            return False
        width = 5 if data[pos] == 0x6A else 2
        if self.kinds.get(int.from_bytes(data[pos + 1 : pos + width], "little")) != _FIXED_KINDS[0]:
            return False
        m = _PROBE.match(data, pos)
        if m is None:
            return False
        fixed = tuple(
            int.from_bytes(m.group(f"s{i}"), "little") >> 8 for i in range(len(_FIXED_KINDS))
        )
        if any(slot >= self.slots for slot in fixed):
            raise ops.NotRegular
        if tuple(map(self.kinds.get, fixed)) != _FIXED_KINDS:
            return False
        patterns = self.patterns.get(fixed)
        if patterns is None:
            if len(self.patterns) >= MAX_PATTERNS:
                raise ops.NotRegular
            patterns = self.patterns[fixed] = _compile(fixed)
        run = patterns.run.match(data, pos)
        if run is None:  # (the probe matched one entry)
            raise ops.NotRegular
        found = patterns.entry.findall(data, pos, run.end())
        self._take(found)
        # the run ends with the last entry found (its last PUT, BUILD): the entries tile it
        if data[run.end() - 6 : run.end()] != b"r" + (self.slots - 1).to_bytes(4, "little") + b"b":
            raise ops.NotRegular
        self._copy_to(pos)
        run_token = self.parsed.token(len(self.parsed.runs) - 1)
        self.out += b"C" + bytes([len(run_token)]) + run_token
        stack.append(TOKEN)
        self.copied = self.pos = run.end()
        return True

    def _take(self, found: list[tuple[bytes, ...]]) -> None:
        """The entries of a run: their slots checked to be the next ones, their numbers
        recorded."""
        n = len(found)
        puts = b"".join(
            itertools.chain.from_iterable(map(operator.itemgetter(*_PUT_GROUPS), found))
        )
        expected = np.arange(self.slots, self.slots + ENTRY_SLOTS * n, dtype="<u4")
        if len(puts) != 4 * ENTRY_SLOTS * n or not np.array_equal(
            np.frombuffer(puts, "<u4"), expected
        ):
            raise ops.NotRegular
        parsed = self.parsed
        at = -1
        if self.records:
            columns = list(zip(*found, strict=True))
            records = np.empty(n, SHARD)
            lists = self.lists
            records["offsets"] = parsed.tuples.ids_of(
                ops.cached(lists, columns[_OFFSETS], _list_ints)
            )
            records["sizes"] = parsed.tuples.ids_of(ops.cached(lists, columns[_SIZES], _list_ints))
            records["rank"] = ops.cached(self.ints, columns[_RANK], ops.int_value)
            at = parsed.spill.append(records)
        parsed.runs.append(ShardRun(parsed.spill, at, n, parsed.tuples.values))
        self.removed_at.append(self.slots)
        self.slots += ENTRY_SLOTS * n
        self.removed_end.append(self.slots)
        self.removed += ENTRY_SLOTS * n
        self.removed_before.append(self.removed)


def _list_ints(raw: bytes) -> tuple[int, ...]:
    """The ints of a list as ``_LIST_BODY`` matched it."""
    if not raw:
        return ()
    return ops.int_opcodes(raw[1:-1] if raw[:1] == b"(" else raw[:-1])
