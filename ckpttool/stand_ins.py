"""Stand-ins the restricted unpickler hands out for torch and numpy globals.

torch's tensor rebuild functions return lazy :class:`~ckpttool.tree.TensorRef`
leaves (no bytes read); ShardedTensor and DTensor become :class:`LocalShards`
records that :mod:`ckpttool.formats.per_rank` combines; numpy arrays become
tensors and numpy scalars numbers; containers and primitives are rebuilt for
real, as they run no code. ``SAFE_GLOBALS`` maps each allowed global to its stand-in.
"""

from __future__ import annotations

import collections
import functools
import math
import struct
from typing import Any

from .errors import CkptError
from .guard import charge
from .tree import (
    DTYPES,
    SPARSE_PARTS,
    ByteSource,
    DType,
    Opaque,
    Sealed,
    Shard,
    SparseRef,
    StorageRef,
    TensorRef,
    check_dtype,
    contiguous_stride,
    opaque_class,
    state_attrs,
)

# Module-level torch objects referenced by real checkpoints that need nothing but a name.
TORCH_LAYOUTS = frozenset(
    "strided sparse_coo sparse_csr sparse_csc sparse_bsr sparse_bsc _mkldnn jagged".split()
)
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


# What torch.device accepts (torch/csrc/Device.cpp's types), as a pickle may name them.
DEVICE_TYPES = frozenset(
    """cpu cuda mkldnn opengl opencl ideep hip ve fpga maia xla lazy vulkan metal xpu mps
    meta hpu mtia privateuseone""".split()
)


class Device(str):
    """A ``torch.device`` seen in a pickle, kept as its string (``cuda:0``).

    No ``__dict__`` (``__slots__``): a pickle's BUILD cannot attach anything to it.
    """

    __slots__ = ()


class TorchName(str):
    """A torch module-level object seen in a pickle (layout, memory format), by name."""

    __slots__ = ()


class TorchSize(tuple):
    """A ``torch.Size`` seen in a pickle: its ints, given back (``load``, ``merge``) as a
    ``torch.Size``, whose ``numel()`` code reading the file relies on (DeepSpeed's
    ``param_shapes``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"torch.Size({list(self)!r})"


class StorageType(Sealed):
    """Stand-in for a ``torch.*Storage`` class: only its element dtype matters."""

    def __init__(self, name: str, dtype: DType):
        self.name = name
        self.dtype = dtype

    def global_name(self) -> str:
        return f"torch.{self.name}"


def check_storage_reference(storage_type: Any, numel: Any) -> None:
    """A persistent id's storage class and size are usable, or a one-line reason."""
    if isinstance(storage_type, type) and issubclass(storage_type, Opaque):
        name = storage_type.class_name()
        if name.startswith("torch.") and name.endswith("Storage"):  # QUInt4x2Storage...
            raise CkptError(f"tensors of storage type {name} are not supported")
    if not isinstance(storage_type, StorageType) or type(numel) is not int or numel < 0:
        raise CkptError("corrupt pickle: bad storage reference")


class NamedGlobal(functools.partial):
    """What the unpickler gives for an allowed global: the stand-in, callable as the
    pickle calls it, and the name the pickle gave. Named but never called (a function
    saved as a value, ``{"shape_type": torch.Size}``), it is shown and written back as
    that name instead of as ckpttool's own function.

    A fresh object per read keeps BUILD off our shared functions (``__kwdefaults__``
    would change how every later file is read); a partial calls through in C, without
    a Python frame per tensor.
    """

    # partial's own __setstate__ would let a BUILD swap the function it calls
    __setstate__ = Sealed.__setstate__

    def global_name(self) -> str:
        name = self.__dict__.get("name")
        return name if isinstance(name, str) else "<unknown global>"

    def builtin_type(self) -> type | None:
        """The builtin class it names (``{"dtype": float}`` saved a class as a value)."""
        return BUILTIN_TYPES.get(self.global_name())


def global_name(value: Any) -> str | None:
    """The pickle's name for a global kept as a value (not called), else None."""
    if isinstance(value, (NamedGlobal, StorageType)):
        return value.global_name()
    return None


class WrapperStub(Sealed):
    """What ``torch._utils._rebuild_wrapper_subclass`` returns: the global tensor's metadata."""

    def __init__(self, cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
        if not isinstance(device, Device):
            raise CkptError(f"corrupt tensor device {device!r:.80}")
        self.cls = cls
        self.dtype = dtype
        self.shape = _int_tuple(size, "size")
        check_shape(self.shape)
        self.device = str(device)
        self.requires_grad = bool(requires_grad)


class LocalShards(Sealed):
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


_INT_ONLY = frozenset({int})


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    # hot: called for every size, stride and shard offset, so the check runs in C;
    # exact `int` types also reject bool
    if type(value) in (tuple, list, TorchSize) and _INT_ONLY.issuperset(map(type, value)):
        return tuple(value)
    raise CkptError(f"corrupt tensor {what} {value!r}")


def _as_dtype(value: Any) -> DType:
    return check_dtype(value)


def rebuild_tensor(
    storage,
    storage_offset,
    size,
    stride,
    requires_grad=False,
    backward_hooks=None,
    metadata=None,
    *_,
    dtype=None,
):
    """Stand-in for ``torch._utils._rebuild_tensor_v2``: a lazy TensorRef, bounds-checked.

    ``metadata`` carries the conjugate / negative bits of a lazy view (``{"conj": True}``).
    """
    if not isinstance(storage, StorageRef):
        raise CkptError("corrupt pickle: tensor without a storage")
    shape = _int_tuple(size, "shape")
    strides = _int_tuple(stride, "stride") if stride is not None else contiguous_stride(shape)
    if not isinstance(storage_offset, int) or storage_offset < 0 or len(strides) != len(shape):
        raise CkptError("corrupt tensor metadata (offset or stride)")
    if any(s < 0 for s in shape) or any(s < 0 for s in strides):
        raise CkptError("corrupt tensor metadata (negative size or stride)")
    dt = dtype or storage.dtype
    check_shape(shape)
    # The last element must lie inside the storage, or reading would run past it.
    if all(shape):
        last = storage_offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        if (last + 1) * dt.itemsize > storage.nbytes:
            raise CkptError(
                f"tensor of shape {list(shape)} does not fit its storage of "
                f"{storage.nbytes} bytes (corrupt or truncated file)"
            )
        check_view(shape, dt, storage.nbytes)
    return TensorRef(
        dtype=dt,
        shape=shape,
        stride=strides,
        offset=storage_offset,
        storage=storage,
        device=storage.device,
        requires_grad=bool(requires_grad),
        conj=isinstance(metadata, dict) and metadata.get("conj") is True,
        neg=isinstance(metadata, dict) and metadata.get("neg") is True,
    )


# torch counts elements in an int64; safetensors and torch refuse a shape past it even
# where another dimension is 0
MAX_NUMEL = 2**63 - 1
# A view may repeat its storage's elements (stride 0: ``x.expand(n)``); written out, the
# repeats cost bytes the file does not hold. Past this many extra bytes it is refused.
MAX_VIEW_GROWTH = 64 << 20


def check_shape(shape: tuple[int, ...]) -> None:
    """Each dimension and the element count of every non-empty part fit torch's int64."""
    count = 1
    for n in shape:
        count *= max(n, 1)
        if n < 0 or count > MAX_NUMEL:
            raise CkptError(f"corrupt tensor: impossible shape {list(shape)[:8]}")


def check_view(shape: tuple[int, ...], dtype: DType, storage_nbytes: int) -> None:
    """A view's full size stays near what its storage holds (see MAX_VIEW_GROWTH)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > storage_nbytes + MAX_VIEW_GROWTH:
        raise CkptError(
            f"a view of {math.prod(shape)} elements repeats its storage of "
            f"{storage_nbytes} bytes past {MAX_VIEW_GROWTH >> 20} MiB: not supported"
        )


def _rebuild_tensor_v1(storage, storage_offset, size, stride):
    return rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(
    storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None, *_
):
    return rebuild_tensor(
        storage,
        storage_offset,
        size,
        stride,
        requires_grad,
        hooks,
        metadata,
        dtype=_as_dtype(dtype),
    )


def _rebuild_parameter(data, requires_grad=False, *_):
    if isinstance(data, (TensorRef, SparseRef)):
        data.parameter = True
        data.requires_grad = bool(requires_grad)
    return data


def _rebuild_qtensor(storage, storage_offset, size, stride, quantizer_params=None, *rest):
    """Stand-in for ``torch._utils._rebuild_qtensor``: a tensor of the quantized dtype
    (its stored bytes are the integer representation) with its quantizer."""
    requires_grad = rest[0] if rest else False
    ref = rebuild_tensor(storage, storage_offset, size, stride, requires_grad)
    ref.kind = "quantized"
    ref.quantizer = _quantizer(quantizer_params)
    if ref.quantizer is not None and len(ref.quantizer) == 4:
        _, scales, zero_points, axis = ref.quantizer
        if not (0 <= axis < len(ref.shape)) or not (
            scales.numel == zero_points.numel == ref.shape[axis]
            and len(scales.shape) == len(zero_points.shape) == 1
        ):
            raise CkptError(
                f"corrupt quantized tensor: {scales.numel} scales and {zero_points.numel} zero "
                f"points for axis {axis} of shape {list(ref.shape)}"
            )
    return ref


PER_CHANNEL_QSCHEMES = ("per_channel_affine", "per_channel_affine_float_qparams")


def _quantizer(params: Any) -> tuple | None:
    """The quantizer torch pickles: (qscheme, scale, zero point) or (qscheme, scales,
    zero points, axis); the qscheme is a ``torch.per_*`` global. None if not one of these."""
    if not isinstance(params, tuple) or not params:
        return None
    scheme = params[0]
    is_torch_name = (
        isinstance(scheme, type) and issubclass(scheme, Opaque) and scheme.module == "torch"
    )
    name = scheme.qualname if is_torch_name else None
    if name == "per_tensor_affine" and len(params) == 3:
        scale, zero_point = params[1:]
        if isinstance(scale, (int, float)) and isinstance(zero_point, int):
            return (name, float(scale), zero_point)
    if name in PER_CHANNEL_QSCHEMES and len(params) == 4:
        scales, zero_points, axis = params[1:]
        if isinstance(scales, TensorRef) and isinstance(zero_points, TensorRef):
            if isinstance(axis, int):
                return (name, scales, zero_points, axis)
    return None


def _rebuild_meta(dtype, size, stride, requires_grad=False):
    shape = _int_tuple(size, "shape")
    check_shape(shape)
    return TensorRef(
        dtype=_as_dtype(dtype),
        shape=shape,
        stride=_int_tuple(stride, "stride"),
        offset=0,
        storage=None,
        device="meta",
        requires_grad=bool(requires_grad),
    )


def _rebuild_sparse_tensor(layout, data):
    """Stand-in for ``torch._utils._rebuild_sparse_tensor``: a :class:`SparseRef` of the
    stored index and value tensors. torch checks their invariants when it is read."""
    name = layout.removeprefix("torch.") if isinstance(layout, TorchName) else None
    if name not in SPARSE_PARTS:  # a layout this version does not know: kept inert
        return opaque_class("torch._utils", "_rebuild_sparse_tensor").make(layout, data)
    count = len(SPARSE_PARTS[name])
    is_coalesced = None
    # COO data is (indices, values, size) before torch 2.1, then is_coalesced too
    if name == "sparse_coo" and isinstance(data, tuple) and len(data) == count + 2:
        data, is_coalesced = data[:-1], data[-1]
    if (
        not isinstance(data, tuple)
        or len(data) != count + 1
        or not all(isinstance(part, TensorRef) for part in data[:count])
        or not isinstance(is_coalesced, (bool, type(None)))
    ):
        raise CkptError(f"corrupt sparse tensor ({name})")
    parts, size = data[:count], _int_tuple(data[count], "shape")
    if any(n < 0 for n in size) or math.prod(size) >= 2**63:  # torch's numel is an int64
        raise CkptError(f"corrupt sparse tensor: impossible shape {list(size)}")
    if any(part.dtype.name not in ("int32", "int64") for part in parts[:-1]):
        raise CkptError(f"corrupt sparse tensor ({name}): its indices are not integers")
    if name != "sparse_coo" and len(size) < 2:
        raise CkptError(f"corrupt sparse tensor ({name}): shape {list(size)} has no 2 dims")
    if name == "sparse_coo":
        indices, values = parts
        nnz = indices.shape[1] if len(indices.shape) == 2 else -1
        if nnz < 0 or not values.shape or values.shape[0] != nnz:
            raise CkptError("corrupt sparse tensor: its indices and values do not match")
        if indices.shape[0] + len(values.shape) - 1 != len(size):
            raise CkptError(f"corrupt sparse tensor: indices do not fit its shape {list(size)}")
    return SparseRef(name, size, parts, is_coalesced)


PLAIN_TENSOR_CLASSES = ("torch.Tensor", "torch._tensor.Tensor", "torch.nn.parameter.Parameter")


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
    if isinstance(base, SparseRef) and name in PLAIN_TENSOR_CLASSES:
        return base
    if isinstance(base, TensorRef):
        if name == "torch.nn.parameter.Parameter":
            base.parameter = True
        elif name and name not in PLAIN_TENSOR_CLASSES:
            base.kind = name
        return base
    if name:
        # another tensor subclass (torchao's NF4Tensor, Float8Tensor...): an object of
        # its class holding its attributes, whose inner tensors are the data
        obj = new_type.make()
        obj.state = state
        return obj
    return opaque_class("torch._tensor", "_rebuild_from_type_v2").make(new_type, state)


_attrs = state_attrs


def _sharded_tensor_local(stub: WrapperStub, state: Any) -> LocalShards:
    """A ShardedTensor's pickled state: (local shards, metadata, process group state, ...)."""

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
        if cls == "Shard":
            placements.append(("shard", a.get("dim")))
        elif cls == "_StridedShard":  # FSDP2 over TP on the same dim
            placements.append(("strided_shard", a.get("dim"), a.get("split_factor")))
        elif cls == "Replicate":
            placements.append(("replicate", None))
        else:
            placements.append((cls.lower() or "unknown", None))
    out.layout = {
        "mesh_shape": _mesh_shape(mesh),
        "coordinate": tuple(mesh.get("_coordinate_on_dim") or ()),
        "placements": placements,
        "world_size": _mesh_world_size(mesh),
    }
    out.rank = mesh.get("_rank") if isinstance(mesh.get("_rank"), int) else None
    out.shards.append(_LocalBlock(local))
    return out


class _LocalBlock(Sealed):
    """A DTensor's local tensor before its offsets are known (set when ranks are combined)."""

    def __init__(self, tensor: TensorRef):
        self.tensor = tensor


def _mesh_world_size(mesh: dict) -> int | None:
    """The ranks of the whole job, when the mesh records them (torch >= 2.9: the root
    mesh's rank map, also in a submesh such as the ``dp`` dimension of a 2-D mesh)."""
    ranks = mesh.get("_flatten_rank_map")
    if isinstance(ranks, tuple) and ranks:
        return len(ranks)
    rank_map = mesh.get("_rank_map")
    if isinstance(rank_map, TensorRef) and rank_map.numel:
        return rank_map.numel
    return None


def _mesh_shape(mesh: dict) -> tuple[int, ...] | None:
    """The mesh's size along each of its dimensions.

    torch >= 2.9 records a layout: one axis per mesh dimension, each a CuTe-style
    shape whose product is that dimension's size (``()`` for a size-1 dimension, two
    numbers for one flattened from non-adjacent dimensions). Older torch pickles the
    mesh tensor of ranks itself."""
    layout = _attrs(mesh.get("_layout"))
    axes = layout.get("axes") if layout else None
    if isinstance(axes, tuple) and axes:
        shapes = [_attrs(axis).get("shape") for axis in axes]
        if all(isinstance(s, tuple) and _INT_ONLY.issuperset(map(type, s)) for s in shapes):
            return tuple(math.prod(s) for s in shapes)
    mesh_tensor = mesh.get("mesh")
    if isinstance(mesh_tensor, TensorRef):
        return mesh_tensor.shape
    return None


def _torch_size(values=()):
    if not isinstance(values, (tuple, list)) or not _INT_ONLY.issuperset(map(type, values)):
        raise CkptError(f"corrupt torch.Size {values!r:.80}")
    return TorchSize(values)


def _torch_device(kind, index=None):
    """``torch.device("cuda:0")`` or ``torch.device("cuda", 0)``, checked as torch checks it:
    the string is written back into outputs, so it must be a device torch can parse."""
    if isinstance(kind, Device) and index is None:
        return kind
    text = kind if isinstance(kind, str) else None
    if text is not None and index is not None:
        text = f"{kind}:{index}" if type(index) is int and index >= 0 else None
    device_type, _, number = (text or "").partition(":")
    if (
        device_type not in DEVICE_TYPES
        or (":" in (text or "") and not (number.isdigit() and number.isascii()))
        or len(number) > 9
    ):
        raise CkptError(f"corrupt torch.device {kind!r:.80}")
    return Device(text)


def _get_layout(name):
    return TorchName(name)


def _codecs_encode(obj, encoding="utf-8", errors="strict"):
    # Protocol 2 pickles bytes as _codecs.encode(str, "latin1").
    if (
        not isinstance(obj, str)
        or not isinstance(encoding, str)
        or encoding.lower()
        not in (
            "latin1",
            "latin-1",
            "utf-8",
            "utf8",
            "ascii",
        )
    ):
        raise CkptError("corrupt pickle: unexpected _codecs.encode call")
    charge(len(obj))
    return obj.encode(encoding, "strict" if errors not in ("strict", "replace") else errors)


def _size_of(value: Any) -> int:
    """What building from ``value`` costs: its length, or the size an int asks for."""
    if type(value) is int:
        return max(value, 0)
    try:
        return len(value)
    except TypeError:  # an inert stand-in: the constructor will refuse it
        return 0


def _constructor(ctor: Any) -> Any:
    """``ctor`` (a container or data type) charging the read's budget for what it builds."""

    def build(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise CkptError(f"corrupt pickle: {ctor.__name__}() with keyword arguments")
        if args:
            if ctor in (bytes, bytearray) and type(args[0]) is int:
                if args[0] > MAX_BYTES_CONSTRUCTOR:
                    raise CkptError("corrupt pickle: absurd buffer size")
            elif ctor is str and type(args[0]) not in (str, bytes, int, float, bool):
                # str() of a container renders every item, shared ones again and again
                raise CkptError("corrupt pickle: str() of a container")
            charge(sum(map(_size_of, args)))
        return ctor(*args)

    build.__name__ = ctor.__name__
    return build


def _reconstructor(cls, base, state=None):
    # copyreg._reconstructor(cls, object, None) == object.__new__(cls)
    if isinstance(cls, type) and issubclass(cls, Opaque):
        return cls.make()  # object.__new__(cls): creates, calls nothing
    return opaque_class("copyreg", "_reconstructor").make(cls, base, state)


def _newobj(cls, *args):
    if isinstance(cls, type) and issubclass(cls, Opaque):
        return cls.make(*args)  # cls.__new__(cls, *args): creates, calls nothing
    return opaque_class("copyreg", "__newobj__").make(cls, *args)


def _defaultdict(default_factory=None, *args):
    # Keep the mapping, drop the factory: we never call it, and a plain dict
    # stays loadable with weights_only=True.
    return _constructor(dict)(*args)


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
        self._args = args

    def __setstate__(self, state: Any) -> None:
        described = None
        if isinstance(state, tuple) and len(state) >= 4:
            shape, np_dtype, fortran, raw = state[-4:]
            described = _numpy_dtype(np_dtype)
        if described is None or not isinstance(raw, (bytes, bytearray)):
            # strings, objects, records: not a tensor. The object becomes what any other
            # class's does, an inert placeholder keeping the state (the layouts match,
            # both are plain objects with a __dict__)
            args = self._args
            self.__dict__.clear()
            self.__class__ = opaque_class("numpy", "ndarray", known=True)
            self.args, self.state = args, state
            return
        dtype, _, big_endian = described
        shape = _int_tuple(shape, "shape")
        stride = contiguous_stride(shape[::-1])[::-1] if fortran else contiguous_stride(shape)
        numel = len(raw) // dtype.itemsize
        self.dtype, self.shape, self.stride = dtype, shape, stride
        self.storage = StorageRef("numpy", dtype, numel, "cpu", ByteSource(data=raw), big_endian)
        if self.numel > numel:
            raise CkptError("corrupt numpy array: fewer bytes than its shape needs")


def _numpy_frombuffer(buffer: Any, np_dtype: Any, shape: Any, order: Any = "C") -> Any:
    """``numpy._core.numeric._frombuffer``: how numpy pickles a contiguous array with
    protocol 5 (``torch.save(..., pickle_protocol=5)``), its bytes in-band."""
    array = NumpyArrayRef()
    array.__setstate__((1, shape, np_dtype, order == "F", buffer))
    return array


def _numpy_scalar(np_dtype: Any, raw: Any = None) -> Any:
    described = _numpy_dtype(np_dtype)
    if described is None or described[1] is None or not isinstance(raw, (bytes, bytearray)):
        return opaque_class("numpy", "generic", known=True).make(np_dtype, raw)
    dtype, fmt, big_endian = described
    try:
        return struct.unpack((">" if big_endian else "<") + fmt, raw)[0]
    except struct.error:
        raise CkptError("corrupt numpy scalar") from None


def _wrapper_subclass(
    cls, dtype, size, stride, storage_offset, layout, device, requires_grad=False
):
    return WrapperStub(cls, dtype, size, stride, storage_offset, layout, device, requires_grad)


def _identity(value: Any) -> Any:
    return value


# Builtin types a pickle may name and call; called, each charges the read's budget.
BUILTIN_TYPES: dict[str, type] = {
    "collections.OrderedDict": collections.OrderedDict,
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
    "builtins.bytes": bytes,
    "builtins.bytearray": bytearray,
}

SAFE_GLOBALS: dict[str, Any] = {
    **{name: _constructor(ctor) for name, ctor in BUILTIN_TYPES.items()},
    "collections.defaultdict": _defaultdict,
    "builtins.object": opaque_class("builtins", "object", known=True),
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
    "torch._utils._rebuild_sparse_tensor": _rebuild_sparse_tensor,
    "torch._utils._rebuild_wrapper_subclass": _wrapper_subclass,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch._tensor._rebuild_from_type": lambda func, type_, args, dict_: func(*args),
    "numpy.core.multiarray._reconstruct": NumpyArrayRef,
    "numpy._core.multiarray._reconstruct": NumpyArrayRef,
    "numpy.core.numeric._frombuffer": _numpy_frombuffer,
    "numpy._core.numeric._frombuffer": _numpy_frombuffer,
    "numpy.core.multiarray.scalar": _numpy_scalar,
    "numpy._core.multiarray.scalar": _numpy_scalar,
    "torch.Size": _torch_size,
    "torch.device": _torch_device,
    "torch.serialization._get_layout": _get_layout,
    "builtins.Ellipsis": Ellipsis,
    # TorchScript pickles (a scripted module's data.pkl) wrap typed lists in these;
    # torch's own are identity functions too
    "torch.jit._pickle.build_intlist": _identity,
    "torch.jit._pickle.build_tensorlist": _identity,
    "torch.jit._pickle.build_doublelist": _identity,
    "torch.jit._pickle.build_boollist": _identity,
    "torch.jit._pickle.build_tensor_from_id": _identity,
    "torch.jit._pickle.restore_type_tag": lambda value, type_str=None: value,
}
