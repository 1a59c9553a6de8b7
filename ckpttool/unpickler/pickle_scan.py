"""A static walk over a pickle's opcodes: every global it names and how it uses it.

Nothing is built and nothing is imported: each opcode is parsed (``pickletools``'s
table says what it takes and what it leaves on the stack) and only what a verdict
needs is kept: the strings on the stack (protocol 4 names a global by two of them,
``STACK_GLOBAL``), the memo, and for every other value the globals it came from. Any
protocol, 0 to 5, is walked the same way, text opcodes included (``GLOBAL``, ``INST``,
``PERSID``, protocol-0 strings).

The restricted unpickler (:mod:`ckpttool.unpickler`) is the verdict of a read; this
walk is the verdict where that read cannot give one: a file that is not a checkpoint
(is it a pickle at all? what would ``torch.load`` run?), and a read that stopped on an
error before it met every global (``Opaque.__setstate__`` given a module, a persistent
id it could not resolve): a dangerous global after that point is still named.

Every size, count and index is the file's: lengths are checked against the bytes that
are there before anything is sliced, the memo holds at most one entry per opcode, and
a value remembers at most :data:`MAX_NAMES_PER_VALUE` globals, so the walk costs time
and memory in proportion to the pickle's size.
"""

from __future__ import annotations

import codecs
import pickletools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..guard import BUILD_ON_GLOBAL, CLASS_SWAP, CONSTRUCTED, MUTATED

# What a pickle may do with a global, strongest first (the reason shown for it).
CALLED = "called"
INSTANTIATED = CONSTRUCTED  # NEWOBJ, NEWOBJ_EX
BUILD_TARGET = BUILD_ON_GLOBAL
BUILD_SET = "BUILD-set"
HANDED = "handed to"
PERSISTENT = "handed to persistent_load"
# getattr(X, "Name") of a global X and a constant name: the policy judges each
# (``Uses.getattrs``); ShardedTensor pickles getattr(ShardedTensor, "ProcessGroupState")
NESTED_GETATTR = "called on a global and a name"
REFERENCED = "referenced"
_RANK = {
    CALLED: 0,
    INSTANTIATED: 1,
    BUILD_TARGET: 2,
    MUTATED: 2,
    CLASS_SWAP: 2,
    HANDED: 3,  # (before BUILD-set: what a call was handed stays known as such)
    BUILD_SET: 4,
    NESTED_GETATTR: 5,
    PERSISTENT: 6,
    REFERENCED: 7,
}
_GETATTR = frozenset({"builtins.getattr"})

# A global whose name the walk cannot know: STACK_GLOBAL of values computed while
# unpickling (a REDUCE's result), or an extension code (EXT1/2/4) that the real
# unpickler looks up in ``copyreg``'s registry. No checkpoint does either.
COMPUTED_NAME = "<a global named by a value computed while unpickling>"
EXTENSION_NAME = "<a global named by a copyreg extension code>"
# What the walk refuses that is no global: a REDUCE of an object (a partial, a method
# reached by getattr) rather than of a global, and a BUILD state with a ``__class__`` or
# ``__dict__`` key (a class swap). Named as globals are, never importable.
OBJECT_CALLED = "<an object>()"
CLASS_SWAP_KEY = "<a __class__ or __dict__ key>"
_SWAP_KEYS = frozenset({"__class__", "__dict__"})
_SWAP: frozenset[str] = frozenset({CLASS_SWAP_KEY})

# A value keeps at most this many of the globals it came from (for the reasons only:
# every global is recorded where it is named).
MAX_NAMES_PER_VALUE = 8
# A string longer than this is no module or class name: kept as "a long string".
MAX_NAME_BYTES = 1024
HIGHEST_PROTOCOL = 5
# Distinct globals recorded by name; past this, each further one counts as unknown
# (a real checkpoint names a few dozen).
MAX_GLOBALS = 10_000


_Names = frozenset[str]
# None (plain data), str (a string constant), or (head, all, is the global itself):
# the globals a value is (a global, an object made by calling one) and all those it is
# or holds
_Value = object
Resolve = Callable[[str, str], tuple[str, str]]


@dataclass
class Uses:
    """What the walk found: each global and the strongest use the pickle makes of it."""

    uses: dict[str, str] = field(default_factory=dict)  # full name -> reason
    parts: dict[str, tuple[str, str]] = field(default_factory=dict)  # full name -> (module, name)
    getattrs: set[tuple[str, str]] = field(default_factory=set)  # (global, name) of NESTED_GETATTR
    callers: dict[str, str] = field(default_factory=dict)  # for HANDED/BUILD_SET: to what
    complete: bool = False  # the walk reached STOP
    end: int = 0  # where it stopped: after STOP, at the error, or the end of the data
    error: str | None = None  # why it stopped before STOP (None: STOP, or data ran out)
    acts: bool = False  # an opcode that imports or calls came before any error
    truncated: bool = False  # the data ran out before STOP

    def note(self, names: frozenset[str], use: str, caller: frozenset[str] = frozenset()) -> None:
        for name in names:
            old = self.uses.get(name)
            if old is None or _RANK[use] < _RANK[old]:
                self.uses[name] = use
                if use in (HANDED, BUILD_SET) and caller:
                    self.callers[name] = ", ".join(sorted(caller)[:2])
                else:
                    self.callers.pop(name, None)

    def reason(self, name: str) -> str:
        """How the pickle uses ``name``, in words: ``called``, ``handed to x.Y``..."""
        use = self.uses.get(name, REFERENCED)
        caller = self.callers.get(name)
        if use == HANDED:
            return f"handed to {caller}" if caller else "handed to a call"
        if use == BUILD_SET:
            return f"BUILD-set on {caller}" if caller else "BUILD-set on an object"
        return use


def _cap(found: set[str]) -> frozenset[str]:
    if len(found) > MAX_NAMES_PER_VALUE:
        found = set(sorted(found)[:MAX_NAMES_PER_VALUE])
    return frozenset(found)


def _head(value: _Value) -> _Names:
    """The globals a value is (a global itself, an object of it, what calling it gave)."""
    return value[0] if isinstance(value, tuple) else _EMPTY


def _all(*values: _Value) -> _Names:
    """The globals values are or hold (a tuple of arguments holding a class)."""
    found: set[str] = set()
    for value in values:
        if isinstance(value, tuple):
            found.update(value[1])
    return _cap(found) if found else _EMPTY


def _sym(head: _Names, *held: _Value) -> _Value:
    """A value made from ``head`` (not the global itself) that holds what ``held`` are
    or hold."""
    inner = _all(*held)
    if not head and not inner:
        return None
    return (head, _cap(set(head) | set(inner)) if inner else head, False)


def _is_global(value: _Value) -> bool:
    """Whether a value is a global itself (GLOBAL, STACK_GLOBAL), not made from one."""
    return isinstance(value, tuple) and value[2]


_EMPTY: _Names = frozenset()


class _Stop(Exception):
    """The walk ends (an error, or the data ran out)."""


# How each opcode is walked (a kind, and what it needs), precomputed from pickletools.
(_PUSH, _STR, _GENERIC, _MARK_OP, _STOP, _GLOBAL, _INST, _STACK_GLOBAL, _REDUCE, _OBJ,
 _NEWOBJ, _NEWOBJ_EX, _BUILD, _EXT, _PERSID, _BINPERSID, _PUT, _MEMOIZE, _GET, _DUP,
 _PROTO, _SKIP, _NEXT_BUFFER, _POP, _APPEND, _SETITEM) = range(26)  # fmt: skip
_SPECIAL = {
    "MARK": _MARK_OP, "STOP": _STOP, "GLOBAL": _GLOBAL, "INST": _INST,
    "STACK_GLOBAL": _STACK_GLOBAL, "REDUCE": _REDUCE, "OBJ": _OBJ, "NEWOBJ": _NEWOBJ,
    "NEWOBJ_EX": _NEWOBJ_EX, "BUILD": _BUILD, "EXT1": _EXT, "EXT2": _EXT, "EXT4": _EXT,
    "PERSID": _PERSID, "BINPERSID": _BINPERSID, "PUT": _PUT, "BINPUT": _PUT,
    "LONG_BINPUT": _PUT, "MEMOIZE": _MEMOIZE, "GET": _GET, "BINGET": _GET,
    "LONG_BINGET": _GET, "DUP": _DUP, "PROTO": _PROTO, "FRAME": _SKIP,
    "NEXT_BUFFER": _NEXT_BUFFER,
    # where C's unpickler reads the stack its own way (see _walk)
    "POP": _POP, "APPEND": _APPEND, "SETITEM": _SETITEM,
}  # fmt: skip
_STRINGS = frozenset(
    "STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8".split()
)
# an argument: a fixed size (>= 0), a line (-1), or a length of 1, 4 (signed), 4 or 8 bytes
_LINE = -1
_LENGTH = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}
_ACTING = frozenset(
    {_GLOBAL, _STACK_GLOBAL, _INST, _OBJ, _REDUCE, _BUILD, _NEWOBJ, _NEWOBJ_EX, _PERSID}
    | {_BINPERSID, _EXT}
)


def _table() -> dict[int, tuple[int, str, int, tuple[int, bool] | None, bool, int, int]]:
    """opcode byte -> (kind, name, fixed size or _LINE, (length bytes, signed) or None,
    takes a mark, values taken besides the mark's, values left)."""
    table = {}
    for op in pickletools.opcodes:
        name = op.name
        kind = _SPECIAL.get(name)
        before = [s.name for s in op.stack_before]
        if kind is None:
            if name in _STRINGS:
                kind = _STR
            elif not before and len(op.stack_after) == 1:
                kind = _PUSH
            else:
                kind = _GENERIC
        n = op.arg.n if op.arg is not None else 0
        fixed, length = (n, None) if n >= 0 else (_LINE, None)
        if n in _LENGTH:
            fixed, length = 0, _LENGTH[n]
        mark = "mark" in before
        taken = before.index("mark") if mark else len(before)
        table[op.code.encode("latin-1")[0]] = (
            kind, name, fixed, length, mark, taken, len(op.stack_after)
        )  # fmt: skip
    return table


_OPS = _table()


def scan_pickle(
    data: bytes | bytearray | memoryview,
    resolve: Resolve | None = None,
    *,
    encoding: str = "utf-8",
    importable_only: bool = False,
) -> Uses:
    """Walk the one pickle at the start of ``data`` (up to its STOP).

    Args:
        data: The bytes; the walk stops at the first STOP, an error, or their end.
        resolve: ``(module, name) -> (module, name)``: the name the real unpickler would
            import (Python 2 names of protocols 0-2); as given when None.
        encoding: How protocol-0/1 byte strings become text (as ``torch.load``: utf-8).
        importable_only: Stop at a global no import can find (``import os`` in a Python
            file reads as INST of ``mport os``): where the real unpickler stops too. For
            telling a pickle from text; a verdict walks on and names it.

    Returns:
        Every global named and how; where and why the walk stopped.
    """
    out = Uses()
    raw = data if isinstance(data, bytes) else bytes(data)
    try:
        _walk(raw, out, resolve, encoding, importable_only)
    except _Stop as stop:
        out.error = None if out.truncated else str(stop)
    return out


def _walk(
    data: bytes, out: Uses, resolve: Resolve | None, encoding: str, importable_only: bool
) -> None:  # noqa: C901
    size = len(data)
    stack: list[_Value] = []
    marks: list[int] = []
    fence = 0
    memo: dict[int, _Value] = {}
    ops = _OPS
    pos = 0

    def ran_out(what: str) -> _Stop:
        out.truncated = True
        out.end = size
        return _Stop(what)

    def line() -> bytes:
        nonlocal pos
        end = data.find(b"\n", pos)
        if end < 0:
            raise ran_out("the data ends inside a line")
        chunk = data[pos:end]
        pos = end + 1
        return chunk

    def argument(fixed: int, length: tuple[int, bool] | None) -> tuple[int, int]:
        """(start, end) of an opcode's argument; ``pos`` moves past it."""
        nonlocal pos
        if length is not None:
            nbytes, signed = length
            if pos + nbytes > size:
                raise ran_out("the data ends inside an opcode")
            count = int.from_bytes(data[pos : pos + nbytes], "little", signed=signed)
            if count < 0:
                raise _Stop("negative length")
            pos += nbytes
        elif fixed == _LINE:
            start = pos
            line()
            return start, pos - 1
        else:
            count = fixed
        if pos + count > size:
            raise ran_out("the data ends inside an opcode")
        pos += count
        return pos - count, pos

    def pop() -> _Value:
        if len(stack) <= fence:
            raise _Stop("stack underflow")
        return stack.pop()

    def pop_mark() -> list[_Value]:
        nonlocal fence
        if not marks:
            raise _Stop("no MARK")
        at = marks.pop()
        fence = marks[-1] if marks else 0
        items = stack[at:]
        del stack[at:]
        return items

    def text(chunk: bytes) -> _Value:
        if len(chunk) > MAX_NAME_BYTES:
            return None
        try:
            return chunk.decode(encoding)
        except (UnicodeDecodeError, LookupError):
            return chunk.decode("latin-1")

    def global_name(module: object, name: object) -> _Value:
        if importable_only and not (_dotted(module) and _dotted(name)):
            raise _Stop("a global no import finds")
        if not (isinstance(module, str) and isinstance(name, str)):
            full = frozenset({COMPUTED_NAME})
        else:
            mod, qual = resolve(module, name) if resolve is not None else (module, name)
            key = f"{mod}.{qual}"
            full = frozenset({key})
            if key in out.parts or len(out.parts) < MAX_GLOBALS:
                out.parts[key] = (mod, qual)
            else:  # no pickle names this many: judged as one whose name is unknown
                full = frozenset({COMPUTED_NAME})
        out.note(full, REFERENCED)
        return (full, full, True)

    while True:
        if pos >= size:
            raise ran_out("the data ends before STOP")
        code = data[pos]
        entry = ops.get(code)
        if entry is None:
            out.end = pos
            raise _Stop(f"unknown opcode {code:#04x}")
        pos += 1
        kind, name, fixed, length, mark, taken, left = entry
        if kind == _PUSH:
            # (INT, LONG, FLOAT lines are not parsed: C's unpickler takes "0x10" and
            # more; the walk never stops where the real unpickler would go on)
            if fixed or length is not None:
                argument(fixed, length)
            stack.append(None)
            continue
        if kind == _GENERIC:
            items: list[_Value] = []
            if mark:
                items = pop_mark()
            if taken:
                # (APPENDS, SETITEMS, ADDITEMS: C takes the container below the MARK
                # whatever other marks say)
                if len(stack) - taken < (0 if mark else fence):
                    raise _Stop("stack underflow")
                below = stack[-taken:]
                if mark and _is_global(below[0]):  # a module-level object changed
                    out.note(_head(below[0]), MUTATED)
                items += below
                del stack[-taken:]
            if left:
                held = None
                for item in items:
                    if item is not None and type(item) is tuple:
                        held = _sym(_EMPTY, *items)
                        break
                if not _SWAP_KEYS.isdisjoint(i for i in items if type(i) is str):
                    held = _sym(_EMPTY, *items, (_EMPTY, _SWAP, False))
                if len(items) == 2 and _is_global(items[0]) and type(items[1]) is str:
                    # (X, "Name"): getattr's arguments, if it is called with them
                    target = next(iter(_head(items[0])))
                    held = (_EMPTY, _all(items[0]), False, (target, items[1]))
                stack.append(held)
            continue
        if kind == _STR:
            stack.append(_string(name, argument(fixed, length), data, text))
        elif kind == _MARK_OP:
            marks.append(len(stack))
            fence = len(stack)
        elif kind == _PUT or kind == _MEMOIZE:
            if kind == _MEMOIZE:
                index = len(memo)
            else:
                start, end = argument(fixed, length)
                index = _number(data[start:end], fixed)
            if len(stack) <= fence:
                raise _Stop("memo of an empty stack")
            memo[index] = stack[-1]
        elif kind == _GET:
            start, end = argument(fixed, length)
            index = _number(data[start:end], fixed)
            if index not in memo:
                raise _Stop(f"memo index {index} was never set")
            stack.append(memo[index])
        elif kind == _STOP:
            pop()
            out.complete = True
            out.end = pos
            return
        elif kind == _GLOBAL or kind == _INST:
            module = line().decode("utf-8", "surrogateescape")
            qual = line().decode("utf-8", "surrogateescape")
            value = global_name(module, qual)
            if kind == _INST:
                args = pop_mark()
                out.note(_head(value), CALLED)
                out.note(_all(*args), HANDED, _head(value))
                value = _sym(_head(value), *args)
            stack.append(value)
        elif kind == _STACK_GLOBAL:
            qual_value, module_value = pop(), pop()
            stack.append(global_name(module_value, qual_value))
        elif kind == _REDUCE:
            args_value, func = pop(), pop()
            if _is_global(func) and _head(func) == _GETATTR and _getattr_args(args_value):
                target, attr = args_value[3]  # type: ignore[index]
                out.note(_GETATTR, NESTED_GETATTR)
                if len(out.getattrs) < MAX_GLOBALS:
                    out.getattrs.add((target, attr))
                else:
                    out.note(_GETATTR, CALLED)
                module_name = out.parts.get(str(target))
                value = None
                if module_name is not None:
                    value = global_name(module_name[0], f"{module_name[1]}.{attr}")
                stack.append(value)
                out.acts = True
                continue
            if not _is_global(func):  # an object called: a partial, a method
                out.note(frozenset({OBJECT_CALLED}), CALLED)
            out.note(_head(func), CALLED)
            out.note(_all(args_value), HANDED, _head(func))
            stack.append(_sym(_head(func), func, args_value))
        elif kind == _OBJ:
            items = pop_mark()
            if not items:
                raise _Stop("OBJ without a class")
            out.note(_head(items[0]), CALLED)
            out.note(_all(*items[1:]), HANDED, _head(items[0]))
            stack.append(_sym(_head(items[0]), *items))
        elif kind == _NEWOBJ or kind == _NEWOBJ_EX:
            kwargs = pop() if kind == _NEWOBJ_EX else None
            args_value, cls = pop(), pop()
            out.note(_head(cls), INSTANTIATED)
            out.note(_all(args_value, kwargs), HANDED, _head(cls))
            stack.append(_sym(_head(cls), cls, args_value, kwargs))
        elif kind == _BUILD:
            state = pop()
            built = pop()
            if _is_global(built):  # a module or class itself changed
                out.note(_head(built), BUILD_TARGET)
            if CLASS_SWAP_KEY in _all(state):
                out.note(_SWAP, CLASS_SWAP)
            out.note(_all(state) - _SWAP, BUILD_SET, _head(built))
            stack.append(_sym(_head(built), built, state))
        elif kind == _EXT:
            argument(fixed, length)
            full = frozenset({EXTENSION_NAME})
            out.note(full, REFERENCED)
            stack.append((full, full, True))
        elif kind == _PERSID:
            line()
            stack.append(None)
        elif kind == _BINPERSID:
            out.note(_all(pop()), PERSISTENT)
            stack.append(None)
        elif kind == _DUP:
            value = pop()
            stack.extend((value, value))
        elif kind == _PROTO:
            start, _ = argument(fixed, length)
            if data[start] > HIGHEST_PROTOCOL:
                raise _Stop("unsupported pickle protocol")
        elif kind == _SKIP:
            argument(fixed, length)
        elif kind == _POP:
            if marks and marks[-1] == len(stack):  # C's POP takes a MARK on top too
                marks.pop()
                fence = marks[-1] if marks else 0
            else:
                pop()
        elif kind == _APPEND or kind == _SETITEM:
            # C's APPEND and SETITEM take their items whatever the marks say (do_append,
            # do_setitems): they need the container and the items, nothing more
            count = 1 if kind == _APPEND else 2
            if len(stack) <= count:
                raise _Stop("stack underflow")
            items = stack[-count:]
            del stack[-count:]
            held = stack[-1]
            if _is_global(held):  # a module-level object changed
                out.note(_head(held), MUTATED)
            if kind == _SETITEM and type(items[0]) is str and items[0] in _SWAP_KEYS:
                items.append((_EMPTY, _SWAP, False))
            stack[-1] = _sym(_head(held), held, *items)
        else:  # NEXT_BUFFER
            raise _Stop("out-of-band buffers (torch.load passes none)")
        if kind in _ACTING:  # it parsed: the real unpickler imports or calls here
            out.acts = True


def is_pickle_start(head: bytes, *, whole: bool = False) -> bool:
    """Whether ``head`` (a file's first bytes; ``whole``: all of it) is the start of a
    pickle that the real unpickler would walk into: opcodes that parse up to a STOP (or
    the end of ``head``, where the file goes on), or that import or call something
    before they stop parsing (which would already have run under ``torch.load``)."""
    if not head:
        return False
    uses = scan_pickle(head, importable_only=True)
    if uses.acts or uses.complete:
        return True
    return uses.error is None and not whole  # (a text file that ends in a line: no pickle)


def _dotted(name: object) -> bool:
    return isinstance(name, str) and all(part.isidentifier() for part in name.split("."))


def _getattr_args(value: _Value) -> bool:
    return isinstance(value, tuple) and len(value) == 4


def _number(raw: bytes, fixed: int) -> int:
    """A memo index: a decimal line (protocol 0) or a little-endian unsigned int."""
    if fixed == _LINE:
        try:
            return int(raw)
        except ValueError:
            raise _Stop("not a number") from None
    return int.from_bytes(raw, "little")


def _string(name: str, span: tuple[int, int], data: bytes, text: Any) -> _Value:
    """The value of a string opcode: its text where it may name a global, else None."""
    start, end = span
    if end - start > MAX_NAME_BYTES + 2:
        return None
    raw = data[start:end]
    if name == "STRING":
        if len(raw) < 2 or raw[:1] not in (b"'", b'"') or raw[-1:] != raw[:1]:
            raise _Stop("STRING not quoted")
        try:
            return text(codecs.escape_decode(raw[1:-1])[0])  # type: ignore[attr-defined]
        except ValueError:
            raise _Stop("bad STRING escape") from None
    if name == "UNICODE":
        try:
            return raw.decode("raw-unicode-escape")
        except UnicodeDecodeError:
            raise _Stop("bad UNICODE escape") from None
    if name in ("BINSTRING", "SHORT_BINSTRING"):
        return text(raw)
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise _Stop("bad UTF-8 in a string") from None
