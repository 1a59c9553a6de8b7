"""DCP's ``.metadata``: the bytes ``pickle.dumps`` gives for torch's ``Metadata``, without torch.

The DCP writer used to build torch's own ``Metadata``, ``TensorStorageMetadata``,
``TensorProperties``, ``ChunkStorageMetadata``, ``MetadataIndex`` and ``_StorageInfo``
objects and pickle them, which imported torch (about 220 MiB and 1.5 s) in every
process just to plan. :func:`metadata_pickle` writes the same bytes directly: the
opcodes CPython's C pickler (``_pickle.c``) emits for those objects at
``pickle.DEFAULT_PROTOCOL`` (4 or 5: the same opcodes here), with its memo, its
``MARK``/``SETITEMS`` batches of 1000 (and the empty batch after a full one) and
its framing (a ``FRAME`` before each run of at least 64 KiB, cut where an object's
save begins; a string of 64 KiB or more outside any frame). Tests compare the bytes
with ``pickle.dumps`` of the objects built the old way.

The memo is keyed as the C pickler keys it, by object identity: a tensor name is one
object (the dict key, the planner entry, the index's fqn), attribute names and class
names are torch's interned strings (so a name that is the same interned string is
written once, as torch would), torch's other strings are its own objects.
"""

from __future__ import annotations

import pickle
import struct
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

__all__ = ["DcpItem", "metadata_pickle"]

# torch's names, as the C pickler finds them (``__module__``, ``__qualname__``)
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
_SERIALIZATION_MODULE = "torch.serialization"
# torch.dtype's ``__module__``: a 'torch' of its own, not the interned one torch.Size has
_DTYPE_MODULE = "torch"

_FRAME_SIZE_TARGET = 64 * 1024  # _pickle.c: FRAME_SIZE_TARGET
_FRAME_SIZE_MIN = 4  # a shorter frame loses its header
_FRAME_HEADER = 9
_BATCHSIZE = 1000


class DcpItem(NamedTuple):
    """One tensor of a one-rank DCP checkpoint: a single chunk at offset zero."""

    name: str  # the same object is written for every mention (memoized by identity)
    dtype: str  # torch's dtype name: "float32", "bfloat16", "float8_e4m3fn", ...
    shape: tuple[int, ...]
    requires_grad: bool
    offset: int  # of its blob in the data file
    length: int


class _Emitter:
    """The C pickler's output buffer, frames and memo, for the few types written here."""

    def __init__(self, protocol: int):
        self.out = bytearray(pickle.PROTO + bytes([protocol]))
        self.frame_start = -1
        self.framing = True
        self.memo: dict[Hashable, int] = {}
        self.count = 0
        self.alive: dict[int, object] = {}  # objects whose id() keys the memo

    # --- the buffer and its frames (_Pickler_Write, _Pickler_CommitFrame)

    def write(self, data: bytes) -> None:
        if self.framing and self.frame_start < 0:
            self.frame_start = len(self.out)
            self.out += b"\xfe" * _FRAME_HEADER
        self.out += data

    def commit_frame(self) -> None:
        if not self.framing or self.frame_start < 0:
            return
        start = self.frame_start
        length = len(self.out) - start - _FRAME_HEADER
        if length >= _FRAME_SIZE_MIN:
            self.out[start : start + _FRAME_HEADER] = pickle.FRAME + struct.pack("<Q", length)
        else:
            del self.out[start : start + _FRAME_HEADER]
        self.frame_start = -1

    def save(self, key: Hashable | None = None) -> bool:
        """The start of the C pickler's ``save()`` of one object: the frame boundary
        check, then the memo (True when the object was written as a GET)."""
        if self.frame_start >= 0 and len(self.out) - self.frame_start - _FRAME_HEADER >= (
            _FRAME_SIZE_TARGET
        ):
            self.commit_frame()
        if key is None or key not in self.memo:
            return False
        index = self.memo[key]
        if index < 256:
            self.write(pickle.BINGET + bytes([index]))
        else:
            self.write(pickle.LONG_BINGET + struct.pack("<I", index))
        return True

    def memoize(self, key: Hashable | None) -> None:
        self.write(pickle.MEMOIZE)
        if key is not None:
            self.memo[key] = self.count
        self.count += 1

    # --- atoms

    def integer(self, value: int) -> None:
        self.save()
        if 0 <= value < 256:
            self.write(pickle.BININT1 + bytes([value]))
        elif 0 <= value < 65536:
            self.write(pickle.BININT2 + struct.pack("<H", value))
        elif -(1 << 31) <= value < (1 << 31):
            self.write(pickle.BININT + struct.pack("<i", value))
        else:
            data = pickle.encode_long(value)  # type: ignore[attr-defined]
            self.write(pickle.LONG1 + bytes([len(data)]) + data)

    def boolean(self, value: bool) -> None:
        self.save()
        self.write(pickle.NEWTRUE if value else pickle.NEWFALSE)

    def none(self) -> None:
        self.save()
        self.write(pickle.NONE)

    def string(self, text: str, key: Hashable | None) -> None:
        """A str; ``key`` None for a string torch makes afresh each time."""
        if self.save(key):
            return
        data = text.encode("utf-8", "surrogatepass")
        if len(data) < 256:
            header = pickle.SHORT_BINUNICODE + bytes([len(data)])
        elif len(data) <= 0xFFFFFFFF:
            header = pickle.BINUNICODE + struct.pack("<I", len(data))
        else:
            header = pickle.BINUNICODE8 + struct.pack("<Q", len(data))
        if len(data) >= _FRAME_SIZE_TARGET:  # _Pickler_write_bytes: outside any frame
            self.commit_frame()
            self.framing = False
            self.write(header + data)
            self.framing = True
        else:
            self.write(header + data)
        self.memoize(key)

    def obj(self, value: object) -> Hashable:
        """The memo key of an object, by identity as the C pickler keys it (the object
        kept alive while the memo is, so that its id is not reused)."""
        self.alive.setdefault(id(value), value)
        return ("id", id(value))

    def interned(self, text: str) -> None:
        """One of torch's interned strings (attribute names, class names, ``torch``)."""
        interned = sys.intern(text)
        self.string(interned, self.obj(interned))

    def global_(
        self, module: str, module_key: Hashable, name: str, name_key: Hashable | None
    ) -> None:
        """A class or function by name (STACK_GLOBAL), memoized as ``("global", module,
        name)``: the module and name strings are saved (and memoized) the first time only."""
        key = ("global", module, name)
        if self.save(key):
            return
        self.string(module, module_key)
        self.string(name, name_key)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(key)

    def torch_class(self, module: str, name: str) -> None:
        """A class or function of a torch module: ``module`` is one string object for
        all of its classes, ``name`` (a ``__qualname__``) is interned."""
        self.global_(module, ("module", module), name, self.obj(sys.intern(name)))

    def metadata_class(self, name: str) -> None:
        self.torch_class(_METADATA_MODULE, name)

    # --- containers (batch_dict_exact, save_tuple)

    def new_object(self) -> None:
        """``cls`` is on the stack: ``copyreg.__newobj__(cls)`` as the C pickler writes it."""
        self.save()
        self.write(pickle.EMPTY_TUPLE)  # no arguments
        self.write(pickle.NEWOBJ)
        self.memoize(None)

    def object_with_state(self) -> None:
        """``cls`` is on the stack: the new object, then its ``__dict__`` opened for its
        items (MARK); :meth:`state_end` sets them and builds the object."""
        self.new_object()
        self.state_dict_start()
        self.write(pickle.MARK)

    def state_end(self) -> None:
        self.write(pickle.SETITEMS)
        self.write(pickle.BUILD)

    def state_dict_start(self) -> None:
        self.save()
        self.write(pickle.EMPTY_DICT)
        self.memoize(None)

    def tuple_of_ints(self, values: Sequence[int]) -> None:
        self.save()
        if not values:
            self.write(pickle.EMPTY_TUPLE)  # the empty tuple is never memoized
            return
        if len(values) > 3:
            self.write(pickle.MARK)
        for value in values:
            self.integer(value)
        self.write(_TUPLE_OPS.get(len(values), pickle.TUPLE))
        self.memoize(None)

    def torch_size(self, shape: Sequence[int], key: Hashable | None) -> None:
        """``torch.Size`` as it reduces: ``torch.Size((d0, d1, ...))``."""
        if self.save(key):
            return
        # torch.Size: its __module__ the interned 'torch', its __qualname__ made afresh
        self.global_("torch", self.obj(sys.intern("torch")), "Size", None)
        self.save()  # the arguments' 1-tuple
        self.tuple_of_ints(shape)
        self.write(pickle.TUPLE1)
        self.memoize(None)
        self.write(pickle.REDUCE)
        self.memoize(key)


_TUPLE_OPS = {1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}


def _dict_items(emit: _Emitter, count: int, write_item: Callable[[int], None]) -> None:
    """batch_dict_exact: one SETITEM for a single item, else MARK ... SETITEMS in batches
    of 1000, with an empty batch after a full last one."""
    if count == 1:
        write_item(0)
        emit.write(pickle.SETITEM)
        return
    done = 0
    while count > 1:
        emit.write(pickle.MARK)
        batch = range(done, min(done + _BATCHSIZE, count))
        for index in batch:
            write_item(index)
        emit.write(pickle.SETITEMS)
        done += len(batch)
        if len(batch) < _BATCHSIZE:
            return


def metadata_pickle(items: Sequence[DcpItem], data_file: str) -> bytes:
    """``pickle.dumps`` of torch's ``Metadata`` for ``items``, all in ``data_file``.

    What the DCP writer used to build: per tensor a ``TensorStorageMetadata`` (its
    ``TensorProperties``: dtype, ``torch.strided``, requires_grad, contiguous format,
    not pinned), one chunk at zero offsets, ``planner_data[name] = (name,)`` and
    ``storage_data[MetadataIndex(name, zeros, 0)] = _StorageInfo(data_file, offset,
    length)``; no ``storage_meta``, no ``version``. ``data_file`` is one object,
    written once.
    """
    protocol = pickle.DEFAULT_PROTOCOL
    if protocol < 4:  # pragma: no cover - Python < 3.8
        raise RuntimeError("the DCP metadata writer needs pickle protocol 4 or later")
    emit = _Emitter(protocol)

    def attribute(name: str) -> None:
        emit.interned(name)

    # Metadata(): class, no arguments, then its __dict__ as the BUILD state
    emit.save()
    emit.metadata_class("Metadata")
    emit.object_with_state()

    attribute("state_dict_metadata")
    emit.state_dict_start()

    def tensor_entry(index: int) -> None:
        item = items[index]
        name_key = emit.obj(item.name)
        emit.string(item.name, name_key)
        # TensorStorageMetadata(properties, size, chunks)
        emit.save()
        emit.metadata_class("TensorStorageMetadata")
        emit.object_with_state()
        attribute("properties")
        _properties(emit, item)
        emit.write(pickle.BUILD)
        attribute("size")
        shape_key = ("shape", index)
        emit.torch_size(item.shape, shape_key)
        attribute("chunks")
        emit.save()
        emit.write(pickle.EMPTY_LIST)
        emit.memoize(None)
        # [ChunkStorageMetadata(offsets=zeros, sizes=shape)]
        emit.save()
        emit.metadata_class("ChunkStorageMetadata")
        emit.object_with_state()
        attribute("offsets")
        emit.torch_size((0,) * len(item.shape), None)
        attribute("sizes")
        emit.torch_size(item.shape, shape_key)
        emit.state_end()
        emit.write(pickle.APPEND)  # the chunk into the list
        emit.state_end()  # (the TensorStorageMetadata's)

    _dict_items(emit, len(items), tensor_entry)

    attribute("planner_data")
    emit.state_dict_start()

    def planner_entry(index: int) -> None:
        name = items[index].name
        emit.string(name, emit.obj(name))
        emit.save()  # (name,)
        emit.string(name, emit.obj(name))
        emit.write(pickle.TUPLE1)
        emit.memoize(None)

    _dict_items(emit, len(items), planner_entry)

    attribute("storage_data")
    emit.state_dict_start()
    path_key = emit.obj(data_file)

    def storage_entry(index: int) -> None:
        item = items[index]
        # MetadataIndex(fqn=name, offset=torch.Size(zeros), index=0): its __dict__ in
        # the order its __init__ sets them
        emit.save()
        emit.metadata_class("MetadataIndex")
        emit.object_with_state()
        attribute("fqn")
        emit.string(item.name, emit.obj(item.name))
        attribute("index")
        emit.integer(0)
        attribute("offset")
        emit.torch_size((0,) * len(item.shape), None)
        emit.state_end()
        # _StorageInfo(data_file, offset, length): __getstate__ drops the None
        # transform_descriptors
        emit.save()
        emit.torch_class(_FILESYSTEM_MODULE, "_StorageInfo")
        emit.object_with_state()
        attribute("relative_path")
        emit.string(data_file, path_key)
        attribute("offset")
        emit.integer(item.offset)
        attribute("length")
        emit.integer(item.length)
        emit.state_end()

    _dict_items(emit, len(items), storage_entry)

    attribute("storage_meta")
    emit.none()
    attribute("version")
    emit.none()
    emit.state_end()
    emit.write(pickle.STOP)
    emit.commit_frame()
    return bytes(emit.out)


def _properties(emit: _Emitter, item: DcpItem) -> None:
    """TensorProperties: its ``__getstate__`` tuple (dtype, layout, requires_grad,
    memory-format encoding, pin_memory) as the BUILD state."""
    emit.save()
    emit.metadata_class("TensorProperties")
    emit.new_object()
    emit.save()  # the state tuple
    emit.write(pickle.MARK)
    # torch.<dtype>: its __reduce__ gives its name, found in torch's module
    if not emit.save(("dtype", item.dtype)):
        emit.string(_DTYPE_MODULE, ("module", "torch.dtype"))
        emit.string(item.dtype, None)
        emit.write(pickle.STACK_GLOBAL)
        emit.memoize(("dtype", item.dtype))
    # torch.strided, as copyreg has torch pickle layouts: _get_layout("torch.strided")
    if not emit.save(("layout", "strided")):
        emit.torch_class(_SERIALIZATION_MODULE, "_get_layout")
        emit.save()
        emit.string("torch.strided", None)
        emit.write(pickle.TUPLE1)
        emit.memoize(None)
        emit.write(pickle.REDUCE)
        emit.memoize(("layout", "strided"))
    emit.boolean(item.requires_grad)
    # _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, as an Enum reduces: cls(0)
    if not emit.save(("memory_format", 0)):
        emit.metadata_class("_MEM_FORMAT_ENCODING")
        emit.save()
        emit.integer(0)
        emit.write(pickle.TUPLE1)
        emit.memoize(None)
        emit.write(pickle.REDUCE)
        emit.memoize(("memory_format", 0))
    emit.boolean(False)  # pin_memory
    emit.write(pickle.TUPLE)
    emit.memoize(None)
