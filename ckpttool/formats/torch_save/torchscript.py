"""``torchscript``: a ``torch.jit.save`` archive (zip with ``code/`` and ``constants.pkl``).

Its ``data.pkl`` pickles the module objects (``__torch__.Net``) with their
attributes; we list the tensors as a flat state dict (``fc.weight``) without
running or compiling any TorchScript code.

``torch.load`` hands such an archive to ``torch.jit.load``, which runs one piece of the
archive's own code while it loads: the ``__setstate__`` of every module, submodule and
script class that defines one (CVE-2025-32434's way in). That code is judged as text,
parsed by Python's ``ast`` (TorchScript's printed code is Python syntax), never compiled:
a ``__setstate__`` that only restores attributes (``self.w = (state)[0]``, then ``return
None``) passes; a call, or any other statement, is refused naming it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

from ...errors import CkptError, UnsafeError
from ...tree import Checkpoint, Opaque, is_tensor
from ..made import checkpoint
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
        # the verdict on the code first: a damaged data.pkl does not hide it
        code = read_code(archive, path, permissive=permissive)
        seen.update(f"!{name}" for name in code.findings)  # (--unsafe: listed as dangerous)
        module = archive.load(permissive=permissive, seen=seen)
    state: dict[str, Any] = {}
    _flatten_module(module, "", state, set(), code.state_names)
    return checkpoint(FORMAT, [path], state, seen)


@dataclass
class Code:
    """What an archive's ``code/`` says: each class's state names and what its
    ``__setstate__`` would run beyond restoring attributes (``{name: reason}``)."""

    state_names: dict[str, set[str]] = field(default_factory=dict)
    findings: dict[str, str] = field(default_factory=dict)


def is_code_entry(name: str) -> bool:
    """An entry ``torch.jit.load`` may compile: ``<archive>/code/<module path>.py`` (in
    any case: names are matched loosely, strictly judged)."""
    lowered = name.lower()
    return lowered.endswith(".py") and "/code/" in f"/{lowered}"


def read_code(archive: ZipPickle, path: str, *, permissive: bool = False) -> Code:
    """Read and judge every code file of a TorchScript archive.

    Raises:
        UnsafeError: A ``__setstate__`` would run more than attribute restoring, or the
            code cannot be judged (too much of it, unreadable, unparsable); not where
            ``permissive``: then :attr:`Code.findings` lists it.
    """
    code = Code()
    budget = MAX_CODE_BYTES
    for entry in archive.names():
        if not is_code_entry(entry):
            continue
        budget -= archive.infos[entry].file_size
        module = _module_name(entry)
        if budget < 0:
            code.findings[f"<{entry}>"] = f"TorchScript code past {MAX_CODE_BYTES} bytes, unjudged"
            break
        try:
            raw = bytes(archive.read_entry(entry))
        except CkptError:
            # torch.jit.load may still take it (its reader checks less): unjudged, refused
            code.findings[f"<{entry}>"] = "TorchScript code that cannot be read, unjudged"
            continue
        text = raw.decode("utf-8", "replace")
        for cls, params, buffers in _CLASS_STATE.findall(text):
            code.state_names[f"{module}.{cls}"] = set(re.findall(r'"([^"]*)"', params + buffers))
        code.findings.update(judge_setstate(raw, module, entry))
    if code.findings and not permissive:
        raise refusal(code.findings, path)
    return code


def _module_name(entry: str) -> str:
    """``archive/code/__torch__/pkg/mod.py`` -> ``__torch__.pkg.mod``."""
    inner = entry[f"/{entry.lower()}".index("/code/") + len("code/") :]
    return inner[: -len(".py")].replace("/", ".")


def refusal(findings: dict[str, str], path: str) -> UnsafeError:
    """The refusal of an archive whose load would run ``findings`` (``{name: reason}``)."""
    exc = UnsafeError(list(findings), path=path, reasons=findings)
    shown = "; ".join(f"{name} {reason}" for name, reason in sorted(findings.items()))
    exc.message = f"torch.jit.load would run the archive's code: {shown}; nothing was executed"
    exc.args = (exc.one_line(),)
    return exc


SETSTATE = "__setstate__"
# What ``state`` may be for ``(state)[i]`` to be a plain read: a container or a tensor
# (indexing an object of a script class runs its ``__getitem__``); none: a Tensor
PLAIN_STATE_TYPES = frozenset({"Tuple", "List", "Dict", "Tensor", "tuple", "list", "dict"})


def judge_setstate(raw: bytes, module: str, entry: str) -> dict[str, str]:
    """What the ``__setstate__`` methods of one code file would run, ``{name: reason}``:
    empty where each only restores attributes.

    TorchScript names a method only by its plain identifier, so a file without the bytes
    ``__setstate__`` defines none (and costs no parse). Where it has them, the file must
    parse as Python, and every occurrence must be a definition judged here: a name that
    Python reads as part of a string or comment, where torch's own lexer might not, is
    refused rather than trusted.
    """
    occurrences = raw.count(SETSTATE.encode())
    if not occurrences:
        return {}
    try:
        tree = ast.parse(raw.decode("utf-8"), filename=entry)
    except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, MemoryError):
        return {f"<{entry}>": f"TorchScript code defining {SETSTATE} that cannot be parsed"}
    findings: dict[str, str] = {}
    defined = 0
    for owner, method in _setstate_methods(tree):
        defined += 1
        where = f"{module}.{owner.name}" if owner is not None else module
        findings.update(_judge_method(method, owner, f"by {SETSTATE} of {where}"))
    if defined != occurrences:
        findings[f"<{entry}>"] = f"{SETSTATE} named outside a definition of it"
    return findings


def _setstate_methods(tree: ast.AST) -> list[tuple[ast.ClassDef | None, ast.FunctionDef]]:
    """Every definition of ``__setstate__`` anywhere in ``tree``, with its class."""
    found: list[tuple[ast.ClassDef | None, ast.FunctionDef]] = []

    def walk(node: ast.AST, owner: ast.ClassDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.name == SETSTATE:
                    found.append((owner, child))  # type: ignore[arg-type]
                walk(child, None)
            else:
                walk(child, child if isinstance(child, ast.ClassDef) else owner)

    walk(tree, None)
    return found


def _judge_method(
    method: ast.FunctionDef, owner: ast.ClassDef | None, where: str
) -> dict[str, str]:
    """``{name: reason}`` for what ``method`` runs beyond ``self.x = (state)[i]``."""
    args = method.args
    if (
        isinstance(method, ast.AsyncFunctionDef)
        or method.decorator_list
        or owner is None
        or len(args.args) != 2
        or args.posonlyargs
        or args.kwonlyargs
        or args.vararg
        or args.kwarg
        or args.defaults
    ):
        return {f"<an unusual {SETSTATE} at line {method.lineno}>": f"defined {where}"}
    self_name, state_arg = args.args[0].arg, args.args[1]
    declared = _declared_attributes(owner)
    others = [
        stmt
        for stmt in method.body
        if not (_restores_attribute(stmt, self_name, state_arg, declared) or _returns_none(stmt))
    ]
    # what it calls names it best; a statement is named only where nothing is called
    calls = {
        _dotted(node.func): f"called {where}"
        for stmt in others
        for node in ast.walk(stmt)
        if isinstance(node, ast.Call)
    }
    return calls or {f"<{type(s).__name__} at line {s.lineno}>": f"run {where}" for s in others}


def _declared_attributes(owner: ast.ClassDef) -> set[str]:
    """The attributes a printed class declares (``w : Tensor``): assigning one stores it;
    any other name might be a property whose setter runs."""
    return {
        stmt.target.id
        for stmt in owner.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }


def _restores_attribute(stmt: ast.stmt, self_name: str, state: ast.arg, declared: set[str]) -> bool:
    """``self.x = state``, ``self.x = (state)[i]`` (``i`` an int) or ``self.x = <constant>``."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return False
    target, value = stmt.targets[0], stmt.value
    if not (
        isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == self_name
        and target.attr in declared
    ):
        return False
    if isinstance(value, ast.Constant) or _is_name(value, state.arg):
        return True
    return (
        isinstance(value, ast.Subscript)
        and _is_name(value.value, state.arg)
        and isinstance(value.slice, ast.Constant)
        and type(value.slice.value) is int
        and _plain_state_type(state.annotation)
    )


def _plain_state_type(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return True
    outer = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return isinstance(outer, ast.Name) and outer.id in PLAIN_STATE_TYPES


def _returns_none(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Return) and (
        stmt.value is None or (isinstance(stmt.value, ast.Constant) and stmt.value.value is None)
    )


def _is_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _dotted(func: ast.expr) -> str:
    """A called expression as a name: ``torch.from_file``, ``self.helper``, ``<a call>``."""
    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        return ".".join([func.id, *reversed(parts)])
    return f"<a call at line {getattr(func, 'lineno', '?')}>"


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
