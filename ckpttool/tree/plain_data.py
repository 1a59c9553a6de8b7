"""The lazy tree as plain data, what ``torch.load(weights_only=True)`` accepts.

Shared by ``ckpttool.load(select="all")``, which builds real torch objects, and the
torch zip writer, which only needs to name them in its pickle (and so never imports
torch for a merge that copies bytes).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

from ..dtypes import DType
from ..errors import CkptError
from .checkpoint import walk
from .leaves import Node, StorageRef, TensorRef, is_tensor
from .opaque import Opaque
from .torch_values import Device, TorchName, TorchSize, global_name

# Values that are plain data as they are (exact types: a subclass may be an Opaque)
SCALARS = frozenset({str, int, float, bool, type(None), bytes, complex})

TorchValue = Device | DType | TorchName | TorchSize


def _weights_only_refuses(value: Any) -> bool:
    """Plain Python values ``torch.load(weights_only=True)`` has no global for: a
    frozenset, a slice, Ellipsis, and a builtin class saved as a value
    (``{"dtype": float}`` in hyperparameters)."""
    return (
        isinstance(value, (frozenset, slice))
        or value is Ellipsis
        or (isinstance(value, type) and not issubclass(value, Opaque))
    )


def _builtin_name(value: Any) -> str:
    if value is Ellipsis:
        return "builtins.Ellipsis"
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return f"builtins.{type(value).__name__}"


def recorded_classes(root: Any) -> list[str]:
    """The classes whose objects a torch.save output keeps as plain-data records."""
    names = set()
    for _, value in walk(root):
        if isinstance(value, Opaque) or (isinstance(value, type) and issubclass(value, Opaque)):
            names.add(value.class_name())
        elif (name := global_name(value)) is not None:
            names.add(name)
        elif _weights_only_refuses(value):
            names.add(_builtin_name(value))
    return sorted(names)


def to_plain(
    node: Node,
    leaf: Callable[[Any], Any],
    torch_value: Callable[[TorchValue], Any],
    *,
    weights_only: bool = False,
    storage: Callable[[StorageRef], Any] | None = None,
) -> Any:
    """The tree with tensors as ``leaf(ref)`` and torch values as ``torch_value(value)``.

    An opaque object becomes ``{"__class__": "pkg.mod.Class", "state": ..., "args": ...,
    ...}`` so no key disappears (one inside its own state, a back-reference, becomes
    ``{"__class__": ..., "back_reference": True}``); a class or function saved by
    reference becomes ``{"__global__": "pkg.mod.Class"}``; devices, dtypes, sizes,
    layouts and memory formats go through ``torch_value``; a storage saved on its own
    goes through ``storage`` (by default: ``leaf`` of its flat tensor). Containers
    shared by several paths stay shared.
    With ``weights_only`` (a torch.save output) a frozenset, slice, Ellipsis or builtin
    class, which ``torch.load(weights_only=True)`` refuses, becomes such a record too.
    """
    memo: dict[int, Any] = {}
    building: set[int] = set()  # opaque objects whose records are being built

    def key(value: Any) -> Any:
        """A dict key or set element as plain data; one that became a record dict (an
        Enum member, a path, a frozenset under ``weights_only``) cannot be hashed: its
        text is kept instead."""
        built = build(value)
        try:
            hash(built)
        except TypeError:
            return repr(value)
        return built

    def build(value: Any) -> Any:
        if type(value) in SCALARS:  # most keys and leaves: nothing to build
            return value
        if is_tensor(value):
            return leaf(value)
        if id(value) in memo:
            return memo[id(value)]
        result: Any
        if weights_only and _weights_only_refuses(value):
            result = _stand_in(value)
            memo[id(value)] = result
            return result
        if isinstance(value, Mapping):
            out: dict[Any, Any] = (
                collections.OrderedDict() if isinstance(value, collections.OrderedDict) else {}
            )
            memo[id(value)] = out
            for k, v in value.items():
                out[key(k)] = build(v)
            return out
        if isinstance(value, list):
            out_list: list[Any] = []
            memo[id(value)] = out_list
            out_list.extend(build(v) for v in value)
            return out_list
        if isinstance(value, (Device, DType, TorchName, TorchSize)):
            result = torch_value(value)
        elif isinstance(value, tuple):
            result = tuple(build(v) for v in value)
        elif isinstance(value, (set, frozenset)):
            result = type(value)(key(v) for v in value)
        elif isinstance(value, type) and issubclass(value, Opaque):
            result = {"__global__": value.class_name()}
        elif isinstance(value, Opaque) and id(value) in building:
            # an object pointing back at one that holds it (a config node's parent):
            # cut there, as every walk over the tree does, so the output has no cycle
            return {"__class__": value.class_name(), "back_reference": True}
        elif isinstance(value, Opaque):
            result = {"__class__": value.class_name()}
            parts = {
                "args": list(value.args),
                "state": value.state,
                "items": value.items,
                "list": value.list,
            }
            building.add(id(value))
            for name, part in parts.items():
                if part is not None and (part or name == "state"):
                    result[name] = build(part)
            building.discard(id(value))
        elif isinstance(value, StorageRef):  # a storage saved on its own
            result = storage(value) if storage else leaf(TensorRef.whole_storage(value))
        elif global_name(value):  # an allowed function or class named, not called
            result = {"__global__": global_name(value)}
        elif type(value).__module__.startswith("ckpttool."):
            # one of our own stand-ins that no reader resolved: writing it would make
            # an output nothing but ckpttool can load
            raise CkptError(f"cannot write a {type(value).__name__} stand-in (unusual input)")
        else:
            result = value
        memo[id(value)] = result
        return result

    def _stand_in(value: Any) -> dict:
        name = _builtin_name(value)
        if isinstance(value, frozenset):
            return {"__class__": name, "args": [[build(v) for v in value]]}
        if isinstance(value, slice):
            return {
                "__class__": name,
                "args": [build(value.start), build(value.stop), build(value.step)],
            }
        return {"__global__": name}

    return build(node)
