"""``torchscript``: a ``torch.jit.save`` archive (zip with ``code/`` and ``constants.pkl``).

Its ``data.pkl`` pickles the module objects (``__torch__.Net``) with their
attributes; we list the tensors as a flat state dict (``fc.weight``) without
running or compiling any TorchScript code.
"""

from __future__ import annotations

from typing import Any

from ..tree import Checkpoint, Opaque, is_tensor
from .torch_zip import checkpoint
from .zip_pickle import ZIP_MAGIC, ZipPickle, central_directory

FORMAT = "torchscript"


def detect(path: str, head: bytes) -> bool:
    if not head.startswith(ZIP_MAGIC):
        return False
    names = central_directory(path)
    return b"/constants.pkl" in names or b"/code/" in names


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    seen: set[str] = set()
    with ZipPickle(path) as archive:
        module = archive.load(permissive=permissive, seen=seen)
    state: dict[str, Any] = {}
    _flatten_module(module, "", state, set())
    return checkpoint(FORMAT, [path], state, seen)


def _flatten_module(obj: Any, prefix: str, out: dict[str, Any], visiting: set[int]) -> None:
    """Collect tensors of a scripted module and its submodules as ``a.b.weight``."""
    if id(obj) in visiting:
        return
    visiting.add(id(obj))
    attrs = obj.attrs() if isinstance(obj, Opaque) else {}
    for name, value in attrs.items():
        if is_tensor(value):
            out[prefix + str(name)] = value
        elif isinstance(value, Opaque) and value.module.startswith("__torch__"):
            _flatten_module(value, f"{prefix}{name}.", out, visiting)
