"""What both scale readers of pickles share: DCP's ``.metadata`` (:mod:`.metadata_runs`) and
ShardedTensor rank files (:mod:`.shard_runs`) walk a pickle's skeleton opcode by
opcode and match its long runs of regular entries as regex steps.

One floor below both (no family imports the other's): the opcodes by name, taken from
CPython's own table (``pickletools.opcodes``, the declarative one every reader of the
format derives from) and checked against it when this module is imported; the regex of
an int opcode the runs match and the numbers read back from it; the cache of the runs'
values; the signal that a file is not one the fast paths vouch for.
"""

from __future__ import annotations

import itertools
import operator
import pickletools
from collections.abc import Callable
from itertools import repeat

# opcode name -> its byte, from CPython's table
OP: dict[str, int] = {op.name: op.code.encode("latin-1")[0] for op in pickletools.opcodes}
# the opcodes the walkers test by byte (commented with their names there): each is the
# byte of that name, or importing this module fails
WALKED = {
    "BININT1": 0x4B, "BININT2": 0x4D, "BININT": 0x4A, "BINFLOAT": 0x47, "LONG1": 0x8A,
    "EMPTY_DICT": 0x7D, "EMPTY_LIST": 0x5D, "EMPTY_TUPLE": 0x29, "NONE": 0x4E,
    "NEWTRUE": 0x88, "NEWFALSE": 0x89, "TUPLE1": 0x85, "TUPLE2": 0x86, "TUPLE3": 0x87,
    "NEWOBJ": 0x81, "REDUCE": 0x52, "BINPERSID": 0x51, "BUILD": 0x62, "SETITEM": 0x73,
    "APPEND": 0x61, "MEMOIZE": 0x94, "BINGET": 0x68, "LONG_BINGET": 0x6A,
    "SHORT_BINUNICODE": 0x8C, "BINUNICODE": 0x58, "MARK": 0x28, "TUPLE": 0x74,
    "SETITEMS": 0x75, "APPENDS": 0x65, "STACK_GLOBAL": 0x93, "STOP": 0x2E, "PROTO": 0x80,
    "FRAME": 0x95, "BINPUT": 0x71, "LONG_BINPUT": 0x72, "SHORT_BINBYTES": 0x43,
    "BINUNICODE8": 0x8D, "GLOBAL": 0x63,
}  # fmt: skip
_drift = {name: byte for name, byte in WALKED.items() if OP.get(name) != byte}
if _drift:  # (never, unless pickle's own table changed: the walkers would misread)
    raise ImportError(f"opcodes differ from pickletools': {_drift}")

MAX_CACHED = 1 << 16  # distinct bytes a cache of the runs' values keeps (see cached)

# a non-negative int opcode as the pickler writes it (BININT1, BININT2, BININT, LONG1 of
# 5 to 8 bytes), its shortest form only: what ``int_value`` reads back
INT = (
    rb"(?:K.|M.[\x01-\xff]|J..(?:[\x01-\xff][\x00-\x7f]|\x00[\x01-\x7f])"
    rb"|\x8a(?:\x05...|\x06....|\x07.....|\x08......)(?:[\x80-\xff]\x00|.[\x01-\x7f]))"
)
INT_WIDTH = {OP["BININT1"]: 1, OP["BININT2"]: 2, OP["BININT"]: 4}


# what a skeleton walk keeps of a value: ("S", str), ("G", module, name), and these
LIST, DICT, OTHER, TOKEN = ("L",), ("D",), ("O",), ("T",)
# the walkers' stack effects of the opcodes that push one value, pop n and push one, or
# pop n with the target left (BUILD, SETITEM, APPEND)
PUSHES = {OP["EMPTY_DICT"]: DICT, OP["EMPTY_LIST"]: LIST, OP["EMPTY_TUPLE"]: OTHER,
          OP["NONE"]: OTHER, OP["NEWTRUE"]: OTHER, OP["NEWFALSE"]: OTHER}  # fmt: skip
POP_PUSH = {OP["TUPLE1"]: 1, OP["TUPLE2"]: 2, OP["TUPLE3"]: 3, OP["NEWOBJ"]: 2, OP["REDUCE"]: 2}
POP = {OP["BUILD"]: 1, OP["SETITEM"]: 2, OP["APPEND"]: 1}


class NotRegular(Exception):
    """Not a file this parser vouches for: the readers after it read it."""


def cached(cache: dict, raw: tuple[bytes, ...] | list[bytes], make: Callable) -> list:
    """``make(r)`` of each of ``raw``, made once per distinct bytes (equal ones shared;
    the cache is emptied past ``MAX_CACHED`` entries: it may not grow with the file)."""
    got = list(map(cache.get, raw))
    if None in got:
        missing = set(itertools.compress(raw, map(operator.is_, got, repeat(None))))
        if len(cache) > MAX_CACHED:
            cache.clear()
            missing = set(raw)
        for new in missing:
            cache[new] = make(new)
        got = list(map(cache.__getitem__, raw))
    return got


FROM_BYTES: Callable[[bytes, str], int] = int.from_bytes  # type: ignore[assignment]


# how far to shift an int opcode read whole to get its number, by its length: BININT1,
# BININT2, BININT (one opcode byte), LONG1 (two)
_SHIFT = (0, 0, 8, 8, 0, 8, 0, 16, 16, 16, 16)


def ints(raws: tuple[bytes, ...] | list[bytes]) -> list[int]:
    """The numbers of int opcodes (validated by ``INT``: non-negative)."""
    return list(
        map(
            operator.rshift,
            map(FROM_BYTES, raws, repeat("little")),
            map(_SHIFT.__getitem__, map(len, raws)),
        )
    )


def int_value(raw: bytes) -> int:
    return ints([raw])[0]


def int_opcodes(body: bytes) -> tuple[int, ...]:
    """The numbers of consecutive int opcodes as ``INT`` matches them."""
    out, pos = [], 0
    while pos < len(body):
        op = body[pos]
        if op == OP["LONG1"]:
            n = body[pos + 1]
            out.append(int.from_bytes(body[pos + 2 : pos + 2 + n], "little"))
            pos += 2 + n
        else:
            n = INT_WIDTH[op]
            out.append(int.from_bytes(body[pos + 1 : pos + 1 + n], "little"))
            pos += 1 + n
    return tuple(out)
