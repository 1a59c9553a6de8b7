"""Checkpoints written by torch 1.13 (fixtures/torch1/, see make_torch1_fixtures.py):
each reads as torch 2.x's own loaders read it, and the sharded ones merge to the values
the generator recorded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import FIXTURES, assert_identical, check_error, run_cli

import ckpttool

TORCH1 = FIXTURES / "torch1"


def test_fixtures_were_written_by_torch_1():
    assert (TORCH1 / "VERSION").read_text().startswith("1.13")
    # a 1.x zip has no .format_version / byteorder records, which 2.x always writes
    names = __import__("zipfile").ZipFile(TORCH1 / "plain.pt").namelist()
    assert not any(n.endswith((".format_version", "/byteorder")) for n in names)


@pytest.mark.parametrize(
    "name, fmt", [("plain.pt", "torch-zip"), ("legacy.pt", "torch-legacy"),
                  ("snapshot.pt", "torch-zip")],
)  # fmt: skip
def test_single_files_read_as_torch_load_reads_them(name, fmt):
    path = TORCH1 / name
    want = torch.load(path, weights_only=True)
    assert ckpttool.read(path).format == fmt
    got = ckpttool.load(path, select="all")
    assert_identical(got, want, ordered=False, exact_types=False)
    model = want["model"] if "model" in want else want
    assert list(ckpttool.load(path)) == list(model)  # auto: the model, keys in order


def test_snapshot_model_is_found_and_its_tied_weights_kept():
    report = json.loads(run_cli("inspect", "--json", TORCH1 / "snapshot.pt").stdout)
    assert report["model_key"] == ["model"] and report["prefix"] is None
    assert report["values"][-1] == {"key": ["epoch"], "type": "int", "value": 3}
    sd = ckpttool.load(TORCH1 / "snapshot.pt")
    assert torch.equal(sd["emb.weight"], sd["head.weight"])


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_torchscript_of_torch_1_lists_what_jit_load_gives():
    path = TORCH1 / "scripted.pt"
    want = torch.jit.load(path).state_dict()
    assert ckpttool.read(path).format == "torchscript"
    got = ckpttool.load(path)
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_per_rank_sharded_tensors_of_torch_1_merge(tmp_path):
    """Composer layout, 5 rows over 2 ranks and a 1-row tensor (rank 1 holds nothing)."""
    expected = torch.load(TORCH1 / "expected.pt", weights_only=True)
    ckpt = ckpttool.read(TORCH1 / "ep0-ba20-rank1.pt")  # siblings found from one rank's file
    assert (ckpt.format, ckpt.world_size) == ("per-rank", 2)
    out = tmp_path / "merged.pt"
    proc = run_cli("merge", TORCH1 / "ep0-ba20-rank*.pt", "-o", out)
    assert proc.returncode == 0, proc.stderr
    merged = torch.load(out, weights_only=True)
    model = merged["state"]["model"]
    assert list(model) == ["module.w", "module.b", "module.tiny", "module.rep"]
    for key in ("w", "b", "tiny"):
        assert torch.equal(model[f"module.{key}"], expected[key]), key
    assert torch.equal(model["module.rep"], torch.arange(4.0))
    adam = merged["state"]["optimizers"]["Adam"]
    assert torch.equal(adam["state"]["module.w"]["exp_avg"], expected["exp_avg"])
    assert adam["param_groups"] == [{"lr": 0.1, "params": ["module.w"]}]
    assert merged["state"]["timestamp"] == {"epoch": 0, "batch": 20}


def test_dcp_of_torch_1_reads_its_prototype_metadata():
    """DCP from ``torch.distributed._shard.checkpoint``: other class paths, no planner
    data, file names from the plan index."""
    expected = torch.load(TORCH1 / "expected.pt", weights_only=True)
    ckpt = ckpttool.read(TORCH1 / "dcp")
    assert (ckpt.format, ckpt.world_size) == ("dcp", 2)
    got = ckpttool.load(TORCH1 / "dcp", select="all")
    assert list(got) == ["w", "b", "tiny", "rep", "step"]
    for key in ("w", "b", "tiny"):
        assert torch.equal(got[key], expected[key]), key
    assert torch.equal(got["rep"], torch.arange(4.0)) and got["step"] == 5


def test_dcp_value_holding_one_ranks_shards_is_shown_and_refused_by_name(tmp_path):
    """torch 1.13's DCP pickled a nested dict whole, from rank 0 alone: its
    ShardedTensor has rank 0's rows only. inspect shows it as a sharded tensor;
    whatever needs its data names it; the rest of the checkpoint still reads."""
    folder = tmp_path / "dcp_nested"
    shutil.copytree(TORCH1 / "dcp_nested", folder)
    report = json.loads(run_cli("inspect", "--json", folder).stdout)
    w = next(t for t in report["tensors"] if t["key"] == ["model", "w"])
    assert (w["shape"], w["sharded"]) == ([5, 3], True)
    proc = run_cli("inspect", "--json", "--stats", folder)  # the others still get numbers
    stats = {tuple(t["key"]): t["stats"] for t in json.loads(proc.stdout)["tensors"]}
    assert stats[("model", "w")]["mean"] is None and stats[("model", "rep")]["mean"] == 1.5
    out = tmp_path / "out.safetensors"
    for args in (("convert", folder, "--to", "safetensors", "--select", "all", "-o", out),
                 ("merge", folder, "-o", out.with_suffix(".pt")),
                 ("diff", folder, folder)):  # fmt: skip
        check_error(run_cli(*args), 2, "w' holds rank 0's shards only (9 of 15 elements)")
        assert not out.exists()
    with pytest.raises(ckpttool.CkptError, match="'model.w' holds rank 0's shards only"):
        ckpttool.load(folder, select="all")
    assert torch.equal(ckpttool.load(folder, select="model.rep"), torch.arange(4.0))
