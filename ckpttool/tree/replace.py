"""One walk that rebuilds a tree with some of its leaves replaced, paths and all."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .opaque import Opaque


def replace_leaves(node: Any, path: tuple, kind: type, make: Callable[[tuple, Any], Any]) -> Any:
    """``node`` with every leaf of type ``kind`` replaced by ``make(key path, leaf)``.

    Containers are rebuilt; an opaque object is changed in place (it keeps its class),
    its children keyed as :meth:`Opaque.children` keys them, so that the same path
    finds the same leaf in another rank's tree. A cycle is followed once.
    """
    return _Replacer(kind, make)(node, path)


class _Replacer:
    """:func:`replace_leaves`'s walk. (Not a nested function that calls itself: that is
    a reference cycle, and the cyclic collector is paused while a checkpoint is read
    (``formats.gc_paused``), so it would keep every leaf ``make`` saw: every rank file's,
    for a read of hundreds.)"""

    def __init__(self, kind: type, make: Callable[[tuple, Any], Any]):
        self.kind = kind
        self.make = make
        self.active: set[int] = set()

    def __call__(self, node: Any, path: tuple) -> Any:
        if isinstance(node, self.kind):
            return self.make(path, node)
        if id(node) in self.active or not isinstance(node, (dict, list, tuple, Opaque)):
            return node
        self.active.add(id(node))
        try:
            if isinstance(node, dict):
                out = type(node)() if type(node) is not dict else {}
                for k, v in node.items():
                    out[k] = self(v, path + (k,))
                return out
            if isinstance(node, list):
                return [self(v, path + (i,)) for i, v in enumerate(node)]
            if isinstance(node, tuple):  # a torch.Size stays one
                return type(node)(self(v, path + (i,)) for i, v in enumerate(node))
            _replace_in_opaque(node, path, self)
            return node
        finally:
            self.active.discard(id(node))


def _replace_in_opaque(node: Opaque, path: tuple, replace: Callable[[Any, tuple], Any]) -> None:
    attrs = node.attrs()
    if attrs:
        new = {k: replace(v, path + (k,)) for k, v in attrs.items()}
        if any(new[k] is not v for k, v in attrs.items()):
            node.state = new
    elif node.state is not None:
        node.state = replace(node.state, path + ("__state__",))
    if node.items:
        node.items = {k: replace(v, path + (k,)) for k, v in node.items.items()}
    if node.list:
        node.list = [replace(v, path + (i,)) for i, v in enumerate(node.list)]
    if node.args:
        node.args = replace(node.args, path + ("__args__",))
