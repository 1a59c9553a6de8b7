"""Persistent ids of ``torch.save(..., pickle_protocol=0)``: a tuple's text, not a tuple.

Protocol 0 has no binary persistent id: the pickler writes ``str(pid)`` (``PERSID``),
so a storage reads back as the text ``('storage', <class 'torch.FloatStorage'>, '0',
'cpu', 6)`` (a legacy stream adds ``, None``: no view). ``torch.load`` itself refuses
that text; ckpttool reads it by this one exact shape, never by evaluating it.
"""

from __future__ import annotations

import re
from typing import Any

from ..dtypes import DTYPES, STORAGE_CLASSES
from ..errors import CkptError
from ..tree import StorageType

# keys are small decimal numbers (zip) or object ids (legacy); locations are devices
_STORAGE_ID = re.compile(
    r"\('storage', <class 'torch\.(?P<cls>[A-Za-z0-9]{1,40})'>, '(?P<key>[0-9A-Za-z_]{1,64})', "
    r"'(?P<location>[A-Za-z0-9_:]{1,64})', (?P<numel>[0-9]{1,20})(?P<view>, None)?\)"
)
_MODULE_ID = re.compile(r"\('module', <class '(?P<cls>[A-Za-z0-9_.]{1,300})'>, ")


def text_persistent_id(pid: Any, path: object = None) -> Any:
    """The tuple a protocol-0 persistent id stands for; any other ``pid`` unchanged.

    Raises:
        CkptError: A text id of no shape torch writes.
    """
    if not isinstance(pid, str):
        return pid
    match = _STORAGE_ID.fullmatch(pid)
    if match is not None and match["cls"] in STORAGE_CLASSES:
        storage_type = StorageType(match["cls"], DTYPES[STORAGE_CLASSES[match["cls"]]])
        numel = int(match["numel"])
        found: tuple[Any, ...] = ("storage", storage_type, match["key"], match["location"], numel)
        return (*found, None) if match["view"] else found
    if _MODULE_ID.match(pid):  # torch.save(model): the class's source, never imported
        return ("module", None)
    raise CkptError(f"corrupt pickle: unknown persistent id {pid!r:.80}", path=path)
