"""Hostile torch.save files built opcode by opcode, the way attackers build them.

Each case is a ``data.pkl`` (protocol 2 or 4, written byte by byte, so every opcode,
name, size and count is the attacker's) inside a real torch zip container holding one
float32 storage ``0`` of 4 elements, so a reader sees a well-formed checkpoint around
the payload. Payloads that act create a file named ``marker`` beside the checkpoint
(``{marker}`` in the source below), so a test can prove that nothing ran.

The families follow picklescan / modelscan / fickling bypasses and torch
``weights_only`` CVEs: dotted names resolved by protocol 4, gadgets in benign-looking
modules, BUILD on the objects an unpickler hands out, calls of objects, and tiny
pickles that make containers, byte strings or repeated text without bound.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# ------------------------------------------------------------------ opcodes

PROTO2 = b"\x80\x02"
PROTO4 = b"\x80\x04"
MARK, STOP, TUPLE, REDUCE, BUILD = b"(", b".", b"t", b"R", b"b"
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE = b"}", b"]", b")"
SETITEM, SETITEMS, APPEND, APPENDS = b"s", b"u", b"a", b"e"
NEWOBJ, NONE, NEWTRUE, NEWFALSE = b"\x81", b"N", b"\x88", b"\x89"
STACK_GLOBAL, MEMOIZE, BINPERSID = b"\x93", b"\x94", b"Q"


def glob(module: str, name: str) -> bytes:
    """GLOBAL: ``module`` and ``name`` as given (protocol 0-3 style)."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(value: str) -> bytes:
    """BINUNICODE."""
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def raw(value: bytes) -> bytes:
    """BINBYTES (protocol 3+)."""
    return b"B" + struct.pack("<I", len(value)) + value


def integer(value: int) -> bytes:
    """BININT / LONG1."""
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def put(index: int) -> bytes:
    return b"q" + bytes([index])


def get(index: int) -> bytes:
    return b"h" + bytes([index])


def tup(*items: bytes) -> bytes:
    return MARK + b"".join(items) + TUPLE


def call(func: bytes, *args: bytes) -> bytes:
    """``func(*args)`` by REDUCE."""
    return func + tup(*args) + REDUCE


def dict_of(**items: bytes) -> bytes:
    return EMPTY_DICT + MARK + b"".join(text(k) + v for k, v in items.items()) + SETITEMS


def storage(key: str = "0", numel: int = 4) -> bytes:
    """torch's persistent id for a float32 storage: ('storage', FloatStorage, key, cpu, n)."""
    return tup(text("storage"), glob("torch", "FloatStorage"), text(key), text("cpu"),
               integer(numel)) + BINPERSID  # fmt: skip


def tensor(shape: tuple[int, ...] = (4,), stride: tuple[int, ...] = (1,), offset: int = 0,
           key: str = "0", numel: int = 4) -> bytes:  # fmt: skip
    """``_rebuild_tensor_v2(storage, offset, shape, stride, False, OrderedDict())``."""
    return call(
        glob("torch._utils", "_rebuild_tensor_v2"),
        storage(key, numel),
        integer(offset),
        tup(*map(integer, shape)),
        tup(*map(integer, stride)),
        NEWFALSE,
        call(glob("collections", "OrderedDict")),
    )


def checkpoint(*entries: tuple[str, bytes], proto: bytes = PROTO2) -> bytes:
    """A state dict ``{"w": tensor, **entries}``: what a real snapshot looks like."""
    body = b"".join(text(k) + v for k, v in [("w", tensor()), *entries])
    return proto + EMPTY_DICT + MARK + body + SETITEMS + STOP


# ------------------------------------------------------------------ the container

STORAGE_BYTES = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)


def write_torch_zip(path: Path, data_pkl: bytes, extra: dict[str, bytes] | None = None) -> None:
    """A torch.save zip (``archive/``) holding ``data_pkl`` and one storage ``0``."""
    entries = {
        "archive/data.pkl": data_pkl,
        "archive/byteorder": b"little",
        "archive/data/0": STORAGE_BYTES,
        "archive/version": b"3\n",
        **(extra or {}),
    }
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)


# ------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    """One hostile file: how to build its pickle, and what ckpttool must answer.

    ``exit``: 3 refused as unsafe (``names`` must be in the message), 2 corrupt (``names``:
    words of the message), 0 valid and inert (its outputs are checked instead).
    ``live``: the payload provably acts under ``torch.load(weights_only=False)`` here
    (it creates the marker), so "no marker" is a real assertion.
    """

    name: str
    build: Callable[[str], bytes]
    exit: int
    names: tuple[str, ...] = ()
    live: bool = False


def _touch(marker: str) -> bytes:
    return text(f"touch {marker}")


def _starmap(marker: str) -> bytes:
    """``starmap(FileHandler, [(marker,)])`` made by NEWOBJ (nothing called): iterating
    it creates the file."""
    return (
        glob("itertools", "starmap")
        + tup(glob("logging", "FileHandler"), EMPTY_LIST + MARK + tup(text(marker)) + APPENDS)
        + NEWOBJ
    )


def _iterating(module: str, name: str, marker: str) -> bytes:
    """``module.name(starmap(FileHandler, [(marker,)]))``: the call iterates the starmap."""
    return checkpoint(("x", call(glob(module, name), _starmap(marker))))


def _optimizer_holding(param_groups: bytes) -> bytes:
    """A pickled ``torch.optim.SGD`` object (NEWOBJ + BUILD) with ``param_groups``:
    SGD's ``__setstate__`` iterates them."""
    state = dict_of(param_groups=param_groups, defaults=EMPTY_DICT, state=EMPTY_DICT)
    return glob("torch.optim", "SGD") + EMPTY_TUPLE + NEWOBJ + state + BUILD


def _partial_made_by_newobj(marker: str) -> bytes:
    """``partial(FileHandler, marker)`` made by NEWOBJ (``partial.__new__``): nothing
    called; calling the partial later creates the file."""
    return glob("functools", "partial") + tup(glob("logging", "FileHandler"), text(marker)) + NEWOBJ


def _weakset_holding(marker: str) -> bytes:
    """A ``weakref.WeakSet`` made by NEWOBJ (no arguments) whose BUILD state holds the
    partial in ``data``: iterating the set calls each of ``data``'s items."""
    state = dict_of(
        data=call(
            glob("builtins", "set"), EMPTY_LIST + MARK + _partial_made_by_newobj(marker) + APPENDS
        ),
        _pending_removals=EMPTY_LIST,
        _iterating=call(glob("builtins", "set")),
    )
    return glob("weakref", "WeakSet") + EMPTY_TUPLE + NEWOBJ + state + BUILD


def _weakvaluedict_holding(marker: str) -> bytes:
    """A ``weakref.WeakValueDictionary`` (NEWOBJ + BUILD) whose ``data`` maps ``nesterov``
    to the partial: its ``setdefault("nesterov", ...)`` calls ``data["nesterov"]()``."""
    state = dict_of(
        data=dict_of(nesterov=_partial_made_by_newobj(marker)), _pending_removals=EMPTY_LIST
    )
    return glob("weakref", "WeakValueDictionary") + EMPTY_TUPLE + NEWOBJ + state + BUILD


CASES = [
    # --- nothing a file controls reaches an output: BUILD on handed-out values
    Case(
        "build-renames-dtype",
        lambda m: checkpoint(
            (
                "dt",
                glob("torch", "float32")
                + dict_of(
                    name=text(f"float32\n0cposix\nsystem\n(S'touch {m}'\ntR0ctorch\nfloat32"),
                )
                + BUILD,
            ),
        ),
        2,
        ("corrupt pickle", "DType"),
    ),
    Case(
        "build-changes-dtype-itemsize",
        lambda m: checkpoint(
            ("dt", glob("torch", "float16") + dict_of(itemsize=integer(0)) + BUILD)
        ),
        2,
        ("corrupt pickle",),
    ),
    Case(
        "build-renames-storage-dtype",
        lambda m: checkpoint(
            ("s", glob("torch", "FloatStorage") + dict_of(name=text("x\nos\nsystem")) + BUILD)
        ),
        2,
        ("corrupt pickle",),
    ),
    Case(
        "build-on-tensor",
        lambda m: checkpoint(
            ("t", tensor() + dict_of(dtype=text("float32\nposix\nsystem")) + BUILD)
        ),
        2,
        ("corrupt pickle",),
    ),
    Case(
        "build-swaps-size-function",  # partial.__setstate__ would replace the function
        lambda m: checkpoint(
            (
                "s",
                glob("torch", "Size")
                + tup(glob("builtins", "list"), EMPTY_TUPLE, EMPTY_DICT, NONE)
                + BUILD,
            ),  # fmt: skip
        ),
        2,
        ("corrupt pickle",),
    ),
    Case(
        "ordereddict-attribute-hides-values",
        lambda m: checkpoint(
            (
                "sd",
                call(glob("collections", "OrderedDict"))
                + dict_of(values=glob("builtins", "list"))
                + BUILD,
            ),  # fmt: skip
        ),
        2,
        ("hide its methods",),
    ),
    Case(
        "device-string-injection",
        lambda m: checkpoint(("d", call(glob("torch", "device"), text("cpu\nposix\nsystem")))),
        2,
        ("torch.device",),
    ),
    # --- a verdict people can rely on: gadgets by dotted names and in benign modules
    Case(
        "dotted-name-protocol-4",
        lambda m: checkpoint(
            ("x", text("torch") + text("os.system") + STACK_GLOBAL + tup(_touch(m)) + REDUCE),
            proto=PROTO4,
        ),
        3,
        ("torch.os.system",),
        live=True,
    ),
    Case(
        "builtins-dotted-method",
        lambda m: checkpoint(
            (
                "x",
                text("builtins") + text("dict.fromkeys") + STACK_GLOBAL + tup(text("ab")) + REDUCE,
            ),
            proto=PROTO4,
        ),
        3,
        ("builtins.dict.fromkeys",),
    ),
    Case(
        "numpy-testing-runstring",
        lambda m: checkpoint(
            (
                "x",
                call(
                    glob("numpy.testing", "runstring"),
                    text(f"open({m!r}, 'w').close()"),
                    EMPTY_DICT,
                ),
            ),  # fmt: skip
        ),
        3,
        ("numpy.testing.runstring",),
    ),
    Case(
        "logging-config-dictconfig",
        lambda m: checkpoint(
            ("x", call(glob("logging.config", "dictConfig"), dict_of(version=integer(1)))),
        ),
        3,
        ("logging.config.dictConfig",),
    ),
    Case(
        "typing-get-type-hints",
        lambda m: checkpoint(
            ("x", call(glob("typing", "get_type_hints"), glob("functools", "partial"))),
        ),
        3,
        ("typing.get_type_hints",),
    ),
    Case(
        "dataclasses-create-fn",
        lambda m: checkpoint(
            ("x", call(glob("dataclasses", "_create_fn"), text("f"), EMPTY_TUPLE, EMPTY_LIST)),
        ),
        3,
        ("dataclasses._create_fn",),
    ),
    Case(
        "uuid-get-command-stdout",
        lambda m: checkpoint(
            ("x", call(glob("uuid", "_get_command_stdout"), text("touch"), text(m))),
        ),
        3,
        ("uuid._get_command_stdout",),
        live=True,
    ),
    Case(
        "torch-collect-env-run",
        lambda m: checkpoint(("x", call(glob("torch.utils.collect_env", "run"), _touch(m)))),
        3,
        ("torch.utils.collect_env.run",),
        live=True,
    ),
    Case(
        "xxsubinterpreters-run-string",
        lambda m: checkpoint(
            ("x", call(glob("_xxsubinterpreters", "run_string"), integer(0), text("1"))),
        ),
        3,
        ("_xxsubinterpreters.run_string",),
    ),
    Case(
        # a class in a package whose classes are allowed (torch.distributed's metadata):
        # its constructor serves HTTP on every interface
        "torch-distributed-debug-server",
        lambda m: checkpoint(
            ("x", call(glob("torch.distributed.debug._frontend", "FrontendServer"), integer(0)))
        ),
        3,
        ("torch.distributed.debug._frontend.FrontendServer",),
    ),
    Case(
        "numpy-datasource",  # DataSource(None) makes a temporary folder; it opens URLs
        lambda m: checkpoint(("x", call(glob("numpy.lib._datasource", "DataSource"), NONE))),
        3,
        ("numpy.lib._datasource.DataSource",),
    ),
    Case(
        "torch-dcp-async-process",  # starts a checkpointing process
        lambda m: checkpoint(
            (
                "x",
                call(
                    glob(
                        "torch.distributed.checkpoint._async_process_executor",
                        "_AsyncCheckpointProcess",
                    ),
                    NONE,
                ),
            ),
        ),
        3,
        ("torch.distributed.checkpoint._async_process_executor._AsyncCheckpointProcess",),
    ),
    Case(
        "logging-filehandler-creates-file",
        lambda m: checkpoint(("x", call(glob("logging", "FileHandler"), text(m)))),
        3,
        ("logging.FileHandler",),
        live=True,
    ),
    # --- known globals that call what they are given, and methods of known classes
    Case(
        "pathlib-method-creates-file",  # the pathlib family is classes, not their methods
        lambda m: checkpoint(
            ("x", call(glob("pathlib", "Path.touch"), call(glob("pathlib", "Path"), text(m)))),
            proto=PROTO4,
        ),
        3,
        ("pathlib.Path.touch",),
        live=True,
    ),
    Case(
        "pathlib-method-links-a-file",
        lambda m: checkpoint(
            (
                "x",
                call(
                    glob("pathlib", "Path.symlink_to"),
                    call(glob("pathlib", "Path"), text(m)),
                    text("/etc/hostname"),
                ),
            ),
            proto=PROTO4,
        ),
        3,
        ("pathlib.Path.symlink_to",),
        live=True,
    ),
    Case(
        "reconstructor-runs-its-base",  # base.__init__(obj, state) runs FileHandler(path)
        lambda m: checkpoint(
            (
                "x",
                call(
                    glob("copyreg", "_reconstructor"),
                    glob("logging", "FileHandler"),
                    glob("logging", "FileHandler"),
                    text(m),
                ),
            ),
        ),
        3,
        ("logging.FileHandler",),
        live=True,
    ),
    Case(
        "numpy-randomstate-ctor-calls-its-argument",
        lambda m: checkpoint(
            (
                "x",
                call(
                    glob("numpy.random._pickle", "__randomstate_ctor"),
                    text(m),
                    glob("logging", "FileHandler"),
                ),
            ),
        ),
        3,
        ("logging.FileHandler",),
        live=True,
    ),
    Case(
        "numpy-generator-ctor-calls-its-argument",
        lambda m: checkpoint(
            (
                "x",
                call(
                    glob("numpy.random._pickle", "__generator_ctor"),
                    text(m),
                    glob("logging", "FileHandler"),
                ),
            ),
        ),
        3,
        ("logging.FileHandler",),
        live=True,
    ),
    Case(
        "rebuild-from-type-calls-its-function",
        lambda m: checkpoint(
            (
                "x",
                call(
                    glob("torch._tensor", "_rebuild_from_type_v2"),
                    glob("logging", "FileHandler"),
                    glob("torch", "Tensor"),
                    tup(text(m)),
                    EMPTY_DICT,
                ),
            ),
        ),
        3,
        ("logging.FileHandler",),
        live=True,
    ),
    Case(
        "tcpstore-re-exported-by-a-known-package",  # listens on a port when made
        lambda m: checkpoint(
            (
                "x",
                call(
                    glob("torch.distributed.checkpoint._async_process_executor", "TCPStore"),
                    text("127.0.0.1"),
                    integer(29999),
                    integer(1),
                    NEWTRUE,
                ),
            ),
        ),
        3,
        ("torch.distributed.checkpoint._async_process_executor.TCPStore",),
    ),
    Case(
        "known-class-handed-a-partial",  # LambdaLR calls its lambda as it is made
        lambda m: checkpoint(
            (
                "x",
                call(
                    glob("torch.optim.lr_scheduler", "LambdaLR"),
                    call(
                        glob("torch.optim", "SGD"),
                        EMPTY_LIST + MARK + tensor() + APPENDS,
                        b"G" + struct.pack(">d", 0.1),
                    ),
                    EMPTY_LIST
                    + MARK
                    + call(
                        glob("functools", "partial"),
                        glob("pathlib", "Path.touch"),
                        call(glob("pathlib", "Path"), text(m)),
                    )
                    + APPENDS,
                ),
            ),
            proto=PROTO4,
        ),
        3,
        ("functools.partial()",),
        live=True,
    ),
    Case(
        "data-constructor-iterates-an-unknown-object",  # list() runs starmap's __next__
        lambda m: _iterating("builtins", "list", m),
        3,
        ("builtins.list(itertools.starmap)",),
        live=True,
    ),
    Case(
        "torch-size-iterates-an-unknown-object",  # any rebuilt global, not only list()
        lambda m: _iterating("torch", "Size", m),
        3,
        ("torch.Size(itertools.starmap)",),
        live=True,
    ),
    Case(
        # SGD.__setstate__ iterates its param_groups: the starmap, made by NEWOBJ (nothing
        # called), calls FileHandler. Refused where the starmap is handed the callable.
        "known-class-setstate-iterates-an-unknown-object",
        lambda m: checkpoint(("opt", _optimizer_holding(_starmap(m)))),
        3,
        ("logging.FileHandler",),
        live=True,
    ),
    Case(
        "copyreg-newobj-hands-a-callable",  # copyreg.__newobj__(starmap, ...) by REDUCE
        lambda m: checkpoint(
            (
                "opt",
                _optimizer_holding(
                    call(
                        glob("copyreg", "__newobj__"),
                        glob("itertools", "starmap"),
                        glob("logging", "FileHandler"),
                        EMPTY_LIST + MARK + tup(text(m)) + APPENDS,
                    )
                ),
            ),
        ),
        3,
        ("logging.FileHandler",),
        live=True,
    ),
    Case(
        # SGD.__setstate__ iterates its param_groups: a WeakSet (an object made with no
        # arguments) calls the partial its BUILD put in ``data``. Refused where the state
        # hands the callable to the object of a class on no allow-list.
        "build-state-hands-a-callable-to-an-unknown-object",
        lambda m: checkpoint(("opt", _optimizer_holding(_weakset_holding(m)))),
        3,
        ("functools.partial()",),
        live=True,
    ),
    Case(
        # SGD.__setstate__ calls each group's setdefault(): a WeakValueDictionary's calls
        # the value its BUILD state keeps under that key
        "build-state-callable-called-by-a-method",
        lambda m: checkpoint(
            ("opt", _optimizer_holding(EMPTY_LIST + MARK + _weakvaluedict_holding(m) + APPENDS))
        ),
        3,
        ("functools.partial()",),
        live=True,
    ),
    Case(
        "known-class-iterates-an-unknown-object",  # deque(x) runs x's __next__
        lambda m: _iterating("collections", "deque", m),
        3,
        ("collections.deque(itertools.starmap)",),
        live=True,
    ),
    Case(
        "torch-save-creates-file",
        lambda m: checkpoint(("x", call(glob("torch", "save"), EMPTY_DICT, text(m)))),
        3,
        ("torch.save",),
        live=True,
    ),
    Case(
        "torch-from-file-creates-file",
        lambda m: checkpoint(
            ("x", call(glob("torch", "from_file"), text(m), NEWTRUE, integer(4))),
        ),
        3,
        ("torch.from_file",),
        live=True,
    ),
    Case(
        "dcp-format-utils-nested-load",
        lambda m: checkpoint(
            (
                "x",
                call(
                    glob("torch.distributed.checkpoint.format_utils", "torch_save_to_dcp"),
                    text("in.pt"),
                    text(m),
                ),
            ),  # fmt: skip
        ),
        3,
        ("torch.distributed.checkpoint.format_utils.torch_save_to_dcp",),
    ),
    Case(
        "getattr-on-torch-reaches-os",
        lambda m: checkpoint(
            ("x", call(glob("builtins", "getattr"), glob("torch", "serialization"), text("os"))),
        ),
        3,
        ("builtins.getattr",),
    ),
    Case(
        "getattr-reaches-a-torch-method",  # a method of a known class, called with file data
        lambda m: checkpoint(
            (
                "x",
                call(
                    call(
                        glob("builtins", "getattr"),
                        glob("torch.distributed.checkpoint.filesystem", "FileSystemWriter"),
                        text("write_data"),
                    ),
                    text(m),
                ),
            ),  # fmt: skip
        ),
        3,
        ("builtins.getattr",),
    ),
    Case(
        "partial-object-called",  # partial is a plain class; calling the object runs its target
        lambda m: checkpoint(
            (
                "x",
                call(glob("functools", "partial"), glob("logging", "FileHandler"), text(m))
                + EMPTY_TUPLE
                + REDUCE,
            ),  # fmt: skip
        ),
        3,
        ("functools.partial()",),
        live=True,
    ),
    Case(
        "unknown-function-called",
        lambda m: checkpoint(("x", call(glob("mylib.helpers", "make_config"), text("a")))),
        3,
        ("mylib.helpers.make_config",),
    ),
    # --- a class on no allow-list, created as pickle creates objects: construction is a
    # call (its __new__ and __setstate__ would run), refused until allowed
    Case(
        "unknown-class-newobj-build",
        lambda m: checkpoint(
            (
                "cfg",
                glob("mylib.config", "TrainConfig")
                + EMPTY_TUPLE
                + NEWOBJ
                + dict_of(lr=integer(3), name=text("run"))
                + BUILD,
            ),  # fmt: skip
        ),
        3,
        ("mylib.config.TrainConfig",),
    ),
    # --- benign: a class on no allow-list only referenced (a value, never made): inert
    Case(
        "unknown-class-referenced",
        lambda m: checkpoint(("cfg_class", glob("mylib.config", "TrainConfig"))),
        0,
        ("mylib.config.TrainConfig",),
    ),
    # --- bounded work: a small pickle cannot build much, however it is spelled
    Case(
        "bytearray-constructor-repeated",
        lambda m: checkpoint(
            (
                "x",
                MARK
                + b"".join(
                    call(glob("builtins", "bytearray"), integer(1 << 24)) for _ in range(200)
                )
                + b"l",
            ),  # fmt: skip
        ),
        2,
        ("corrupt pickle",),
    ),
    Case(
        "list-copies-of-a-shared-list",
        lambda m: checkpoint(
            (
                "x",
                EMPTY_LIST
                + put(1)
                + MARK
                + integer(7) * 200_000
                + APPENDS
                + b"0"
                + MARK
                + b"".join(call(glob("builtins", "list"), get(1)) for _ in range(2000))
                + b"l",
            ),  # fmt: skip
        ),
        2,
        ("corrupt pickle",),
    ),
    Case(
        "str-of-a-shared-container",
        lambda m: checkpoint(
            (
                "x",
                EMPTY_LIST
                + put(1)
                + MARK
                + text("a" * 100) * 1000
                + APPENDS
                + b"0"
                + call(glob("builtins", "str"), get(1)),
            ),  # fmt: skip
        ),
        2,
        ("str() of a container",),
    ),
    Case(
        "one-string-repeated",
        lambda m: checkpoint(
            ("x", text("x" * 200_000) + put(1) + b"0" + MARK + get(1) * 60_000 + b"l"),
        ),
        0,  # valid: nothing copies the string, and reports shorten it
    ),
    Case(
        "memo-index-of-a-billion",  # CPython's C unpickler grows its memo table to the index
        lambda m: checkpoint(("x", text("a") + b"r" + struct.pack("<I", 1_000_000_000))),
        2,
        ("more memory than it holds",),
    ),
    Case(
        "text-memo-index-of-a-billion",
        lambda m: checkpoint(("x", text("a") + b"p1000000000\n")),
        2,
        ("more memory than it holds",),
    ),
    Case(
        "billion-laughs",
        lambda m: checkpoint(
            (
                "x",
                EMPTY_LIST
                + put(0)
                + b"0"
                + b"".join(MARK + get(i) + get(i) + b"l" + put(i + 1) + b"0" for i in range(40))
                + get(40),
            ),  # fmt: skip
        ),
        2,
        ("corrupt pickle",),
    ),
    Case(
        "deep-nesting",
        lambda m: checkpoint(("x", EMPTY_LIST * 5000 + APPEND * 4999)),
        2,
        ("corrupt pickle",),
    ),
    # --- outputs their consumers accept
    Case(
        "shape-overflows-with-a-zero",
        lambda m: checkpoint(("z", tensor((2**40, 2**40, 0), (0, 0, 1)))),
        2,
        ("shape",),
    ),
    Case(
        "stride-zero-view-of-2-62",
        lambda m: checkpoint(("v", tensor((2**62,), (0,)))),
        2,
        ("elements",),
    ),
]

# --- every protocol's opcodes, and the verdict before any error of the reader
CASES += [
    Case(
        "module-override-build-then-eval",  # picklescan's: BUILD gives a module attributes
        lambda m: checkpoint(
            (
                "x",
                tup(
                    glob("torch", "nn") + dict_of(ckpttool_was_here=integer(1)) + BUILD,
                    call(glob("builtins", "eval"), text(f"open({m!r}, 'w').close()")),
                ),
            ),
        ),
        3,
        ("builtins.eval", "torch.nn"),
        live=True,
    ),
    Case(
        "build-on-an-unknown-class-itself",  # the class, not an object of it, changed
        lambda m: checkpoint(
            ("x", glob("mylib.config", "TrainConfig") + dict_of(lr=integer(1)) + BUILD)
        ),
        3,
        ("mylib.config.TrainConfig",),
    ),
    Case(
        "protocol-0-inst-inside-a-checkpoint",  # INST: the text opcode calling its class
        lambda m: checkpoint(("x", MARK + text(f"touch {m}") + b"iposix\nsystem\n")),
        3,
        ("posix.system",),
        live=True,
    ),
    Case(
        "obj-calls-exec",  # OBJ (protocol 1): the first marked item called on the rest
        lambda m: checkpoint(
            ("x", MARK + glob("builtins", "exec") + text(f"open({m!r}, 'w').close()") + b"o")
        ),
        3,
        ("builtins.exec",),
        live=True,
    ),
]

CASES_BY_NAME = {case.name: case for case in CASES}


def write_case(case: Case, folder: Path) -> Path:
    """Write ``case`` as ``folder/<name>.pt``; its marker path is ``folder/marker``."""
    marker = str(folder / "marker")
    path = folder / f"{case.name}.pt"
    write_torch_zip(path, case.build(marker))
    return path
