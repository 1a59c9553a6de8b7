"""``torchscript`` (formats/torchscript.py): a torch.jit.save archive's parameters and buffers."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

import ckpttool
from ckpttool.inspection import inspect_report


class _Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.sub = _Sub()
        self.register_buffer("buf", torch.arange(5.0))
        self.scale = torch.tensor([2.0])  # a plain attribute: not in the state dict

    def forward(self, x):
        return self.sub(self.fc(x)) * self.scale + self.buf.sum()


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_torchscript_lists_parameters_and_buffers(tmp_path):
    torch.manual_seed(0)
    net = _Net()
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(net), path)
    ckpt = ckpttool.read(path)
    assert ckpt.format == "torchscript"
    assert sorted(ckpt.root) == ["buf", "fc.bias", "fc.weight", "sub.lin.bias", "sub.lin.weight"]
    assert list(ckpt.root) == list(torch.jit.load(path).state_dict())  # and in its order
    _check_torchscript(path, ckpt, net)


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("how", ["script", "trace"])
def test_torchscript_cnn(tmp_path, how):
    """A scripted conv net's pickle wraps typed lists in torch.jit._pickle.build_intlist
    & co. (identity functions): read, not refused."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    net.eval()
    module = (
        torch.jit.script(net) if how == "script" else torch.jit.trace(net, torch.randn(1, 3, 8, 8))
    )
    path = tmp_path / f"{how}.pt"
    torch.jit.save(module, path)
    ckpt = ckpttool.read(path)
    assert ckpt.format == "torchscript" and ckpt.dangerous == []
    _check_torchscript(path, ckpt, net)


def _check_torchscript(path, ckpt, net):
    loaded = ckpttool.load(path)
    expected = net.state_dict()
    assert sorted(loaded) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    report = inspect_report(ckpt)
    assert report["model_key"] == [] and report["prefix"] is None
    assert report["num_params"] == sum(v.numel() for v in expected.values())


class _NoState(nn.Module):
    def forward(self, x):
        return x.relu()


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_parameterless_torchscript_and_empty_safetensors_are_an_empty_model(tmp_path):
    """Their root is the model's state dict whatever it holds: an empty one loads as {}
    (as torch.jit.load(f).state_dict() and safetensors' load_file give it), not as
    "no model state dict found"; an empty torch.save dict is still not taken for one."""
    scripted, empty = tmp_path / "relu.pt", tmp_path / "empty.safetensors"
    torch.jit.save(torch.jit.script(_NoState()), scripted)
    save_file({}, empty)
    assert dict(torch.jit.load(scripted).state_dict()) == {} == load_file(empty)
    for path in (scripted, empty):
        assert ckpttool.load(path) == {}
        assert inspect_report(ckpttool.read(path))["model_key"] == []
    torch.save({}, tmp_path / "empty.pt")
    with pytest.raises(ckpttool.CkptError, match="no model state dict found"):
        ckpttool.load(tmp_path / "empty.pt")
