"""What the restricted unpickler refuses, and pickle shapes no checkpoint has.

The refusal list is by name: a global whose module or name reaches the OS, the
network, the interpreter or another deserializer. Nothing on this list is ever
imported or called; the list only decides between "opaque" and "refused".
"""

from __future__ import annotations

import _compat_pickle
from typing import Any

from .errors import CkptError
from .tree import Opaque

# Modules whose every global is refused: they reach the OS, the network, the
# interpreter or another deserializer.
DANGEROUS_MODULES = frozenset(
    """os posix nt posixpath ntpath subprocess sys runpy importlib imp socket shutil pickle
    _pickle cPickle dill cloudpickle joblib marshal ctypes _ctypes pty code codeop commands
    webbrowser multiprocessing asyncio http urllib urllib2 ftplib smtplib telnetlib poplib
    imaplib requests pdb bdb timeit platform signal threading _thread tempfile io _io fcntl
    resource cProfile profile trace types inspect gc pip setuptools distutils zipimport
    pkgutil sqlite3 ssl select selectors mmap operator _operator xmlrpc socketserver pydoc
    _posixsubprocess _socket _winapi venv""".split()
)
# Single globals refused outside those modules.
DANGEROUS_NAMES = frozenset(
    """torch.load torch.serialization.load torch.serialization._load torch.jit.load
    torch.storage._load_from_bytes torch._C._load_for_lite_interpreter torch.hub.load
    torch.hub.load_state_dict_from_url torch.utils.cpp_extension.load
    torch.utils.cpp_extension.load_inline numpy.load numpy.loadtxt numpy.fromfile
    numpy.testing._private.utils.runstring numpy.lib.npyio.load numpy.f2py""".split()
)
# Names refused under any module: reaching ``torch.os`` or ``numpy.sys`` is reaching os.
DANGEROUS_ATTRS = frozenset(
    """eval exec compile __import__ __builtins__ system popen open execv execve spawnv
    spawnl fork attrgetter methodcaller""".split()
)
DANGEROUS_PREFIXES = (
    "torch.fx.",
    "torch.package.",
    "torch._dynamo.",
    "torch._inductor.",
    "torch.distributed.rpc.",
    "torch.utils.cpp_extension.",
    "torch.hub.",
    "torch._C._jit",
    "torch.jit.",
    "torch.ops.",
    "numpy.f2py",
    "numpy.distutils",
)
# builtins that are plain data constructors; every other builtin is refused
# (eval, exec, compile, open, __import__, getattr on non-torch objects, ...).
SAFE_BUILTINS = frozenset(
    # no `range`: set(range(10**12)) would be a tiny pickle that never finishes
    "dict list tuple set frozenset str int float complex bool slice object".split()
)


# Harmless classes inside refused modules (or unlisted builtins): they become inert
# stand-ins like any other class. In-memory buffers, not files: DCP checkpoints keep
# io.BytesIO values, torchtitan's train state among them.
HARMLESS_NAMES = frozenset(
    """io.BytesIO _io.BytesIO io.StringIO _io.StringIO builtins.range builtins.NotImplemented
    torch._dynamo.decorators._DimRange""".split()
)


def is_dangerous(module: str, name: str) -> bool:
    """Whether the global ``module.name`` is refused without ``--unsafe``."""
    full = f"{module}.{name}"
    root = module.split(".", 1)[0]
    if full in HARMLESS_NAMES:
        return False
    if module == "builtins":
        return name not in SAFE_BUILTINS and not _is_exception_name(name)
    return (
        root in DANGEROUS_MODULES
        or name in DANGEROUS_MODULES
        or name in DANGEROUS_ATTRS
        or full in DANGEROUS_NAMES
        or any(full.startswith(p) for p in DANGEROUS_PREFIXES)
    )


def python3_name(module: str, name: str) -> tuple[str, str]:
    """The global the real unpickler would import for ``module.name``.

    Protocols 0-2 (torch.save writes 2) store Python 2 names: ``subprocess.Popen`` is
    written ``commands.Popen``, ``http.server`` ``BaseHTTPServer``, ``_thread`` ``thread``.
    """
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _is_exception_name(name: str) -> bool:
    return name.endswith(("Error", "Exception", "Warning"))


# Far beyond any real checkpoint (Composer snapshots nest ~8 levels), and within what the
# recursive consumers (layout, materialize, JSON) handle.
MAX_NESTING = 200
# Entries seen again through containers that are shared (reachable by several paths).
MAX_SHARED_ENTRIES = 1_000_000


def check_structure(root: Any, path: object = None) -> None:
    """Refuse shapes that a few bytes of pickle can build and no checkpoint has.

    The memo lets a pickle share one container many times: a list holding the same
    list twice, 30 levels deep, is 300 bytes but 2**30 paths for every walk over the
    tree; a dict that holds itself never ends a walk over plain containers.

    Raises:
        CkptError: nesting deeper than MAX_NESTING, shared containers that expand to
            more than MAX_SHARED_ENTRIES entries, or a dict/list/tuple that holds itself.
    """
    expanded: set[int] = set()
    ancestors: set[int] = set()
    shared_entries = 0
    containers = (dict, list, tuple, Opaque)
    stack: list[tuple[Any, int, bool]] = [(root, 0, False)] if isinstance(root, containers) else []
    while stack:
        node, depth, leaving = stack.pop()
        if leaving:
            ancestors.discard(id(node))
            continue
        if id(node) in ancestors:
            if isinstance(node, Opaque):  # objects may point back at a parent; walks cut that
                continue
            raise CkptError("corrupt pickle: a container holds itself", path=path)
        if depth > MAX_NESTING:
            raise CkptError(f"corrupt pickle: nests deeper than {MAX_NESTING} levels", path=path)
        if isinstance(node, dict):
            kids: Any = node.values()
        elif isinstance(node, Opaque):
            kids = [child for _, child in node.children()]
        else:
            kids = node
        if id(node) in expanded:  # every entry counts: a walk visits leaves too
            shared_entries += len(kids)
            if shared_entries > MAX_SHARED_ENTRIES:
                raise CkptError(
                    "corrupt pickle: containers shared by many paths would expand to more "
                    f"than {MAX_SHARED_ENTRIES} entries",
                    path=path,
                )
        expanded.add(id(node))
        ancestors.add(id(node))
        stack.append((node, depth, True))
        # only containers go on the stack (hot: a large DCP .metadata has millions of
        # numbers); tensors and other leaves end a walk
        stack.extend((child, depth + 1, False) for child in kids if isinstance(child, containers))
