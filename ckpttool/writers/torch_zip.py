"""Write a ``torch.save``-compatible zip, streaming one tensor at a time, without torch.

``torch.save`` needs the whole object in memory; this writer copies each tensor's
bytes into its own ``archive/data/<key>`` entry as it goes (straight from the input
file where the bytes are stored as they are, see :func:`write_leaf`) and pickles the structure
last. The pickle names torch's rebuild functions, storage classes, dtypes and
devices as globals, exactly as ``torch.save`` does, so ``torch.load(weights_only=True)``
(and ``mmap=True``) read it, yet torch is never imported unless a tensor must be
cast or gathered.
"""

from __future__ import annotations

import codecs
import collections
import io
import pickle
import struct
from typing import Any

from ..dtypes import DTYPES, STORAGE_CLASSES, DType, check_dtype
from ..errors import CkptError
from ..plain import TorchValue, to_plain
from ..torch_values import TORCH_LAYOUTS, Device, TorchName, TorchSize
from ..tree import SparseRef, StorageRef, TensorRef, iter_tensors
from . import OutputFile, Progress, output_dtype, output_nbytes, write_leaf

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

    def __reduce_ex__(self, protocol: int) -> Any:
        return (self.func, self.args)


class _Storage:
    def __init__(self, key: str, dtype: DType, numel: int, location: str):
        self.key, self.dtype, self.numel, self.location = key, dtype, numel, location
        self.nbytes = numel * dtype.itemsize


def _tensor(storage: _Storage, shape: tuple[int, ...], requires_grad: bool = False) -> _Reduced:
    """``_rebuild_tensor_v2(storage, 0, size, stride, requires_grad, {})``, as torch
    pickles a tensor."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    args = (
        storage,
        0,
        pickle_value(TorchSize(shape)),
        tuple(reversed(stride)),
        requires_grad,
        collections.OrderedDict(),
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
    dispatch = pickle._Pickler.dispatch.copy()

    def save_torch_global(self, obj: _TorchGlobal) -> None:
        check_writable(obj.module, obj.name)
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[_TorchGlobal] = save_torch_global

    def save_global(self, obj: Any, name: str | None = None) -> None:
        # every other GLOBAL the Python pickler would write (OrderedDict, _codecs.encode
        # for bytes, the class of anything unexpected) passes the same check
        module = getattr(obj, "__module__", None)
        qualname = name or getattr(obj, "__qualname__", None)
        if not isinstance(module, str) or not isinstance(qualname, str):
            raise CkptError(f"cannot write a {type(obj).__name__} (unusual input)")
        check_writable(module, qualname)
        super().save_global(obj, name)

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        allowed = type(obj) in _PICKLABLE or any(obj is g for g in _PICKLED_GLOBALS)
        if not allowed and self.persistent_id(obj) is None:
            raise CkptError(f"cannot write a {type(obj).__name__} (unusual input)")
        super().save(obj, save_persistent_id)

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

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # 30 bytes, then name and extra
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_ZIP64_VERSION = 45
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, as zipfile and torch write
_ZIP64_LIMIT = (1 << 31) - 1  # as Python's zipfile: sizes and offsets past this use zip64
_CRC_OFFSET = 14  # of the CRC field in a local header
_PAD_ID = 0x4246  # the extra field torch pads with ("FB") to align data
_LOCAL_EXTRA = 20 + 4  # zip64 sizes, then the padding field's header


class _Entry:
    def __init__(self, name: bytes, header_offset: int, size: int):
        self.name, self.header_offset, self.size = name, header_offset, size
        self.data_offset = 0
        self.crc = 0


class ZipWriter:
    """A stored (uncompressed) zip written front to back, its data 64-byte aligned.

    Each entry's size is declared before its data and its CRC-32, computed as the
    data passes, patched in after: the data streams through once, nothing is held
    or read back. Every local header carries zip64 sizes.
    """

    def __init__(self, out: OutputFile):
        self.out = out
        self.entries: list[_Entry] = []

    def begin(self, name: str, size: int) -> _Entry:
        raw = name.encode()
        entry = _Entry(raw, self.out.pos, size)
        header_end = entry.header_offset + _LOCAL_HEADER.size + len(raw) + _LOCAL_EXTRA
        pad = -header_end % ALIGNMENT
        extra = struct.pack("<HHQQHH", 1, 16, size, size, _PAD_ID, pad) + b"Z" * pad
        # fmt: off
        header = _LOCAL_HEADER.pack(
            0x04034B50, _ZIP64_VERSION, 0, 0, 0, _DOS_DATE,  # signature .. date
            0, 0xFFFFFFFF, 0xFFFFFFFF,  # CRC (patched in at close), sizes (in the extra)
            len(raw), len(extra),
        )
        # fmt: on
        self.out.write(header + raw + extra)
        entry.data_offset = self.out.pos
        self.out.begin_crc32()
        return entry

    def end(self, entry: _Entry) -> None:
        """Close the entry whose data was just written."""
        if self.out.pos - entry.data_offset != entry.size:
            raise CkptError(
                f"internal error: {self.out.pos - entry.data_offset} bytes written for "
                f"{entry.name.decode()}, {entry.size} declared"
            )
        entry.crc = self.out.end_crc32()
        self.out.patch(entry.header_offset + _CRC_OFFSET, struct.pack("<I", entry.crc))
        self.entries.append(entry)

    def add(self, name: str, data: bytes) -> None:
        entry = self.begin(name, len(data))
        self.out.write(data)
        self.end(entry)

    def close(self) -> None:
        """Write the central directory (and zip64 end records if needed)."""
        directory = bytearray()
        for entry in self.entries:
            big_size, big_offset = entry.size > _ZIP64_LIMIT, entry.header_offset > _ZIP64_LIMIT
            values = (entry.size, entry.size) * big_size + (entry.header_offset,) * big_offset
            zip64 = struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values)
            extra = zip64 if values else b""
            # fmt: off
            directory += _CENTRAL_HEADER.pack(
                0x02014B50, (3 << 8) | _ZIP64_VERSION, _ZIP64_VERSION, 0, 0, 0, _DOS_DATE,
                entry.crc,
                0xFFFFFFFF if big_size else entry.size, 0xFFFFFFFF if big_size else entry.size,
                len(entry.name), len(extra), 0, 0, 0, 0o644 << 16,  # name .. external attrs
                0xFFFFFFFF if big_offset else entry.header_offset,
            ) + entry.name + extra
            # fmt: on
        offset, size, count = self.out.pos, len(directory), len(self.entries)
        if count > 0xFFFF or max(offset, size) > _ZIP64_LIMIT:
            # fmt: off
            directory += _ZIP64_END.pack(
                0x06064B50, _ZIP64_END.size - 12, _ZIP64_VERSION, _ZIP64_VERSION, 0, 0,
                count, count, size, offset,
            ) + _ZIP64_LOCATOR.pack(0x07064B50, 0, offset + size, 1)
            # fmt: on
            count, size, offset = min(count, 0xFFFF), min(size, 0xFFFFFFFF), 0xFFFFFFFF
        directory += _END.pack(0x06054B50, 0, 0, count, count, size, offset, 0)
        self.out.write(directory)


# ---------------------------------------------------------------- the writer


class TorchZipWriter:
    """Stream tensors into a torch zip, then pickle the structure that refers to them."""

    def __init__(
        self,
        out: OutputFile,
        *,
        cast: DType | None = None,
        location: str = "cpu",
        progress: Progress | None = None,
    ):
        self.zip = ZipWriter(out)
        self.cast, self.location, self.progress = cast, location, progress
        self._count = 0

    def add_tensor(self, leaf: Any) -> _Reduced:
        """Write one tensor's bytes now; return what the pickle will hold for it: as
        torch pickles it, an ``nn.Parameter`` where one was read, ``requires_grad`` kept
        (sharded tensors are written plain)."""
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
            args = (reduced, grad, collections.OrderedDict())
            return _Reduced(torch_global("torch._utils", "_rebuild_parameter"), args)
        return reduced

    def _dense(self, leaf: Any, requires_grad: bool) -> _Reduced:
        key = str(self._count)
        self._count += 1
        dt = output_dtype(leaf, self.cast)
        entry = self.zip.begin(f"{ARCHIVE}/data/{key}", leaf.numel * dt.itemsize)
        write_leaf(self.zip.out, leaf, self.cast, self.progress)
        self.zip.end(entry)
        storage = _Storage(key, dt, leaf.numel, self.location)
        quantizer = getattr(leaf, "quantizer", None)
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
        leaf.load("cpu")  # checks its invariants: torch.load would refuse the output otherwise
        parts = [self.add_tensor(part) for part in leaf.parts]
        size = pickle_value(TorchSize(leaf.shape))
        coalesced = (leaf.is_coalesced,) if leaf.layout == "sparse_coo" else ()
        layout = pickle_value(TorchName(f"torch.{leaf.layout}"))
        data = (*parts, size, *coalesced)
        return _Reduced(torch_global("torch._utils", "_rebuild_sparse_tensor"), (layout, data))

    def add_storage(self, ref: StorageRef) -> _Storage:
        """A storage saved on its own: its bytes now, the storage itself in the pickle."""
        key = str(self._count)
        self._count += 1
        entry = self.zip.begin(f"{ARCHIVE}/data/{key}", ref.nbytes)
        write_leaf(self.zip.out, TensorRef.whole_storage(ref), None, self.progress)
        self.zip.end(entry)
        return _Storage(key, ref.dtype, ref.numel, self.location)

    def convert(self, node: Any) -> Any:
        """The structure with every lazy tensor written and replaced by its pickle stand-in."""
        return to_plain(
            node, self.add_tensor, pickle_value, weights_only=True, storage=self.add_storage
        )

    def finish(self, structure: Any) -> None:
        data = io.BytesIO()
        _Pickler(data, protocol=PICKLE_PROTOCOL).dump(structure)
        self.zip.add(f"{ARCHIVE}/data.pkl", data.getvalue())
        self.zip.add(f"{ARCHIVE}/byteorder", b"little")
        self.zip.add(f"{ARCHIVE}/version", b"3\n")
        self.zip.add(f"{ARCHIVE}/.format_version", b"1")
        self.zip.add(f"{ARCHIVE}/.storage_alignment", str(ALIGNMENT).encode())
        self.zip.close()


def write_torch(
    path: str,
    root: Any,
    *,
    cast: DType | None = None,
    location: str = "cpu",
    progress: Progress | None = None,
) -> None:
    """Write ``root`` (a nested structure with lazy tensors) as a torch.save file."""
    # the tensors' bytes: the zip's headers and the pickle add a little
    size = sum(output_nbytes(leaf, cast) for _, leaf in iter_tensors(root))
    with OutputFile(path, size_hint=size) as out:
        writer = TorchZipWriter(out, cast=cast, location=location, progress=progress)
        writer.finish(writer.convert(root))
