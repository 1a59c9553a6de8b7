"""``torch-legacy`` (formats/torch_legacy.py): the pre-1.6 torch.save stream."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers import assert_identical, check_error, run_cli, small_state_dict, subprocess_env

import ckpttool


@pytest.mark.parametrize("protocol", [2, 1])
def test_legacy_reads_the_same_as_torch_load(tmp_path, protocol):
    """The legacy stream reader agrees with torch.load on every tensor, also for a file
    written with pickle_protocol=1 (its magic number is text: it was not detected)."""
    original = {"model": small_state_dict(), "epoch": 2}
    path = tmp_path / "legacy.pt"
    torch.save(original, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    # weights_only=True refuses protocol 1's opcodes; the file is torch's own here
    reference = torch.load(path, weights_only=protocol == 2)
    assert ckpttool.read(path).format == "torch-legacy"
    everything = ckpttool.load(path, select="all")
    assert_identical(everything, reference, ordered=False, exact_types=False)


# ------------------------------- what torch.load runs beyond the pickles' own globals


def _legacy_with(main: bytes) -> bytes:
    """A pre-1.6 stream whose main pickle is ``main`` (no storages)."""
    from ckpttool.formats.torch_save.legacy import MAGIC_NUMBER, PROTOCOL_VERSION

    head = b"".join(pickle.dumps(v, protocol=2) for v in (MAGIC_NUMBER, PROTOCOL_VERSION, {}))
    return head + main + pickle.dumps([], protocol=2)


def _record(cls: bytes, source: bytes = b"X\x05\x00\x00\x00src\n\n") -> bytes:
    """``{"m": <persistent id ("module", cls, "linear.py", source)>}``, protocol 2."""
    text = b"X\x06\x00\x00\x00module" + cls + b"X\x09\x00\x00\x00linear.py" + source
    return b"\x80\x02}X\x01\x00\x00\x00m(" + text + b"tQs."


def _glob(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _made_class(module: str, metaclass: str) -> bytes:
    """``metaclass("Linear", (), {dump_patches: True, __module__: nn's, __qualname__})``
    by NEWOBJ: a class made on the spot, posing as torch.nn.Linear."""

    def text(s):
        return b"X" + len(s).to_bytes(4, "little") + s.encode()

    nn_module = text("torch.nn.modules.linear")
    namespace = (b"}(" + text("dump_patches") + b"\x88" + text("__module__") + nn_module
                 + text("__qualname__") + text("Linear") + b"u")  # fmt: skip
    return _glob(module, metaclass) + b"(" + text("Linear") + b")" + namespace + b"t\x81"


LEGACY_RECORDS = {  # name: (the class value, refused)
    "abcmeta": (_made_class("abc", "ABCMeta"), "abc.ABCMeta"),
    "protocolmeta": (_made_class("typing", "_ProtocolMeta"), "typing._ProtocolMeta"),
}


@pytest.fixture(scope="module")
def patching(tmp_path_factory):
    """Each record proven live: torch.load (one child, each file in a folder of its own
    as its working folder) writes Linear.patch."""
    base = tmp_path_factory.mktemp("patching")
    paths = {}
    for name, (cls, _) in LEGACY_RECORDS.items():
        (base / name).mkdir()
        paths[name] = base / name / "model.pt"
        paths[name].write_bytes(_legacy_with(_record(cls)))
    _torch_load_in_each_folder(base, list(paths.values()))
    for path in paths.values():
        assert (path.parent / "Linear.patch").exists(), f"{path}: torch.load wrote no patch"
        (path.parent / "Linear.patch").unlink()
    return paths


def _torch_load_in_each_folder(base, paths):
    script = "import os, torch, warnings\nwarnings.simplefilter('ignore')\n" + "".join(
        f"os.chdir({str(p.parent)!r})\ntry:\n    torch.load({str(p)!r}, weights_only=False)\n"
        "except Exception:\n    pass\n"
        for p in paths
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True,
        env=subprocess_env(), cwd=base, timeout=600,  # a hang guard, no timing
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("name", list(LEGACY_RECORDS))
def test_container_record_of_a_made_class_is_refused(patching, name, monkeypatch):
    path = patching[name]
    monkeypatch.chdir(path.parent)  # where a patch would be written
    check_error(run_cli("inspect", path), 3, LEGACY_RECORDS[name][1])
    with pytest.raises(ckpttool.UnsafeError) as caught:
        ckpttool.load(path)
    assert LEGACY_RECORDS[name][1] in caught.value.dangerous
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pt"]


@pytest.mark.parametrize(
    "cls, refused",
    [
        (_glob("argparse", "Namespace"), "argparse.Namespace"),  # a plain class, no torch.nn one
        (_glob("mymodel", "Net"), "mymodel.Net"),  # on no list
        (b"X\x0f\x00\x00\x00torch.nn.Linear", "<a container record of a str>"),
        (_glob("torch.nn.modules.linear", "_Private"), "torch.nn.modules.linear._Private"),
    ],
)
def test_container_record_rule_holds_on_its_own(tmp_path, cls, refused):
    """Whatever the unpickler makes of the value, a record with source is refused unless
    its class is a plain global naming a torch.nn class on ckpttool's lists."""
    from ckpttool.formats.torch_save import legacy as torch_legacy

    path = tmp_path / "model.pt"
    path.write_bytes(_legacy_with(_record(cls)))
    with pytest.raises(ckpttool.UnsafeError) as caught:
        torch_legacy.read(str(path))
    assert refused in caught.value.dangerous, caught.value
    check_error(run_cli("inspect", path), 3, refused)


def test_container_records_of_torch_nn_classes_read(tmp_path):
    """torch.save(model) of torch.nn modules, pre-1.6: every class a record with source."""
    path = tmp_path / "seq.pt"
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    torch.save(model, path, _use_new_zipfile_serialization=False)
    ckpt = ckpttool.read(path)
    assert (ckpt.format, ckpt.dangerous) == ("torch-legacy", [])
    # a record without source is handed back unchecked, as torch does
    empty = tmp_path / "empty.pt"
    empty.write_bytes(_legacy_with(_record(_glob("mymodel", "Net"), b"N")))
    assert ckpttool.read(empty).dangerous == []


# ------------------------------------------------ the tar container of torch < 0.4


def _evil(marker: Path) -> bytes:
    return f"cposix\nsystem\n(S'touch {marker}'\ntR.".encode()


def _tar(members: list[tuple[str, bytes]], cut: int | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()[:cut]


def _p(value) -> bytes:
    return pickle.dumps(value, protocol=2)


EMPTY_STORAGES, EMPTY_TENSORS = _p(0) + _p([]), _p(0)
TARS = {  # name: members of a tar (one marker each); cut: the file cut short there
    "storage-count": lambda m: [("storages", _evil(m))],
    "storage-views": lambda m: [("storages", _p(0) + _evil(m))],
    "storage-count-past-its-member": lambda m: [("storages", _p(10**12) + _evil(m))],
    "storage-count-true": lambda m: [("storages", _p(True) + _evil(m))],
    "tensor-count-past-its-member": lambda m: [
        ("storages", EMPTY_STORAGES),
        ("tensors", _p(10**12) + _evil(m)),
    ],  # fmt: skip
    "main-pickle": lambda m: [
        ("storages", EMPTY_STORAGES),
        ("tensors", EMPTY_TENSORS),
        ("pickle", _evil(m)),
    ],  # fmt: skip
    # a record of the main pickle: a class made on the spot, torch writes Linear.patch
    "main-container-record": lambda m: [
        ("storages", EMPTY_STORAGES),
        ("tensors", EMPTY_TENSORS),
        (
            "pickle",
            b"\x80\x02("
            + _made_class("abc", "ABCMeta")
            + b"X\x09\x00\x00\x00linear.pyX\x05\x00\x00\x00src\n\ntQ.",
        ),
    ],  # fmt: skip
}


@pytest.fixture(scope="module")
def hostile_tars(tmp_path_factory):
    base = tmp_path_factory.mktemp("tars")
    paths = {}
    for name, members in TARS.items():
        (base / name).mkdir()
        paths[name] = base / name / "model.tar"
        paths[name].write_bytes(_tar(members(base / name / "marker")))
    # the first member's name a pickle, the storages cut short: torch's tar reader
    # raises a TarError, and torch.load reads the file again as a legacy stream
    (base / "fallback").mkdir()
    paths["fallback"] = base / "fallback" / "model.tar"
    members = [(_evil(base / "fallback" / "marker").decode(), b"x"), ("storages", _p(0) * 200)]
    paths["fallback"].write_bytes(_tar(members, cut=512 * 4 + 100))
    _torch_load_in_each_folder(base, list(paths.values()))
    for name, path in paths.items():
        made = [p.name for p in path.parent.iterdir() if p.name != "model.tar"]
        assert made, f"{name}: torch.load ran nothing"
        for p in made:
            (path.parent / p).unlink()
    return paths


@pytest.mark.parametrize("name", [*TARS, "fallback"])
def test_tar_pickle_that_runs_code_is_refused_before_not_supported(hostile_tars, name):
    path = hostile_tars[name]
    refused = "abc.ABCMeta" if name == "main-container-record" else "posix.system"
    check_error(run_cli("inspect", path), 3, refused)
    with pytest.raises(ckpttool.UnsafeError):
        ckpttool.load(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.tar"]


def test_benign_tar_is_not_supported(tmp_path):
    path = tmp_path / "model.tar"
    path.write_bytes(_tar([("storages", EMPTY_STORAGES), ("tensors", EMPTY_TENSORS),
                           ("pickle", _p({"a": 1}))]))  # fmt: skip
    check_error(run_cli("inspect", path), 2, "tar archive (PyTorch < 0.4) is not supported")
    path.write_bytes(_tar([("storages", _p(10**12))]))  # damaged: exit 2, no verdict of refusal
    check_error(run_cli("inspect", path), 2)
