"""Malicious pickles are refused (exit 3), name their globals, and never run.

Each payload is a real exploit: ``test_payloads_are_live`` proves that a plain
``torch.load(weights_only=False)`` / DCP metadata read runs it, so the
"marker was not created" assertions below can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import types

import pytest
from helpers import check_error, run_cli, write_dcp
from payloads import MALICIOUS_KINDS

import ckpttool

PAYLOAD_NAMES = (
    "os_system",
    "popen",
    "eval",
    "exec",
    "getattr_builtins_eval",
    "getattr_os_system",
    "attrgetter",
    "nested_pickle_loads",
    "torch_load",
    "runpy",
    "shutil_rmtree",
    "socket",
    "pydoc_pipepager",
    "py2_alias_http_server",
)
CASES = [(kind, name) for kind in MALICIOUS_KINDS for name in PAYLOAD_NAMES]
# The CLI runs every payload in a zip, and a few per other container (a subprocess each).
CLI_CASES = [("torch-zip", name) for name in PAYLOAD_NAMES] + [
    (kind, name)
    for kind in ("torch-legacy", "dcp")
    for name in ("os_system", "getattr_os_system", "torch_load", "py2_alias_http_server")
]


def _ids(case):
    return f"{case[0]}-{case[1]}"


LIVE_SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    for kind, path in zip(sys.argv[1::2], sys.argv[2::2]):
        try:
            if kind == "dcp":
                dcp.FileSystemReader(path).read_metadata()
            else:
                torch.load(path, weights_only=False)
        except BaseException as exc:  # a payload may fail after it fired
            print(kind, path, type(exc).__name__)
    """
)


def test_payloads_are_live(malicious, tmp_path):
    """Control: the same files DO run their payload under an unrestricted torch.load."""
    files = [f for f in malicious.values() if f.payload.live]
    assert not any(f.payload.fired() for f in files)
    args = [x for f in files for x in (f.kind, str(f.path))]
    proc = subprocess.run(
        [sys.executable, "-c", LIVE_SCRIPT, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    try:
        deadline = time.monotonic() + 10  # Popen/pipepager run `touch` in a child process
        while not all(f.payload.fired() for f in files) and time.monotonic() < deadline:
            time.sleep(0.1)
        not_fired = [(f.kind, f.payload.name) for f in files if not f.payload.fired()]
        assert not_fired == [], proc.stdout + proc.stderr
    finally:
        for f in malicious.values():
            f.payload.reset()
    assert not any(f.payload.fired() for f in files)


@pytest.mark.parametrize("case", CLI_CASES, ids=_ids)
def test_inspect_refuses_and_names_globals(malicious, case):
    f = malicious[case]
    assert not f.payload.fired()
    line = check_error(run_cli("inspect", f.path), 3, *f.payload.expected)
    where = f.path / ".metadata" if f.kind == "dcp" else f.path  # the file with the pickle
    assert line.startswith(f"ckpttool: refused: {where}: the pickle references dangerous globals ")
    assert line.count("refused") == 1
    assert "--unsafe" in line  # the next step, for a file the user trusts
    assert not f.payload.fired()


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_read_raises_unsafe_error(malicious, case):
    f = malicious[case]
    with pytest.raises(ckpttool.UnsafeError) as info:
        ckpttool.read(f.path)
    for name in f.payload.expected:
        assert any(name in g for g in info.value.dangerous), (name, info.value.dangerous)
    assert info.value.exit_code == 3
    assert isinstance(info.value, ckpttool.CkptError)
    with pytest.raises(ckpttool.UnsafeError):
        ckpttool.load(f.path, select="all")
    assert not f.payload.fired()


def test_os_system_is_named_exactly(malicious):
    for kind in MALICIOUS_KINDS:
        with pytest.raises(ckpttool.UnsafeError) as info:
            ckpttool.read(malicious[(kind, "os_system")].path)
        assert info.value.dangerous == ["posix.system"], kind


def test_getattr_trick_names_every_global(malicious):
    with pytest.raises(ckpttool.UnsafeError) as info:
        ckpttool.read(malicious[("torch-zip", "getattr_builtins_eval")].path)
    assert info.value.dangerous == ["builtins.__import__", "builtins.getattr"]


@pytest.mark.parametrize("kind", MALICIOUS_KINDS)
@pytest.mark.parametrize(
    "command",
    [
        ("convert", "--to", "safetensors"),
        ("convert", "--to", "pt"),
        ("convert", "--to", "dcp"),
        ("merge",),
    ],
    ids=lambda c: "-".join(c),
)
def test_no_output_written_when_refused(malicious, kind, command, tmp_path):
    f = malicious[(kind, "os_system")]
    out = tmp_path / "out" / "result"
    check_error(run_cli(*command, f.path, "-o", out), 3, "posix.system")
    assert not out.exists()
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
    assert not f.payload.fired()


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_unsafe_read_keeps_payload_inert(malicious, case):
    """``--unsafe`` reads the file, lists the globals as dangerous, and still runs nothing."""
    from ckpttool.inspection import inspect_report

    f = malicious[case]
    report = inspect_report(ckpttool.read(f.path, unsafe=True))
    for name in f.payload.expected:
        assert any(name in g for g in report["dangerous"]), (name, report["dangerous"])
    keys = [t["key"] for t in report["tensors"]]
    assert (["model", "w"] if f.kind == "dcp" else ["w"]) in keys
    assert not f.payload.fired()


@pytest.mark.parametrize("kind", MALICIOUS_KINDS)
def test_unsafe_inspect_cli_exit_0(malicious, kind):
    f = malicious[(kind, "getattr_os_system")]
    proc = run_cli("inspect", "--unsafe", "--json", f.path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["dangerous"] == ["builtins.getattr", "importlib.import_module"]
    assert (["model", "w"] if kind == "dcp" else ["w"]) in [t["key"] for t in report["tensors"]]
    assert not f.payload.fired()


def test_unsafe_human_output_has_security_line(malicious):
    f = malicious[("torch-zip", "os_system")]
    proc = run_cli("inspect", "--unsafe", f.path)
    assert proc.returncode == 0, proc.stderr
    assert "security: dangerous globals kept inert (--unsafe): posix.system" in proc.stdout
    assert not f.payload.fired()


@pytest.mark.parametrize("kind", MALICIOUS_KINDS)
def test_unsafe_load_returns_tensors_and_runs_nothing(malicious, kind):
    import torch

    f = malicious[(kind, "os_system")]
    everything = ckpttool.load(f.path, select="all", unsafe=True)
    w = everything["model"]["w"] if kind == "dcp" else everything["w"]
    assert torch.equal(w, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    if kind != "dcp":  # DCP keeps the payload in .metadata, not in the tree
        # the refused callable stays an inert plain-data stand-in, as merge writes it
        assert everything["x"]["__class__"] == "posix.system"
    assert not f.payload.fired()


def test_unsafe_convert_writes_output_and_runs_nothing(malicious, tmp_path):
    from safetensors.torch import load_file

    f = malicious[("torch-zip", "os_system")]
    out = tmp_path / "w.safetensors"
    proc = run_cli("convert", f.path, "--to", "safetensors", "-o", out, "--unsafe", "-q")
    assert proc.returncode == 0, proc.stderr
    assert list(load_file(out)) == ["w"]
    assert not f.payload.fired()


# ------------------------------------------------------------ benign classes


def _throwaway_class():
    """A class in a module that exists only while we pickle (a reader must not need it)."""
    mod = types.ModuleType("ckpttool_throwaway_mod")
    exec("class Config:\n    def __init__(self):\n        self.lr = 0.1\n", mod.__dict__)
    mod.Config.__module__ = mod.__name__
    return mod


@pytest.fixture
def benign_files(tmp_path):
    import argparse

    import torch

    mod = _throwaway_class()
    sys.modules[mod.__name__] = mod
    try:
        obj = {
            "model": {"w": torch.ones(2, 3)},
            "args": argparse.Namespace(lr=0.1, epochs=3),
            "cfg": mod.Config(),
            "epoch": 5,
        }
        torch.save(obj, tmp_path / "zip.pt")
        torch.save(obj, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
        write_dcp(tmp_path / "dcp", obj)
    finally:
        del sys.modules[mod.__name__]
    return {
        "torch-zip": tmp_path / "zip.pt",
        "torch-legacy": tmp_path / "legacy.pt",
        "dcp": tmp_path / "dcp",
    }


@pytest.mark.parametrize("kind", MALICIOUS_KINDS)
def test_benign_custom_classes_never_stop_inspection(benign_files, kind):
    """Once allowed: a class on no list that the pickle constructs is refused without
    it, and the refusal names the class and the --allow that reads it."""
    refused = run_cli("inspect", benign_files[kind])
    assert refused.returncode == 3, refused.stderr
    assert refused.stderr.count("\n") == 1
    assert "cannot vouch for: ckpttool_throwaway_mod.Config (constructed)" in refused.stderr
    assert "--allow ckpttool_throwaway_mod.Config" in refused.stderr
    allow = ("--allow", "ckpttool_throwaway_mod.Config")
    proc = run_cli("inspect", "--json", benign_files[kind], *allow)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["format"] == kind
    assert report["dangerous"] == []
    assert report["model_key"] == ["model"]
    assert [t["key"] for t in report["tensors"]] == [["model", "w"]]
    values = {tuple(v["key"]): v for v in report["values"]}
    assert values[("args",)] == {
        "key": ["args"],
        "type": "opaque",
        "value": "<opaque argparse.Namespace>",
    }
    assert values[("cfg",)]["value"] == "<opaque ckpttool_throwaway_mod.Config>"
    assert values[("epoch",)] == {"key": ["epoch"], "type": "int", "value": 5}


def test_benign_custom_class_load_gives_stand_in_and_tensors(benign_files):
    import torch

    with pytest.raises(ckpttool.errors.UnsafeError) as refused:
        ckpttool.load(benign_files["torch-zip"])
    assert refused.value.allowable == ["ckpttool_throwaway_mod.Config"]
    allow = ["ckpttool_throwaway_mod.Config"]
    everything = ckpttool.load(benign_files["torch-zip"], select="all", allow=allow)
    assert torch.equal(everything["model"]["w"], torch.ones(2, 3))
    assert everything["args"] == {
        "__class__": "argparse.Namespace",
        "state": {"lr": 0.1, "epochs": 3},
    }
    lazy = ckpttool.read(benign_files["torch-zip"], allow=allow).root["args"]  # the object kept
    assert repr(lazy) == "<opaque argparse.Namespace>"
    assert ckpttool.load(benign_files["torch-zip"], allow=allow).keys() == {"w"}


def test_reader_never_imports_the_module_of_a_class(tmp_path):
    """A class whose module has import side effects: reading must not import it."""
    import torch

    marker = tmp_path / "imported"
    (tmp_path / "sideeffect_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nclass Thing:\n    pass\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import sideeffect_mod

        torch.save({"w": torch.zeros(2), "thing": sideeffect_mod.Thing()}, tmp_path / "t.pt")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("sideeffect_mod", None)
    marker.unlink()
    # ``python -m`` puts the working directory on sys.path: the module IS importable.
    refused = run_cli("inspect", "t.pt", cwd=tmp_path)  # constructed: refused, not imported
    assert refused.returncode == 3 and "--allow sideeffect_mod.Thing" in refused.stderr
    assert not marker.exists()
    proc = run_cli("inspect", "--json", "t.pt", "--allow", "sideeffect_mod.Thing", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {"key": ["thing"], "type": "opaque", "value": "<opaque sideeffect_mod.Thing>"} in report[
        "values"
    ]
    assert not marker.exists()


def test_malicious_file_does_not_touch_the_input(malicious, tmp_path):
    f = malicious[("torch-zip", "os_system")]
    copy = tmp_path / "copy.pt"
    shutil.copy(f.path, copy)
    before = copy.read_bytes()
    run_cli("convert", copy, "--to", "pt", "-o", tmp_path / "o.pt")
    assert copy.read_bytes() == before


# --------------------------------------------------- files outside the checkpoint


def test_dcp_storage_path_cannot_leave_the_folder(tmp_path):
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "ckpt"
    write_dcp(folder, {"model": {"w": torch.ones(3)}, "step": 1})
    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    for info in meta.storage_data.values():
        info.relative_path = "../outside.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    shutil.copy(next(folder.glob("*.distcp")), tmp_path / "outside.distcp")
    check_error(run_cli("inspect", folder), 2, "'../outside.distcp' leaves the folder")


def test_safetensors_index_cannot_point_outside_its_folder(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "outside.safetensors")
    folder = tmp_path / "hf"
    folder.mkdir()
    index = {"metadata": {}, "weight_map": {"w": "../outside.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    check_error(run_cli("inspect", folder), 2, "leaves the folder")


@pytest.mark.slow
def test_malicious_sibling_rank_file_is_refused(dist_runs, tmp_path):
    """Rank 1's file carries the payload; giving rank 0 (siblings found) or a glob refuses."""
    from helpers import rewrite_zip

    marker = tmp_path / "marker"
    evil = (
        b"X\x04\x00\x00\x00evil"
        + b"cposix\nsystem\n(X"
        + len(f"touch {marker}").to_bytes(4, "little")
        + f"touch {marker}".encode()
        + b"tRs."
    )
    for rank in (0, 1):
        src = dist_runs.two / f"ep0-ba1-rank{rank}.pt"
        dst = tmp_path / src.name
        if rank == 0:
            shutil.copy(src, dst)
        else:  # set root["evil"] = os.system(...) just before the pickle's STOP
            rewrite_zip(src, dst, lambda n, d: d[:-1] + evil if n.endswith("/data.pkl") else None)
    for args in ([tmp_path / "ep0-ba1-rank0.pt"], [tmp_path / "ep0-ba1-rank*.pt"]):
        check_error(run_cli("inspect", *args), 3, "posix.system", "ep0-ba1-rank1.pt")
        with pytest.raises(ckpttool.UnsafeError):
            ckpttool.load(str(args[0]), select="all")
    out = tmp_path / "merged.pt"
    check_error(run_cli("merge", tmp_path / "ep0-ba1-rank*.pt", "-o", out), 3, "posix.system")
    assert not out.exists()
    assert not marker.exists()


def test_sharded_bin_with_a_malicious_shard_is_refused(malicious, tmp_path):
    """``pytorch_model.bin.index.json``: every torch.save shard is read with the same rules."""
    import torch

    f = malicious[("torch-zip", "os_system")]
    folder = tmp_path / "hf"
    folder.mkdir()
    torch.save({"a": torch.ones(2)}, folder / "pytorch_model-00001-of-00002.bin")
    shutil.copy(f.path, folder / "pytorch_model-00002-of-00002.bin")
    weight_map = {"a": "pytorch_model-00001-of-00002.bin", "w": "pytorch_model-00002-of-00002.bin"}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    line = check_error(run_cli("inspect", folder), 3, "posix.system")
    assert "pytorch_model-00002-of-00002.bin" in line
    out = tmp_path / "out.safetensors"
    check_error(run_cli("convert", folder, "--to", "safetensors", "-o", out), 3, "posix.system")
    assert not out.exists()
    assert not f.payload.fired()
    assert ckpttool.read(folder, unsafe=True).dangerous == ["posix.system"]
