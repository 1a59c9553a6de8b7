"""Megatron-core ``torch_dist`` checkpoints written by megatron-core itself
(fixtures/megatron/, see make_megatron_fixtures.py): read without megatron, every
tensor by its stored name and global shape, equal to megatron's own
``load_plain_tensors``; the ``common.pt`` values shown as values."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import FIXTURES, assert_identical, check_error, run_cli

import ckpttool

MEGATRON = FIXTURES / "megatron"
GPT = MEGATRON / "gpt"
NEMO = MEGATRON / "nemo2" / "model"


def _truth(name: str) -> dict:
    return torch.load(MEGATRON / name, weights_only=True)


def _split(tensors: dict, model_prefix: str = "") -> tuple[dict, dict]:
    """megatron's stored keys: the model's, and the optimizer's without ``optimizer.``."""
    model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    optim = {k.removeprefix("optimizer."): v for k, v in tensors.items() if k not in model}
    return model, optim


def _tensors(state: dict) -> dict:
    """The tensors of a loaded model; its ShardedObjects (a layer's ``_extra_state``,
    ``decoder.layers....linear_fc1._extra_state/shard_0_2``) are values beside them."""
    others = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    assert all("._extra_state/shard_" in k for k in others), others
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_megatron_is_not_installed_here():
    with pytest.raises(ImportError):
        __import__("megatron.core")


def test_gpt_inspect_lists_every_stored_tensor_with_its_global_shape():
    truth = _truth("gpt_truth.pt")
    model, optim = _split(truth["tensors"])
    proc = run_cli("inspect", GPT, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["format"], report["world_size"], report["model_key"]) == (
        "megatron",
        2,
        ["model"],
    )
    assert ckpttool.read(GPT).metadata["sharded_backend"] == "torch_dist"
    shapes = {tuple(t["key"]): t["shape"] for t in report["tensors"]}
    want = {("model", k): list(v.shape) for k, v in model.items()}
    want |= {("optimizer", k): list(v.shape) for k, v in optim.items()}
    want[("optimizer", "state", "common_step")] = []  # common.pt's own tensor
    assert shapes == want
    # stacked along the layer axis, as stored
    assert shapes[("model", "decoder.layers.mlp.linear_fc1.weight")] == [2, 32, 8]
    values = {tuple(v["key"]): v["value"] for v in report["values"]}
    assert values[("iteration",)] == 2
    assert values[("args", "hidden_size")] == 8
    assert values[("args", "ckpt_format")] == "torch_dist"
    assert "megatron.core.enums.ModelType" in report["globals"]


def test_gpt_tensors_equal_megatrons_own_load():
    truth = _truth("gpt_truth.pt")
    model, optim = _split(truth["tensors"])
    loaded = _tensors(ckpttool.load(GPT))
    assert sorted(loaded) == sorted(model)
    assert_identical({k: loaded[k] for k in model}, model, ordered=False, exact_types=False)
    full = ckpttool.load(GPT, select="all")
    assert_identical(
        {k: full["optimizer"][k] for k in optim}, optim, ordered=False, exact_types=False
    )
    assert full["iteration"] == truth["common"]["iteration"]
    assert full["args"]["hidden_size"] == truth["common"]["args"]["hidden_size"]


def test_nemo2_checkpoint_reads_its_weights_folder_with_the_prefix_stripped():
    truth = _truth("nemo2_truth.pt")
    model, _ = _split(truth["tensors"])
    report = json.loads(run_cli("inspect", NEMO, "--json").stdout)
    assert (report["format"], report["model_key"], report["prefix"]) == (
        "megatron",
        ["state_dict"],
        "module.",
    )
    loaded = _tensors(ckpttool.load(NEMO))
    want = {k.removeprefix("module."): v for k, v in model.items()}
    assert sorted(loaded) == sorted(want)
    assert_identical({k: loaded[k] for k in want}, want, ordered=False, exact_types=False)
    # the weights/ folder itself, or one of its .distcp files, reads the same
    assert ckpttool.read(NEMO / "weights" / "__1_0.distcp").format == "megatron"
    assert ckpttool.read(NEMO / "weights" / ".metadata").format == "megatron"
    assert sorted(_tensors(ckpttool.load(NEMO / "weights"))) == sorted(want)


def test_convert_then_diff_is_equal_and_merge_loads_weights_only(tmp_path):
    out = tmp_path / "model.safetensors"
    assert run_cli("convert", GPT, "--to", "safetensors", "-o", out).returncode == 0
    proc = run_cli("diff", GPT, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    merged_path = tmp_path / "merged.pt"
    assert run_cli("merge", GPT, "-o", merged_path).returncode == 0
    merged = torch.load(merged_path, weights_only=True)
    truth = _truth("gpt_truth.pt")
    model, optim = _split(truth["tensors"])
    assert_identical(
        {k: merged["model"][k] for k in model}, model, ordered=False, exact_types=False
    )
    assert_identical(
        {k: merged["optimizer"][k] for k in optim}, optim, ordered=False, exact_types=False
    )
    assert merged["iteration"] == 2 and merged["args"]["num_layers"] == 2


def test_torch_dist_folder_without_common_pt_is_refused_by_name(tmp_path):
    folder = tmp_path / "iter_0000002"
    shutil.copytree(GPT, folder)
    (folder / "common.pt").unlink()
    out = tmp_path / "out.safetensors"
    proc = run_cli("convert", folder, "--to", "safetensors", "-o", out)
    check_error(proc, 2, "common.pt", "without its common.pt")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002"]


def test_zarr_backend_is_named_in_one_line(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "metadata.json").write_text('{"sharded_backend": "zarr", "common_backend": "torch"}')
    (folder / "common.pt").write_bytes((GPT / "common.pt").read_bytes())
    check_error(run_cli("inspect", folder), 2, "'zarr' backend", "reads only 'torch_dist'")


def test_common_pt_that_calls_os_system_is_refused_and_nothing_runs(tmp_path):
    import os

    from payloads import Reduce, write_malicious_zip

    folder = tmp_path / "ckpt"
    shutil.copytree(GPT, folder)
    marker = tmp_path / "fired"
    write_malicious_zip(folder / "common.pt", Reduce(os.system, (f"touch {marker}",)))
    out = tmp_path / "out.safetensors"
    proc = run_cli("convert", folder, "--to", "safetensors", "-o", out)
    check_error(proc, 3, "common.pt", "system")
    assert not marker.exists() and not out.exists()


# ------------------------------------------- the save folder: latest_checkpointed_iteration


@pytest.mark.parametrize("tracker, folder", [("2", "iter_0000002"), ("release", "release")])
def test_save_folder_reads_the_iteration_its_tracker_names(tmp_path, tracker, folder):
    save = tmp_path / "checkpoints"
    save.mkdir()
    shutil.copytree(GPT, save / folder)
    shutil.copytree(GPT, save / "iter_0000001")  # an older one, not named
    (save / "latest_checkpointed_iteration.txt").write_text(tracker + "\n")
    ckpt = ckpttool.read(save)
    assert ckpt.format == "megatron"
    assert ckpt.files == [f.replace(str(GPT), str(save / folder)) for f in ckpttool.read(GPT).files]
    assert_identical(ckpttool.load(save), ckpttool.load(GPT))


def _legacy_rank_file(path):
    """What Megatron-LM's legacy format saves per model-parallel rank."""
    path.parent.mkdir(parents=True)
    embedding = {"word_embeddings": {"weight": torch.ones(4, 2)}}
    encoder = {"layers.0.mlp.dense_h_to_4h.weight": torch.ones(8, 2)}
    model = {"language_model": {"embedding": embedding, "encoder": encoder}}
    torch.save({"model": model, "iteration": 5, "checkpoint_version": 3.0}, path)
    return model


def test_legacy_save_folder_reads_its_one_rank_file(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    rank = tmp_path / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    model = _legacy_rank_file(rank)
    ckpt = ckpttool.read(tmp_path)
    assert (ckpt.format, ckpt.files) == ("torch-zip", [str(rank)])
    assert_identical(ckpttool.load(tmp_path, select="model"), model, exact_types=False)
    _legacy_rank_file(tmp_path / "iter_0000005" / "mp_rank_01" / "model_optim_rng.pt")
    # two ranks are merged from the run's args: without them, what only they say is no guess
    check_error(run_cli("inspect", tmp_path), 2, "mp_rank_00/model_optim_rng.pt: the run's args "
                "do not say whether 'language_model.encoder.layers.0.mlp.dense_h_to_4h.weight' "
                "is SwiGLU's")  # fmt: skip


@pytest.mark.parametrize("tracker", ["../gpt", "7", "-1", "1e3", ""])
def test_tracker_that_names_no_iteration_here_is_not_followed(tmp_path, tracker):
    shutil.copytree(GPT, tmp_path / "iter_0000002")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(tracker)
    # the one iteration beside it is named, never taken instead (`inspect` lists it)
    with pytest.raises(ckpttool.CkptError, match=r"holds a checkpoint in iter_0000002/"):
        ckpttool.read(tmp_path)
