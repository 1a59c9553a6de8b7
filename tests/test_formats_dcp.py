"""``dcp`` (formats/dcp.py): torch.distributed.checkpoint folders, from one process and from
torchrun runs, with torch's and the safetensors serialization."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import (
    FIXTURES,
    assert_identical,
    check_error,
    run_cli,
    sha256,
    small_state_dict,
    write_dcp,
)

import ckpttool
from ckpttool.inspection import inspect_report


def test_dcp_single_process(tmp_path):
    sd = small_state_dict()
    write_dcp(tmp_path / "ckpt", {"model": sd, "epoch": 4, "name": "run"})
    ckpt = ckpttool.read(tmp_path / "ckpt")
    assert ckpt.format == "dcp"
    assert ckpt.files[0] == str(tmp_path / "ckpt" / ".metadata")
    everything = ckpttool.load(tmp_path / "ckpt", select="all")
    assert everything["epoch"] == 4 and everything["name"] == "run"
    assert_identical({k: everything["model"][k] for k in sd}, sd)
    assert sorted(everything["model"]) == sorted(sd)


@pytest.mark.slow
def test_dcp_two_ranks(dist_runs, dist_reference):
    path = dist_runs.two / "dcp"
    ckpt = ckpttool.read(path)
    assert ckpt.format == "dcp"
    assert ckpt.world_size == 2
    assert sorted(ckpt.files[1:]) == [str(path / "__0_0.distcp"), str(path / "__1_0.distcp")]
    everything = ckpttool.load(path, select="all")
    assert everything["step"] == 7
    full = dist_reference["two"]
    assert_identical({k: everything["model"][k] for k in full["model"]}, full["model"])
    assert_identical(
        everything["optim"]["state"], full["optim"]["state"], ordered=False, exact_types=False
    )
    assert_identical(ckpttool.load(path), full["model"])  # auto: the model state dict
    report = inspect_report(ckpt)
    weight = next(t for t in report["tensors"] if t["key"] == ["model", "0.weight"])
    assert weight == {
        "key": ["model", "0.weight"],
        "dtype": "float32",
        "shape": [5, 4],
        "device": "cpu",
        "nbytes": 80,
        "sharded": True,
        "shards": 2,
        "file": None,  # its shards lie in both ranks' files
    }


@pytest.mark.slow
def test_dcp_tuple_holding_one_ranks_dtensor_block(dist_runs, tmp_path):
    """DCP does not flatten a tuple: rank 0 pickles it whole, with its own block of the
    DTensor in it. inspect shows the global tensor; reading it is refused by name."""
    folder = dist_runs.mesh / "dcp-tuple"
    report = inspect_report(ckpttool.read(folder))
    pair = next(t for t in report["tensors"] if t["key"] == ["pair", 0])
    assert (pair["shape"], pair["sharded"]) == ([5, 6], True)
    out = tmp_path / "out.pt"
    check_error(run_cli("merge", folder, "-o", out), 2,
                "tensor 'pair.0' holds rank 0's shards only (9 of 30 elements)")  # fmt: skip
    assert not out.exists()
    assert ckpttool.load(folder, select="step") == 1


def test_distcp_file_without_its_metadata_is_refused(tmp_path):
    write_dcp(tmp_path / "ckpt", {"w": torch.ones(3)})
    (tmp_path / "ckpt" / ".metadata").unlink()
    check_error(run_cli("inspect", tmp_path / "ckpt" / "__0_0.distcp"), 2, "has no .metadata")


@pytest.mark.slow
@pytest.mark.parametrize("run, given", [("two", "dcp"), ("mesh", "dcp-safetensors")])
@pytest.mark.parametrize("part", ["__1_0.distcp", ".metadata"])
def test_one_file_of_a_dcp_folder_reads_its_folder(dist_runs, run, given, part):
    folder = getattr(dist_runs, run) / given
    ckpt = ckpttool.read(folder / part)
    assert ckpt.format == "dcp"
    assert ckpt.files == ckpttool.read(folder).files
    assert_identical(ckpttool.load(folder / part), ckpttool.load(folder))


def test_a_metadata_file_without_its_data_files_is_refused(tmp_path):
    write_dcp(tmp_path / "ckpt", {"w": torch.ones(3)})
    (tmp_path / "ckpt" / "__0_0.distcp").unlink()
    out = tmp_path / "o.safetensors"
    given = tmp_path / "ckpt" / ".metadata"
    check_error(
        run_cli("convert", given, "--to", "safetensors", "-o", out),
        2,
        "__0_0.distcp: missing: the checkpoint names this file (incomplete copy?)",
    )
    assert not out.exists()


@pytest.mark.slow
def test_dcp_safetensors_blob_that_lacks_a_chunk_is_refused(dist_runs, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(dist_runs.mesh / "dcp-safetensors", folder)
    distcp = folder / "__0_0.distcp"
    data = distcp.read_bytes()
    name = b'"model.lin.weight"'
    assert data.count(name) == 1  # the header's key (DCP_SHARDING_INFO escapes its quotes)
    distcp.write_bytes(data.replace(name, b'"model.lin.weighs"'))
    check_error(
        run_cli("convert", folder, "--to", "safetensors", "-o", tmp_path / "o.safetensors"),
        2,
        "holds no chunk of 'model.lin.weight' at [0, 0]",
    )
    assert not (tmp_path / "o.safetensors").exists()


def _rewrite_metadata(folder, edit) -> None:
    """``edit(metadata)`` applied to the DCP ``.metadata`` of ``folder``, as torch reads it."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    edit(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("how", ["shared", "negative", "float"])
def test_storage_entries_must_have_bytes_of_their_own(tmp_path, how):
    # one chunk's bytes named by a thousand entries made a 364 KB folder a 256 MiB output
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp", folder)

    def edit(metadata):
        first, second = list(metadata.storage_data)[:2]
        info = metadata.storage_data[first]
        if how == "shared":
            metadata.storage_data[second] = info
        else:
            object.__setattr__(info, "offset", -1 if how == "negative" else 0.5)

    _rewrite_metadata(folder, edit)
    digest = sha256(folder)
    out = tmp_path / "out"
    out.mkdir()
    message = (
        "other entries name the bytes of"
        if how == "shared"
        else "corrupt DCP .metadata: the stored span of"
    )
    check_error(run_cli("convert", folder, "--to", "pt", "-o", out / "x.pt"), 2, message)
    assert list(out.iterdir()) == [] and sha256(folder) == digest
    with pytest.raises(ckpttool.CkptError, match=message):
        ckpttool.load(folder)


def test_list_index_past_the_entries_is_refused(tmp_path):
    # a key path (optimizer.param_groups.0.lr) whose 0 became 1,000,000: 12 KB of
    # .metadata made a list of a million holes (14 s and 870 MB for inspect)
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp", folder)

    def edit(metadata):
        fqn, path = next((k, p) for k, p in metadata.planner_data.items() if 0 in p)
        metadata.planner_data[fqn] = tuple(1_000_000 if part == 0 else part for part in path)

    _rewrite_metadata(folder, edit)
    check_error(run_cli("inspect", folder), 2, "list index 1000000 in a key path")
    with pytest.raises(ckpttool.CkptError, match="list index 1000000"):
        ckpttool.load(folder, select="all")
