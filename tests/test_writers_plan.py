"""The writers' shared shape: a registry by ``--to``, a plan made from metadata only, and
a write step that writes any part of the plan at its offsets."""

from __future__ import annotations

import hashlib
import os
import random
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpttool
from ckpttool.api.reading import flatten_tensors, select_node
from ckpttool.convert import convert
from ckpttool.dtypes import DTYPES
from ckpttool.errors import CkptError
from ckpttool.merge import merge
from ckpttool.writers import WRITERS, output_file, writer_for
from ckpttool.writers import plan as plan_module
from ckpttool.writers.plan import (
    Plan,
    WriteOptions,
    allocate,
    complete_files,
    write_parts,
    write_plan,
)
from ckpttool.writers.torch_zip import plan as plan_torch


def state() -> dict:
    """A snapshot with the cases a writer lays out differently: a parameter, a view,
    ints, bf16, a 0-d and an empty tensor, odd sizes (offsets that are not aligned)."""
    base = torch.linspace(-3, 3, 7 * 13).reshape(7, 13)
    return {
        "model": {
            "emb.weight": torch.nn.Parameter(torch.arange(33 * 5, dtype=torch.float32).view(33, 5)),
            "fc.weight": base.t(),  # a view: written contiguous
            "fc.bias": torch.arange(7, dtype=torch.int64),
            "norm.weight": torch.linspace(0, 1, 1001).to(torch.bfloat16),
            "big": torch.arange(20011, dtype=torch.float32),  # crosses 8 KiB buffers
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
        },
        "step": 12,
        "opt": {"state": {0: {"exp_avg": torch.ones(3, 3)}}, "lr": [0.1, 0.2]},
    }


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    path = tmp_path / "in.pt"
    torch.save(state(), path)
    return path


@pytest.fixture
def small_buffers(monkeypatch):
    """8 KiB staging buffers: parts start and end inside buffers and blocks."""
    monkeypatch.setattr(output_file, "BUFFER_BYTES", 8192)
    monkeypatch.setattr(output_file, "BUFFERS", 3)


def model_tensors(path: Path) -> dict:
    path_, node = select_node(ckpttool.read(str(path)), "auto", "auto")
    return flatten_tensors(node, str(path_[-1]) if path_ else "")


# (writer, options) for each of the four writers, and merge's nested torch zip
CASES = {
    "safetensors": ("safetensors", WriteOptions(metadata={"source": "in.pt"})),
    "safetensors-shards": ("safetensors", WriteOptions(max_shard_size=2000)),
    "pt": ("pt", WriteOptions(location="cpu")),
    "pt-float16": ("pt", WriteOptions(cast=DTYPES["float16"])),
    "dcp": ("dcp", WriteOptions()),
}


def plan_for(case: str, path: Path) -> Plan:
    if case == "merge":
        return plan_torch(ckpttool.read(str(path)).root, WriteOptions())
    to, options = CASES[case]
    return writer_for(to).plan(model_tensors(path), options)


ALL_CASES = [*CASES, "merge"]


def test_registry_is_keyed_by_the_contracts_to_values_and_every_writer_has_one_surface():
    assert sorted(WRITERS) == ["dcp", "pt", "safetensors"]
    for to in WRITERS:
        writer = writer_for(to)
        assert writer.TO == to
        assert writer.write is plan_module.write  # one write step for every plan
        assert callable(writer.plan) and callable(writer.layout)
    assert writer_for("safetensors").layout(WriteOptions()) is None
    assert writer_for("safetensors").layout(WriteOptions(max_shard_size=10)).kind == (
        "Hugging Face shards"
    )
    assert writer_for("pt").layout(WriteOptions()) is None
    assert writer_for("dcp").layout(WriteOptions()).last == ".metadata"
    with pytest.raises(CkptError, match="unknown --to 'npz'"):
        writer_for("npz")


@pytest.mark.parametrize("case", ALL_CASES)
def test_plan_reads_no_tensor_byte(snapshot: Path, tmp_path: Path, case: str):
    """The input is cut to nothing after its metadata is read: planning still works
    (and lays every file out without gaps), writing then fails on the missing bytes."""
    tensors = model_tensors(snapshot)
    reference = plan_for(case, snapshot)
    if case == "merge":
        root = ckpttool.read(str(snapshot)).root
    os.truncate(snapshot, 0)
    cut = (
        plan_torch(root, WriteOptions())
        if case == "merge"
        else writer_for(CASES[case][0]).plan(tensors, CASES[case][1])
    )
    assert [(f.name, f.size) for f in cut.files] == [(f.name, f.size) for f in reference.files]
    for file in cut.files:
        at = 0
        for piece in file.pieces:
            assert piece.offset == at
            at = piece.end
        assert at == file.size
    expected = 4 * (33 * 5 + 91 + 20011 + 1) + 8 * 7 + 2 * 1001
    if case == "pt-float16":
        expected = 2 * (33 * 5 + 91 + 20011 + 1) + 8 * 7 + 2 * 1001
    if case == "merge":
        expected += 4 * 9
    assert cut.total_bytes == expected
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CkptError):
        write_plan(cut, str(out / "file") if not cut.names else str(out))


def _digests(target: Path) -> dict[str, str]:
    if not target.is_dir():
        return {"": hashlib.sha256(target.read_bytes()).hexdigest()}
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(target.iterdir())}


@pytest.mark.parametrize("case", ALL_CASES)
@pytest.mark.parametrize("max_part", [None, 1, 3000])
def test_parts_in_any_order_give_the_front_to_back_bytes(
    snapshot: Path, tmp_path: Path, small_buffers, case: str, max_part
):
    """Each part written through its own output opened at its offset, in a shuffled
    order, the CRCs and the zip directory filled in after: bitwise the same files."""
    plan = plan_for(case, snapshot)
    folder = bool(plan.names)
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    if folder:
        whole.mkdir()
        parted.mkdir()
    write_plan(plan, str(whole))
    parts = list(plan.parts(max_part))
    random.Random(len(parts)).shuffle(parts)
    allocate(plan, str(parted))
    written = write_parts(parts, str(parted))
    complete_files(plan, str(parted), written)
    assert _digests(parted) == _digests(whole)
    if case.startswith("pt") or case == "merge":
        assert zipfile.ZipFile(parted).testzip() is None  # every CRC right
        loaded = torch.load(parted, weights_only=True)
        expected = state()["model"]
        assert torch.equal(
            (loaded if case != "merge" else loaded["model"])["big"].float(),
            expected["big"].to(torch.float16 if case == "pt-float16" else torch.float32).float(),
        )


# What the writers wrote before they were split into plan and write (sha256 of each
# output of `state()` saved as in.pt): the split must not change a byte.
GOLDEN = {
    "pt": "6f91c6ca9c898c54cd8d13f943c7639ddf6fda89b4bd3aa4c1d1ff520e5ef93c",
    "pt16": "348396f0cb57c167c860af0e7c538923a9c019ab26cdba8b02f4e5f172f82136",
    "st": "0c786fa28ff146c7d1fb035957600c5a87973c3c14c3d9ac396576d3ac5ce497",
    "merge": "8944ab981db97b28e7101a5c93f53c2b37eec1da6306bbb233f5b866b54ac594",
}


def test_outputs_are_byte_for_byte_what_the_one_walk_writers_wrote(snapshot: Path, tmp_path: Path):
    convert([str(snapshot)], "pt", str(tmp_path / "a.pt"))
    convert([str(snapshot)], "pt", str(tmp_path / "h.pt"), dtype="float16")
    convert([str(snapshot)], "safetensors", str(tmp_path / "a.safetensors"))
    merge([str(snapshot)], str(tmp_path / "m.pt"))
    found = {
        name: hashlib.sha256((tmp_path / file).read_bytes()).hexdigest()
        for name, file in [("pt", "a.pt"), ("pt16", "h.pt"), ("st", "a.safetensors"),
                           ("merge", "m.pt")]
    }  # fmt: skip
    assert found == GOLDEN


@contextmanager
def _counting():
    seen: dict[str, int] = {"total": -1, "done": 0}

    def advance(n: int) -> None:
        seen["done"] += n

    @contextmanager
    def factory(total: int, description: str):
        seen["total"] = total
        yield advance

    yield factory, seen


@pytest.mark.parametrize(
    "kwargs",
    [
        {"to": "safetensors"},
        {"to": "safetensors", "max_shard_size": "3KB"},
        {"to": "pt"},
        {"to": "pt", "dtype": "float16"},
        {"to": "dcp"},
        {"to": "pt", "select": "all"},
    ],
    ids=["safetensors", "shards", "pt", "pt-float16", "dcp", "pt-all"],
)
def test_progress_total_is_exactly_the_bytes_reported(snapshot: Path, tmp_path: Path, kwargs):
    with _counting() as (factory, seen):
        result = convert([str(snapshot)], out=str(tmp_path / "out"), progress=factory, **kwargs)
    assert seen["done"] == seen["total"] == result.nbytes > 0


def test_merge_progress_total_counts_sparse_parts_and_storages_as_written(tmp_path: Path):
    """Before the plan, merge's total was the tensors' dense sizes; a sparse tensor
    writes its indices and values, a bare storage its bytes."""
    sparse = torch.sparse_coo_tensor([[0, 5]], [1.0, 2.0], (1000,), check_invariants=True)
    sparse = sparse.coalesce()
    storage = torch.arange(6, dtype=torch.int32).untyped_storage()
    torch.save({"s": sparse, "raw": storage, "w": torch.ones(5)}, tmp_path / "in.pt")
    with _counting() as (factory, seen):
        merge([str(tmp_path / "in.pt")], str(tmp_path / "m.pt"), progress=factory)
    assert seen["done"] == seen["total"] == 2 * 8 + 2 * 4 + 6 * 4 + 5 * 4
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert torch.equal(loaded["s"].to_dense(), sparse.to_dense())


def test_shards_plan_matches_what_loads(snapshot: Path, tmp_path: Path):
    """The shard plan's files are the files written, each loadable, every key once."""
    result = convert([str(snapshot)], "safetensors", str(tmp_path / "hf"), max_shard_size="2KB")
    plan = writer_for("safetensors").plan(
        model_tensors(snapshot), WriteOptions(max_shard_size=2000)
    )
    assert result.files == plan.names == sorted(p.name for p in (tmp_path / "hf").iterdir())
    keys = [k for f in plan.names[:-1] for k in load_file(tmp_path / "hf" / f)]
    assert sorted(keys) == sorted(state()["model"])
