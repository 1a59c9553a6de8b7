"""A restricted unpickler: rebuilds tensors lazily and never runs code from the file.

Every global a pickle names goes through :meth:`SafeUnpickler.find_class`, which
returns one of our own stand-ins, never the real object:

* torch's tensor rebuild functions return :class:`~ckpttool.tree.TensorRef`
  (no bytes read), ShardedTensor and DTensor become local-shard records;
* containers and primitives (``collections.OrderedDict``, ``builtins.set``...)
  are rebuilt for real, as they run no user code;
* a dangerous callable (``os.system``, ``builtins.eval``, ``subprocess.Popen``...)
  is recorded and replaced by an inert stand-in, so the whole pickle can still
  be walked and every offending global named; the caller then refuses the file;
* any other class becomes an inert :class:`~ckpttool.tree.Opaque`.
"""

from __future__ import annotations

import _compat_pickle
import collections
import dataclasses
import io
import pickle
import struct
from collections.abc import Callable
from typing import IO, Any

from .errors import CkptError, UnsafeError
from .tree import (
    DTYPES,
    STORAGE_CLASSES,
    ByteSource,
    DType,
    Opaque,
    StorageRef,
    TensorRef,
    contiguous_stride,
    opaque_class,
    state_attrs,
)

# Modules whose every global is refused: they reach the OS, the network, the
# interpreter or another deserializer.
DANGEROUS_MODULES = frozenset(
    """os posix nt posixpath ntpath subprocess sys runpy importlib imp socket shutil pickle
    _pickle cPickle dill cloudpickle joblib marshal ctypes _ctypes pty code codeop commands
    webbrowser multiprocessing asyncio http urllib urllib2 ftplib smtplib telnetlib poplib
    imaplib requests pdb bdb timeit platform signal threading _thread tempfile io _io fcntl
    resource cProfile profile trace types inspect gc pip setuptools distutils zipimport
    pkgutil sqlite3 ssl select selectors mmap operator _operator xmlrpc socketserver pydoc
    _posixsubprocess _socket _winapi venv""".split()
)
# Single globals refused outside those modules.
DANGEROUS_NAMES = frozenset(
    """torch.load torch.serialization.load torch.serialization._load torch.jit.load
    torch.storage._load_from_bytes torch._C._load_for_lite_interpreter torch.hub.load
    torch.hub.load_state_dict_from_url torch.utils.cpp_extension.load
    torch.utils.cpp_extension.load_inline numpy.load numpy.loadtxt numpy.fromfile
    numpy.testing._private.utils.runstring numpy.lib.npyio.load numpy.f2py""".split()
)
# Names refused under any module: reaching ``torch.os`` or ``numpy.sys`` is reaching os.
DANGEROUS_ATTRS = frozenset(
    """eval exec compile __import__ __builtins__ system popen open execv execve spawnv
    spawnl fork attrgetter methodcaller""".split()
)
DANGEROUS_PREFIXES = (
    "torch.fx.",
    "torch.package.",
    "torch._dynamo.",
    "torch._inductor.",
    "torch.distributed.rpc.",
    "torch.utils.cpp_extension.",
    "torch.hub.",
    "torch._C._jit",
    "torch.jit.",
    "torch.ops.",
    "numpy.f2py",
    "numpy.distutils",
)
# builtins that are plain data constructors; every other builtin is refused
# (eval, exec, compile, open, __import__, getattr on non-torch objects, ...).
SAFE_BUILTINS = frozenset(
    # no `range`: set(range(10**12)) would be a tiny pickle that never finishes
    "dict list tuple set frozenset str int float complex bool slice object".split()
)
# Module-level torch objects referenced by real checkpoints that need nothing but a name.
TORCH_LAYOUTS = frozenset({"strided", "sparse_coo", "sparse_csr", "_mkldnn", "jagged"})
TORCH_MEMORY_FORMATS = frozenset(
    {"contiguous_format", "channels_last", "channels_last_3d", "preserve_format"}
)
# Metadata classes of ShardedTensor, DTensor and DCP: rebuilt as records, not opaque.
KNOWN_TORCH_PREFIXES = (
    "torch.distributed._shard.",
    "torch.distributed.tensor.",
    "torch.distributed._tensor.",
    "torch.distributed.device_mesh.",
    "torch.distributed._mesh_layout.",
    "torch.distributed.checkpoint.",
    "torch.distributed.remote_device.",
    "torch.nn.parameter.",
    "torch.Tensor",
    "torch._tensor.",
)
SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"
DTENSOR_CLASSES = frozenset(
    {
        "torch.distributed.tensor.DTensor",
        "torch.distributed._tensor.api.DTensor",
        "torch.distributed.tensor._api.DTensor",
    }
)
MAX_BYTES_CONSTRUCTOR = 1 << 24


def is_dangerous(module: str, name: str) -> bool:
    """Whether the global ``module.name`` is refused without ``--unsafe``."""
    full = f"{module}.{name}"
    root = module.split(".", 1)[0]
    if module == "builtins":
        return name not in SAFE_BUILTINS and not _is_exception_name(name)
    return (
        root in DANGEROUS_MODULES
        or name in DANGEROUS_MODULES
        or name in DANGEROUS_ATTRS
        or full in DANGEROUS_NAMES
        or any(full.startswith(p) for p in DANGEROUS_PREFIXES)
    )


def python3_name(module: str, name: str) -> tuple[str, str]:
    """The global the real unpickler would import for ``module.name``.

    Protocols 0-2 (torch.save writes 2) store Python 2 names: ``subprocess.Popen`` is
    written ``commands.Popen``, ``http.server`` ``BaseHTTPServer``, ``_thread`` ``thread``.
    """
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _is_exception_name(name: str) -> bool:
    return name.endswith(("Error", "Exception", "Warning"))


class Device(str):
    """A ``torch.device`` seen in a pickle, kept as its string (``cuda:0``)."""


class TorchName(str):
    """A torch module-level object seen in a pickle (layout, memory format), by name."""


class StorageType:
    """Stand-in for a ``torch.*Storage`` class: only its element dtype matters."""

    def __init__(self, name: str, dtype: DType):
        self.name = name
        self.dtype = dtype


class WrapperStub:
    """What ``torch._utils._rebuild_wrapper_subclass`` returns: the global tensor's metadata."""

    def __init__(self, cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
        self.cls = cls
        self.dtype = dtype
        self.shape = _int_tuple(size, "size")
        self.device = str(device)
        self.requires_grad = bool(requires_grad)


class LocalShards:
    """One rank's part of a ShardedTensor or DTensor, before ranks are combined.

    Attributes:
        kind: ``sharded_tensor`` or ``dtensor``.
        dtype, shape, device: the global tensor's.
        shards: this rank's blocks, as :class:`~ckpttool.tree.Shard`.
        layout: global description of every block (ShardedTensor: list of
            (offsets, sizes, rank)); DTensor: mesh shape, coordinate, placements.
        rank, world_size: when the file says so.
    """

    def __init__(self, kind, dtype, shape, device, requires_grad=False):
        self.kind = kind
        self.dtype = dtype
        self.shape = shape
        self.device = device
        self.requires_grad = requires_grad
        self.shards: list = []
        self.layout: Any = None
        self.rank: int | None = None
        self.world_size: int | None = None

    @property
    def nbytes(self) -> int:
        import math

        return math.prod(self.shape) * self.dtype.itemsize


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise CkptError(f"corrupt tensor {what} {value!r}")
    return tuple(value)


def _as_dtype(value: Any) -> DType:
    if isinstance(value, DType):
        return value
    raise CkptError(f"corrupt tensor dtype {value!r}")


def rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, *_, dtype=None):
    """Stand-in for ``torch._utils._rebuild_tensor_v2``: a lazy TensorRef, bounds-checked."""
    if not isinstance(storage, StorageRef):
        raise CkptError("corrupt pickle: tensor without a storage")
    shape = _int_tuple(size, "shape")
    strides = _int_tuple(stride, "stride") if stride is not None else contiguous_stride(shape)
    if not isinstance(storage_offset, int) or storage_offset < 0 or len(strides) != len(shape):
        raise CkptError("corrupt tensor metadata (offset or stride)")
    if any(s < 0 for s in shape) or any(s < 0 for s in strides):
        raise CkptError("corrupt tensor metadata (negative size or stride)")
    dt = dtype or storage.dtype
    # The last element must lie inside the storage, or reading would run past it.
    if all(shape):
        last = storage_offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        if (last + 1) * dt.itemsize > storage.nbytes:
            raise CkptError(
                f"tensor of shape {list(shape)} does not fit its storage of "
                f"{storage.nbytes} bytes (corrupt or truncated file)"
            )
    return TensorRef(
        dtype=dt,
        shape=shape,
        stride=strides,
        offset=storage_offset,
        storage=storage,
        device=storage.device,
        requires_grad=bool(requires_grad),
    )


def _rebuild_tensor_v1(storage, storage_offset, size, stride):
    return rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_):
    return rebuild_tensor(
        storage, storage_offset, size, stride, requires_grad, dtype=_as_dtype(dtype)
    )


def _rebuild_parameter(data, requires_grad=False, *_):
    if isinstance(data, TensorRef):
        data.kind = "parameter"
        data.requires_grad = bool(requires_grad)
    return data


def _rebuild_qtensor(storage, storage_offset, size, stride, *_):
    """Stand-in for ``torch._utils._rebuild_qtensor``: a tensor of the quantized dtype.

    The quantizer (scale, zero point) is not kept, so reading its values fails with a
    clear error instead of the tensor silently vanishing from conversions.
    """
    ref = rebuild_tensor(storage, storage_offset, size, stride)
    ref.kind = "quantized"
    return ref


def _rebuild_meta(dtype, size, stride, requires_grad=False):
    shape = _int_tuple(size, "shape")
    return TensorRef(
        dtype=_as_dtype(dtype),
        shape=shape,
        stride=_int_tuple(stride, "stride"),
        offset=0,
        storage=None,
        device="meta",
        requires_grad=bool(requires_grad),
    )


def _rebuild_from_type_v2(func, new_type, args, state):
    """Stand-in for ``torch._tensor._rebuild_from_type_v2`` (tensor subclasses)."""
    base = func(*args)
    name = (
        new_type.class_name() if isinstance(new_type, type) and issubclass(new_type, Opaque) else ""
    )
    if isinstance(base, WrapperStub) and name == SHARDED_TENSOR:
        return _sharded_tensor_local(base, state)
    if isinstance(base, WrapperStub) and name in DTENSOR_CLASSES:
        return _dtensor_local(base, state)
    if isinstance(base, TensorRef):
        if name == "torch.nn.parameter.Parameter":
            base.kind = "parameter"
        elif name and name not in ("torch.Tensor", "torch._tensor.Tensor"):
            base.kind = name
        return base
    return opaque_class("torch._tensor", "_rebuild_from_type_v2")(func, new_type, args, state)


_attrs = state_attrs


def _sharded_tensor_local(stub: WrapperStub, state: Any) -> LocalShards:
    """A ShardedTensor's pickled state: (local shards, metadata, process group state, ...)."""
    from .tree import Shard

    if not isinstance(state, tuple) or len(state) < 2:
        raise CkptError("corrupt ShardedTensor state")
    local_shards, metadata = state[0], state[1]
    meta = _attrs(metadata)
    out = LocalShards(
        "sharded_tensor", _as_dtype(stub.dtype), stub.shape, stub.device, stub.requires_grad
    )
    layout = []
    for shard_meta in meta.get("shards_metadata", []):
        m = _attrs(shard_meta)
        layout.append(
            (
                _int_tuple(m.get("shard_offsets"), "shard offsets"),
                _int_tuple(m.get("shard_sizes"), "shard sizes"),
                _placement_rank(m.get("placement")),
            )
        )
    out.layout = layout
    for shard in local_shards or []:
        s = _attrs(shard)
        m = _attrs(s.get("metadata"))
        offsets = _int_tuple(m.get("shard_offsets"), "shard offsets")
        sizes = _int_tuple(m.get("shard_sizes"), "shard sizes")
        tensor = s.get("tensor")
        if not isinstance(tensor, TensorRef) or tensor.shape != sizes:
            raise CkptError("corrupt ShardedTensor: a local shard does not match its metadata")
        out.shards.append(Shard(offsets, sizes, tensor, _placement_rank(m.get("placement"))))
    if len(state) > 2:
        pg = _attrs(state[2])
        out.rank = pg.get("global_rank")
        out.world_size = pg.get("global_world_size")
    if out.device == "cpu" and out.shards:
        out.device = out.shards[0].tensor.device
    return out


def _placement_rank(placement: Any) -> int | None:
    """``_remote_device('rank:1/cuda:1')`` -> 1."""
    if isinstance(placement, Opaque):
        a = placement.attrs()
        if isinstance(a.get("_worker_name"), str) and a["_worker_name"].startswith("rank:"):
            return int(a["_worker_name"][5:])
        if isinstance(a.get("_rank"), int):
            return a["_rank"]
        for arg in placement.args:
            if isinstance(arg, str) and arg.startswith("rank:"):
                return int(arg[5:].split("/", 1)[0])
    return None


def _dtensor_local(stub: WrapperStub, state: Any) -> LocalShards:
    """A DTensor's pickled state: ``{"_local_tensor", "_spec": DTensorSpec(mesh, placements)}``."""
    s = _attrs(state)
    local = s.get("_local_tensor")
    spec = _attrs(s.get("_spec"))
    mesh = _attrs(spec.get("mesh"))
    if not isinstance(local, TensorRef):
        raise CkptError("corrupt DTensor: no local tensor")
    out = LocalShards(
        "dtensor", _as_dtype(stub.dtype), stub.shape, local.device, stub.requires_grad
    )
    placements = []
    for p in spec.get("placements") or ():
        cls = type(p).__name__ if isinstance(p, Opaque) else ""
        a = _attrs(p)
        if cls in ("Shard", "_StridedShard"):
            if cls == "_StridedShard":
                raise CkptError("DTensor _StridedShard placements are not supported")
            placements.append(("shard", a.get("dim")))
        elif cls == "Replicate":
            placements.append(("replicate", None))
        else:
            placements.append((cls.lower() or "unknown", None))
    out.layout = {
        "mesh_shape": _mesh_shape(mesh),
        "coordinate": tuple(mesh.get("_coordinate_on_dim") or ()),
        "placements": placements,
    }
    out.rank = mesh.get("_rank") if isinstance(mesh.get("_rank"), int) else None
    out.shards.append(_LocalBlock(local))
    return out


class _LocalBlock:
    """A DTensor's local tensor before its offsets are known (set when ranks are combined)."""

    def __init__(self, tensor: TensorRef):
        self.tensor = tensor


def _mesh_shape(mesh: dict) -> tuple[int, ...] | None:
    layout = _attrs(mesh.get("_layout"))
    if layout:
        shapes = []
        for axis in layout.get("axes") or ():
            shape = _attrs(axis).get("shape")
            if isinstance(shape, tuple):
                shapes.extend(shape)
        if shapes:
            return tuple(shapes)
    mesh_tensor = mesh.get("mesh")
    if isinstance(mesh_tensor, TensorRef):
        return mesh_tensor.shape
    return None


def _torch_size(values=()):
    return tuple(values)


def _torch_device(kind, index=None):
    if isinstance(kind, Device):
        return kind
    if not isinstance(kind, str):
        raise CkptError(f"corrupt torch.device {kind!r}")
    return Device(kind if index is None else f"{kind}:{index}")


def _get_layout(name):
    return TorchName(name)


def _codecs_encode(obj, encoding="utf-8", errors="strict"):
    # Protocol 2 pickles bytes as _codecs.encode(str, "latin1").
    if not isinstance(obj, str) or encoding.lower() not in (
        "latin1",
        "latin-1",
        "utf-8",
        "utf8",
        "ascii",
    ):
        raise CkptError("corrupt pickle: unexpected _codecs.encode call")
    return obj.encode(encoding, errors)


def _bounded(ctor):
    def build(*args):
        if args and isinstance(args[0], int) and args[0] > MAX_BYTES_CONSTRUCTOR:
            raise CkptError("corrupt pickle: absurd buffer size")
        return ctor(*args)

    return build


def _reconstructor(cls, base, state=None):
    # copyreg._reconstructor(cls, object, None) == object.__new__(cls)
    if isinstance(cls, type) and issubclass(cls, Opaque):
        return cls()
    return opaque_class("copyreg", "_reconstructor")(cls, base, state)


def _newobj(cls, *args):
    if isinstance(cls, type) and issubclass(cls, Opaque):
        return cls(*args)
    return opaque_class("copyreg", "__newobj__")(cls, *args)


def _defaultdict(default_factory=None, *args):
    # Keep the mapping, drop the factory: we never call it, and a plain dict
    # stays loadable with weights_only=True.
    return dict(*args)


# numpy dtype codes (``numpy.dtype("f4")``) -> (torch dtype, struct format for scalars)
NUMPY_CODES = {
    "f8": ("float64", "d"),
    "f4": ("float32", "f"),
    "f2": ("float16", "e"),
    "i8": ("int64", "q"),
    "i4": ("int32", "i"),
    "i2": ("int16", "h"),
    "i1": ("int8", "b"),
    "u8": ("uint64", "Q"),
    "u4": ("uint32", "I"),
    "u2": ("uint16", "H"),
    "u1": ("uint8", "B"),
    "b1": ("bool", "?"),
    "c8": ("complex64", None),
    "c16": ("complex128", None),
}


def _numpy_dtype(obj: Any) -> tuple[DType, str | None, bool] | None:
    """(dtype, struct format, big endian) of a pickled ``numpy.dtype``, None if not numeric."""
    if not isinstance(obj, Opaque) or not obj.args or not isinstance(obj.args[0], str):
        return None
    code = NUMPY_CODES.get(obj.args[0])
    if code is None:
        return None
    order = obj.state[1] if isinstance(obj.state, tuple) and len(obj.state) > 1 else "<"
    return DTYPES[code[0]], code[1], order == ">"


class NumpyArrayRef(TensorRef):
    """A pickled ``numpy.ndarray``, read as a tensor (no numpy import, bytes kept in memory).

    Built empty by ``_reconstruct`` and filled by the pickle's BUILD, as numpy does.
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(DTYPES["uint8"], (0,), (1,), 0, None, kind="numpy.ndarray")

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) < 4:
            return
        shape, np_dtype, fortran, raw = state[-4:]
        described = _numpy_dtype(np_dtype)
        if described is None or not isinstance(raw, (bytes, bytearray)):
            self.kind = "numpy.ndarray (object or unsupported dtype, not read)"
            return
        dtype, _, big_endian = described
        shape = _int_tuple(shape, "shape")
        stride = contiguous_stride(shape[::-1])[::-1] if fortran else contiguous_stride(shape)
        numel = len(raw) // dtype.itemsize
        self.dtype, self.shape, self.stride = dtype, shape, stride
        self.storage = StorageRef("numpy", dtype, numel, "cpu", ByteSource(data=raw), big_endian)
        if self.numel > numel:
            raise CkptError("corrupt numpy array: fewer bytes than its shape needs")


def _numpy_scalar(np_dtype: Any, raw: Any = None) -> Any:
    described = _numpy_dtype(np_dtype)
    if described is None or described[1] is None or not isinstance(raw, (bytes, bytearray)):
        return opaque_class("numpy", "generic", known=True)(np_dtype, raw)
    dtype, fmt, big_endian = described
    try:
        return struct.unpack((">" if big_endian else "<") + fmt, raw)[0]
    except struct.error:
        raise CkptError("corrupt numpy scalar") from None


def _wrapper_subclass(
    cls, dtype, size, stride, storage_offset, layout, device, requires_grad=False
):
    return WrapperStub(cls, dtype, size, stride, storage_offset, layout, device, requires_grad)


SAFE_GLOBALS: dict[str, Any] = {
    "collections.OrderedDict": collections.OrderedDict,
    "collections.defaultdict": _defaultdict,
    "builtins.dict": dict,
    "builtins.list": list,
    "builtins.tuple": tuple,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.str": str,
    "builtins.int": int,
    "builtins.float": float,
    "builtins.complex": complex,
    "builtins.bool": bool,
    "builtins.slice": slice,
    "builtins.bytes": _bounded(bytes),
    "builtins.bytearray": _bounded(bytearray),
    "builtins.object": opaque_class("builtins", "object"),
    "_codecs.encode": _codecs_encode,
    "copyreg._reconstructor": _reconstructor,
    "copyreg.__newobj__": _newobj,
    "torch._utils._rebuild_tensor": _rebuild_tensor_v1,
    "torch._utils._rebuild_tensor_v2": rebuild_tensor,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._utils._rebuild_meta_tensor_no_storage": _rebuild_meta,
    "torch._utils._rebuild_qtensor": _rebuild_qtensor,
    "torch._utils._rebuild_wrapper_subclass": _wrapper_subclass,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch._tensor._rebuild_from_type": lambda func, type_, args, dict_: func(*args),
    "numpy.core.multiarray._reconstruct": NumpyArrayRef,
    "numpy._core.multiarray._reconstruct": NumpyArrayRef,
    "numpy.core.multiarray.scalar": _numpy_scalar,
    "numpy._core.multiarray.scalar": _numpy_scalar,
    "torch.Size": _torch_size,
    "torch.device": _torch_device,
    "torch.serialization._get_layout": _get_layout,
}


class _ReadOnlyCall:
    """A safe global as a pickle gets it: callable, but no attribute can be set.

    A pickle may BUILD on any object it names; on our shared functions that would
    change how every later file is read (``__kwdefaults__``, ``__defaults__``).
    """

    __slots__ = ("_func",)

    def __init__(self, func: Callable[..., Any]):
        object.__setattr__(self, "_func", func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._func(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("read-only")


class SafeUnpickler(pickle.Unpickler):
    """Unpickle with stand-ins; collects every global seen and the dangerous ones.

    Args:
        file: A binary file positioned at the pickle.
        persistent_load: Called with each persistent id (torch storages).
        permissive: Do not refuse dangerous globals (``--unsafe``); they stay inert.
    """

    def __init__(
        self,
        file: IO[bytes],
        persistent_load: Callable[[Any], Any] | None = None,
        *,
        permissive: bool = False,
        encoding: str = "utf-8",
    ):
        super().__init__(file, encoding=encoding)
        self._persistent_load = persistent_load
        self.permissive = permissive
        self.seen: set[str] = set()
        self.dangerous: set[str] = set()

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent_load is None:
            raise CkptError("corrupt pickle: unexpected persistent id")
        return self._persistent_load(pid)

    def find_class(self, module: str, name: str) -> Any:
        module, name = python3_name(module, name)
        full = f"{module}.{name}"
        self.seen.add(full)
        if full in SAFE_GLOBALS:
            value = SAFE_GLOBALS[full]
            # builtin types cannot be changed and stand-in classes are read-only
            is_type = isinstance(value, type)
            if is_type and (
                value.__module__ in ("builtins", "collections") or issubclass(value, Opaque)
            ):
                return value
            return _ReadOnlyCall(value)
        if module == "builtins" and name == "getattr":
            return self._getattr
        if is_dangerous(module, name):
            self.dangerous.add(full)
            return opaque_class(module, name, dangerous=True)
        if module in ("torch", "torch.storage") and name in STORAGE_CLASSES:
            return StorageType(name, DTYPES[STORAGE_CLASSES[name]])
        if module == "torch" and name in DTYPES:
            # a copy: BUILD writes into __dict__ past ``frozen``, and DTYPES is shared
            return dataclasses.replace(DTYPES[name])
        if module == "torch" and name in TORCH_LAYOUTS | TORCH_MEMORY_FORMATS:
            return TorchName(f"torch.{name}")
        known = full.startswith(KNOWN_TORCH_PREFIXES) or module.startswith("pathlib")
        return opaque_class(module, name, known=known)

    def _getattr(self, obj: Any, name: Any, *default: Any) -> Any:
        """``getattr`` is allowed only to reach a nested class of a torch class.

        ShardedTensor pickles ``getattr(ShardedTensor, "ProcessGroupState")``.
        """
        if (
            isinstance(obj, type)
            and issubclass(obj, Opaque)
            and obj.module.startswith("torch.")
            and not obj.dangerous
            and isinstance(name, str)
            and name.isidentifier()
            and not name.startswith("_")
        ):
            qualname = f"{obj.qualname}.{name}"
            self.seen.add(f"{obj.module}.{qualname}")
            return opaque_class(obj.module, qualname, known=obj.known)
        self.dangerous.add("builtins.getattr")
        return opaque_class("builtins", "getattr", dangerous=True)(obj, name)


class _Absorb:
    """Accepts whatever a pickle does to an object and builds nothing (globals scan)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Absorb:
        return _ABSORB

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Absorb:
        return self

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


_ABSORB = object.__new__(_Absorb)


class GlobalsScanner(SafeUnpickler):
    """Judges every global exactly as :class:`SafeUnpickler` does, but rebuilds nothing.

    Several times faster than a full read: for the rank files of a per-rank
    checkpoint whose structure rank 0 already describes.
    """

    def find_class(self, module: str, name: str) -> Any:
        value = super().find_class(module, name)
        if value == self._getattr:
            return value
        if isinstance(value, type) and issubclass(value, Opaque) and not value.dangerous:
            return _named_absorb(value.module, value.qualname)  # getattr may look into it
        return _Absorb

    def _getattr(self, obj: Any, name: Any, *default: Any) -> Any:
        if isinstance(obj, type) and issubclass(obj, _Absorb) and obj is not _Absorb:
            # the same rule as a full read, on the class the absorbing one stands for
            obj = opaque_class(obj.module, obj.qualname)
        value = super()._getattr(obj, name, *default)
        if isinstance(value, type) and not value.dangerous:
            return _named_absorb(value.module, value.qualname)
        return _Absorb

    def persistent_load(self, pid: Any) -> Any:
        return _ABSORB


_NAMED_ABSORB: dict[tuple[str, str], type] = {}


def _named_absorb(module: str, qualname: str) -> type:
    """An absorbing class that remembers which global it stands for."""
    cls = _NAMED_ABSORB.get((module, qualname))
    if cls is None:
        cls = type("Absorb", (_Absorb,), {"module": module, "qualname": qualname})
        _NAMED_ABSORB[(module, qualname)] = cls
    return cls


def load_pickle(
    data: bytes | IO[bytes],
    persistent_load: Callable[[Any], Any] | None = None,
    *,
    path: object = None,
    permissive: bool = False,
    seen: set[str] | None = None,
    scan_only: bool = False,
) -> Any:
    """Unpickle ``data`` safely and return the object (with lazy tensor leaves).

    Args:
        data: The pickle bytes, or a binary file positioned at it.
        persistent_load: Resolves persistent ids (torch storages).
        path: The file, for messages.
        permissive: Keep dangerous globals as inert stand-ins instead of refusing.
        seen: A set that collects every global referenced (and ``!name`` for refused ones).
        scan_only: Only judge the globals (:class:`GlobalsScanner`); returns None.

    Raises:
        UnsafeError: The pickle references dangerous globals (and not ``permissive``).
        CkptError: The pickle is corrupt or truncated.
    """
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    start = stream.tell()
    unpickler_class = GlobalsScanner if scan_only else SafeUnpickler
    unpickler = unpickler_class(stream, persistent_load, permissive=permissive)
    error: BaseException | None = None
    result = None
    try:
        try:
            result = unpickler.load()
        except UnicodeDecodeError:
            # Python 2 pickles hold byte strings: torch.load(encoding="latin1") reads them.
            stream.seek(start)
            unpickler = unpickler_class(
                stream, persistent_load, permissive=permissive, encoding="latin1"
            )
            result = unpickler.load()
    except CkptError as exc:
        error = exc
    except RecursionError:
        error = CkptError("pickle nests too deeply", path=path)
    except Exception as exc:  # any malformed-pickle error the C unpickler raises
        error = exc
    if seen is not None:
        seen.update(unpickler.seen)
        seen.update("!" + g for g in unpickler.dangerous)
    if unpickler.dangerous and not permissive:
        raise UnsafeError(sorted(unpickler.dangerous), path=path)
    if isinstance(error, CkptError):
        if error.path is None:
            error.path = None if path is None else str(path)
            error.args = (error.one_line(),)
        raise error
    if error is not None:
        reason = "truncated" if isinstance(error, EOFError) else "corrupt"
        raise CkptError(f"{reason} pickle ({type(error).__name__}: {error})", path=path) from None
    if scan_only:
        return None
    check_structure(result, path)
    return result


# Far beyond any real checkpoint (Composer snapshots nest ~8 levels), and within what the
# recursive consumers (layout, materialize, JSON) handle.
MAX_NESTING = 200
# Entries seen again through containers that are shared (reachable by several paths).
MAX_SHARED_ENTRIES = 1_000_000


def check_structure(root: Any, path: object = None) -> None:
    """Refuse shapes that a few bytes of pickle can build and no checkpoint has.

    The memo lets a pickle share one container many times: a list holding the same
    list twice, 30 levels deep, is 300 bytes but 2**30 paths for every walk over the
    tree; a dict that holds itself never ends a walk over plain containers.

    Raises:
        CkptError: nesting deeper than MAX_NESTING, shared containers that expand to
            more than MAX_SHARED_ENTRIES entries, or a dict/list/tuple that holds itself.
    """
    from .tree import children, is_tensor

    expanded: set[int] = set()
    ancestors: set[int] = set()
    shared_entries = 0
    stack: list[tuple[Any, int, bool]] = [(root, 0, False)]
    while stack:
        node, depth, leaving = stack.pop()
        if leaving:
            ancestors.discard(id(node))
            continue
        if is_tensor(node) or not isinstance(node, (dict, list, tuple, Opaque)):
            continue
        if id(node) in ancestors:
            if isinstance(node, Opaque):  # objects may point back at a parent; walks cut that
                continue
            raise CkptError("corrupt pickle: a container holds itself", path=path)
        if depth > MAX_NESTING:
            raise CkptError(f"corrupt pickle: nests deeper than {MAX_NESTING} levels", path=path)
        kids = [child for _, child in children(node)]
        if id(node) in expanded:
            shared_entries += len(kids)
            if shared_entries > MAX_SHARED_ENTRIES:
                raise CkptError(
                    "corrupt pickle: containers shared by many paths would expand to more "
                    f"than {MAX_SHARED_ENTRIES} entries",
                    path=path,
                )
        expanded.add(id(node))
        ancestors.add(id(node))
        stack.append((node, depth, True))
        stack.extend((child, depth + 1, False) for child in kids)
