"""Ultralytics YOLO checkpoints written by its own trainer (fixtures/ultralytics/, see
fixtures/make_ultralytics_fixtures.py): a pickled ``DetectionModel`` is read as its
``state_dict()``, the model is the one Ultralytics' loader takes
(``ckpt.get("ema") or ckpt["model"]``), and every tensor equals what that loader gave
back (``truth.pt``), fp16 as stored."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import FIXTURES, assert_identical, check_error, run_cli
from safetensors.torch import load_file

import ckpttool

WEIGHTS = FIXTURES / "ultralytics" / "weights"
# the classes of the pickled model: read inert, never called by the pickle
MODEL_CLASSES = [
    "ultralytics.nn.modules.block.Bottleneck",
    "ultralytics.nn.modules.block.C2f",
    "ultralytics.nn.modules.block.DFL",
    "ultralytics.nn.modules.conv.Conv",
    "ultralytics.nn.modules.head.Detect",
    "ultralytics.nn.tasks.DetectionModel",
]
# The model's ``args`` during training: SimpleNamespace's __reduce__ pickles it as
# ``GLOBAL IterableSimpleNamespace, EMPTY_TUPLE, REDUCE, {...}, BUILD``: a call of a
# class, allowed by name (strip_optimizer makes it a dict, so last.pt and best.pt have
# none once training ends).
CALLED_CLASS = "ultralytics.utils.IterableSimpleNamespace"
# file -> the model key
FILES = {"last.pt": "model", "best.pt": "model", "epoch1.pt": "ema"}


@pytest.fixture(scope="module")
def truth():
    return torch.load(FIXTURES / "ultralytics" / "truth.pt", weights_only=True)


@pytest.mark.parametrize("name", list(FILES))
def test_ultralytics_model_is_the_one_its_loader_takes(name, truth):
    key = FILES[name]
    assert truth[name]["loader_key"] == key  # ckpt.get("ema") or ckpt["model"]
    proc = run_cli("inspect", WEIGHTS / name, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["format"], report["model_key"]) == ("torch-zip", [key])
    # the model's modules are vouched for as a family (nn.Module subclasses, restored)
    assert (report["unverified"], report["dangerous"]) == ([], [])
    assert set(MODEL_CLASSES) <= set(report["globals"])
    assert (CALLED_CLASS in report["globals"]) == (name == "epoch1.pt")
    names = [".".join(map(str, t["key"])) for t in report["tensors"]]
    model = [n for n in names if n.startswith(f"{key}.")]
    assert model == [f"{key}.{k}" for k in truth[name][key]]  # state_dict() names, in order


@pytest.mark.parametrize("name", list(FILES))
def test_ultralytics_model_equals_its_loaders_state_dict_as_stored(name, truth):
    key = FILES[name]
    want = truth[name][key]
    model = ckpttool.load(WEIGHTS / name)
    assert list(model) == list(want)
    assert {t.dtype for t in model.values()} == {torch.float16, torch.int64}  # fp16, as saved
    assert assert_identical(model, want, exact_types=False) == 71
    assert_identical(ckpttool.load(WEIGHTS / name, select=key), want)


def test_ultralytics_last_epoch_ema_is_the_stripped_last_pt_model():
    # strip_optimizer moves the EMA to "model" and nulls the rest; the values stay
    ema = ckpttool.load(WEIGHTS / "epoch1.pt")
    assert_identical(ema, ckpttool.load(WEIGHTS / "last.pt"))


def test_ultralytics_training_args_read_as_values():
    args = ckpttool.load(WEIGHTS / "epoch1.pt", select="ema")  # the module's state only
    assert "args" not in args
    full = ckpttool.load(WEIGHTS / "epoch1.pt", select="all")
    assert full["train_args"]["imgsz"] == 32


@pytest.mark.parametrize("name, key", [("last.pt", "ema"), ("epoch1.pt", "model")])
def test_ultralytics_selecting_the_empty_model_key_is_an_error(name, key, tmp_path):
    out = tmp_path / "model.safetensors"
    proc = run_cli("convert", WEIGHTS / name, "--select", key, "--to", "safetensors",
                   "-o", out)  # fmt: skip
    check_error(proc, 2, "no tensors")
    assert not out.exists()


@pytest.mark.parametrize("name", list(FILES))
def test_ultralytics_converts_to_safetensors_equal_to_its_loaders_state_dict(name, truth, tmp_path):
    key = FILES[name]
    out = tmp_path / "model.safetensors"
    proc = run_cli("convert", WEIGHTS / name, "--to", "safetensors", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert_identical(load_file(out), truth[name][key])
    proc = run_cli("diff", WEIGHTS / name, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ultralytics_select_all_names_tensors_as_state_dict_and_keeps_the_optimizer(
    truth, tmp_path
):
    out = tmp_path / "all.safetensors"
    proc = run_cli("convert", WEIGHTS / "epoch1.pt", "--select", "all",
                   "--to", "safetensors", "-o", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = load_file(out)
    want = {f"ema.{k}": v for k, v in truth["epoch1.pt"]["ema"].items()}
    for index, state in truth["epoch1.pt"]["optimizer"]["state"].items():
        want.update({f"optimizer.state.{index}.{k}": v for k, v in state.items()})
    assert list(got) == list(want)  # ema.model.0.conv.weight, not ema._modules...
    assert_identical(got, want)


def test_ultralytics_select_all_reads_the_training_state(truth):
    full = ckpttool.load(WEIGHTS / "epoch1.pt", select="all")
    values = truth["epoch1.pt"]["values"]
    assert (full["epoch"], full["updates"], full["version"]) == (
        values["epoch"],
        values["updates"],
        values["version"],
    )
    assert (
        full["model"] is None and full["ema"]["__class__"] == "ultralytics.nn.tasks.DetectionModel"
    )
    assert_identical(full["optimizer"], truth["epoch1.pt"]["optimizer"], exact_types=False)
    assert full["train_args"]["imgsz"] == 32 and full["train_args"]["epochs"] == 2
    stripped = ckpttool.load(WEIGHTS / "last.pt", select="all")
    assert (stripped["epoch"], stripped["ema"], stripped["optimizer"]) == (-1, None, None)
