"""The table of globals a pickle may name, and the stand-in the unpickler gives for each.

torch's tensor rebuild functions (:mod:`ckpttool.unpickler.rebuild`) return lazy tensor refs;
numpy arrays (:mod:`ckpttool.unpickler.numpy_values`) become tensors and numpy scalars
numbers; containers and primitives are rebuilt for real here, as they run no code,
each charging the read's budget for what it builds.
"""

from __future__ import annotations

import itertools
from typing import Any

from ..errors import CkptError
from ..guard import charge
from ..tree import (
    BUILTIN_TYPES,
    DEVICE_TYPES,
    FULL_READ,
    INT_ONLY,
    Device,
    Opaque,
    TorchName,
    TorchSize,
    judge_new,
    judge_objects_handed,
    opaque_class,
)
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


def _torch_size(values: Any = ()) -> Any:
    # torch.Size holds int64s: one made of a bigger int cannot be printed, compared with
    # another or saved (a merged output holding it would not load)
    if (
        not isinstance(values, (tuple, list))
        or not INT_ONLY.issuperset(map(type, values))
        or (values and not (_INT64_MIN <= min(values) and max(values) <= _INT64_MAX))
    ):
        raise CkptError(f"corrupt torch.Size {values!r:.80}")
    return TorchSize(values)


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _torch_size_call(*args: Any, **kwargs: Any) -> Any:
    """``torch.Size(values)`` as a pickle calls it: one Python call for the usual tuple of
    ints (a 2048-rank DCP ``.metadata`` makes twelve million); anything else goes
    through the judged stand-in (an object among the arguments is judged there)."""
    if len(args) == 1 and not kwargs:
        values = args[0]
        if (
            type(values) is tuple
            and INT_ONLY.issuperset(map(type, values))
            and (not values or (_INT64_MIN <= min(values) and max(values) <= _INT64_MAX))
        ):
            return TorchSize(values)
    return _judged_torch_size(*args, **kwargs)


def _torch_device(kind: Any, index: Any = None) -> Any:
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


def _get_layout(name: Any) -> Any:
    return TorchName(name)


def _codecs_encode(obj: Any, encoding: Any = "utf-8", errors: Any = "strict") -> Any:
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


def calls(target: Any) -> None:
    """The real function calls ``target``: judged as if the pickle called it.

    A stand-in class on no allow-list (``FileHandler``) or an object (a partial) is
    noted by its own call, and the file is refused; a class on an allow-list, or one
    of our own stand-in functions, is fine. Values that are no callable stand-in are
    left alone: the real call would fail on them.
    """
    if isinstance(target, Opaque) or (isinstance(target, type) and issubclass(target, Opaque)):
        target()


def _reconstructor(cls: Any, base: Any, state: Any = None) -> Any:
    # copyreg._reconstructor(cls, base, state) runs base.__new__(cls, state) and, where
    # base has its own __init__, base.__init__(obj, state): a call of base
    # (object, or dict for a dict subclass, in real files)
    calls(base)
    if isinstance(cls, type) and issubclass(cls, Opaque):
        # base.__new__(cls): a construction of cls, judged as NEWOBJ's
        judge_new(cls.as_global(), (), {}, FULL_READ)
        return cls.make()
    return opaque_class("copyreg", "_reconstructor").make(cls, base, state)


def _calling_argument(full: str) -> Any:
    """The known function ``full`` that calls its argument at ``CALLS_ARGUMENT[full]``:
    that call is judged (:func:`calls`), the result is an inert object of its class."""
    module, name = full.rsplit(".", 1)
    position = CALLS_ARGUMENT[full]
    cls = opaque_class(module, name, known=True)

    def stand_in(*args: Any, **kwargs: Any) -> Opaque:
        if len(args) > position:
            calls(args[position])
        return cls.make(*args, **kwargs)

    stand_in.__name__ = name
    return stand_in


# Known functions that call one of their arguments (position): numpy's RNG
# constructors call the constructor they are given (``__bit_generator_ctor`` in real
# files); torch's subclass rebuilders call the rebuild function; copyreg's
# reconstructor its base. A globals scan judges these calls as a full read does.
CALLS_ARGUMENT = {
    "copyreg._reconstructor": 1,
    "torch._tensor._rebuild_from_type": 0,
    "torch._tensor._rebuild_from_type_v2": 0,
    "numpy.random._pickle.__randomstate_ctor": 1,
    "numpy.random._pickle.__generator_ctor": 1,
    "numpy.random._pickle.__bit_generator_ctor": 0,
}


def _newobj(cls: Any, *args: Any) -> Any:
    if isinstance(cls, type) and issubclass(cls, Opaque):
        return cls.__new__(cls, *args)  # as NEWOBJ: creates, judges what it is handed
    return opaque_class("copyreg", "__newobj__").make(cls, *args)


def _defaultdict(default_factory: Any = None, *args: Any) -> Any:
    # Keep the mapping, drop the factory: we never call it, and a plain dict
    # stays loadable with weights_only=True.
    return _constructor(dict)(*args)


def _identity(value: Any) -> Any:
    return value


def _judging_objects(full: str, function: Any) -> Any:
    """``function`` (the stand-in for the global ``full``), refusing an object of a class
    on no allow-list among its arguments: the real function iterates or converts what
    it is given (``list(x)``, ``str(x)``, a tensor's ``size``), which runs the object's
    own methods (``list(starmap(FileHandler, [(path,)]))`` makes the file). Judged as
    calling it; --unsafe keeps the result inert."""
    module, name = full.rsplit(".", 1)

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        if not kwargs and not any(map(isinstance, args, _OPAQUE)):
            return function(*args)  # (hot: every tensor of every rank file; checked in C)
        if not judge_objects_handed(full, args, kwargs, FULL_READ):
            return function(*args, **kwargs)
        return opaque_class(module, name, known=True).make(*args)

    stand_in.__name__ = getattr(function, "__name__", name)
    return stand_in


_OPAQUE = itertools.repeat(Opaque)  # (a map over a call's arguments stops at their end)

# Stand-ins that create an object as pickle's NEWOBJ does (``cls.__new__(cls, *args)``,
# which may be given objects): not judged by their arguments.
CREATES_OBJECTS = frozenset({"copyreg._reconstructor", "copyreg.__newobj__"})


_STAND_INS: dict[str, Any] = {
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
    **{
        full: _calling_argument(full)
        for full in CALLS_ARGUMENT
        if full.startswith("numpy.random._pickle.")
    },
}
SAFE_GLOBALS: dict[str, Any] = {
    full: (
        value
        if isinstance(value, type) or value is Ellipsis or full in CREATES_OBJECTS
        else _judging_objects(full, value)
    )
    for full, value in _STAND_INS.items()
}
_judged_torch_size = SAFE_GLOBALS["torch.Size"]
SAFE_GLOBALS["torch.Size"] = _torch_size_call
