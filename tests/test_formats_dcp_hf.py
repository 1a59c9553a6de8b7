"""``dcp`` as HuggingFaceStorageWriter(save_distributed=True) writes it (formats/dcp_hf.py):
each rank's blocks in safetensors files placed by DCP_SHARDING_INFO."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import assert_identical, check_error, run_cli
from safetensors.torch import load_file

import ckpttool


@pytest.mark.slow
@pytest.mark.parametrize("given", ["hf-dist", "hf-dist2", "one-file"])
def test_hf_storage_writer_distributed_shards(dist_runs, given):
    """HuggingFaceStorageWriter(save_distributed=True): each rank's blocks in its own
    ``shard-R-model-K-of-N.safetensors``, placed by DCP_SHARDING_INFO, no .metadata or
    index. Given one of its files, the folder is read (a block alone is not the tensor)."""
    folder = dist_runs.mesh / ("hf-dist" if given == "one-file" else given)
    one = folder / "shard-00003-model-00001-of-00001.safetensors"
    path = one if given == "one-file" else folder
    ckpt = ckpttool.read(path)
    assert (ckpt.format, ckpt.world_size) == ("dcp", 4)
    assert ckpt.files == sorted(str(p) for p in folder.glob("shard-*.safetensors"))
    full = torch.load(dist_runs.mesh / "full.pt", weights_only=True)["model"]
    assert {k: v.shape for k, v in ckpt.root.items()} == {k: v.shape for k, v in full.items()}
    assert len(ckpt.root["lin.weight"].shards) == 4  # replicated blocks were written once
    assert len(ckpt.root["lin.bias"].shards) == 2
    assert_identical(ckpttool.load(path), full)


@pytest.mark.slow
def test_hf_distributed_shards_with_a_rank_missing(dist_runs, tmp_path):
    for file in (dist_runs.mesh / "hf-dist").glob("shard-*.safetensors"):
        if not file.name.startswith("shard-00004"):
            shutil.copy(file, tmp_path)
    check_error(run_cli("inspect", tmp_path), 2, "'lin.weight'", "a rank file is missing?")


@pytest.mark.slow
def test_hf_distributed_shard_with_damaged_sharding_info(dist_runs, tmp_path):
    """No file of the folder may be read without the damaged one, nor the damaged one alone."""
    import struct

    folder = tmp_path / "ckpt"
    shutil.copytree(dist_runs.mesh / "hf-dist", folder)
    bad = folder / "shard-00003-model-00001-of-00001.safetensors"
    data = bad.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["DCP_SHARDING_INFO"] = "{not json"
    raw = json.dumps(header).encode().ljust(n)  # same length: the data does not move
    assert len(raw) == n
    bad.write_bytes(data[:8] + raw + data[8 + n :])
    for given in (folder, folder / "shard-00001-model-00001-of-00001.safetensors", bad):
        check_error(run_cli("inspect", given), 2, str(bad), "corrupt DCP_SHARDING_INFO")


@pytest.mark.slow
def test_one_dcp_data_file_converts_to_a_file_named_after_its_folder(dist_runs, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(dist_runs.mesh / "hf-dist", folder)
    proc = run_cli("convert", folder / "shard-00002-model-00001-of-00001.safetensors",
                   "--to", "safetensors")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    full = torch.load(dist_runs.mesh / "full.pt", weights_only=True)["model"]
    assert_identical(load_file(tmp_path / "ckpt.safetensors"), full)
