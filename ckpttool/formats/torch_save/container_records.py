"""Legacy container records: a pre-1.6 ``torch.save`` pickle's ``('module', cls,
source_file, source)`` persistent ids, judged as ``torch.load`` meets them (its
``_check_container_source``), for the legacy stream and the tar container alike."""

from __future__ import annotations

from typing import Any

from ...errors import CkptError, UnsafeError
from ...tree import Opaque, opaque_class
from ...unpickler import ALLOWED


def container_record(record: tuple, refused: dict[str, str]) -> Any:
    """What a legacy pickle's container record ``(cls, source_file, source)`` stands for
    (the class, inert), judged as ``torch.load`` meets it; ``refused`` collects
    ``{name: reason}`` for one it would act on.

    ``torch.load`` hands a record whose file and source are both set to
    ``_check_container_source``: it reads ``cls``'s source through ``inspect``, and
    where it differs and ``cls.dump_patches`` is set, writes ``<cls.__name__>.patch``
    into the working folder. Only a plain global naming a ``torch.nn`` class on
    ckpttool's lists is real torch there (no ``dump_patches``), or one the user allowed;
    anything else (a class the pickle made, say by a metaclass, posing as one) is
    refused. A record without source is handed back unchecked, as torch does.
    """
    cls = record[0] if record else None
    stand_in = cls if isinstance(cls, type) and issubclass(cls, Opaque) else None
    value = stand_in or opaque_class("torch.nn", "Module")
    if any(_plainly_empty(v) for v in record[1:]):
        return value  # "Ignore containers that don't have any sources saved"
    if stand_in is not None and _real_container_class(stand_in):
        return value
    name = stand_in.class_name() if stand_in is not None else _value_name(cls)
    refused[name] = "a container record with source: torch.load checks it and may write a .patch"
    return value


def _real_container_class(cls: type[Opaque]) -> bool:
    """A stand-in for a real ``torch.nn`` class (a CapWords name on ckpttool's lists, as a
    GLOBAL names it), or for a class the user allowed."""
    if cls.dangerous:
        return False
    if ALLOWED.get().matches(cls.class_name()):
        return True
    in_nn = cls.module == "torch.nn" or cls.module.startswith("torch.nn.")
    return in_nn and cls.known and cls.qualname.isidentifier() and not cls.qualname.startswith("_")


def _plainly_empty(value: Any) -> bool:
    """Falsy without running anything of the file (``all()`` asks each its truth)."""
    return value is None or (type(value) in (str, bytes, int, bool, tuple, list) and not value)


def _value_name(value: Any) -> str:
    if isinstance(value, Opaque):
        return type(value).class_name()  # an object the pickle made: abc.ABCMeta(...)
    return f"<a container record of a {type(value).__name__}>"


def container_refusal(exc: CkptError | None, refused: dict[str, str], path: str) -> UnsafeError:
    """The refusal of a legacy pickle whose container records ``refused`` names, merged
    with the read's own error ``exc`` where that is a refusal too (any other error of
    the read gives way: the verdict comes first)."""
    if isinstance(exc, UnsafeError):
        merged = UnsafeError(
            [*exc.dangerous, *refused],
            path=exc.path,
            reasons={**exc.reasons, **refused},
            globals=exc.globals,
            unverified=exc.unverified,
            allowable=exc.allowable,
        )
        merged.format = exc.format
        return merged
    refusal = UnsafeError(list(refused), path=path, reasons=refused)
    shown = ", ".join(sorted(refused))
    refusal.message = (
        f"the pickle gives torch.load a container class whose source it checks, {shown}, "
        "which is no torch.nn class (torch.load would write a .patch file); nothing was executed"
    )
    refusal.args = (refusal.one_line(),)
    return refusal
