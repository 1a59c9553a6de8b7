"""The table of globals a pickle may name, and the stand-in the unpickler gives for each.

torch's tensor rebuild functions (:mod:`ckpttool.rebuild`) return lazy tensor refs;
numpy arrays (:mod:`ckpttool.numpy_values`) become tensors and numpy scalars
numbers; containers and primitives are rebuilt for real here, as they run no code,
each charging the read's budget for what it builds.
"""

from __future__ import annotations

from typing import Any

from .errors import CkptError
from .guard import charge
from .numpy_values import NumpyArrayRef, numpy_frombuffer, numpy_scalar
from .rebuild import (
    rebuild_from_type_v2,
    rebuild_meta,
    rebuild_parameter,
    rebuild_qtensor,
    rebuild_sparse_tensor,
    rebuild_tensor,
    rebuild_tensor_v1,
    rebuild_tensor_v3,
    rebuild_wrapper_subclass,
)
from .torch_values import BUILTIN_TYPES, DEVICE_TYPES, INT_ONLY, Device, TorchName, TorchSize
from .tree import Opaque, opaque_class

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
MAX_BYTES_CONSTRUCTOR = 1 << 24


def _torch_size(values=()):
    # torch.Size holds int64s: one made of a bigger int cannot be printed, compared with
    # another or saved (a merged output holding it would not load)
    if (
        not isinstance(values, (tuple, list))
        or not INT_ONLY.issuperset(map(type, values))
        or not all(-(2**63) <= n < 2**63 for n in values)
    ):
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
        or (number.startswith("0") and number != "0")  # torch refuses "cuda:01"
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


def _identity(value: Any) -> Any:
    return value


SAFE_GLOBALS: dict[str, Any] = {
    **{name: _constructor(ctor) for name, ctor in BUILTIN_TYPES.items()},
    "collections.defaultdict": _defaultdict,
    "builtins.object": opaque_class("builtins", "object", known=True),
    "_codecs.encode": _codecs_encode,
    "copyreg._reconstructor": _reconstructor,
    "copyreg.__newobj__": _newobj,
    "torch._utils._rebuild_tensor": rebuild_tensor_v1,
    "torch._utils._rebuild_tensor_v2": rebuild_tensor,
    "torch._utils._rebuild_tensor_v3": rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": rebuild_parameter,
    "torch._utils._rebuild_meta_tensor_no_storage": rebuild_meta,
    "torch._utils._rebuild_qtensor": rebuild_qtensor,
    "torch._utils._rebuild_sparse_tensor": rebuild_sparse_tensor,
    "torch._utils._rebuild_wrapper_subclass": rebuild_wrapper_subclass,
    "torch._tensor._rebuild_from_type_v2": rebuild_from_type_v2,
    "torch._tensor._rebuild_from_type": lambda func, type_, args, dict_: func(*args),
    "numpy.core.multiarray._reconstruct": NumpyArrayRef,
    "numpy._core.multiarray._reconstruct": NumpyArrayRef,
    "numpy.core.numeric._frombuffer": numpy_frombuffer,
    "numpy._core.numeric._frombuffer": numpy_frombuffer,
    "numpy.core.multiarray.scalar": numpy_scalar,
    "numpy._core.multiarray.scalar": numpy_scalar,
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
