"""torchtune output folders written by torchtune's own checkpointers (fixtures/torchtune/,
fixtures/make_torchtune_fixtures.py): the model is the one ``epoch_N/`` folder, the
recipe state (and a LoRA run's ``adapter_model.pt``) come with ``--select all``, and the
values equal what torchtune's own loaders gave back (``truth.pt`` beside each run)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from helpers import FIXTURES, assert_identical, check_error, run_cli
from safetensors.torch import load_file

import ckpttool

TORCHTUNE = FIXTURES / "torchtune"
# run -> (format id, the model's files in truth["files"], parts besides the epoch)
RUNS = {
    "hf": (
        "safetensors-sharded",
        ["epoch_0/model-00001-of-00002.safetensors", "epoch_0/model-00002-of-00002.safetensors"],
        ["recipe_state"],
    ),
    "meta_lora": (
        "torch-zip",
        ["epoch_0/model-00001-of-00001.bin"],
        ["adapter_model", "recipe_state"],
    ),
    "hf_lora": ("safetensors", ["epoch_0/adapter_model.safetensors"], ["adapter_model"]),
}
WEIGHT_FILES = sorted(
    path.relative_to(TORCHTUNE)
    for path in TORCHTUNE.glob("*/output/**/*")
    if path.suffix in (".pt", ".bin", ".safetensors")
)
RECIPE_KEYS = ["dataloader", "epochs_run", "max_steps_per_epoch", "optimizer", "seed",
               "total_epochs"]  # fmt: skip


def _truth(run: str) -> dict:
    return torch.load(TORCHTUNE / run / "truth.pt", weights_only=False)  # our own fixture


def _model_truth(run: str) -> dict:
    files = _truth(run)["files"]
    return {key: t for name in RUNS[run][1] for key, t in files[name].items()}


def _inspect(path) -> dict:
    proc = run_cli("inspect", path, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_output_folder_reads_its_one_epoch_as_the_model(run):
    output = TORCHTUNE / run / "output"
    fmt, model_files, _ = RUNS[run]
    report = _inspect(output)
    assert (report["format"], report["model_key"], report["prefix"]) == (fmt, ["epoch_0"], None)
    assert {str(output / name) for name in model_files} <= set(report["files"])
    want = _model_truth(run)
    model = ckpttool.load(output)
    assert sorted(model) == sorted(want)
    assert_identical(model, want, ordered=False, exact_types=False)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_epoch_folder_alone_is_its_model(run):
    epoch = TORCHTUNE / run / "output" / "epoch_0"
    report = _inspect(epoch)
    assert (report["format"], report["model_key"]) == (RUNS[run][0], [])
    # the epoch alone is the model only: no adapter_model.pt beside the merged model
    assert all("adapter_model.pt" not in name for name in report["files"])
    assert_identical(ckpttool.load(epoch), _model_truth(run), ordered=False, exact_types=False)


def test_hf_epoch_keeps_the_dtype_and_shards_torchtune_wrote():
    report = _inspect(TORCHTUNE / "hf" / "output" / "epoch_0")
    assert {t["dtype"] for t in report["tensors"]} == {"bfloat16"}
    shards = {t["file"].rsplit("/", 1)[-1] for t in report["tensors"]}
    assert shards == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert report["num_params"] == sum(t.numel() for t in _model_truth("hf").values())


def test_several_epochs_are_refused_naming_them():
    # a run of 2 epochs leaves epoch_0/ and epoch_1/: which one is meant is the user's call
    output = TORCHTUNE / "tune" / "output"
    check_error(run_cli("inspect", output), 2, "several models (epoch_0, epoch_1)")
    check_error(run_cli("convert", output, "--to", "safetensors", "-o", "-"), 2, "epoch_0")
    with pytest.raises(ckpttool.CkptError, match="epoch_0, epoch_1"):
        ckpttool.load(output)


@pytest.mark.parametrize("epoch", ["epoch_0", "epoch_1"])
def test_each_epoch_of_a_finished_run_equals_torchtune_load_checkpoint(epoch):
    # FullModelTorchTuneCheckpointer stores torchtune's own key names: its
    # load_checkpoint()["model"] is the file as it is
    folder = TORCHTUNE / "tune" / "output" / epoch
    truth = _truth("tune")
    report = _inspect(folder)
    assert (report["format"], report["model_key"]) == ("torch-zip", [])
    model = ckpttool.load(folder)
    want = truth["epochs"][epoch]
    assert list(model) == list(want)
    assert_identical(model, want, exact_types=False)
    assert_identical(model, truth["files"][f"{epoch}/model-00001-of-00001.bin"], exact_types=False)


def test_finished_run_with_one_epoch_left_brings_its_recipe_state(tmp_path):
    # the user keeps the epoch to resume from: the folder then reads as torchtune resumes it
    src = TORCHTUNE / "tune" / "output"
    shutil.copytree(src / "epoch_1", tmp_path / "epoch_1")
    shutil.copytree(src / "recipe_state", tmp_path / "recipe_state")
    truth = _truth("tune")
    assert _inspect(tmp_path)["model_key"] == ["epoch_1"]
    full = ckpttool.load(tmp_path, select="all")
    assert sorted(full) == ["epoch_1", "recipe_state"]
    assert_identical(full["epoch_1"], truth["resume"]["model"], exact_types=False)
    assert sorted(full["recipe_state"]) == RECIPE_KEYS
    resume = {k: v for k, v in truth["resume"].items() if k != "model"}
    assert_identical(full["recipe_state"], resume, ordered=False, exact_types=False)


@pytest.mark.parametrize("run", ["hf", "meta_lora"])
def test_select_all_brings_what_torchtune_resume_reads(run):
    output = TORCHTUNE / run / "output"
    truth = _truth(run)
    full = ckpttool.load(output, select="all")
    assert sorted(full) == sorted(["epoch_0", *RUNS[run][2]])
    recipe = full["recipe_state"]
    assert sorted(recipe) == RECIPE_KEYS
    want = truth["files"]["recipe_state/recipe_state.pt"]
    assert_identical(recipe, want, ordered=False, exact_types=False)
    # torchtune's resume merges the recipe state into its top level
    resume = {k: truth["resume"][k] for k in RECIPE_KEYS}
    assert_identical(recipe, resume, ordered=False, exact_types=False)
    values = (recipe["epochs_run"], recipe["total_epochs"], recipe["max_steps_per_epoch"])
    assert values == (1, 2, 2)
    state = recipe["optimizer"]["state"]
    params = recipe["optimizer"]["param_groups"][0]["params"]
    assert sorted(state) == params and sorted(state[0]) == ["exp_avg", "exp_avg_sq", "step"]
    if run == "meta_lora":  # the optimizer holds the adapter's parameters only
        assert len(params) == len(truth["resume"]["adapter"])
        assert_identical(full["adapter_model"], truth["resume"]["adapter"], exact_types=False)
        assert_identical(
            full["adapter_model"], truth["files"]["epoch_0/adapter_model.pt"], exact_types=False
        )
    else:
        assert len(params) == len(truth["epochs"]["epoch_0"])


def test_adapter_only_epoch_is_its_peft_adapter():
    # adapter_only=True: no model; the adapter in PEFT's names (adapter_model.safetensors,
    # what PEFT loads) is the model, torchtune's own copy (adapter_model.pt) comes with all
    output = TORCHTUNE / "hf_lora" / "output"
    truth = _truth("hf_lora")["files"]
    model = ckpttool.load(output)
    assert all(key.startswith("base_model.model.") and ".lora_" in key for key in model)
    full = ckpttool.load(output, select="all")
    assert sorted(full) == ["adapter_model", "epoch_0"]
    assert_identical(full["adapter_model"], truth["epoch_0/adapter_model.pt"], exact_types=False)


@pytest.mark.parametrize("name", [str(p) for p in WEIGHT_FILES])
def test_each_file_inspects_without_dangerous_or_unverified_globals(name):
    report = _inspect(TORCHTUNE / name)
    assert report["dangerous"] == [] and report["unverified"] == []
    run, _, rel = name.split("/", 2)
    want = _truth(run)["files"][rel]
    got = ckpttool.load(TORCHTUNE / name, select="all")
    assert_identical(got, want, ordered=False, exact_types=False)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_convert_to_safetensors_equals_truth(run, tmp_path):
    out = tmp_path / "model.safetensors"
    proc = run_cli("convert", TORCHTUNE / run / "output", "--to", "safetensors", "-o", out)
    assert proc.returncode == 0, proc.stderr
    want = _model_truth(run)
    got = load_file(out)
    assert sorted(got) == sorted(want)
    assert_identical(got, want, ordered=False, exact_types=False)


def test_convert_select_all_writes_the_optimizer_state(tmp_path):
    out = tmp_path / "all.safetensors"
    output = TORCHTUNE / "hf" / "output"
    proc = run_cli("convert", output, "--to", "safetensors", "--select", "all", "-o", out)
    assert proc.returncode == 0, proc.stderr
    got = load_file(out)
    optim = _truth("hf")["files"]["recipe_state/recipe_state.pt"]["optimizer"]["state"]
    for i, state in optim.items():
        for name, tensor in state.items():
            assert torch.equal(got[f"recipe_state.optimizer.state.{i}.{name}"], tensor)
    for key, tensor in _model_truth("hf").items():
        assert torch.equal(got[f"epoch_0.{key}"], tensor)


@pytest.mark.parametrize(
    "names, want",
    [
        (["model-00001-of-00001.bin", "adapter_model.pt"], ["w0"]),
        (["adapter_model.pt", "model-00001-of-00001.safetensors"], ["w1"]),  # the safetensors
        # named, never picked (`inspect` lists them)
        (["optimizer.pt", "adapter_model.pt"], "holds 2 checkpoints ("),
        (["model-00001-of-00001.bin", "adapter_model.pt", "extra.pt"], "holds 3 checkpoints"),
        (["model-00001-of-00002.bin", "adapter_model.pt"], "holds 2 checkpoints"),
    ],
)
def test_merged_model_beside_its_adapter_is_taken_by_name_only(tmp_path, names, want):
    # the rule names torchtune's one model file; any other pair stays ambiguous
    from safetensors.torch import save_file

    for i, name in enumerate(names):
        sd = {f"w{i}": torch.full((2,), float(i))}
        if name.endswith(".safetensors"):
            save_file(sd, tmp_path / name)
        else:
            torch.save(sd, tmp_path / name)
    if isinstance(want, str):
        with pytest.raises(ckpttool.CkptError, match=re.escape(want)):
            ckpttool.read(tmp_path)
    else:
        assert list(ckpttool.load(tmp_path)) == want
