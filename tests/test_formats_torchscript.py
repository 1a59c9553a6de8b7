"""``torchscript`` (formats/torchscript.py): a torch.jit.save archive's parameters and buffers."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from helpers import check_error, run_cli, subprocess_env
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


# --------------------------------------------- code torch.jit.load runs: __setstate__
# torch.load hands a TorchScript archive to torch.jit.load, which runs the __setstate__
# of every module, submodule and script class that defines one (CVE-2025-32434). Each
# hostile one maps a file (torch.from_file(..., shared=True) creates it) in the loading
# process's working folder; the marker names which one ran.


class _Restores(nn.Module):
    """A __setstate__ that only restores attributes: what passes."""

    def __init__(self):
        super().__init__()
        self.w = torch.arange(3.0)

    def forward(self, x):
        return x + self.w

    @torch.jit.export
    def __getstate__(self) -> tuple[torch.Tensor, bool]:
        return (self.w, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[torch.Tensor, bool]) -> None:
        self.w = state[0]
        self.training = state[1]


class _MapsAFile(_Restores):
    @torch.jit.export
    def __setstate__(self, state: tuple[torch.Tensor, bool]) -> None:
        self.w = state[0] + torch.from_file("marker-module", True, 1)
        self.training = state[1]


class _Holds(nn.Module):
    def __init__(self, sub: nn.Module):
        super().__init__()
        self.sub = sub
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(self.sub(x))


class _Box:  # a script class (scripted where it is used: torch.jit warns of itself)
    def __init__(self, v: torch.Tensor):
        self.v = v

    def __getstate__(self) -> tuple[torch.Tensor, int]:
        return (self.v, 0)

    def __setstate__(self, state: tuple[torch.Tensor, int]) -> None:
        self.v = state[0] + torch.from_file("marker-class", True, 1)


class _HoldsABox(nn.Module):
    def __init__(self):
        super().__init__()
        self.box = _Box(torch.ones(3))

    def forward(self, x):
        return x + self.box.v


def _box_holder():
    torch.jit.script(_Box)
    return _HoldsABox()


HOSTILE_SCRIPTS = {  # name: (module, what the refusal names, the marker)
    "module": (_MapsAFile, "__setstate__ of __torch__.", "marker-module"),
    "submodule": (lambda: _Holds(_MapsAFile()), "__setstate__ of __torch__.", "marker-module"),
    "script-class": (_box_holder, "__setstate__ of __torch__.", "marker-class"),
}


@pytest.fixture(scope="module")
def hostile_scripts(tmp_path_factory):
    """Each hostile archive in a folder of its own, proven live: a real torch.load (one
    child, in each archive's folder in turn) maps the marker file."""
    base = tmp_path_factory.mktemp("setstate")
    paths = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.jit is deprecated)
        for name, (build, _, _) in HOSTILE_SCRIPTS.items():
            (base / name).mkdir()
            paths[name] = base / name / "scripted.pt"
            torch.jit.save(torch.jit.script(build()), paths[name])
    script = "import os, torch, warnings\nwarnings.simplefilter('ignore')\n" + "".join(
        f"os.chdir({str(p.parent)!r})\ntorch.load({str(p)!r}, weights_only=False)\n"
        for p in paths.values()
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=base,
        timeout=600,  # a hang guard, no timing
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, (_, _, marker) in HOSTILE_SCRIPTS.items():
        assert (paths[name].parent / marker).exists(), f"{name}: torch.load ran nothing"
        (paths[name].parent / marker).unlink()
    return paths


@pytest.mark.parametrize("name", list(HOSTILE_SCRIPTS))
def test_setstate_that_calls_is_refused_naming_the_call(hostile_scripts, name, tmp_path):
    path = hostile_scripts[name]
    _, where, marker = HOSTILE_SCRIPTS[name]
    line = check_error(run_cli("inspect", path), 3, "torch.from_file called by", where)
    assert "nothing was executed" in line
    out = tmp_path / "out.safetensors"
    check_error(run_cli("convert", path, "--to", "safetensors", "-o", out), 3, "torch.from_file")
    assert not out.exists()
    with pytest.raises(ckpttool.UnsafeError) as caught:
        ckpttool.load(path)
    assert "torch.from_file" in caught.value.dangerous
    assert not (path.parent / marker).exists()
    # --unsafe: read, and the call listed as dangerous
    assert "torch.from_file" in ckpttool.read(path, unsafe=True).dangerous


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_setstate_that_only_restores_attributes_reads(tmp_path):
    torch.manual_seed(0)
    net = _Holds(_Restores())
    path = tmp_path / "restores.pt"
    torch.jit.save(torch.jit.script(net), path)
    ckpt = ckpttool.read(path)
    assert ckpt.dangerous == []
    assert sorted(ckpttool.load(path)) == sorted(torch.jit.load(path).state_dict())


CLASS = "class M(Module):\n  w : Tensor\n  training : bool\n"
HEADER = "  def __setstate__(self: __torch__.M,\n    state: Tuple[Tensor, bool]) -> NoneType:\n"


@pytest.mark.parametrize(
    "body, named",
    [
        ("    self.w = (state)[0]\n    return None\n", None),
        ("    self.w = (state)[0]\n    self.training = (state)[1]\n", None),
        ("    _0 = (self).helper()\n    self.w = (state)[0]\n", "self.helper"),
        ("    self.w = ops.prim.X((state)[0])\n", "ops.prim.X"),
        ("    self.undeclared = (state)[0]\n", "<Assign at line 6>"),  # a property's setter?
        ("    if (state)[1]:\n      pass\n", "<If at line 6>"),
        ("    self.w = (state)[0]\n    x = 1\n", "<Assign at line 7>"),
    ],
)
def test_setstate_body_rules(body, named):
    from ckpttool.formats.torch_save.torchscript import judge_setstate

    found = judge_setstate((CLASS + HEADER + body).encode(), "__torch__", "a/code/__torch__.py")
    assert list(found) == ([] if named is None else [named])
    if named is not None:
        assert found[named].endswith("by __setstate__ of __torch__.M")


@pytest.mark.parametrize(
    "text",
    [
        CLASS + '  x = "__setstate__"\n',  # named where Python sees a string: not trusted
        CLASS + HEADER + "    self.w = (state)[0]\n  # __setstate__\n",
        CLASS + HEADER + "    self.w = (state\n",  # does not parse
        CLASS.replace(" : bool", "") + "  def __setstate__(self, state, extra):\n    pass\n",
        "class M(Module):\n  w : Tensor\n"
        "  def __setstate__(self: __torch__.M, state: __torch__.Evil) -> NoneType:\n"
        "    self.w = (state)[0]\n",  # indexing a script class runs its __getitem__
    ],
)
def test_setstate_that_cannot_be_judged_is_refused(text):
    from ckpttool.formats.torch_save.torchscript import judge_setstate

    assert judge_setstate(text.encode(), "__torch__", "a/code/__torch__.py")


def test_code_without_setstate_costs_no_parse():
    from ckpttool.formats.torch_save.torchscript import judge_setstate

    assert judge_setstate(b"class M(Module):\n  def forward(self, x):\n  ((((", "m", "e") == {}
