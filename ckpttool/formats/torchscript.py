"""``torchscript``: a ``torch.jit.save`` archive (zip with ``code/`` and ``constants.pkl``).

Its ``data.pkl`` pickles the module objects (``__torch__.Net``) with their
attributes; we list the tensors as a flat state dict (``fc.weight``) without
running or compiling any TorchScript code.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import CkptError
from ..tree import Checkpoint, Opaque, is_tensor
from .torch_zip import checkpoint
from .zip_pickle import ZIP_MAGIC, ZipPickle, central_directory

FORMAT = "torchscript"


def detect(path: str, head: bytes) -> bool:
    if not head.startswith(ZIP_MAGIC):
        return False
    names = central_directory(path)
    return b"/constants.pkl" in names or b"/code/" in names


# In code/__torch__/pkg/mod.py: "class Linear(Module):" then the lists of the names
# that are parameters and buffers (the module's state dict; other tensor
# attributes are plain attributes, as torch.jit.load(...).state_dict() has it).
_CLASS_STATE = re.compile(
    r"^class (\w+)\(Module\):\n  __parameters__ = \[([^\]]*)\]\n  __buffers__ = \[([^\]]*)\]",
    re.MULTILINE,
)
MAX_CODE_BYTES = 64 << 20  # all of a model's code: far below this


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    seen: set[str] = set()
    with ZipPickle(path) as archive:
        module = archive.load(permissive=permissive, seen=seen)
        state_names = _state_names(archive)
    state: dict[str, Any] = {}
    _flatten_module(module, "", state, set(), state_names)
    return checkpoint(FORMAT, [path], state, seen)


def _state_names(archive: ZipPickle) -> dict[str, set[str]]:
    """``{"__torch__.torch.nn.modules.linear.Linear": {"weight", "bias"}, ...}`` from the
    archive's code; a class not found there keeps every tensor attribute."""
    names: dict[str, set[str]] = {}
    code = f"{archive.prefix}code/"
    budget = MAX_CODE_BYTES
    for entry in archive.names():
        if not (entry.startswith(code) and entry.endswith(".py")):
            continue
        budget -= archive.infos[entry].file_size
        if budget < 0:
            break
        module = entry[len(code) : -len(".py")].replace("/", ".")
        try:
            text = archive.read_entry(entry).decode("utf-8", "replace")
        except CkptError:  # damaged code: its classes keep every tensor attribute
            continue
        for cls, params, buffers in _CLASS_STATE.findall(text):
            names[f"{module}.{cls}"] = set(re.findall(r'"([^"]*)"', params + buffers))
    return names


def _flatten_module(
    obj: Any, prefix: str, out: dict[str, Any], visiting: set[int], state_names: dict
) -> None:
    """Collect the state (parameters, buffers) of a scripted module and its submodules
    as ``a.b.weight``."""
    if id(obj) in visiting:
        return
    visiting.add(id(obj))
    attrs = obj.attrs() if isinstance(obj, Opaque) else {}
    state = state_names.get(obj.class_name()) if isinstance(obj, Opaque) else None
    for name, value in attrs.items():
        if is_tensor(value):
            if state is None or name in state:
                out[prefix + str(name)] = value
        elif isinstance(value, Opaque) and value.module.startswith("__torch__"):
            _flatten_module(value, f"{prefix}{name}.", out, visiting, state_names)
