"""``Opaque``: the inert stand-in for an object of a class the unpickler does not build,
judged by the call rules (:mod:`ckpttool.tree.call_rules`) as the pickle calls it.

An ``Opaque`` records its class name and the state the pickle gave it, walks as its
children, and cannot be changed by the pickle afterwards. :data:`FULL_READ` says how
its values answer the call rules' questions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from ..guard import CLASS_SWAP, MUTATED, note_build_on_global, note_call
from ..sealed import Sealed
from .call_rules import (
    HOLDS_CALLABLES,
    GlobalClass,
    Kinds,
    judge_build,
    judge_class_call,
    judge_new,
)


class _ReadOnlyClass(type):
    """Stand-in classes are shared by every read: a pickle's BUILD must not change them."""

    # (set by Opaque and opaque_class's subclasses; declared for the type checker)
    module: str
    qualname: str
    dangerous: bool
    known: bool
    may_call: bool

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # only a pickle calls a stand-in class (ckpttool's own code uses make())
        judge_class_call(cls.as_global(), args, kwargs, FULL_READ)
        return cls.make(*args, **kwargs)  # type: ignore[attr-defined]

    def as_global(cls) -> GlobalClass:
        """The global this stand-in class is, as the call rules see it."""
        return GlobalClass(f"{cls.module}.{cls.qualname}", cls.known, cls.dangerous, cls.may_call)

    # SETITEM, APPEND(S) on the global itself (``_compat_pickle.NAME_MAPPING[k] = v``):
    # the real unpickler would change a module-level object for the rest of the process
    # (that mapping renames the globals later pickles import). No checkpoint does.
    # Properties of the metaclass: found before the methods Opaque's objects have.
    def __setitem__(cls, key: Any, value: Any) -> None:
        note_call(cls.class_name(), MUTATED)  # type: ignore[attr-defined]

    @property
    def append(cls) -> Callable[[Any], None]:
        return lambda value: note_call(cls.class_name(), MUTATED)  # type: ignore[attr-defined]

    @property
    def extend(cls) -> Callable[[Any], None]:
        return lambda values: note_call(cls.class_name(), MUTATED)  # type: ignore[attr-defined]

    @property
    def __setstate__(cls) -> Callable[[Any], None]:
        """BUILD on the stand-in class itself (the global, not an object of it): the real
        unpickler would change that module or class (a data descriptor of the metaclass:
        an object's own ``__setstate__`` is found first, a class's is this)."""

        def build(state: Any) -> None:
            note_build_on_global(f"{cls.module}.{cls.qualname}")

        return build

    def __setattr__(cls, name: str, value: Any) -> None:
        raise AttributeError(f"stand-in class {cls.__qualname__} is read-only")

    def __delattr__(cls, name: str) -> None:
        raise AttributeError(f"stand-in class {cls.__qualname__} is read-only")


class Opaque(Sealed, metaclass=_ReadOnlyClass):
    """Inert stand-in for an instance of a class we do not rebuild.

    It records what the pickle gave it (constructor args, state, items) and
    never runs anything. Subclasses are made per class by :func:`opaque_class`.
    """

    module = "builtins"
    qualname = "object"
    dangerous = False
    known = False  # vouched for: may be made (NEWOBJ) and restored (BUILD), not listed
    may_call = True  # and, where known, called (REDUCE); False: vouched for by family only

    # What SETITEM(S) and APPENDS gave it; shared empty defaults until then (hot: a
    # ShardedTensor pickles a dozen metadata objects, none with items).
    items: Mapping[Any, Any] = MappingProxyType({})
    list: Sequence[Any] = ()
    args: tuple[Any, ...]
    state: Any

    # No __init__: with __new__ overridden, object.__init__ accepts the arguments, and
    # Python makes one call per object instead of two.
    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        """NEWOBJ's ``cls.__new__(cls, *args)``: creates the object, calls nothing.

        An object of a class on no allow-list that is made with a callable may call it
        when used (iterating ``itertools.starmap(FileHandler, [(path,)])`` makes the
        file, and a known class's ``__setstate__`` iterates what BUILD gives it, as
        ``SGD``'s does its ``param_groups``): the callables it is handed count as called.
        """
        judge_new(cls.as_global(), args, kwargs, FULL_READ)
        return cls.make(*args, **kwargs)

    def __setstate__(self, state: Any) -> None:
        """BUILD: records the state, calls nothing.

        An object of a class on no allow-list given a callable object (a partial) by
        BUILD is as one made with it (see ``__new__``): its attributes are what the real
        object's methods use (a ``WeakSet`` calls each item of its ``data`` as it is
        iterated, which ``SGD``'s ``__setstate__`` does to its param_groups), so the
        partials in them count as called. A global function among its attributes does
        not: objects hold functions (a pickled module's ``self.act = F.relu``).
        """
        if swaps_class(state):
            note_call(type(self).class_name(), CLASS_SWAP)
        judge_build(type(self).as_global(), state_values(state), FULL_READ)
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        if "items" not in self.__dict__:
            self.items = {}
        self.items[key] = value  # type: ignore[index]  # its own dict from here on

    def append(self, value: Any) -> None:
        self.extend((value,))

    def extend(self, values: Any) -> None:
        if "list" not in self.__dict__:
            self.list = []
        self.list.extend(values)  # type: ignore[attr-defined]  # its own list from here on

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:
        # A pickle may call a stand-in (``getattr(x, "system")(cmd)``): the result is
        # another inert stand-in, so ``--unsafe`` reads such files instead of failing.
        # The real object's __call__ would run (a partial calling what it holds): no
        # checkpoint calls an object, so this is refused as dangerous.
        cls = opaque_class(self.module, f"{self.qualname}()", dangerous=True)
        if not self.dangerous:  # (one already refused is named once)
            note_call(cls.class_name())
        return cls.make(*args, **kwargs)

    @classmethod
    def make(cls, *args: Any, **kwargs: Any) -> Opaque:
        """An object of this stand-in class built by ckpttool itself (not a pickle call)."""
        self = object.__new__(cls)
        self.args = args
        self.state = kwargs or None
        return self

    @classmethod
    def class_name(cls) -> str:
        return f"{cls.module}.{cls.qualname}"

    def __repr__(self) -> str:
        # an Enum member or a small value object is told apart by its arguments
        # (Strategy('steps') and Strategy('epoch') as keys of one dict)
        args = getattr(self, "args", ())
        shown = ", ".join(repr(a) for a in args)
        simple = all(isinstance(a, (str, int, float)) for a in args)
        if args and simple and len(args) <= 3 and len(shown) <= 60:
            return f"<opaque {self.class_name()}({shown})>"
        return f"<opaque {self.class_name()}>"

    def attrs(self) -> dict[str, Any]:
        """The object's attributes as the pickle set them."""
        return state_attrs(self.state)

    def children(self) -> Iterator[tuple[Any, Any]]:
        """(key, value) pairs a walk descends into, as a user names them: those of
        :meth:`parts`, but a pickled ``nn.Module`` (``torch.save(model)``) gives its
        ``state_dict()`` entries (``fc1.weight``, not ``_modules.fc1._parameters.weight``;
        see :func:`module_entries`)."""
        attrs = self.attrs()
        if is_module_state(attrs):
            yield from module_entries(attrs)
        else:
            yield from self.parts()

    def parts(self) -> Iterator[tuple[Any, Any]]:
        """(key, value) of everything the pickle gave the object: attributes, items,
        list items, args (what a check of the whole tree must see)."""
        attrs = self.attrs()
        yield from attrs.items()
        if self.state is not None and not attrs:
            yield "__state__", self.state
        yield from self.items.items()
        yield from enumerate(self.list)
        if self.args:
            yield "__args__", self.args


# Attributes a BUILD may not set: ``setattr(obj, "__class__", C)`` swaps the object's
# class, so that a second BUILD runs C's ``__setstate__`` (a nested pickle's loader) on
# an object made as a harmless one; ``__dict__`` replaces every attribute at once.
_SWAPPING = frozenset({"__class__", "__dict__"})


def swaps_class(state: Any) -> bool:
    """Whether a BUILD state sets ``__class__`` or ``__dict__``: as a dict or either half
    of a ``(dict, slots)`` pair (``setattr`` of the slots half is what swaps)."""
    if type(state) is dict:  # (hot: every object of a scan's rank file; no generator)
        return not _SWAPPING.isdisjoint(state)
    halves = state if type(state) is tuple and len(state) == 2 else (state,)
    return any(isinstance(half, dict) and not _SWAPPING.isdisjoint(half) for half in halves)


def is_module_state(attrs: Mapping[str, Any]) -> bool:
    """Whether an object's attributes are those of a pickled ``nn.Module`` (its
    parameters and submodules, each a dict)."""
    return isinstance(attrs.get("_parameters"), Mapping) and isinstance(
        attrs.get("_modules"), Mapping
    )


def module_entries(attrs: Mapping[str, Any]) -> Iterator[tuple[Any, Any]]:
    """A pickled ``nn.Module``'s entries as its ``state_dict()`` names them: parameters,
    then persistent buffers (None skipped, as torch skips them), then each submodule
    under its name (whose own entries follow the same rule). Its other attributes
    (hooks, flags, a config) are not part of the model's state."""
    listed = attrs.get("_non_persistent_buffers_set")
    non_persistent = listed if isinstance(listed, (set, frozenset)) else frozenset()
    buffers = attrs.get("_buffers")
    for name, value in _items(attrs["_parameters"]):
        if value is not None:
            yield name, value
    for name, value in _items(buffers) if isinstance(buffers, Mapping) else ():
        if value is not None and name not in non_persistent:
            yield name, value
    for name, value in _items(attrs["_modules"]):
        if value is not None:
            yield name, value


def _items(mapping: Mapping[Any, Any]) -> Any:
    # the type's own method: a BUILD may have given an OrderedDict an attribute `items`
    return dict.items(mapping) if isinstance(mapping, dict) else mapping.items()


def state_values(state: Any) -> tuple[Any, ...]:
    """What a BUILD hands an object, as a constructor's arguments: each attribute of a
    dict or ``(dict, slots)`` state, or the state itself."""
    attrs = state_attrs(state) if type(state) in (dict, tuple) else None
    return tuple(attrs.values()) if attrs else (state,)


def state_attrs(state: Any) -> dict[str, Any]:
    """Attributes from a pickled state: a dict, or a ``(dict_state, slots_state)`` pair.

    A dict state comes back as it is, not copied (hot: every ShardedTensor has
    dozens): read it, do not change it.
    """
    if type(state) is dict:
        return state
    if isinstance(state, Opaque):
        return state.attrs()
    if type(state) is tuple and len(state) == 2:
        attrs, slots = state
        if (attrs is None or isinstance(attrs, dict)) and (
            slots is None or isinstance(slots, dict)
        ):
            if not slots:
                return attrs or {}
            if not attrs:
                return slots
            return {**attrs, **slots}
    return dict(state) if isinstance(state, dict) else {}


_OPAQUE_CLASSES: dict[tuple[str, str, bool, bool, bool], type] = {}


def opaque_class(
    module: str,
    qualname: str,
    *,
    dangerous: bool = False,
    known: bool = False,
    may_call: bool = True,
) -> type[Opaque]:
    """The Opaque subclass standing in for ``module.qualname`` (one per name and verdict)."""
    key = (module, qualname, dangerous, known, may_call)  # (a known one is not the unknown one)
    cls = _OPAQUE_CLASSES.get(key)
    if cls is None:
        name = qualname.rsplit(".", 1)[-1]
        attrs = {
            "module": module,
            "qualname": qualname,
            "dangerous": dangerous,
            "known": known,
            "may_call": may_call,
        }
        cls = type(name if name.isidentifier() else "Opaque", (Opaque,), attrs)
        _OPAQUE_CLASSES[key] = cls
    return cls


def _global_class(item: Any) -> GlobalClass | None:
    return item.as_global() if isinstance(item, _ReadOnlyClass) else None


def _unverified_object(item: Any) -> bool:
    return isinstance(item, Opaque) and not (type(item).known or type(item).dangerous)


def _object_name(item: Any) -> str:
    return type(item).class_name()


def _partial(item: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any] | None:
    if not (isinstance(item, Opaque) and type(item).class_name() in HOLDS_CALLABLES):
        return None
    state = item.state  # keywords it was made with (NEWOBJ_EX), until a BUILD
    return item.args, state if type(state) is dict else {}, state


# How a full read's values answer the call rules' questions
FULL_READ = Kinds(_global_class, _unverified_object, _object_name, _partial)
