"""Where the model state dict is inside a snapshot, and which wrapper prefix it carries."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from conftest import run_cli, small_state_dict

import ckpttool
from ckpttool.layout import detect_prefix, strip_prefix
from ckpttool.report import inspect_report

KEYS = list(small_state_dict())


def prefixed(prefix: str) -> dict:
    return {prefix + k: v for k, v in small_state_dict().items()}


def optimizer_state() -> dict:
    """A real Adam state dict after one step: state keyed by int parameter ids."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return opt.state_dict()


def scheduler_state() -> dict:
    return {"last_epoch": 3, "base_lrs": [0.01], "_step_count": 4}


# name -> (object saved, model_key, prefix, plain values expected among report["values"])
LAYOUTS = {
    "plain": (lambda: small_state_dict(), [], None, []),
    "ddp": (lambda: prefixed("module."), [], "module.", []),
    "compile": (lambda: prefixed("_orig_mod."), [], "_orig_mod.", []),
    "ddp_of_compile": (lambda: prefixed("module._orig_mod."), [], "module._orig_mod.", []),
    "torchrun_tutorial": (
        lambda: {"MODEL_STATE": prefixed("module."), "EPOCHS_RUN": 3},
        ["MODEL_STATE"],
        "module.",
        [{"key": ["EPOCHS_RUN"], "type": "int", "value": 3}],
    ),
    "composer": (
        lambda: {
            "state": {
                "model": prefixed("module."),
                "optimizers": {"Adam": optimizer_state()},
                "schedulers": {"LambdaLR": scheduler_state()},
                "timestamp": {"epoch": 2, "batch": 40},
            },
            "rng": [{"python": (3, (1, 2), None), "torch": torch.get_rng_state()}],
        },
        ["state", "model"],
        "module.",
        [
            {"key": ["state", "timestamp", "epoch"], "type": "int", "value": 2},
            {"key": ["state", "schedulers", "LambdaLR", "last_epoch"], "type": "int", "value": 3},
        ],
    ),
    "nanogpt": (
        lambda: {
            "model": prefixed("_orig_mod."),
            "optimizer": optimizer_state(),
            "epoch": 7,
            "best_val_loss": 1.25,
        },
        ["model"],
        "_orig_mod.",
        [
            {"key": ["epoch"], "type": "int", "value": 7},
            {"key": ["best_val_loss"], "type": "float", "value": 1.25},
            {"key": ["optimizer", "param_groups", 0, "lr"], "type": "float", "value": 0.01},
        ],
    ),
    "lightning": (
        lambda: {
            "state_dict": small_state_dict(),
            "epoch": 1,
            "global_step": 250,
            "optimizer_states": [optimizer_state()],
            "pytorch-lightning_version": "2.4.0",
        },
        ["state_dict"],
        None,
        [
            {"key": ["global_step"], "type": "int", "value": 250},
            {"key": ["pytorch-lightning_version"], "type": "str", "value": "2.4.0"},
        ],
    ),
    "model_state": (
        lambda: {
            "model_state": prefixed("module."),
            "optimizer_state": optimizer_state(),
            "step": 100,
        },
        ["model_state"],
        "module.",
        [{"key": ["step"], "type": "int", "value": 100}],
    ),
}


@pytest.fixture(scope="module")
def layout_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("layouts")
    out = {}
    for name, (build, *_rest) in LAYOUTS.items():
        out[name] = folder / f"{name}.pt"
        torch.save(build(), out[name])
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_model_key_prefix_and_values(layout_files, name):
    _, model_key, prefix, values = LAYOUTS[name]
    report = inspect_report(ckpttool.read(layout_files[name]))
    assert report["model_key"] == model_key
    assert report["prefix"] == prefix
    for value in values:
        assert value in report["values"]
    model_tensors = [t["key"][-1] for t in report["tensors"] if t["key"][:-1] == model_key]
    assert model_tensors == [(prefix or "") + k for k in KEYS]
    assert report["num_params"] == sum(v.numel() for v in small_state_dict().values())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_load_returns_the_stripped_model_state_dict(layout_files, name):
    sd = ckpttool.load(layout_files[name])
    assert list(sd) == KEYS
    expected = small_state_dict()
    for key in KEYS:
        assert torch.equal(sd[key], expected[key]), key


def test_strip_prefix_none_keeps_the_keys(layout_files):
    sd = ckpttool.load(layout_files["ddp_of_compile"], strip_prefix="none")
    assert list(sd) == ["module._orig_mod." + k for k in KEYS]
    sd = ckpttool.load(layout_files["ddp_of_compile"], strip_prefix="module.")
    assert list(sd) == ["_orig_mod." + k for k in KEYS]


def test_select_all_and_key_path(layout_files):
    everything = ckpttool.load(layout_files["composer"], select="all")
    assert set(everything) == {"state", "rng"}
    assert set(everything["state"]) == {"model", "optimizers", "schedulers", "timestamp"}
    assert list(everything["state"]["model"]) == ["module." + k for k in KEYS]
    adam = everything["state"]["optimizers"]["Adam"]
    assert sorted(adam["state"]) == [0, 1]
    assert torch.equal(adam["state"][0]["exp_avg"], optimizer_state()["state"][0]["exp_avg"])
    opt = ckpttool.load(layout_files["composer"], select="state.optimizers.Adam")
    assert sorted(opt) == ["param_groups", "state"]
    assert opt["param_groups"][0]["params"] == [0, 1]


def test_optimizer_state_keys_are_ints_in_json(layout_files, cli):
    proc = cli("inspect", "--json", layout_files["nanogpt"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    keys = [t["key"] for t in report["tensors"] if t["key"][0] == "optimizer"]
    assert keys == [
        ["optimizer", "state", 0, "step"],
        ["optimizer", "state", 0, "exp_avg"],
        ["optimizer", "state", 0, "exp_avg_sq"],
        ["optimizer", "state", 1, "step"],
        ["optimizer", "state", 1, "exp_avg"],
        ["optimizer", "state", 1, "exp_avg_sq"],
    ]
    assert {"key": ["optimizer", "param_groups", 0, "params"], "type": "list", "value": [0, 1]} in (
        report["values"]
    )


def test_human_output_shows_model_key_and_prefix(layout_files):
    proc = run_cli("inspect", layout_files["torchrun_tutorial"])
    assert proc.returncode == 0, proc.stderr
    assert "model state dict: MODEL_STATE, wrapper prefix: module." in proc.stdout
    assert "EPOCHS_RUN" in proc.stdout


@pytest.mark.parametrize(
    "keys,prefix",
    [
        (["module.a", "module.b"], "module."),
        (["module.a", "b"], None),  # every key must carry it
        (["_orig_mod.module.a"], "_orig_mod.module."),
        (["module._orig_mod.a", "module._orig_mod.b"], "module._orig_mod."),
        (["modulea"], None),
        ([], None),
    ],
)
def test_detect_prefix(keys, prefix):
    assert detect_prefix(keys) == prefix


def test_strip_prefix_does_not_change_its_input():
    sd = {"module.a": 1, "b": 2}
    assert strip_prefix(sd, "module.") == {"a": 1, "b": 2}
    assert sd == {"module.a": 1, "b": 2}


def test_no_model_state_dict(tmp_path, cli):
    path = tmp_path / "values.pt"
    torch.save({"epoch": 3, "losses": [0.5, 0.25]}, path)
    report = inspect_report(ckpttool.read(path))
    assert report["model_key"] is None and report["prefix"] is None
    assert report["tensors"] == [] and report["num_params"] == 0
    with pytest.raises(ckpttool.CkptError, match="no model state dict"):
        ckpttool.load(path)
    assert ckpttool.load(path, select="all") == {"epoch": 3, "losses": [0.5, 0.25]}


def test_largest_state_dict_found_outside_known_keys(tmp_path):
    path = tmp_path / "custom.pt"
    big, small = small_state_dict(), {"w": torch.zeros(1)}
    torch.save(
        {"ema": small, "weights_of_run": {"inner": big}, "optimizer": {"w": torch.zeros(99)}}, path
    )
    report = inspect_report(ckpttool.read(path))
    assert report["model_key"] == ["weights_of_run", "inner"]


def test_pickled_module_is_not_mistaken_for_one_layer(tmp_path):
    """torch.save(model) keeps one ``_parameters`` dict per layer: none is the state dict."""
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 8))
    path = tmp_path / "whole_model.pt"
    torch.save({"model": model, "epoch": 1}, path)
    report = inspect_report(ckpttool.read(path))
    assert report["model_key"] == ["model"]  # the module itself, not a layer inside it
    keys = [t["key"] for t in report["tensors"]]
    assert ["model", "_modules", "2", "_parameters", "weight"] in keys and len(keys) == 4
    assert {"key": ["epoch"], "type": "int", "value": 1} in report["values"]
    loaded = ckpttool.load(path)  # not silently layer 2's {"weight", "bias"}
    assert list(loaded) == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("snapshot", [False, True])
def test_pickled_whole_module_gives_its_state_dict(tmp_path, legacy, snapshot):
    """torch.save(model) (old repos do it): the module's parameters and persistent buffers,
    read from the pickled object without running its class."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Sequential(nn.Linear(3, 2)))
    model.register_buffer("scratch", torch.zeros(5), persistent=False)
    path = tmp_path / "whole.pt"
    obj = {"model": model, "epoch": 7} if snapshot else model
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)

    expected = model.state_dict()
    loaded = ckpttool.load(path)
    assert list(loaded) == list(expected)  # scratch (non-persistent) is not in it
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor)
    report = inspect_report(ckpttool.read(path))
    assert report["model_key"] == (["model"] if snapshot else [])
    assert report["num_params"] == sum(t.numel() for t in expected.values())
