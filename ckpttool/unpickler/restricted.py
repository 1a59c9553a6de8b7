"""A restricted unpickler: rebuilds tensors lazily and never runs code from the file.

Every global a pickle names goes through :meth:`SafeUnpickler.find_class`, which
returns one of our own stand-ins (:mod:`ckpttool.unpickler.stand_ins`), never the real object;
what is refused is decided in :mod:`ckpttool.unpickler.policy`:

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

import contextlib
import io
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any

from ..dtypes import DTYPES, STORAGE_CLASSES
from ..errors import CkptError, TruncatedPickleError, UnsafeError
from ..guard import (
    CLASS_SWAP,
    MUTATED,
    ReadGuard,
    address_space_limit,
    guarded_read,
    note_build_on_global,
    note_call,
)
from ..tree import (
    HOLDS_CALLABLES,
    TORCH_LAYOUTS,
    TORCH_MEMORY_FORMATS,
    GlobalClass,
    Kinds,
    NamedGlobal,
    Opaque,
    StorageType,
    TorchName,
    judge_build,
    judge_class_call,
    judge_new,
    judge_objects_handed,
    opaque_class,
    state_values,
    swaps_class,
)
from .pickle_scan import CALLED, NESTED_GETATTR, Uses, scan_pickle
from .policy import (
    DANGEROUS,
    KNOWN,
    RESTORABLE,
    SAFE,
    UNVERIFIED,
    allowable,
    check_structure,
    judge,
    nested_class_getattr,
    python3_name,
    refused_use,
)
from .stand_ins import CALLS_ARGUMENT, CREATES_OBJECTS, SAFE_GLOBALS


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
        self.unverified: set[str] = set()
        self.encoding = encoding  # (how a static walk reads its strings too)

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
            # stand-in classes are read-only, Ellipsis is a constant
            if (isinstance(value, type) and issubclass(value, Opaque)) or value is Ellipsis:
                return value
            # A fresh object per read: BUILD cannot reach our shared functions through it
            named = NamedGlobal(value)
            named.name = full  # type: ignore[attr-defined]  # a partial's own __dict__
            return named
        if module == "builtins" and name == "getattr":
            return self._getattr
        if module in ("torch", "torch.storage") and name in STORAGE_CLASSES:
            return StorageType(name, DTYPES[STORAGE_CLASSES[name]])
        if module == "torch" and name in DTYPES:
            return DTYPES[name]  # Sealed: a BUILD on it is refused
        if module == "torch" and name in TORCH_LAYOUTS | TORCH_MEMORY_FORMATS:
            return TorchName(f"torch.{name}")
        verdict = judge(module, name)
        if verdict == DANGEROUS:
            self.dangerous.add(full)
            return opaque_class(module, name, dangerous=True)
        if verdict == UNVERIFIED:
            self.unverified.add(full)
        return opaque_class(
            module, name, known=verdict != UNVERIFIED, may_call=verdict != RESTORABLE
        )

    def _getattr(self, obj: Any, name: Any, *default: Any) -> Any:
        """``getattr`` is allowed only to reach a nested class of a torch class.

        ShardedTensor pickles ``getattr(ShardedTensor, "ProcessGroupState")``.
        """
        if (
            isinstance(obj, type)
            and issubclass(obj, Opaque)
            and not obj.dangerous
            and nested_class_getattr(
                obj.module, obj.qualname, name, KNOWN if obj.known else UNVERIFIED
            )
        ):
            # a nested class is judged as its own global (RESTORABLE or KNOWN by family)
            qualname = f"{obj.qualname}.{name}"
            self.seen.add(f"{obj.module}.{qualname}")
            verdict = judge(obj.module, qualname)
            if verdict == UNVERIFIED:
                self.unverified.add(f"{obj.module}.{qualname}")
            return opaque_class(
                obj.module, qualname, known=verdict != UNVERIFIED, may_call=verdict != RESTORABLE
            )
        self.dangerous.add("builtins.getattr")
        return opaque_class("builtins", "getattr", dangerous=True).make(obj, name)


def global_verdict(module: str, name: str) -> str:
    """What :meth:`SafeUnpickler.find_class` makes of ``module.name`` (already resolved
    to its Python 3 name), as a verdict: SAFE for what ckpttool rebuilds itself, else
    :func:`~ckpttool.unpickler.policy.judge`'s (``getattr`` is DANGEROUS: :func:`static_verdict`
    lets through its calls on a torch class and a nested class's name, as ``_getattr``)."""
    full = f"{module}.{name}"
    if (
        full in SAFE_GLOBALS
        or (module in ("torch", "torch.storage") and name in STORAGE_CLASSES)
        or (module == "torch" and (name in DTYPES or name in TORCH_LAYOUTS | TORCH_MEMORY_FORMATS))
    ):
        return SAFE
    return judge(module, name)


def static_verdict(uses: Uses) -> dict[str, str]:
    """The globals a static walk (:func:`~ckpttool.unpickler.pickle_scan.scan_pickle`) found that
    the policy refuses, each with how the pickle uses it."""
    refused: dict[str, str] = {}
    for full, use in uses.uses.items():
        parts = uses.parts.get(full)
        verdict = DANGEROUS if parts is None else global_verdict(*parts)
        if use == NESTED_GETATTR and all(_nested(uses, *call) for call in uses.getattrs):
            continue  # every getattr reaches a nested class of a torch class
        if refused_use(verdict, use):
            refused[full] = CALLED if use == NESTED_GETATTR else uses.reason(full)
    return refused


def _nested(uses: Uses, target: str, attr: str) -> bool:
    parts = uses.parts.get(target)
    return parts is not None and nested_class_getattr(*parts, attr, global_verdict(*parts))


class _Sink:
    """The one object a globals scan builds: it accepts whatever the pickle does to it."""

    name = "<an object>"  # what a full read names it by (its class), where known

    def __call__(self, *args: Any, **kwargs: Any) -> _Sink:
        note_call("<an object>()")  # as a full read: no checkpoint calls an object
        return self

    def __setstate__(self, state: Any) -> None:
        if swaps_class(state):  # as a full read judges it (Opaque.__setstate__)
            note_call(self.name, CLASS_SWAP)

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _UnverifiedSink(_Sink):
    """An object of a class on no allow-list, in a scan: the partials its BUILD state
    hands it are judged as called (``call_rules.judge_build``), as in a full read."""

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        judge_build(_UNKNOWN, state_values(state), SCAN)


class _HeldSink(_Sink):
    """A partial, in a scan: whether calling it would be of note is judged by
    ``call_rules.held_callable_name`` (the functions it was made with and BUILD gives
    it, and their arguments), as in a full read."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state  # the last BUILD is what the partial calls, as in a full read


_ABSORB = _Sink()
_UNVERIFIED = _UnverifiedSink()  # an object of a class on no allow-list, in a scan


def _new_unverified(cls: _AbsorbClass, *args: Any, **kwargs: Any) -> _Sink:
    """NEWOBJ of a class on no allow-list, in a scan: refused as constructed (as
    ``Opaque.__new__`` judges it), and told apart from other objects."""
    judge_new(cls.as_global(), args, kwargs, SCAN)
    return _UNVERIFIED


def _new_known(cls: _AbsorbClass, *args: Any, **kwargs: Any) -> _Sink:
    """NEWOBJ of a vouched class, in a scan: judged as ``Opaque.__new__`` judges it (a
    construction that makes a class is refused: it takes arguments, the usual NEWOBJ
    none); the object is the class's one sink, so that what a BUILD does to it is named
    as a full read names it."""
    if args or kwargs:
        judge_new(cls.as_global(), args, kwargs, SCAN)
    return cls.sink


def _new_held(cls: type, *args: Any, **kwargs: Any) -> _Sink:
    """NEWOBJ of a class that holds a callable (a partial), in a scan: told apart, as a
    call of the class is (``_AbsorbClass.__call__``)."""
    return _HeldSink(args, kwargs)


class _Absorb:
    """What a globals scan hands out for a global: calling or instantiating it gives the sink.

    ``__new__`` returns an object that is not an instance of the class, so Python
    skips ``__init__``: one Python call per object the pickle builds, not two.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> _Sink:  # type: ignore[misc]
        return _ABSORB


class GlobalsScanner(SafeUnpickler):
    """Judges every global exactly as :class:`SafeUnpickler` does, but rebuilds nothing.

    Several times faster than a full read: for the rank files of a per-rank
    checkpoint whose structure rank 0 already describes.
    """

    def find_class(self, module: str, name: str) -> Any:
        value = super().find_class(module, name)
        if value == self._getattr:
            return value
        full = ".".join(python3_name(module, name))
        position = CALLS_ARGUMENT.get(full)
        if position is not None:
            return _absorb_calling(position)
        if full == "copyreg.__newobj__":
            return _absorb_newobj
        if full in SAFE_GLOBALS and full not in CREATES_OBJECTS:
            return _absorb_judging(full)
        if isinstance(value, type) and issubclass(value, Opaque) and not value.dangerous:
            # getattr may look into it; calling it is judged as in a full read
            return _named_absorb(value.module, value.qualname, value.known, value.may_call)
        return _Absorb

    def _getattr(self, obj: Any, name: Any, *default: Any) -> Any:
        if isinstance(obj, _AbsorbClass):
            # the same rule as a full read, on the class the absorbing one stands for
            obj = opaque_class(obj.module, obj.qualname, known=obj.known, may_call=obj.may_call)
        value = super()._getattr(obj, name, *default)
        if isinstance(value, type) and issubclass(value, Opaque) and not value.dangerous:
            return _named_absorb(value.module, value.qualname, value.known, value.may_call)
        return _Absorb

    def persistent_load(self, pid: Any) -> Any:
        return _ABSORB


def _absorb_newobj(cls: Any, *args: Any) -> _Sink:
    """``copyreg.__newobj__(cls, *args)`` in a scan: NEWOBJ's ``cls.__new__(cls, *args)``,
    judged as NEWOBJ is (what a class on no allow-list is handed)."""
    if isinstance(cls, _AbsorbClass):
        return cls.__new__(cls, *args)  # type: ignore[arg-type, no-any-return]
    return _ABSORB


def _absorb_calling(position: int) -> Callable[..., _Sink]:
    """What a scan hands out for a known function that calls its argument at ``position``
    (:data:`~ckpttool.unpickler.stand_ins.CALLS_ARGUMENT`): that call is judged as a full read
    judges it (a global on no allow-list, or an object, is noted)."""

    def absorb(*args: Any, **kwargs: Any) -> _Sink:
        if len(args) > position and isinstance(args[position], (_AbsorbClass, _Sink)):
            args[position]()
        if position == 1 and args and isinstance(args[0], _AbsorbClass):
            # copyreg._reconstructor(cls, base, state): an object of cls, constructed
            judge_new(args[0].as_global(), (), {}, SCAN)
            return _ABSORB if args[0].known else _UNVERIFIED
        return _ABSORB

    return absorb


def _absorb_judging(full: str) -> Callable[..., Any]:
    """What a scan hands out for a global ckpttool rebuilds (``list``, ``str``, a tensor
    rebuilder): given an object of a class on no allow-list, the real one runs that
    object's methods, as a full read judges (see ``stand_ins._judging_objects``)."""
    value = SAFE_GLOBALS[full]
    if isinstance(value, type) or value is Ellipsis:
        return _Absorb

    def absorb(*args: Any, **kwargs: Any) -> Any:
        judge_objects_handed(full, args, kwargs, SCAN)
        if full in _CONTAINERS and any(type(arg) in _CONTAINER_TYPES for arg in args):
            # a container is built for real (charged as in a full read): a partial in a
            # set(...) that a BUILD state holds is judged there (Opaque.__setstate__)
            try:
                return value(*args, **kwargs)
            except CkptError:
                raise
            except Exception:  # an argument the scan absorbed: the full read judges it
                return _ABSORB
        return _ABSORB

    return absorb


# Data constructors whose result a scan keeps (of real containers only): what a BUILD
# state holds one level in is judged as a full read judges it.
_CONTAINERS = frozenset(
    {"builtins.list", "builtins.tuple", "builtins.set", "builtins.frozenset", "builtins.dict"}
    | {"collections.OrderedDict"}
)
_CONTAINER_TYPES = (list, tuple, set, frozenset, dict)


class _AbsorbClass(type):
    """A class standing for a global in a scan: calling one on no allow-list is noted,
    as :class:`~ckpttool.tree.Opaque`'s metaclass notes it in a full read."""

    module: str
    qualname: str
    known: bool
    may_call: bool
    sink: _Sink  # the one object a NEWOBJ of a vouched class gives, named as its class

    @property
    def __setstate__(cls) -> Callable[[Any], None]:
        """BUILD on the global itself, judged as a full read judges it (``_ReadOnlyClass``)."""

        def build(state: Any) -> None:
            note_build_on_global(f"{cls.module}.{cls.qualname}")

        return build

    # SETITEM, APPEND(S) on the global itself: as ``_ReadOnlyClass`` judges them
    def __setitem__(cls, key: Any, value: Any) -> None:
        note_call(f"{cls.module}.{cls.qualname}", MUTATED)

    @property
    def append(cls) -> Callable[[Any], None]:
        return lambda value: note_call(f"{cls.module}.{cls.qualname}", MUTATED)

    @property
    def extend(cls) -> Callable[[Any], None]:
        return lambda values: note_call(f"{cls.module}.{cls.qualname}", MUTATED)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.known and f"{cls.module}.{cls.qualname}" in HOLDS_CALLABLES:
            return _HeldSink(args, kwargs)  # told apart when handed to another constructor
        judge_class_call(cls.as_global(), args, kwargs, SCAN)
        return _ABSORB

    def as_global(cls) -> GlobalClass:
        """The global this absorbing class stands for, as the call rules see it."""
        return GlobalClass(f"{cls.module}.{cls.qualname}", cls.known, False, cls.may_call)


_NAMED_ABSORB: dict[tuple[str, str, bool, bool], type] = {}


def _named_absorb(module: str, qualname: str, known: bool = False, may_call: bool = True) -> type:
    """An absorbing class that remembers which global it stands for."""
    key = (module, qualname, known, may_call)
    cls = _NAMED_ABSORB.get(key)
    if cls is None:
        attrs: dict[str, Any] = {
            "module": module, "qualname": qualname, "known": known, "may_call": may_call
        }  # fmt: skip
        if not known:
            attrs["__new__"] = _new_unverified
        elif f"{module}.{qualname}" in HOLDS_CALLABLES:
            attrs["__new__"] = _new_held  # a partial made by NEWOBJ is one too
        else:
            attrs["__new__"] = _new_known
            attrs["sink"] = sink = _Sink()
            sink.name = f"{module}.{qualname}"
        cls = _AbsorbClass("Absorb", (_Absorb,), attrs)
        _NAMED_ABSORB[key] = cls
    return cls


@contextlib.contextmanager
def _quiet_buffer_errors() -> Iterator[None]:
    """No stray line on stderr from CPython's unpickler on a hostile BYTEARRAY8.

    A declared size it cannot allocate ends, inside CPython, in "deallocated
    bytearray object has exported buffers" printed through ``sys.excepthook``; the
    read itself fails as it should (a MemoryError, reported as a corrupt pickle).
    """
    previous = sys.excepthook

    def hook(kind: Any, value: Any, traceback: Any) -> None:
        if kind is SystemError and "exported buffers" in str(value):
            return
        previous(kind, value, traceback)

    sys.excepthook = hook
    try:
        yield
    finally:
        sys.excepthook = previous


def load_pickle(
    data: bytes | bytearray | memoryview | IO[bytes],
    persistent_load: Callable[[Any], Any] | None = None,
    *,
    path: object = None,
    permissive: bool = False,
    seen: set[str] | None = None,
    scan_only: bool = False,
    unpickler_class: type[SafeUnpickler] | None = None,
    check: bool = True,
) -> Any:
    """Unpickle ``data`` safely and return the object (with lazy tensor leaves).

    Args:
        data: The pickle bytes, or a binary file positioned at it.
        persistent_load: Resolves persistent ids (torch storages).
        path: The file, for messages.
        permissive: Keep dangerous globals as inert stand-ins instead of refusing.
        seen: A set that collects every global referenced (and ``!name`` for refused ones).
        scan_only: Only judge the globals (:class:`GlobalsScanner`); returns None.
        unpickler_class: A :class:`SafeUnpickler` of another kind (a DCP ``.metadata``'s).
        check: Run :func:`~ckpttool.unpickler.policy.check_structure` on the result; False only
            where the caller checks it itself.

    Raises:
        UnsafeError: The pickle references dangerous globals (and not ``permissive``).
        CkptError: The pickle is corrupt or truncated.
    """
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    start = stream.tell()
    unpickler_class = unpickler_class or (GlobalsScanner if scan_only else SafeUnpickler)
    unpickler = unpickler_class(stream, persistent_load, permissive=permissive)
    error: BaseException | None = None
    result = None
    size = _remaining(stream, start)
    with guarded_read(size) as guard, _quiet_buffer_errors(), address_space_limit(size):
        try:
            try:
                result = unpickler.load()
            except UnicodeDecodeError:
                # Python 2 pickles hold byte strings: torch.load(encoding="latin1") reads them.
                stream.seek(start)
                guard.called.clear()
                unpickler = unpickler_class(
                    stream, persistent_load, permissive=permissive, encoding="latin1"
                )
                result = unpickler.load()
        except CkptError as exc:
            error = exc
        except RecursionError:
            error = CkptError("pickle nests too deeply", path=path)
        except MemoryError:
            error = CkptError("corrupt pickle: it asks for far more memory than it holds")
        except Exception as exc:  # any malformed-pickle error the C unpickler raises
            error = exc
    # The memo holds every object the pickle built, and a memoized ``getattr`` (our bound
    # ``_getattr``) ties it to the unpickler in a cycle: cleared, all of it is freed now
    # by reference counting (the collector is paused while a checkpoint is read, and a
    # per-rank read of 256 ShardedTensor files would keep 4.5 GiB of them).
    unpickler.memo.clear()
    # a global on no allow-list that the pickle calls, or an object it calls, runs code
    # under a real unpickler (FileHandler(path), partial(...)())
    unpickler.dangerous.update(guard.called)
    reasons: dict[str, str] = {}
    if error is not None and not permissive:
        # The verdict first: a read that stopped early (an error of a stand-in, a
        # persistent id it refused) has not met every global; the real unpickler goes on
        reasons = static_verdict(_static_scan(stream, start, unpickler))
        unpickler.dangerous.update(reasons)
    if seen is not None:
        seen.update(unpickler.seen)
        seen.update("?" + g for g in unpickler.unverified - unpickler.dangerous)
        seen.update("!" + g for g in unpickler.dangerous)
    if unpickler.dangerous and not permissive:
        if not reasons:
            reasons = static_verdict(_static_scan(stream, start, unpickler))
        globals_, dangerous, unverified = split_seen(
            (seen if seen is not None else set())
            | unpickler.seen
            | {"!" + g for g in unpickler.dangerous}
            | {"?" + g for g in unpickler.unverified}
        )
        raise UnsafeError(
            dangerous,
            path=path,
            reasons={g: _reason(g, guard, reasons) for g in dangerous},
            globals=globals_,
            unverified=unverified,
            allowable=[g for g in dangerous if allowable(g)],
        )
    if isinstance(error, CkptError):
        if error.path is None:
            error.path = None if path is None else str(path)
            error.args = (error.one_line(),)
        raise error
    if error is not None:
        if isinstance(error, EOFError) or (
            isinstance(error, pickle.UnpicklingError) and "truncated" in str(error)
        ):  # every opcode parsed up to where the data ends (C's words for it)
            raise TruncatedPickleError(
                f"truncated pickle ({type(error).__name__}: {error})", path=path
            ) from None
        raise CkptError(f"corrupt pickle ({type(error).__name__}: {error})", path=path) from None
    if scan_only:
        return None
    if check:
        check_structure(result, path)
    return result


# A refused pickle's static walk (for the reasons, and past a read's error) reads at most
# this much of it: the pickles of checkpoints are KB to a few MB.
MAX_STATIC_SCAN_BYTES = 1 << 30
STATIC_SCAN_CHUNK = 1 << 20
# A stopped read's pickle that goes on past what the walk reads: refused, never exit 2
UNREACHED = "<a pickle past 1 GiB after the read stopped: cannot be vouched for>"


def _static_scan(stream: IO[bytes], start: int, unpickler: SafeUnpickler) -> Uses:
    """:func:`~ckpttool.unpickler.pickle_scan.scan_pickle` of the pickle at ``start`` of ``stream``,
    read a growing chunk at a time (it ends at its STOP, most of a legacy file is data)."""
    encoding = unpickler.encoding
    chunk = STATIC_SCAN_CHUNK
    while True:
        try:
            stream.seek(start)
            data = stream.read(chunk)
        except (OSError, ValueError):
            return Uses()
        uses = scan_pickle(data, python3_name, encoding=encoding)
        if uses.truncated and len(data) >= MAX_STATIC_SCAN_BYTES:
            # the rest is not walked: what it would make torch do cannot be vouched for
            uses.note(frozenset({UNREACHED}), CALLED)
        if not uses.truncated or len(data) < chunk or chunk >= MAX_STATIC_SCAN_BYTES:
            return uses
        chunk = min(chunk * 8, MAX_STATIC_SCAN_BYTES)


def _reason(name: str, guard: ReadGuard, static: dict[str, str]) -> str:
    """How a refused pickle uses ``name``: what the read saw it do, else the static walk's."""
    if name in guard.uses:
        return guard.uses[name]
    if name in guard.called:
        return "called" if not name.endswith(")") else "called (an object it made)"
    return static.get(name, "referenced")


def _remaining(stream: IO[bytes], start: int) -> int:
    """Bytes left in ``stream`` from ``start``: the pickle's size, what its budget is from."""
    try:
        end = stream.seek(0, io.SEEK_END)
        stream.seek(start)
        return end - start
    except (OSError, ValueError):
        return 0


def split_seen(seen: set[str]) -> tuple[list[str], list[str], list[str]]:
    """(globals, dangerous, unverified), sorted, from a ``seen`` set :func:`load_pickle` filled.

    A called global (``!``) is listed among the globals even where the name it was
    called by is a stand-in's (``pkg.Class()`` for an object of it called).
    """
    dangerous = {g[1:] for g in seen if g.startswith("!")}
    plain = {g for g in seen if g[:1] not in ("!", "?")}
    unverified = {g[1:] for g in seen if g.startswith("?")} - dangerous
    return sorted(plain | dangerous), sorted(dangerous), sorted(unverified)


def _scan_global_class(item: Any) -> GlobalClass | None:
    return item.as_global() if isinstance(item, _AbsorbClass) else None


def _scan_partial(item: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any] | None:
    return (item.args, item.kwargs, item.state) if isinstance(item, _HeldSink) else None


# How a globals scan's values answer the call rules' questions: one object of a class
# on no allow-list stands for all of them, and a partial is a _HeldSink
SCAN = Kinds(
    _scan_global_class, lambda item: item is _UNVERIFIED, lambda item: "<an object>", _scan_partial
)
_UNKNOWN = GlobalClass("<a class on no allow-list>", known=False, dangerous=False)
