"""A user allow-list in torch's convention: ``--allow NAME`` on every command,
``allow=[...]`` in the Python API, and what ``torch.serialization.add_safe_globals``
registered.

The files hold an Enum and a namedtuple of a module ckpttool does not know (written
into ``tmp_path``; ``torch.save`` runs in a child with it on ``PYTHONPATH``, so this
process imports it only where a test asks). An Enum pickles as a call of its class:
refused without ``--allow``, read inert with it. Dangerous families cannot be allowed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import check_error, completed, run_many, subprocess_env

import ckpttool
from ckpttool.errors import CkptError, UnsafeError

MODULE = textwrap.dedent(
    """
    import collections
    import enum

    class Color(enum.Enum):
        RED = "red"
        BLUE = "blue"

    Point = collections.namedtuple("Point", "x y")
    """
)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("allow")
    lib = base / "lib"
    lib.mkdir()
    script = textwrap.dedent(
        """
        import os, sys, torch, trainlib_cfg as cfg
        base = sys.argv[1]
        w = torch.arange(6.0).reshape(2, 3)
        torch.save({"w": w, "color": cfg.Color.RED}, os.path.join(base, "enum.pt"))
        torch.save({"w": w, "color": cfg.Color.BLUE}, os.path.join(base, "enum-legacy.pt"),
                   _use_new_zipfile_serialization=False)
        torch.save({"w": w, "point": cfg.Point(1, 2)}, os.path.join(base, "namedtuple.pt"))
        torch.save({"w": w, "color": cfg.Color.RED, "bad": cfg.Evil()},
                   os.path.join(base, "enum-and-system.pt"))
        """
    )
    (lib / "trainlib_cfg.py").write_text(
        MODULE
        + textwrap.dedent(
            """
            class Evil:
                def __reduce__(self):
                    import os
                    return (os.system, ("true",))
            """
        )
    )
    env = subprocess_env(PYTHONPATH=str(lib))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(base)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return {p.stem: p for p in base.glob("*.pt")} | {"lib": lib}


def test_an_enum_of_an_unknown_module_is_refused_without_allow(files):
    results = run_many([["inspect", files["enum"]], ["inspect", "--json", files["enum"]]])
    check_error(completed([], results[0]), 3, "trainlib_cfg.Color")
    report = json.loads(results[1]["stdout"])
    assert report["dangerous"] == ["trainlib_cfg.Color"]
    assert report["reasons"] == {"trainlib_cfg.Color": "called"}
    assert report["allowed"] == []


@pytest.mark.parametrize("name", ["trainlib_cfg.Color", "trainlib_cfg.*"])
@pytest.mark.parametrize("stem", ["enum", "enum-legacy"])
def test_allow_reads_the_enum_inert_in_every_command(files, tmp_path, name, stem):
    path = files[stem]
    argvs = [
        ["inspect", "--json", path, "--allow", name],
        ["--allow", name, "inspect", path],  # before the command too
        ["inspect", path, f"--allow={name}"],
        ["convert", path, "--to", "safetensors", "-o", tmp_path / "w.safetensors", "--allow", name],
        ["merge", path, "-o", tmp_path / "merged.pt", "--allow", name],
        ["diff", path, path, "--allow", name],
    ]
    results = run_many(argvs)
    for argv, result in zip(argvs, results, strict=True):
        assert result["code"] == 0, (argv, result["stderr"])
    report = json.loads(results[0]["stdout"])
    assert report["dangerous"] == [] and report["unverified"] == []
    assert report["allowed"] == ["trainlib_cfg.Color"]
    assert "trainlib_cfg.Color" in report["globals"]
    value = "red" if stem == "enum" else "blue"
    assert report["values"] == [
        {"key": ["color"], "type": "opaque", "value": f"<opaque trainlib_cfg.Color({value!r})>"}
    ]
    assert "allowed by --allow (read inert): trainlib_cfg.Color" in results[1]["stdout"]
    merged = torch.load(tmp_path / "merged.pt", weights_only=True)  # a plain-data stand-in
    assert torch.equal(merged["w"], torch.arange(6.0).reshape(2, 3))


def test_a_namedtuple_is_refused_until_allowed(files):
    path = files["namedtuple"]
    results = run_many(
        [["inspect", "--json", path], ["inspect", "--json", path, "--allow", "trainlib_cfg.Point"]]
    )
    # constructed (NEWOBJ): refused without --allow, naming the --allow that reads it
    line = check_error_json(results[0])
    assert "trainlib_cfg.Point (constructed)" in line and "--allow trainlib_cfg.Point" in line
    plain, allowed = (json.loads(r["stdout"]) for r in results)
    assert plain["unverified"] == [] and plain["dangerous"] == ["trainlib_cfg.Point"]
    assert allowed["unverified"] == [] and allowed["allowed"] == ["trainlib_cfg.Point"]


def test_allow_never_opens_what_else_the_file_calls(files):
    """The Enum is allowed; ``posix.system`` in the same file is still refused."""
    results = run_many(
        [["inspect", "--json", files["enum-and-system"], "--allow", "trainlib_cfg.*"]]
    )
    line = check_error_json(results[0])
    assert "posix.system" in line and "trainlib_cfg.Color" not in line
    report = json.loads(results[0]["stdout"])
    assert report["dangerous"] == ["posix.system"]
    assert report["allowed"] == ["trainlib_cfg.Color"]


def check_error_json(result: dict) -> str:
    assert result["code"] == 3, result
    lines = result["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpttool: refused: "), lines
    return lines[0]


@pytest.mark.parametrize(
    "name",
    ["os.system", "os.*", "subprocess.Popen", "builtins.eval", "builtins.*", "posix.system",
     "torch.load", "torch.serialization.*", "pickle.loads", "__builtin__.eval"],
)  # fmt: skip
def test_a_dangerous_family_cannot_be_allowed(files, name):
    (result,) = run_many([["inspect", files["enum"], "--allow", name]])
    check_error(completed([], result), 2, f"--allow {name}: a dangerous family", "--unsafe")


@pytest.mark.parametrize("name", ["Color", "trainlib cfg.Color", "a..b", ""])
def test_an_allow_name_must_be_a_global_or_a_module_prefix(files, name):
    (result,) = run_many([["inspect", files["enum"], "--allow", name]])
    check_error(completed([], result), 2, "--allow", "not a global")


def test_allow_without_a_value_is_an_error(files):
    (result,) = run_many([["inspect", files["enum"], "--allow"]])
    check_error(completed([], result), 2, "--allow", "not a global")


# ------------------------------------------------------------------ the Python API


@pytest.fixture
def cfg(files, monkeypatch):
    """The module itself, importable here (for allow=[Color] and add_safe_globals)."""
    monkeypatch.syspath_prepend(str(files["lib"]))
    import trainlib_cfg

    yield trainlib_cfg
    sys.modules.pop("trainlib_cfg", None)


def test_api_refuses_then_reads_with_allow_by_name_or_object(files, cfg):
    path = files["enum"]
    with pytest.raises(UnsafeError, match="trainlib_cfg.Color"):
        ckpttool.load(path, select="all")
    for allow in (
        ["trainlib_cfg.Color"],
        ["trainlib_cfg.*"],
        [cfg.Color],
        [(cfg.Color, "trainlib_cfg.Color")],
    ):
        state = ckpttool.load(path, select="all", allow=allow)
        assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3))
        assert state["color"]["__class__"] == "trainlib_cfg.Color"
    ckpt = ckpttool.read(path, allow=[cfg.Color])
    assert ckpt.dangerous == [] and "trainlib_cfg.Color" in ckpt.globals
    with ckpttool.open(path, allow=["trainlib_cfg.Color"]) as f:
        assert torch.equal(f.get_tensor("w"), torch.arange(6.0).reshape(2, 3))
    target = {"w": torch.zeros(2, 3)}
    ckpttool.load_into(target, path, strict=False, allow=[cfg.Color])
    assert torch.equal(target["w"], torch.arange(6.0).reshape(2, 3))


def test_api_honours_torch_safe_globals(files, cfg):
    path = files["enum"]
    with torch.serialization.safe_globals([cfg.Color]):
        state = ckpttool.load(path, select="all")
        assert torch.load(path, weights_only=True)["color"] is cfg.Color.RED  # torch agrees
    assert state["color"]["__class__"] == "trainlib_cfg.Color"
    with pytest.raises(UnsafeError):  # only while registered
        ckpttool.load(path, select="all")
    torch.serialization.add_safe_globals([cfg.Color])
    try:
        ckpttool.load(path, select="all")
    finally:
        torch.serialization.clear_safe_globals()


def test_api_refuses_to_allow_a_dangerous_family(files):
    with pytest.raises(CkptError, match="dangerous family"):
        ckpttool.load(files["enum"], allow=[os.system])
    with pytest.raises(CkptError, match="dangerous family"):
        ckpttool.load(files["enum"], allow=["subprocess.*"])


def test_torch_registered_dangerous_globals_stay_refused(files):
    torch.serialization.add_safe_globals([os.system])
    try:
        with pytest.raises(UnsafeError, match="posix.system"):
            ckpttool.load(files["enum-and-system"], allow=["trainlib_cfg.*"])
    finally:
        torch.serialization.clear_safe_globals()
