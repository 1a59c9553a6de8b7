"""The lazy checkpoint tree every reader produces and every command consumes.

A checkpoint is plain Python containers (dict, list, tuple) whose leaves are
primitives, :class:`TensorRef` (one tensor: metadata plus where its bytes live),
:class:`ShardedRef` (a global tensor made of shards spread over ranks or files),
:class:`SparseRef` (a sparse tensor, made of stored index and value tensors) or
:class:`Opaque` (an inert stand-in for an object of a class we do not rebuild).
Nothing here imports torch: bytes are read and tensors built only in
:mod:`ckpttool.tensors`, when a tensor is actually asked for.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypedDict, TypeGuard, Union

from . import sources
from .dtypes import DType
from .errors import CkptError, InputNotFoundError
from .guard import charge, note_build_on_global, note_call
from .sealed import Sealed
from .spans import read_at

if TYPE_CHECKING:
    from .sharding import Shard
    from .sources import OpenFiles


class ZipHeaderCheck(Protocol):
    """Checks a zip entry's local header (``size`` bytes: the fixed part and the name)
    against the central directory and returns where the entry's data starts in it."""

    size: int

    def __call__(self, header: bytes) -> int: ...


class ByteSource:
    """Where a run of bytes lives: a span of a file, an entry of a zip, or memory.

    A zip entry's data offset needs its local header, so it is found on first read.
    """

    def __init__(
        self,
        path: str | None = None,
        offset: int = 0,
        length: int = 0,
        *,
        data: bytes | bytearray | memoryview | None = None,
        zip_header_offset: int | None = None,
        zip_header_check: ZipHeaderCheck | None = None,
    ):
        self.path = path
        self.offset = offset
        self.length = length if data is None else len(data)
        self.data = data
        self._zip_header_offset = zip_header_offset
        self._zip_header_check = zip_header_check

    def resolve(self, files: OpenFiles | None = None) -> None:
        """Find a zip entry's data offset from its local header (done once, on first use).

        ``files``: descriptors kept open by readers of many entries (local files).
        """
        if self._zip_header_offset is None or self.path is None:
            return
        check = self._zip_header_check
        header = memoryview(bytearray(30 if check is None else check.size))
        try:
            read_at(self.path, self._zip_header_offset, header, files)
        except InputNotFoundError:
            raise
        except CkptError:  # a header cut short is a corrupt entry, whatever the reason
            raise CkptError("corrupt zip entry header", path=self.path) from None
        if check is not None:  # the entry's own checks against its central directory
            self.offset = self._zip_header_offset + check(bytes(header))
        else:
            if header[:4] != b"PK\x03\x04":
                raise CkptError("corrupt zip entry header", path=self.path)
            name_len = int.from_bytes(header[26:28], "little")
            extra_len = int.from_bytes(header[28:30], "little")
            self.offset = self._zip_header_offset + 30 + name_len + extra_len
        self._zip_header_offset = None

    def read(self, start: int = 0, size: int | None = None) -> bytearray:
        """Read ``size`` bytes from ``start`` (relative to the span) into a new buffer."""
        size = self.length - start if size is None else size
        if start < 0 or size < 0 or start + size > self.length:
            raise CkptError("read outside of the stored bytes (truncated file?)", path=self.path)
        if self.data is not None:
            return bytearray(self.data[start : start + size])
        if self.path is None:
            raise CkptError("tensor bytes have no file")
        self.resolve()
        # checked against the file's size before the buffer is allocated: never
        # allocate what a file only declares
        return sources.read(self.path, self.offset + start, size)


@dataclass(eq=False)
class StorageRef(Sealed):
    """One storage as torch saved it: ``numel`` elements of ``dtype`` on ``device``.

    Tensors that share a storage (tied weights, views) hold the same StorageRef.
    """

    key: str
    dtype: DType
    numel: int
    device: str
    source: ByteSource | None = None  # None for a storage whose bytes were never saved (meta)
    big_endian: bool = False  # torch files record the writer's byte order

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


# torch counts elements in an int64; safetensors and torch refuse a shape past it even
# where another dimension is 0
MAX_NUMEL = 2**63 - 1


def check_shape(shape: tuple[int, ...]) -> None:
    """Each dimension and the element count of every non-empty part fit torch's int64.

    Raises:
        CkptError: A shape no torch tensor can have (an output would not load).
    """
    count = 1
    for n in shape:
        count *= max(n, 1)
        if n < 0 or count > MAX_NUMEL:
            raise CkptError(f"corrupt tensor: impossible shape {list(shape)[:8]}")


class _Sized(Sealed):
    """numel and nbytes from ``shape`` and ``dtype`` (global sizes for sharded tensors).

    Every tensor leaf checks its shape when it is made, whichever format read it: a
    shape torch cannot hold must not reach an output that then fails to load.
    """

    shape: tuple[int, ...]
    dtype: DType

    def __post_init__(self) -> None:
        check_shape(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(eq=False)
class TensorRef(_Sized):
    """A tensor whose bytes stay on disk until :meth:`load`.

    ``offset`` and ``stride`` are in elements of ``dtype``, as in ``torch.as_strided``.
    """

    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage: StorageRef | None
    device: str = "cpu"
    requires_grad: bool = False
    kind: str = "tensor"  # "quantized", or a tensor subclass's name
    parameter: bool = False  # saved as an nn.Parameter
    # torch's lazy conjugate / negative views: the stored bytes are the values before it
    conj: bool = False
    neg: bool = False
    # a quantized tensor's scheme and parameters (kind "quantized"): ("per_tensor_affine",
    # scale, zero_point) or (per-channel scheme, scales, zero_points, axis), None if unknown
    quantizer: Any = None

    sharded = False

    def __post_init__(self) -> None:
        super().__post_init__()
        # torch holds strides and the offset in int64 too; an empty tensor's are never
        # checked against its storage, and reading a slice of it passes them to torch
        if abs(self.offset) > MAX_NUMEL or any(abs(s) > MAX_NUMEL for s in self.stride):
            raise CkptError(
                f"corrupt tensor: impossible stride {list(self.stride)[:8]} or offset {self.offset}"
            )

    def tensor_ref(self) -> TensorRef:
        """Itself: a stored tensor is its own :class:`~ckpttool.sharding.Block`."""
        return self

    def is_contiguous(self) -> bool:
        return self.stride == contiguous_stride(self.shape) or self.numel <= 1

    def load(self, map_location: Any = "cpu") -> Any:
        """Read the bytes and return a ``torch.Tensor`` (its own memory, contiguous if a view)."""
        from .tensors import load_tensor

        return load_tensor(self, map_location)

    @classmethod
    def whole_storage(cls, storage: StorageRef) -> TensorRef:
        """A storage saved on its own (``torch.save(t.untyped_storage())``), as the flat
        tensor of all its elements: how its bytes are read and written."""
        return cls(storage.dtype, (storage.numel,), (1,), 0, storage, device=storage.device)


@dataclass(eq=False)
class ShardedRef(_Sized):
    """A global tensor made of shards (ShardedTensor, DTensor or DCP chunks)."""

    dtype: DType
    shape: tuple[int, ...]
    shards: list[Shard]
    device: str = "cpu"
    kind: str = "sharded_tensor"  # "dtensor", "dcp"
    requires_grad: bool = False
    world_size: int | None = None
    # why the full tensor cannot be assembled (some shards were never saved with it):
    # shown by inspect, refused by name where data is needed (see api.require_data)
    incomplete: str | None = None

    sharded = True

    def load(self, map_location: Any = "cpu") -> Any:
        """Assemble the full tensor from its shards."""
        from .tensors import load_sharded

        if self.incomplete:
            raise CkptError(f"sharded tensor {self.incomplete}")
        return load_sharded(self, map_location)


# Sparse layouts torch.save writes, and the stored tensors each is rebuilt from.
SPARSE_PARTS: dict[str, tuple[str, ...]] = {
    "sparse_coo": ("indices", "values"),
    "sparse_csr": ("crow_indices", "col_indices", "values"),
    "sparse_csc": ("ccol_indices", "row_indices", "values"),
    "sparse_bsr": ("crow_indices", "col_indices", "values"),
    "sparse_bsc": ("ccol_indices", "row_indices", "values"),
}


@dataclass(eq=False)
class SparseRef(Sealed):
    """A sparse tensor: its layout, its dense shape and the stored tensors it is made of.

    ``parts`` are named by ``SPARSE_PARTS[layout]``: (indices, values) for COO,
    (compressed indices, plain indices, values) for CSR, CSC, BSR and BSC. Its size
    is what those hold, not the dense shape.
    """

    layout: str
    shape: tuple[int, ...]
    parts: tuple[TensorRef, ...]
    is_coalesced: bool | None = None  # COO only; None when the file does not say
    requires_grad: bool = False
    parameter: bool = False  # saved as an nn.Parameter

    sharded = False

    def __post_init__(self) -> None:
        check_shape(self.shape)  # the dense shape, as for every tensor leaf (see _Sized)

    @property
    def values(self) -> TensorRef:
        return self.parts[-1]

    @property
    def dtype(self) -> DType:
        return self.values.dtype

    @property
    def device(self) -> str:
        return self.values.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def load(self, map_location: Any = "cpu") -> Any:
        """Read the parts and return the sparse ``torch.Tensor`` (its invariants checked)."""
        from .tensors import load_sparse

        return load_sparse(self, map_location)


# Known classes whose objects exist to hold a callable they are given and call it
# later, when called themselves: making one calls nothing.
HOLDS_CALLABLES = frozenset({"functools.partial"})


# Verdicts of the partials met during one judgment (id -> name or None): a partial given
# the same partial twice, thirty levels deep, is a few hundred bytes of pickle and would
# otherwise be judged 2**30 times.
CallVerdicts = dict[int, "str | None"]
CallableName = Callable[[Any, CallVerdicts], "str | None"]


def _callable_name(item: Any, verdicts: CallVerdicts) -> str | None:
    """What calling ``item`` would be named, where it is a callable of note: an object of
    a class that holds a callable (a partial, see :func:`held_callable_name`), or a
    global on no allow-list."""
    if isinstance(item, _ReadOnlyClass) and not (item.known or item.dangerous):
        return f"{item.module}.{item.qualname}"
    return held_callable_name(item, verdicts)


def held_callable_name(item: Any, verdicts: CallVerdicts) -> str | None:
    """``functools.partial()`` where ``item`` is a partial whose call would be of note:
    one that calls anything but a known class with plain arguments. The function it
    calls is the one BUILD gives it (``partial.__setstate__`` replaces the one it was
    made with), so both are judged. ``partial(nn.LayerNorm, eps=1e-6)`` (torchvision's
    ``norm_layer``, kept by its models) calls nothing of note."""
    if not (isinstance(item, Opaque) and type(item).class_name() in HOLDS_CALLABLES):
        return None
    if id(item) in verdicts:
        return verdicts[id(item)]
    verdicts[id(item)] = None  # (one it holds itself, through its BUILD, is judged once)
    state = item.state  # keywords it was made with (NEWOBJ_EX), until a BUILD
    funcs, args, kwargs = partial_call(item.args, state if type(state) is dict else {}, state)
    plain_call = (
        bool(funcs)
        and all(_is_known_class(func) for func in funcs)
        and not handed_callables(args, kwargs, verdicts=verdicts)
        and not any(_is_unverified_object(v) for v in (*args, *kwargs.values()))
    )
    verdicts[id(item)] = None if plain_call else f"{type(item).class_name()}()"
    return verdicts[id(item)]


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


def _is_known_class(item: Any) -> bool:
    return (
        isinstance(item, _ReadOnlyClass)
        and item.known
        and f"{item.module}.{item.qualname}" not in HOLDS_CALLABLES
    )


def _is_unverified_object(item: Any) -> bool:
    return isinstance(item, Opaque) and not (type(item).known or type(item).dangerous)


def handed_callables(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    callable_name: CallableName = _callable_name,
    verdicts: CallVerdicts | None = None,
) -> list[str]:
    """The callables a pickle hands to a constructor, in its arguments or one level into
    a list, tuple, dict or set among them (``callable_name``: a partial object, a global
    on no allow-list). A known class's constructor may call them at once
    (``LambdaLR(optimizer, partial(...))`` does), so they count as called.
    ``verdicts``: those of the judgment this one is part of (a partial's arguments).
    """
    verdicts = {} if verdicts is None else verdicts
    found: list[str] = []
    for value in (*args, *kwargs.values()):
        if type(value) in (list, tuple, set, frozenset):
            items: Any = value
        elif type(value) is dict:
            items = dict.values(value)
        else:
            items = (value,)
        charge(len(items))  # a shared long list handed to many calls
        found.extend(name for item in items if (name := callable_name(item, verdicts)))
    return found


class _ReadOnlyClass(type):
    """Stand-in classes are shared by every read: a pickle's BUILD must not change them."""

    # (set by Opaque and opaque_class's subclasses; declared for the type checker)
    module: str
    qualname: str
    dangerous: bool
    known: bool

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # only a pickle calls a stand-in class (ckpttool's own code uses make()):
        # calling a global on no allow-list is what gadgets do (FileHandler(path))
        if not (cls.known or cls.dangerous):
            note_call(f"{cls.module}.{cls.qualname}")
        elif cls.known and f"{cls.module}.{cls.qualname}" not in HOLDS_CALLABLES:
            for name in handed_callables(args, kwargs):
                note_call(name)
            for value in (*args, *kwargs.values()):
                # deque(x) iterates x: an object of a class on no allow-list runs its code
                if isinstance(value, Opaque) and not (type(value).known or type(value).dangerous):
                    note_call(f"{cls.module}.{cls.qualname}({type(value).class_name()})")
        return cls.make(*args, **kwargs)  # type: ignore[attr-defined]

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
    known = False  # a torch metadata class we understand, not worth a warning

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
        if args and not (cls.known or cls.dangerous):
            for name in handed_callables(args, kwargs):
                note_call(name)
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
        cls = type(self)
        if not (cls.known or cls.dangerous):
            for name in handed_callables(state_values(state), {}, held_callable_name):
                note_call(name)
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


_OPAQUE_CLASSES: dict[tuple[str, str, bool, bool], type] = {}


def opaque_class(module: str, qualname: str, *, dangerous: bool = False, known: bool = False):
    """The Opaque subclass standing in for ``module.qualname`` (one per name)."""
    key = (module, qualname, dangerous, known)  # (a known one is not the unknown one)
    cls = _OPAQUE_CLASSES.get(key)
    if cls is None:
        name = qualname.rsplit(".", 1)[-1]
        attrs = {"module": module, "qualname": qualname, "dangerous": dangerous, "known": known}
        cls = type(name if name.isidentifier() else "Opaque", (Opaque,), attrs)
        _OPAQUE_CLASSES[key] = cls
    return cls


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


LEAF_TYPES = (TensorRef, ShardedRef, SparseRef)
# A tensor leaf of the tree: what inspect lists, convert writes and load turns into a
# torch.Tensor. Every other leaf is plain data or an Opaque.
Leaf: TypeAlias = Union[TensorRef, ShardedRef, SparseRef]  # noqa: UP007  (a runtime alias)
KeyPath = tuple[Any, ...]


def is_tensor(value: Any) -> TypeGuard[Leaf]:
    return isinstance(value, LEAF_TYPES)


def children(node: Any) -> Iterator[tuple[Any, Any]]:
    """The (key, child) pairs of a container node; nothing for a leaf."""
    if isinstance(node, Mapping):
        yield from node.items()
    elif isinstance(node, (list, tuple)):
        yield from enumerate(node)
    elif isinstance(node, Opaque):
        yield from node.children()


def walk(node: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """Yield (key path, node) for every node, depth first, containers before children.

    Shared sub-objects are visited once per path; cycles are cut.
    """
    stack: list[tuple[KeyPath, Any, frozenset[int]]] = [(path, node, frozenset())]
    while stack:
        here, value, ancestors = stack.pop()
        yield here, value
        if is_tensor(value) or id(value) in ancestors:
            continue
        kids = list(children(value))
        if kids:
            inner = ancestors | {id(value)}
            stack.extend((here + (k,), v, inner) for k, v in reversed(kids))


def iter_tensors(node: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Leaf]]:
    """Yield (key path, tensor leaf) for every tensor under ``node``, in order."""
    for here, value in walk(node, path):
        if is_tensor(value):
            yield here, value


def get_path(node: Any, path: KeyPath) -> Any:
    """Follow ``path`` from ``node``; raise CkptError naming the first missing key."""
    for i, key in enumerate(path):
        try:
            if isinstance(node, (list, tuple)):
                node = node[int(key)]
            elif isinstance(node, Opaque):
                node = dict(node.children())[key]
            else:
                node = node[key]
        except (KeyError, IndexError, ValueError, TypeError):
            shown = ".".join(str(k) for k in path[: i + 1])
            raise CkptError(f"no key {shown!r} in the checkpoint") from None
    return node


@dataclass(repr=False)
class Checkpoint(Mapping):
    """What a reader returns: the lazy tree plus what it learned on the way.

    A read-only mapping over its root, as ``torch.load`` would return it (``ckpt["model"]``,
    ``ckpt.keys()``), its values lazy: tensors are :class:`TensorRef` & co. until loaded.

    Attributes:
        format: A format id from the contract (``torch-zip``, ``dcp``, ...).
        files: The files read, in rank order for sharded inputs.
        root: The tree.
        world_size: Number of ranks for ``dcp`` / ``per-rank`` input, else None.
        globals: Every global the pickles referenced, sorted (``module.name``).
        dangerous: Those of them that are refused without ``--unsafe``.
        unverified: Those on none of ckpttool's allow-lists, read as inert stand-ins.
        metadata: Format-level metadata (the safetensors ``__metadata__``).
        model_path: Where the model state dict is, when the reader knows it from the
            layout (run folders, Megatron); None: found from the tree's content.
    """

    format: str
    files: list[str]
    root: Any
    world_size: int | None = None
    globals: list[str] = field(default_factory=list)
    dangerous: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    model_path: KeyPath | None = None

    def _container(self) -> Any:
        root = self.root
        return root if isinstance(root, Mapping) else dict(children(root))

    def __getitem__(self, key: Any) -> Any:
        return self._container()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._container())

    def __len__(self) -> int:
        return len(self._container())

    def __repr__(self) -> str:
        # short at any size: a 70B folder has thousands of tensors and dozens of files
        files = [os.path.basename(f) for f in self.files]
        shown_files = repr(files[:2])[:-1] + (
            f", ... +{len(files) - 2}]" if len(files) > 2 else "]"
        )
        keys = [str(k) for k in list(self._container())[: MAX_REPR_KEYS + 1]]
        shown_keys = ", ".join(
            repr(k if len(k) <= 40 else k[:39] + "…") for k in keys[:MAX_REPR_KEYS]
        )
        if len(keys) > MAX_REPR_KEYS:
            shown_keys += f", ... +{len(self) - MAX_REPR_KEYS}"
        tensors = sum(1 for _ in iter_tensors(self.root))
        world = f", world_size={self.world_size}" if self.world_size else ""
        return (
            f"Checkpoint(format={self.format!r}, files={shown_files}{world}, "
            f"tensors={tensors}, keys=[{shown_keys}])"
        )


MAX_REPR_KEYS = 6


class Verdicts(TypedDict):
    """The keyword arguments of :class:`Checkpoint` that judge its pickles' globals."""

    globals: list[str]
    dangerous: list[str]
    unverified: list[str]


def verdicts(*parts: Checkpoint) -> Verdicts:
    """``globals``, ``dangerous`` and ``unverified`` of several checkpoints read as one
    (keyword arguments for :class:`Checkpoint`)."""
    dangerous = {g for part in parts for g in part.dangerous}
    return {
        "globals": sorted({g for part in parts for g in part.globals}),
        "dangerous": sorted(dangerous),
        "unverified": sorted({g for part in parts for g in part.unverified} - dangerous),
    }
