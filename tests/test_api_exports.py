"""The package's public names: each is what it says whatever was touched first.

A module named like a function its package exports would replace the function on
first import (``ckpttool.load_into`` became the module once ``ckpttool.LoadResult`` was
touched); nothing of the kind may come back.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import types

import torch
from helpers import FIXTURES, ROOT, subprocess_env

import ckpttool

FUNCTIONS = ["load", "load_into", "open", "read", "select_node", "flatten_tensors", "materialize"]
EXPORTED = sorted({*ckpttool.__all__, "open"} - {"__version__"})

CHECK = """
import os, sys, types
import ckpttool

FUNCTIONS = {functions!r}
names = {names!r}
failed = []
for first in names:
    pid = os.fork()
    if pid == 0:
        try:
            getattr(ckpttool, first)
            for name in names:
                getattr(ckpttool, name)
            bad = [f for f in FUNCTIONS if not isinstance(getattr(ckpttool, f), types.FunctionType)]
            os._exit(1 if bad else 0)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        failed.append(first)
print(",".join(failed))
"""


def _submodules() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.walk_packages(ckpttool.__path__, "ckpttool.")
        # remote imports fsspec and requests; __main__ runs the CLI
        if not m.name.startswith("ckpttool.sources.remote") and m.name != "ckpttool.__main__"
    )


def test_every_exported_name_first_leaves_the_functions_functions():
    code = CHECK.format(functions=FUNCTIONS, names=EXPORTED)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
        cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"touched first, these broke a function: {proc.stdout}"


def test_no_module_is_named_like_a_name_its_package_exports():
    clashes = []
    for name in _submodules():
        parent, _, leaf = name.rpartition(".")
        exported = getattr(importlib.import_module(parent), "__all__", [])
        if leaf in exported:
            clashes.append(name)
    assert clashes == []


def test_the_functions_work_after_every_module_is_imported(tmp_path):
    for name in _submodules():
        importlib.import_module(name)
    for f in FUNCTIONS:
        assert isinstance(getattr(ckpttool, f), types.FunctionType), f
    path = FIXTURES / "ddp" / "ep0-rank0.pt"
    sd = ckpttool.load(path)
    targets = {k: torch.empty_like(v) for k, v in sd.items()}
    result = ckpttool.load_into(targets, path)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    for k, v in sd.items():
        assert torch.equal(targets[k], v)
    with ckpttool.open(path) as f:
        assert sorted(f.keys()) == sorted(sd)
    assert ckpttool.read(path).format == "torch-zip"


def test_documented_imports_keep_working():
    import ckpttool.tensors.materialize
    import ckpttool.unsafe
    import ckpttool.writers.safetensors

    assert callable(ckpttool.unsafe.torch_load)
    assert callable(ckpttool.tensors.load_leaf)
    assert ckpttool.writers.safetensors.TO == "safetensors"
    assert os.path.isfile(os.path.join(os.path.dirname(ckpttool.__file__), "py.typed"))
