"""The format registry (formats/__init__.py): formats told by content, never by extension;
which file of a folder is the checkpoint; trees built with the garbage collector paused."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import (
    assert_identical,
    fixture_path,
    small_state_dict,
    write_hf_shards,
)
from safetensors.torch import save_file

import ckpttool


@pytest.mark.parametrize(
    "name,writer,fmt",
    [
        ("x.pt", "safetensors", "safetensors"),
        ("x.bin", "zip", "torch-zip"),
        ("checkpoint", "zip", "torch-zip"),
        ("weights.safetensors", "legacy", "torch-legacy"),
        ("noext", "legacy", "torch-legacy"),
        ("model.json", "zip", "torch-zip"),
    ],
)
def test_format_is_detected_from_content_not_extension(tmp_path, name, writer, fmt):
    sd = small_state_dict()
    path = tmp_path / name
    if writer == "safetensors":
        save_file(sd, path)
    else:
        torch.save(sd, path, _use_new_zipfile_serialization=writer == "zip")
    assert ckpttool.read(path).format == fmt
    loaded = ckpttool.load(path)
    assert_identical(loaded, sd) if writer != "safetensors" else assert_identical(
        loaded, {k: sd[k] for k in loaded}
    )


def test_folder_with_exactly_one_checkpoint_file_is_read(tmp_path):
    sd = small_state_dict()
    torch.save(sd, tmp_path / "only.pth")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    ckpt = ckpttool.read(tmp_path)
    assert ckpt.format == "torch-zip" and ckpt.files == [str(tmp_path / "only.pth")]


def test_hf_folder_with_both_serializations_reads_the_safetensors(tmp_path):
    """A model repo often holds the same weights as safetensors and as .bin; like
    ``from_pretrained``, the safetensors copy is read (sharded or single file)."""
    sd = small_state_dict()
    sharded = tmp_path / "sharded"
    write_hf_shards(sharded, sd, "zip")
    write_hf_shards(sharded, sd, "safetensors")
    ckpt = ckpttool.read(sharded)
    assert ckpt.format == "safetensors-sharded"
    assert ckpt.files[0] == str(sharded / "model.safetensors.index.json")
    single = tmp_path / "single"
    single.mkdir()
    torch.save(sd, single / "pytorch_model.bin")
    save_file(sd, single / "model.safetensors")
    (single / "config.json").write_text("{}")
    assert ckpttool.read(single).files == [str(single / "model.safetensors")]
    (single / "model.safetensors").rename(single / "other.pt")
    (single / "pytorch_model.bin").rename(single / "weights.bin")  # no HF names: ambiguous
    with pytest.raises(ckpttool.SeveralCheckpointsError, match="holds 2 checkpoints") as raised:
        ckpttool.read(single)
    assert sorted(raised.value.candidates) == ["other.pt", "weights.bin"]  # newest last


def test_trainer_checkpoint_folder_reads_its_weights(tmp_path):
    """HF Trainer's checkpoint-N/ keeps pytorch_model.bin beside optimizer.pt,
    scheduler.pt, rng_state.pth and training_args.bin: the folder is its weights, the
    files a resume reads its other parts (tests/test_formats_run_folders.py, on real ones)."""
    sd = small_state_dict()
    folder = tmp_path / "checkpoint-500"
    folder.mkdir()
    torch.save(sd, folder / "pytorch_model.bin")
    torch.save({"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}, folder / "optimizer.pt")
    torch.save({"last_epoch": 500, "base_lrs": [0.1]}, folder / "scheduler.pt")
    torch.save({"cpu": torch.random.get_rng_state()}, folder / "rng_state.pth")
    torch.save({"output_dir": "out", "seed": 42}, folder / "training_args.bin")
    (folder / "trainer_state.json").write_text("{}")
    ckpt = ckpttool.read(folder)
    assert ckpt.files == [str(folder / n) for n in ["pytorch_model.bin", "optimizer.pt",
                          "rng_state.pth", "scheduler.pt"]]  # fmt: skip
    assert ckpt.model_path == ("pytorch_model",)
    loaded = ckpttool.load(folder)
    assert list(loaded) == list(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_folder_of_one_checkpoints_rank_files_is_read_as_that_checkpoint(tmp_path):
    """``ckpttool inspect ckpt_dir/``: a folder holding the rank files of one checkpoint."""
    composer = fixture_path("composer")
    ckpt = ckpttool.read(composer)
    assert ckpt.format == "per-rank" and ckpt.world_size == 2
    assert ckpt.files == [str(composer / f"ep0-ba4-rank{r}.pt") for r in (0, 1)]
    assert_identical(
        ckpttool.load(composer, select="all"),
        ckpttool.load(ckpt.files, select="all"),
        ordered=False,
        exact_types=False,
    )
    # DDP rank files are full copies: the folder reads as the lowest rank's file
    ddp = tmp_path / "ddp"
    shutil.copytree(fixture_path("ddp"), ddp)
    (ddp / "notes.txt").write_text("not a checkpoint")
    ckpt = ckpttool.read(ddp)
    assert ckpt.format == "torch-zip" and ckpt.files == [str(ddp / "ep0-rank0.pt")]
    # a trainer's snapshot folder holds several checkpoints: which one is not guessed
    # (tests/test_folders.py: `inspect` lists them)
    shutil.copy(ddp / "ep0-rank1.pt", ddp / "ep1-rank1.pt")
    shutil.copy(ddp / "ep0-rank0.pt", ddp / "ep1-rank0.pt")
    with pytest.raises(ckpttool.CkptError, match=r"holds 2 checkpoints \(ep0-rank\*.pt, ep1-"):
        ckpttool.read(ddp)


def test_several_full_copies_are_not_per_rank(tmp_path):
    for r in (0, 1):
        torch.save({"MODEL_STATE": small_state_dict()}, tmp_path / f"ep0-rank{r}.pt")
    with pytest.raises(ckpttool.CkptError, match=r"full cop(y|ies).*pass just one"):
        ckpttool.read([str(tmp_path / "ep0-rank0.pt"), str(tmp_path / "ep0-rank1.pt")])
    # one DDP rank file alone is an ordinary torch-zip checkpoint
    assert ckpttool.read(tmp_path / "ep0-rank0.pt").format == "torch-zip"


@pytest.mark.parametrize("enabled", [True, False])
def test_trees_are_built_with_the_garbage_collector_paused(tmp_path, enabled):
    """No collections while a tree is built; the caller's setting comes back, even on error."""
    import gc

    # thousands of containers: with GC on, building them would trigger collections
    torch.save(
        {f"step{i}": {"lr": 0.1, "betas": [0.9, 0.99]} for i in range(5000)}, tmp_path / "ok.pt"
    )
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 not really a zip")
    collections = []

    def record(phase, info):
        collections.append(phase)

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        ckpttool.read(str(tmp_path / "ok.pt"))  # imports done: they allocate too
        gc.callbacks.append(record)
        assert len(ckpttool.read(str(tmp_path / "ok.pt")).root) == 5000
        # none while the tree is built, at most one once the collector is back on
        assert collections.count("start") <= (1 if enabled else 0)
        assert gc.isenabled() is enabled
        with pytest.raises(ckpttool.CkptError):
            ckpttool.read(str(tmp_path / "bad.pt"))
        assert gc.isenabled() is enabled
    finally:
        if record in gc.callbacks:
            gc.callbacks.remove(record)
        gc.enable() if was else gc.disable()
