"""Values the restricted unpickler gives for torch objects: devices, sizes, layouts,
storage classes and named globals, each sealed against the pickle's BUILD, with the
checks every tensor's metadata passes before it is trusted (shape, view size).
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any

from ..dtypes import DType
from ..errors import CkptError
from ..sealed import Sealed
from .leaves import check_shape
from .opaque import Opaque

# Module-level torch objects referenced by real checkpoints that need nothing but a name.
TORCH_LAYOUTS = frozenset(
    "strided sparse_coo sparse_csr sparse_csc sparse_bsr sparse_bsc _mkldnn jagged".split()
)


TORCH_MEMORY_FORMATS = frozenset(
    {"contiguous_format", "channels_last", "channels_last_3d", "preserve_format"}
)


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

    def __init__(  # noqa: PLR0913 (torch's _rebuild_wrapper_subclass arguments)
        self,
        cls: Any,
        dtype: Any,
        size: Any,
        stride: Any,
        storage_offset: Any,
        layout: Any,
        device: Any,
        requires_grad: Any,
    ) -> None:
        if not isinstance(device, Device):
            raise CkptError(f"corrupt tensor device {device!r:.80}")
        self.cls = cls
        self.dtype = dtype
        self.shape = int_tuple(size, "size")
        check_shape(self.shape)
        self.device = str(device)
        self.requires_grad = bool(requires_grad)


INT_ONLY = frozenset({int})


def int_tuple(value: Any, what: str) -> tuple[int, ...]:
    # hot: called for every size, stride and shard offset, so the check runs in C;
    # exact `int` types also reject bool
    if type(value) in (tuple, list, TorchSize) and INT_ONLY.issuperset(map(type, value)):
        return tuple(value)
    raise CkptError(f"corrupt tensor {what} {value!r}")


def check_dtype(value: Any) -> DType:
    return check_dtype(value)


# A view may repeat its storage's elements (stride 0: ``x.expand(n)``); written out, the
# repeats cost bytes the file does not hold. Past this many extra bytes it is refused.
MAX_VIEW_GROWTH = 64 << 20


def check_view(shape: tuple[int, ...], dtype: DType, storage_nbytes: int) -> None:
    """A view's full size stays near what its storage holds (see MAX_VIEW_GROWTH)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > storage_nbytes + MAX_VIEW_GROWTH:
        raise CkptError(
            f"a view of {math.prod(shape)} elements repeats its storage of "
            f"{storage_nbytes} bytes past {MAX_VIEW_GROWTH >> 20} MiB: not supported"
        )


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
