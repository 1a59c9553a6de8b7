"""Write a ``torch.save``-compatible zip, streaming one tensor at a time, without torch.

``torch.save`` needs the whole object in memory; this writer plans first (every
tensor's key and ``archive/data/<key>`` entry at its offset, then the pickle of the
structure that refers to them, all from metadata), then copies each tensor's bytes
into its entry (straight from the input file where the bytes are stored as they are,
see :func:`write_leaf`), then the CRCs and the central directory. The pickle names
torch's rebuild functions, storage classes, dtypes and devices as globals, exactly
as ``torch.save`` does, so ``torch.load(weights_only=True)`` (and ``mmap=True``) read
it, yet torch is never imported unless a tensor must be cast or gathered.
"""

from __future__ import annotations

import codecs
import collections
import functools
import io
import pickle
import struct
import zlib
from typing import Any, SupportsIndex

from ..dtypes import DTYPES, STORAGE_CLASSES, DType, check_dtype
from ..errors import CkptError
from ..tree import (
    TORCH_LAYOUTS,
    Device,
    Leaf,
    Node,
    SparseRef,
    StorageRef,
    TensorRef,
    TorchName,
    TorchSize,
    TorchValue,
    contiguous_stride,
    to_plain,
    weight_key,
)
from ..zip_records import (
    CENTRAL_HEADER,
    CENTRAL_HEADER_SIGNATURE,
    END,
    END_SIGNATURE,
    LOCAL_HEADER,
    LOCAL_HEADER_SIGNATURE,
    ZIP64_END,
    ZIP64_END_SIGNATURE,
    ZIP64_LOCATOR,
    ZIP64_LOCATOR_SIGNATURE,
)
from .folder_layout import FolderLayout
from .leaf_bytes import output_dtype
from .plan import Crcs, FilePlan, Piece, Plan, WriteOptions, write

__all__ = [
    "TO",
    "WRITABLE_GLOBALS",
    "check_writable",
    "layout",
    "plan",
    "plan_zip",
    "write",
]

TO = "pt"

ARCHIVE = "archive"
ALIGNMENT = 64  # torch aligns tensor data to 64 bytes so torch.load(mmap=True) can map it
PICKLE_PROTOCOL = 2  # what torch.save uses
_STORAGE_FOR_DTYPE = {
    dtype: name for name, dtype in STORAGE_CLASSES.items() if name != "UntypedStorage"
}

# ---------------------------------------------------------------- the pickle


# torch.save's quantization schemes (a quantized tensor's pickle names its own)
QSCHEMES = (
    "per_tensor_affine",
    "per_tensor_symmetric",
    "per_channel_affine",
    "per_channel_symmetric",
    "per_channel_affine_float_qparams",
)
# Every global this writer may name, all of them on torch.load(weights_only=True)'s own
# list. A name is checked against this set where it is written, whatever produced it:
# nothing a file controls can make the writer name anything else.
WRITABLE_GLOBALS = frozenset(
    {
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._utils", "_rebuild_qtensor"),
        ("torch._utils", "_rebuild_sparse_tensor"),
        ("torch", "device"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.storage", "UntypedStorage"),
        ("collections", "OrderedDict"),
        ("_codecs", "encode"),
        ("builtins", "set"),
        ("builtins", "bytearray"),
        ("builtins", "complex"),
        *(("torch", name) for name in DTYPES),
        *(("torch", name) for name in STORAGE_CLASSES if name != "UntypedStorage"),
        *(("torch", scheme) for scheme in QSCHEMES),
    }
)


def check_writable(module: str, name: str) -> None:
    """Refuse to write a GLOBAL that is not on :data:`WRITABLE_GLOBALS`."""
    if (module, name) not in WRITABLE_GLOBALS:
        raise CkptError(f"refusing to write the global {module!r:.60}.{name!r:.60} (unusual input)")


class _TorchGlobal:
    """A torch name written as a pickle GLOBAL without importing torch.

    Callable only so that pickle accepts it as the function of a reduce tuple.
    """

    def __init__(self, module: str, name: str):
        check_writable(module, name)
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:
        raise TypeError(f"{self.module}.{self.name} is only a name here")


_GLOBALS: dict[tuple[str, str], _TorchGlobal] = {}


def torch_global(module: str, name: str) -> _TorchGlobal:
    """One object per name, so the pickle memo writes each GLOBAL once."""
    return _GLOBALS.setdefault((module, name), _TorchGlobal(module, name))


class _Reduced:
    """Pickles as ``func(*args)``: the only object besides plain data the pickle holds."""

    def __init__(self, func: _TorchGlobal, args: tuple[Any, ...]):
        self.func, self.args = func, args

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return (self.func, self.args)


class _Storage:
    def __init__(self, key: str, dtype: DType, numel: int, location: str):
        self.key, self.dtype, self.numel, self.location = key, dtype, numel, location
        self.nbytes = numel * dtype.itemsize


def _tensor(storage: _Storage, shape: tuple[int, ...], requires_grad: bool = False) -> _Reduced:
    """``_rebuild_tensor_v2(storage, 0, size, stride, requires_grad, {})``, as torch
    pickles a tensor."""
    backward_hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    args = (
        storage,
        0,
        pickle_value(TorchSize(shape)),
        contiguous_stride(shape),
        requires_grad,
        backward_hooks,
    )
    if storage.dtype.name in _STORAGE_FOR_DTYPE:
        return _Reduced(torch_global("torch._utils", "_rebuild_tensor_v2"), args)
    # dtypes without a typed storage class (fp8, uint16...) use v3 with an untyped storage
    dtype = torch_global("torch", storage.dtype.name)
    return _Reduced(torch_global("torch._utils", "_rebuild_tensor_v3"), (*args, dtype))


def pickle_value(value: TorchValue) -> Any:
    """What a device, dtype, size or layout stand-in pickles as (torch's own globals)."""
    if isinstance(value, Device):
        return _Reduced(torch_global("torch", "device"), (str(value),))
    if isinstance(value, TorchSize):
        return _Reduced(torch_global("torch", "Size"), (tuple(value),))
    if isinstance(value, DType):
        return torch_global("torch", check_dtype(value).name)
    name = value.removeprefix("torch.")
    if name in TORCH_LAYOUTS:  # torch pickles layouts this way
        return _Reduced(torch_global("torch.serialization", "_get_layout"), (f"torch.{name}",))
    return str(value)  # a memory format: torch cannot pickle one, its name is kept


class _Pickler(pickle._Pickler):  # the Python pickler: its dispatch table can be extended
    """The pure-Python pickler with torch's globals written by name and every other
    global checked.

    It uses ``pickle._Pickler``'s undocumented internals, which typeshed leaves out or
    types wrongly (hence the ``type: ignore``): ``write`` and ``memoize`` (set and
    defined by ``_Pickler`` itself), ``save`` and ``save_global`` (its methods), and
    ``dispatch``, whose functions take the pickler (typeshed says an Unpickler).
    """

    dispatch = pickle._Pickler.dispatch.copy()

    def save_torch_global(self, obj: _TorchGlobal) -> None:
        check_writable(obj.module, obj.name)
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]

    dispatch[_TorchGlobal] = save_torch_global  # type: ignore[assignment]

    def save_global(self, obj: Any, name: str | None = None) -> None:
        # every other GLOBAL the Python pickler would write (OrderedDict, _codecs.encode
        # for bytes, the class of anything unexpected) passes the same check
        module = getattr(obj, "__module__", None)
        qualname = name or getattr(obj, "__qualname__", None)
        if not isinstance(module, str) or not isinstance(qualname, str):
            raise CkptError(f"cannot write a {type(obj).__name__} (unusual input)")
        check_writable(module, qualname)
        super().save_global(obj, name)  # type: ignore[misc]

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        allowed = type(obj) in _PICKLABLE or any(obj is g for g in _PICKLED_GLOBALS)
        if not allowed and self.persistent_id(obj) is None:
            raise CkptError(f"cannot write a {type(obj).__name__} (unusual input)")
        super().save(obj, save_persistent_id)  # type: ignore[misc]

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            name = _STORAGE_FOR_DTYPE.get(obj.dtype.name)
            if name is None:
                untyped = torch_global("torch.storage", "UntypedStorage")
                return ("storage", untyped, obj.key, obj.location, obj.nbytes)
            return ("storage", torch_global("torch", name), obj.key, obj.location, obj.numel)
        return None


# What the structure may hold once tensors are replaced: plain data and our own records.
_PICKLABLE = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        bytearray,
        tuple,
        list,
        dict,
        set,
        collections.OrderedDict,
        _Reduced,
        _TorchGlobal,
        _Storage,
    }
)

# The Python objects the pickler itself names for plain data (protocol 2)
_PICKLED_GLOBALS = (collections.OrderedDict, codecs.encode, set, bytearray, complex)

# ---------------------------------------------------------------- the zip container

_ZIP64_VERSION = 45
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, as zipfile and torch write
_ZIP64_LIMIT = (1 << 31) - 1  # as Python's zipfile: sizes and offsets past this use zip64
_CRC_OFFSET = 14  # of the CRC field in a local header
_PAD_ID = 0x4246  # the extra field torch pads with ("FB") to align data
_LOCAL_EXTRA = 20 + 4  # zip64 sizes, then the padding field's header


class _Entry:
    def __init__(self, name: bytes, header_offset: int, size: int, crc: int | None):
        self.name, self.header_offset, self.size = name, header_offset, size
        self.crc = crc  # None: known once its data is written (a tensor's)
        self.data_offset = 0


class _ZipLayout:
    """A stored (uncompressed) zip laid out as pieces, its data 64-byte aligned.

    Each entry's size is declared before its data; a tensor's CRC-32, computed as its
    bytes are written, goes into its local header and the central directory after:
    the data streams through once, nothing is held or read back. Every local header
    carries zip64 sizes. ``base`` is where the zip starts in its file (a DCP blob):
    the zip's own offsets count from there, the pieces' from the file's start.
    """

    def __init__(self, base: int = 0):
        self.base = base
        self.pos = 0  # from the zip's start
        self.pieces: list[Piece] = []
        self.entries: list[_Entry] = []

    def _header(self, entry: _Entry) -> bytes:
        header_end = entry.header_offset + LOCAL_HEADER.size + len(entry.name) + _LOCAL_EXTRA
        pad = -header_end % ALIGNMENT
        extra = struct.pack("<HHQQHH", 1, 16, entry.size, entry.size, _PAD_ID, pad) + b"Z" * pad
        # fmt: off
        header = LOCAL_HEADER.pack(
            LOCAL_HEADER_SIGNATURE, _ZIP64_VERSION, 0, 0, 0, _DOS_DATE,  # signature .. date
            entry.crc or 0, 0xFFFFFFFF, 0xFFFFFFFF,  # CRC, sizes (in the extra)
            len(entry.name), len(extra),
        )
        # fmt: on
        return header + entry.name + extra

    def _bytes(self, data: bytes) -> None:
        self.pieces.append(Piece(self.base + self.pos, len(data), data=data))
        self.pos += len(data)

    def add_tensor(
        self, name: str, size: int, leaf: Leaf, cast: DType | None, check: SparseRef | None
    ) -> None:
        """An entry whose data is a tensor's output bytes (their CRC known once written)."""
        entry = _Entry(name.encode(), self.pos, size, None)
        header = self._header(entry)
        entry.data_offset = self.pos + len(header)
        data_at = self.base + entry.data_offset
        self._bytes(header[:_CRC_OFFSET])
        crc = functools.partial(_crc_field, data_at)
        self.pieces.append(Piece(self.base + self.pos, 4, build=crc, needs=(data_at,)))
        self.pos += 4
        self._bytes(header[_CRC_OFFSET + 4 :])
        self.pieces.append(Piece(data_at, size, leaf=leaf, cast=cast, crc=True, check=check))
        self.pos += size
        self.entries.append(entry)

    def add_bytes(self, name: str, data: bytes) -> None:
        """An entry whose data is known now."""
        entry = _Entry(name.encode(), self.pos, len(data), zlib.crc32(data))
        header = self._header(entry)
        entry.data_offset = self.pos + len(header)
        self._bytes(header + data)
        self.entries.append(entry)

    def close(self) -> None:
        """The central directory (and zip64 end records if needed): built from the CRCs
        once the tensors are written; its size is known now."""
        needs = tuple(self.base + e.data_offset for e in self.entries if e.crc is None)
        build = functools.partial(_directory, self.entries, self.base, self.pos)
        size = len(build(dict.fromkeys(needs, 0)))
        self.pieces.append(Piece(self.base + self.pos, size, build=build, needs=needs))
        self.pos += size


def _crc_field(data_at: int, crcs: Crcs) -> bytes:
    return struct.pack("<I", crcs[data_at])


def _directory(entries: list[_Entry], base: int, offset: int, crcs: Crcs) -> bytes:
    """The central directory at ``offset`` of the zip (which starts at ``base`` of its file)."""
    directory = bytearray()
    for entry in entries:
        crc = entry.crc if entry.crc is not None else crcs[base + entry.data_offset]
        big_size, big_offset = entry.size > _ZIP64_LIMIT, entry.header_offset > _ZIP64_LIMIT
        values = (entry.size, entry.size) * big_size + (entry.header_offset,) * big_offset
        zip64 = struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values)
        extra = zip64 if values else b""
        # fmt: off
        directory += CENTRAL_HEADER.pack(
            CENTRAL_HEADER_SIGNATURE, (3 << 8) | _ZIP64_VERSION, _ZIP64_VERSION, 0, 0, 0,
            _DOS_DATE, crc,
            0xFFFFFFFF if big_size else entry.size, 0xFFFFFFFF if big_size else entry.size,
            len(entry.name), len(extra), 0, 0, 0, 0o644 << 16,  # name .. external attrs
            0xFFFFFFFF if big_offset else entry.header_offset,
        ) + entry.name + extra
        # fmt: on
    size, count = len(directory), len(entries)
    if count > 0xFFFF or max(offset, size) > _ZIP64_LIMIT:
        # fmt: off
        directory += ZIP64_END.pack(
            ZIP64_END_SIGNATURE, ZIP64_END.size - 12, _ZIP64_VERSION, _ZIP64_VERSION, 0, 0,
            count, count, size, offset,
        ) + ZIP64_LOCATOR.pack(ZIP64_LOCATOR_SIGNATURE, 0, offset + size, 1)
        # fmt: on
        count, size, offset = min(count, 0xFFFF), min(size, 0xFFFFFFFF), 0xFFFFFFFF
    directory += END.pack(END_SIGNATURE, 0, 0, count, count, size, offset, 0)
    return bytes(directory)


# ---------------------------------------------------------------- the plan


class _Data:
    """A ``data/<key>`` entry: a tensor's output bytes (``check``: the sparse tensor
    whose invariants are checked before its first part is written)."""

    def __init__(self, key: str, leaf: Leaf, cast: DType | None, nbytes: int):
        self.key, self.leaf, self.cast, self.nbytes = key, leaf, cast, nbytes
        self.check: Any = None


class _Planner:
    """Give every tensor and storage its key, in the order ``torch.save`` would, and
    build the structure the pickle holds: no byte of a tensor is read."""

    def __init__(self, cast: DType | None, location: str):
        self.cast, self.location = cast, location
        self.data: list[_Data] = []
        # a tensor that is the same weight as one before it (a tied head) views the same
        # storage, as torch.save writes it: weight_key -> that storage
        self._weights: dict[tuple, _Storage] = {}

    def add_tensor(self, leaf: Leaf) -> _Reduced:
        """What the pickle holds for one tensor: as torch pickles it, an ``nn.Parameter``
        where one was read, ``requires_grad`` kept (sharded tensors are written plain)."""
        dt = output_dtype(leaf, self.cast)
        # torch refuses requires_grad on other dtypes
        grad_ok = dt.is_floating or dt.name.startswith("complex")
        grad = leaf.requires_grad and not leaf.sharded and grad_ok
        parameter = getattr(leaf, "parameter", False)  # (sharded tensors have no such flag)
        if isinstance(leaf, SparseRef):
            reduced = self._sparse(leaf)
        else:
            reduced = self._dense(leaf, grad and not parameter)
        if parameter:
            backward_hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
            args = (reduced, grad, backward_hooks)
            return _Reduced(torch_global("torch._utils", "_rebuild_parameter"), args)
        return reduced

    def _entry(self, leaf: Leaf, cast: DType | None, dtype: DType) -> _Storage:
        key = str(len(self.data))
        self.data.append(_Data(key, leaf, cast, leaf.numel * dtype.itemsize))
        return _Storage(key, dtype, leaf.numel, self.location)

    def _dense(self, leaf: Leaf, requires_grad: bool) -> _Reduced:
        quantizer = getattr(leaf, "quantizer", None)
        key = weight_key(leaf) if quantizer is None else None
        storage = self._weights.get(key) if key is not None else None
        if storage is None:
            storage = self._entry(leaf, self.cast, output_dtype(leaf, self.cast))
            if key is not None:
                self._weights[key] = storage
        if quantizer is not None:
            return self._quantized(storage, tuple(leaf.shape), quantizer)
        return _tensor(storage, tuple(leaf.shape), requires_grad)

    def _quantized(self, storage: _Storage, shape: tuple[int, ...], quantizer: tuple) -> _Reduced:
        """``_rebuild_qtensor(storage, 0, size, stride, quantizer_params, False, {})``; a
        per-channel quantizer's scales and zero points are tensors of their own."""
        scheme, *params = quantizer
        if len(params) == 3:  # per channel: scales, zero points, axis
            params = [self.add_tensor(params[0]), self.add_tensor(params[1]), params[2]]
        plain = _tensor(storage, shape)  # the same arguments, up to the quantizer
        args = (*plain.args[:4], (torch_global("torch", scheme), *params), *plain.args[4:])
        return _Reduced(torch_global("torch._utils", "_rebuild_qtensor"), args)

    def _sparse(self, leaf: SparseRef) -> _Reduced:
        """``_rebuild_sparse_tensor(layout, (parts..., size[, is_coalesced]))`` as torch
        pickles a sparse tensor; each part is a tensor of its own."""
        first = len(self.data)
        parts = [self.add_tensor(part) for part in leaf.parts]
        if len(self.data) > first:
            self.data[first].check = leaf  # torch.load would refuse the output otherwise
        size = pickle_value(TorchSize(leaf.shape))
        coalesced = (leaf.is_coalesced,) if leaf.layout == "sparse_coo" else ()
        layout = pickle_value(TorchName(f"torch.{leaf.layout}"))
        data = (*parts, size, *coalesced)
        return _Reduced(torch_global("torch._utils", "_rebuild_sparse_tensor"), (layout, data))

    def add_storage(self, ref: StorageRef) -> _Storage:
        """A storage saved on its own: its bytes an entry, the storage itself in the pickle."""
        return self._entry(TensorRef.whole_storage(ref), None, ref.dtype)

    def convert(self, node: Node) -> Any:
        """The structure with every lazy tensor replaced by its pickle stand-in."""
        return to_plain(
            node, self.add_tensor, pickle_value, weights_only=True, storage=self.add_storage
        )


def plan_zip(
    root: Any, *, cast: DType | None = None, location: str = "cpu", base: int = 0
) -> tuple[list[Piece], int]:
    """The pieces of a torch.save zip of ``root`` starting at ``base`` of its file, and
    its size: the tensors' entries, then ``data.pkl`` and torch's small records, then
    the central directory. The pickle is made here, from metadata only: every global
    it names passes :func:`check_writable` as it is written into the pickle's bytes."""
    planner = _Planner(cast, location)
    structure = planner.convert(root)
    pickled = io.BytesIO()
    _Pickler(pickled, protocol=PICKLE_PROTOCOL).dump(structure)
    zip_layout = _ZipLayout(base)
    for data in planner.data:
        name = f"{ARCHIVE}/data/{data.key}"
        zip_layout.add_tensor(name, data.nbytes, data.leaf, data.cast, data.check)
    zip_layout.add_bytes(f"{ARCHIVE}/data.pkl", pickled.getvalue())
    zip_layout.add_bytes(f"{ARCHIVE}/byteorder", b"little")
    zip_layout.add_bytes(f"{ARCHIVE}/version", b"3\n")
    zip_layout.add_bytes(f"{ARCHIVE}/.format_version", b"1")
    zip_layout.add_bytes(f"{ARCHIVE}/.storage_alignment", str(ALIGNMENT).encode())
    zip_layout.close()
    return zip_layout.pieces, zip_layout.pos


def layout(options: WriteOptions) -> FolderLayout | None:
    """One file."""
    return None


def plan(root: Any, options: WriteOptions) -> Plan:
    """Lay out ``root`` (a nested structure with lazy tensors, or a flat name -> tensor
    dict) as one torch.save file, ``options.location`` recorded as the tensors' device."""
    pieces, size = plan_zip(root, cast=options.cast, location=options.location or "cpu")
    return Plan([FilePlan("", size, pieces)])
