"""What a pickle's calls would run: the call rules, written once.

Two readers apply them. A full read builds :class:`~ckpttool.tree.opaque.Opaque`
stand-ins and judges each call as it happens; the globals scan that judges the other
rank files of a checkpoint builds nothing but a few absorbing values, and must refuse
exactly what a full read refuses. Each reader says how its values answer the rules'
questions (a :class:`Kinds`: is this a global's class, an object of a class on no
allow-list, a partial?), and the rules below do the judging for both.

A judgment notes what it finds (:func:`~ckpttool.guard.note_call`); the read that is
under way refuses the file at its end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..guard import CONSTRUCTED, MAKES_CLASS, charge, note_call

# Known classes whose objects exist to hold a callable they are given and call it
# later, when called themselves: making one calls nothing.
HOLDS_CALLABLES = frozenset({"functools.partial"})

# Verdicts of the partials met during one judgment (id -> name or None): a partial given
# the same partial twice, thirty levels deep, is a few hundred bytes of pickle and would
# otherwise be judged 2**30 times.
CallVerdicts = dict[int, "str | None"]


class GlobalClass(NamedTuple):
    """A global the pickle named, as a class it may call."""

    name: str  # module.qualname
    known: bool  # vouched for: its objects may be made (NEWOBJ) and restored (BUILD)
    dangerous: bool
    # and it may be called (REDUCE: its __init__ runs with the pickle's arguments);
    # False for a class vouched for by its family only (a framework's configs)
    may_call: bool = True


@dataclass(frozen=True)
class Kinds:
    """How one reader's values answer the rules' questions.

    Attributes:
        global_class: The global ``item`` stands for, where it is one's class, else None.
        unverified_object: Whether ``item`` is an object of a class on no allow-list.
        object_name: How such an object is named in a verdict.
        partial: ``(args, keywords, state)`` where ``item`` is a partial (a class of
            :data:`HOLDS_CALLABLES`): what it was made with and its last BUILD state.
    """

    global_class: Callable[[Any], GlobalClass | None]
    unverified_object: Callable[[Any], bool]
    object_name: Callable[[Any], str]
    partial: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any], Any] | None]


def partial_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], state: Any
) -> tuple[tuple[Any, ...], tuple[Any, ...], dict[str, Any]]:
    """(functions, arguments, keywords) a pickled partial would call: the function it
    was made with (``args[0]``) and the one its last BUILD gives it (``state``, as
    ``partial.__setstate__`` takes it: ``(func, args, keywords, __dict__)``), with the
    arguments of both. Both functions are judged: the real one calls the second."""
    funcs, call_args, keywords = args[:1], args[1:], kwargs
    if type(state) is tuple and state:
        funcs += state[:1]
        if len(state) > 1 and type(state[1]) is tuple:
            call_args += state[1]
        if len(state) > 2 and type(state[2]) is dict:
            keywords = {**keywords, **state[2]}
    return funcs, call_args, keywords


def held_callable_name(item: Any, verdicts: CallVerdicts, kinds: Kinds) -> str | None:
    """``functools.partial()`` where ``item`` is a partial whose call would be of note:
    one that calls anything but a known class with plain arguments. The function it
    calls is the one BUILD gives it (``partial.__setstate__`` replaces the one it was
    made with), so both are judged. ``partial(nn.LayerNorm, eps=1e-6)`` (torchvision's
    ``norm_layer``, kept by its models) calls nothing of note."""
    parts = kinds.partial(item)
    if parts is None:
        return None
    if id(item) in verdicts:
        return verdicts[id(item)]
    verdicts[id(item)] = None  # (one it holds itself, through its BUILD, is judged once)
    funcs, args, kwargs = partial_call(*parts)
    plain_call = (
        bool(funcs)
        and all(_is_known_class(func, kinds) for func in funcs)
        and not handed_callables(args, kwargs, kinds, verdicts)
        and not any(kinds.unverified_object(v) for v in (*args, *kwargs.values()))
    )
    verdicts[id(item)] = None if plain_call else "functools.partial()"
    return verdicts[id(item)]


def callable_name(item: Any, verdicts: CallVerdicts, kinds: Kinds) -> str | None:
    """What calling ``item`` would be named, where it is a callable of note: a partial
    whose call would be (:func:`held_callable_name`), or a global on no allow-list."""
    cls = kinds.global_class(item)
    if cls is not None and not (cls.known and cls.may_call) and not cls.dangerous:
        return cls.name
    return held_callable_name(item, verdicts, kinds)


def handed_callables(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    kinds: Kinds,
    verdicts: CallVerdicts | None = None,
    *,
    partials_only: bool = False,
) -> list[str]:
    """The callables a pickle hands to a constructor, in its arguments or one level into
    a list, tuple, dict or set among them: partials whose call would be of note and,
    unless ``partials_only``, globals on no allow-list. A known class's constructor may
    call them at once (``LambdaLR(optimizer, partial(...))`` does), so they count as
    called. ``verdicts``: those of the judgment this one is part of (a partial's
    arguments)."""
    verdicts = {} if verdicts is None else verdicts
    name_of = held_callable_name if partials_only else callable_name
    found: list[str] = []
    for value in (*args, *kwargs.values()):
        if type(value) in (list, tuple, set, frozenset):
            items: Any = value
        elif type(value) is dict:
            items = dict.values(value)
        else:
            items = (value,)
        charge(len(items))  # a shared long list handed to many calls
        found.extend(name for item in items if (name := name_of(item, verdicts, kinds)))
    return found


def judge_class_call(
    cls: GlobalClass, args: tuple[Any, ...], kwargs: dict[str, Any], kinds: Kinds
) -> None:
    """A pickle calls a global's class (REDUCE, INST, OBJ): its ``__init__`` runs with the
    pickle's arguments. Calling one ckpttool does not vouch for as callable is what
    gadgets do (``FileHandler(path)``, sympy's classes evaluating a string); a vouched
    class's constructor may call the callables it is handed, and iterates or converts
    the objects it is handed (``deque(x)`` iterates ``x``: an object of a class on no
    allow-list runs its own code)."""
    if makes_a_class(args, kinds) and not cls.dangerous:
        note_call(cls.name, MAKES_CLASS)
    elif not (cls.known and cls.may_call) and not cls.dangerous:
        note_call(cls.name)
    elif cls.known and cls.name not in HOLDS_CALLABLES:
        for called in handed_callables(args, kwargs, kinds):
            note_call(called)
        judge_objects_handed(cls.name, args, kwargs, kinds)


def judge_new(
    cls: GlobalClass, args: tuple[Any, ...], kwargs: dict[str, Any], kinds: Kinds
) -> None:
    """NEWOBJ's ``cls.__new__(cls, *args)`` (and copyreg's ``__newobj__`` and
    ``_reconstructor``): construction is a call. The real class's ``__new__`` runs with
    the pickle's arguments (sympy's ``Tuple.__new__`` sympifies, that is evaluates, a
    string), and so do its ``__setstate__``, ``__setitem__`` and ``append`` on what the
    pickle does to the object next: a class ckpttool does not vouch for is refused as
    constructed, and so is any construction that makes a class."""
    if cls.dangerous:
        return  # (refused by its name already)
    if makes_a_class(args, kinds):
        note_call(cls.name, MAKES_CLASS)
    elif not cls.known:
        note_call(cls.name, CONSTRUCTED)
        # and what it is handed may be called by it when used (iterating
        # ``itertools.starmap(FileHandler, [(path,)])`` makes the file): named too
        for called in handed_callables(args, kwargs, kinds):
            note_call(called)


def makes_a_class(args: tuple[Any, ...], kinds: Kinds) -> bool:
    """Whether a construction's arguments are a class's: a name, bases that are
    globals, a namespace (``type(name, bases, ns)``). Only a metaclass takes them, and
    the class it makes is one torch would then trust (a legacy ``module`` record's
    ``dump_patches``). No checkpoint makes a class, whatever the metaclass is named."""
    return (
        len(args) >= 3
        and type(args[0]) is str
        and type(args[1]) is tuple
        and type(args[2]) is dict
        and all(kinds.global_class(base) is not None for base in args[1])
    )


def judge_build(cls: GlobalClass, values: tuple[Any, ...], kinds: Kinds) -> None:
    """BUILD hands an object ``values`` (its attributes): an object of a class on no
    allow-list (one refused as constructed already, or made by ckpttool's own stand-ins)
    given a partial is as one made with it (its methods use what it holds: a ``WeakSet``
    calls each item of its ``data`` as it is iterated). A global function among its
    attributes is not a call: objects hold functions (``self.act = F.relu``)."""
    if not (cls.known or cls.dangerous):
        for called in handed_callables(values, {}, kinds, partials_only=True):
            note_call(called)


def judge_objects_handed(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], kinds: Kinds
) -> bool:
    """A known function or class that iterates or converts what it is given (``list(x)``,
    ``str(x)``, a tensor's ``size``) runs the own methods of an object of a class on no
    allow-list (``list(starmap(FileHandler, [(path,)]))`` makes the file): noted as a
    call. Whether there was one."""
    found = False
    for value in (*args, *kwargs.values()):
        if kinds.unverified_object(value):
            note_call(f"{name}({kinds.object_name(value)})")
            found = True
    return found


def _is_known_class(item: Any, kinds: Kinds) -> bool:
    cls = kinds.global_class(item)
    return cls is not None and cls.known and cls.may_call and cls.name not in HOLDS_CALLABLES
