"""Hugging Face sharded checkpoints (formats/sharded_index.py): an ``*.index.json`` and its
shards, safetensors or torch.save."""

from __future__ import annotations

import json

import pytest
from helpers import assert_identical, check_error, run_cli, small_state_dict, write_hf_shards

import ckpttool


@pytest.fixture
def sharded_safetensors(tmp_path):
    """A Hugging Face style folder: two shards and model.safetensors.index.json."""
    sd = small_state_dict()
    write_hf_shards(tmp_path / "hf", sd)
    return tmp_path / "hf", sd


@pytest.mark.parametrize("via", ["index", "folder"])
def test_sharded_safetensors(sharded_safetensors, via):
    folder, sd = sharded_safetensors
    path = folder / "model.safetensors.index.json" if via == "index" else folder
    ckpt = ckpttool.read(path)
    assert ckpt.format == "safetensors-sharded"
    assert ckpt.files[0] == str(folder / "model.safetensors.index.json")
    assert sorted(ckpt.files[1:]) == sorted(str(p) for p in folder.glob("*.safetensors"))
    assert_identical(ckpttool.load(path), sd)


def test_sharded_safetensors_missing_shard(sharded_safetensors):
    folder, _ = sharded_safetensors
    (folder / "model-00002-of-00002.safetensors").unlink()
    check_error(run_cli("inspect", folder), 2, "missing shard model-00002-of-00002.safetensors")


@pytest.mark.parametrize("shard_format,fmt", [("zip", "torch-zip"), ("legacy", "torch-legacy")])
@pytest.mark.parametrize("via", ["index", "folder"])
def test_sharded_torch_bin(tmp_path, shard_format, fmt, via):
    """``pytorch_model.bin.index.json`` + torch.save shards: one checkpoint, the shards' format."""
    sd = small_state_dict()
    index = write_hf_shards(tmp_path / "hf", sd, shard_format)
    ckpt = ckpttool.read(index if via == "index" else index.parent)
    assert ckpt.format == fmt
    assert ckpt.files == [str(index)] + [
        str(index.parent / f"pytorch_model-0000{i}-of-00002.bin") for i in (1, 2)
    ]
    assert list(ckpt.root) == list(sd)
    assert "torch._utils._rebuild_tensor_v2" in ckpt.globals and ckpt.dangerous == []
    assert_identical(ckpttool.load(index), sd)
    out = tmp_path / "one.safetensors"
    assert run_cli("convert", index.parent, "--to", "safetensors", "-o", out).returncode == 0
    assert_identical(ckpttool.load(out), sd)


def test_sharded_torch_bin_tensor_missing_from_its_shard(tmp_path):
    index = write_hf_shards(tmp_path / "hf", small_state_dict(), "zip")
    data = json.loads(index.read_text())
    data["weight_map"]["extra.weight"] = "pytorch_model-00001-of-00002.bin"
    index.write_text(json.dumps(data))
    check_error(
        run_cli("inspect", index),
        2,
        "'extra.weight' is not in pytorch_model-00001-of-00002.bin",
    )
