"""``ckpttool.load``: devices, map_location, selection, and that it never changes its input."""

from __future__ import annotations

import pytest
import torch
from conftest import autograd_view, parameter_snapshot, rewrite_zip, sha256, small_state_dict

import ckpttool


def _cuda_bytes(data: bytes) -> bytes:
    """Rewrite the pickled storage location 'cpu' (BINUNICODE) to 'cuda:0'."""
    old = b"X\x03\x00\x00\x00cpu"
    assert old in data
    return data.replace(old, b"X\x06\x00\x00\x00cuda:0")


@pytest.fixture
def gpu_saved(tmp_path):
    """A torch.save file whose storages say they were saved on cuda:0 (crafted, no GPU)."""
    sd = small_state_dict()
    cpu = tmp_path / "cpu.pt"
    torch.save({"model": sd, "epoch": 1}, cpu)
    gpu = tmp_path / "gpu.pt"
    rewrite_zip(cpu, gpu, lambda n, d: _cuda_bytes(d) if n.endswith("/data.pkl") else None)
    # the crafted file is a valid torch checkpoint: torch itself reads it back to the CPU
    reference = torch.load(gpu, map_location="cpu", weights_only=True)
    for k, v in sd.items():
        assert torch.equal(reference["model"][k], v)
    return gpu, sd


def test_gpu_saved_tensors_report_their_device(gpu_saved):
    from ckpttool.report import inspect_report

    path, sd = gpu_saved
    report = inspect_report(ckpttool.read(path))
    assert [t["device"] for t in report["tensors"]] == ["cuda:0"] * len(sd)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_gpu_saved_tensors_load_on_cpu(gpu_saved):
    path, sd = gpu_saved
    for kwargs in ({}, {"map_location": "cpu"}, {"map_location": {"cuda:0": "cpu"}}):
        loaded = ckpttool.load(path, **kwargs)
        assert list(loaded) == list(sd)
        for k, v in sd.items():
            assert loaded[k].device.type == "cpu", kwargs
            assert torch.equal(loaded[k], v), kwargs
    loaded = ckpttool.load(path, map_location=torch.device("cpu"))
    assert all(t.device.type == "cpu" for t in loaded.values())
    # keeping the saved device needs a GPU: a clear error, not a crash
    with pytest.raises(ckpttool.CkptError, match="cuda:0") as info:
        ckpttool.load(path, map_location=None)
    assert "map_location='cpu'" in str(info.value)
    with pytest.raises(ckpttool.CkptError, match="cuda:0"):
        ckpttool.load(path, map_location={"cuda:0": "cuda:0"})


def test_gpu_saved_map_location_callable(gpu_saved):
    path, sd = gpu_saved
    seen = []

    def to_cpu(storage, location):
        seen.append(location)
        return storage

    loaded = ckpttool.load(path, map_location=to_cpu)
    assert set(seen) == {"cuda:0"}
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())


def test_gpu_saved_file_inspects_in_the_cli(gpu_saved, cli):
    import json

    path, _ = gpu_saved
    proc = cli("inspect", "--json", path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {t["device"] for t in report["tensors"]} == {"cuda:0"}
    assert {"key": ["epoch"], "type": "int", "value": 1} in report["values"]


def test_loaded_tensors_are_writable_and_detached_from_the_file(tmp_path):
    w = torch.arange(6.0)
    path = tmp_path / "tied.pt"
    torch.save({"a": w, "b": w}, path)
    before = sha256(path)
    sd = ckpttool.load(path)
    sd["a"].add_(1)  # a writable tensor, not a view of a read-only buffer
    assert torch.equal(sd["a"], torch.arange(6.0) + 1)
    assert sha256(path) == before
    assert torch.equal(ckpttool.load(path)["a"], torch.arange(6.0))


def test_load_preserves_dtypes(tmp_path):
    sd = {
        "p": torch.nn.Parameter(torch.ones(2)),
        "h": torch.ones(2, dtype=torch.float16),
        "i": torch.ones(2, dtype=torch.int8),
        "c": torch.ones(2, dtype=torch.complex64),
    }
    path = tmp_path / "dtypes.pt"
    torch.save(sd, path)
    loaded = ckpttool.load(path)
    assert {k: v.dtype for k, v in loaded.items()} == {k: v.dtype for k, v in sd.items()}
    assert all(torch.equal(loaded[k], v.detach()) for k, v in sd.items())


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_parameters_and_requires_grad_come_back_as_torch_load_gives_them(tmp_path, legacy):
    path = tmp_path / "params.pt"
    torch.save(parameter_snapshot(), path, _use_new_zipfile_serialization=not legacy)
    expected_flags, expected = autograd_view(torch.load(path, weights_only=True))
    assert expected_flags["params.weight"][:2] == ("Parameter", True)  # what torch gives
    assert expected_flags["grad"][:2] == ("Tensor", True)
    got_flags, got = autograd_view(ckpttool.load(path, select="all"))
    assert got_flags == expected_flags
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    assert ckpttool.load(path, select="params")["weight"].requires_grad


def test_a_pickled_module_gives_its_state_dict_detached(tmp_path):
    """``torch.save(model)``: what ``model.state_dict()`` gives, plain tensors, with tied
    weights one tensor; the whole structure (select all) keeps its Parameters."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied
    path = tmp_path / "model.pt"
    torch.save(model, path)
    sd = ckpttool.load(path)
    expected = model.state_dict()
    assert list(sd) == list(expected)
    assert {k: (type(v).__name__, v.requires_grad) for k, v in sd.items()} == {
        k: ("Tensor", False) for k in expected
    }
    assert all(torch.equal(sd[k], v) for k, v in expected.items())
    assert sd["0.weight"] is sd["1.weight"]
    whole = ckpttool.load(path, select="all")
    param = whole["state"]["_modules"]["0"]["state"]["_parameters"]["weight"]
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad


def test_select_key_path_with_dotted_keys(tmp_path):
    path = tmp_path / "snap.pt"
    torch.save({"state": {"model": {"0.weight": torch.ones(1)}, "step": 3}}, path)
    assert list(ckpttool.load(path, select="state.model")) == ["0.weight"]
    assert torch.equal(ckpttool.load(path, select="state.model.0.weight"), torch.ones(1))
    with pytest.raises(ckpttool.CkptError, match="no key 'nothing'"):
        ckpttool.load(path, select="state.nothing")


def test_load_never_changes_the_input(tmp_path):
    path = tmp_path / "snap.pt"
    torch.save({"MODEL_STATE": {"module.w": torch.ones(3)}, "EPOCHS_RUN": 1}, path)
    before = sha256(path)
    ckpttool.load(path)
    ckpttool.load(path, select="all")
    assert sha256(path) == before


def test_read_reads_no_tensor_bytes(tmp_path):
    """read() is metadata only: it works even when the storage bytes are garbage."""
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(4)}, path)
    broken = tmp_path / "broken.pt"
    rewrite_zip(path, broken, lambda n, d: b"\xff" * len(d) if n.endswith("/data/0") else None)
    ckpt = ckpttool.read(broken)
    assert ckpt.root["w"].shape == (4,)
    assert not torch.equal(ckpttool.load(broken)["w"], torch.ones(4))  # bytes read only now


def test_pathlike_and_string_inputs(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(2)}, path)
    assert list(ckpttool.load(path)) == list(ckpttool.load(str(path))) == ["w"]


def test_select_all_turns_objects_into_plain_stand_ins_with_real_tensors(tmp_path):
    """load(select="all") never hands back lazy references: tensors inside objects are read,
    objects become the same plain-data stand-ins as merge writes, torch names torch objects."""
    import argparse

    import torch.nn as nn

    model = nn.Sequential(nn.Linear(2, 3))
    torch.save(
        {
            "module": model,
            "hparams": argparse.Namespace(scale=torch.ones(2), lr=0.1),
            "device": torch.device("cuda", 1),
            "dtype": torch.bfloat16,
        },
        tmp_path / "objects.pt",
    )
    out = ckpttool.load(tmp_path / "objects.pt", select="all")
    assert out["hparams"] == {
        "__class__": "argparse.Namespace",
        "state": {"scale": out["hparams"]["state"]["scale"], "lr": 0.1},
    }
    assert torch.equal(out["hparams"]["state"]["scale"], torch.ones(2))
    assert out["module"]["__class__"] == "torch.nn.modules.container.Sequential"
    linear = out["module"]["state"]["_modules"]["0"]["state"]["_parameters"]
    assert torch.equal(linear["weight"], model[0].weight.detach())
    assert out["device"] == torch.device("cuda", 1)
    assert out["dtype"] is torch.bfloat16


def test_public_names_stay_what_they_are_after_use(tmp_path):
    """ckpttool.materialize is a function: a submodule of the same name, imported when
    the first tensor was read, replaced it in the package (TypeError on the next call)."""
    path = tmp_path / "sd.pt"
    sd = small_state_dict()
    torch.save(sd, path)
    ckpttool.load(path)
    for name in ckpttool.__all__:
        value = getattr(ckpttool, name)
        assert not isinstance(value, type(ckpttool)), name
    node = ckpttool.select_node(ckpttool.read(path))[1]
    loaded = ckpttool.materialize(node)
    assert list(loaded) == list(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)
