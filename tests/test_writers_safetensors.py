"""The safetensors writer (writers/safetensors.py): one file or Hugging Face shards plus their
index, the dtypes safetensors has codes for, and a refusal before writing for the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_identical,
    check_error,
    run_cli,
    safetensors_header,
    shard_source,
    tree_files,
)
from safetensors import safe_open
from safetensors.torch import load_file

import ckpttool
from ckpttool.convert import convert
from ckpttool.errors import CkptError


@pytest.mark.parametrize(
    ("size", "plan"),
    [
        # greedy in key order; a tensor over the limit (a, e, g, h at 100 B) sits alone
        ("100", [["a"], ["b", "c", "d"], ["e"], ["f"], ["g"], ["h"]]),
        ("1KB", [["a", "b", "c", "d"], ["e"], ["f", "g"], ["h"]]),  # 1000 bytes
        ("1KiB", [["a", "b", "c", "d"], ["e"], ["f", "g", "h"]]),  # 1024 bytes
    ],
)
def test_max_shard_size_writes_hf_shards(tmp_path: Path, size, plan):
    source = shard_source()
    torch.save(source, tmp_path / "w.pt")
    out = tmp_path / "shards"
    result = convert([str(tmp_path / "w.pt")], "safetensors", str(out), max_shard_size=size)
    n = len(plan)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert result.files == [*names, "model.safetensors.index.json"]
    assert tree_files(out) == sorted(result.files)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == {
        "metadata": {"total_size": 2424},
        "weight_map": {k: names[i] for i, keys in enumerate(plan) for k in keys},
    }
    assert list(index["weight_map"]) == list(source)
    merged = {}
    for name, keys in zip(names, plan, strict=True):
        header = safetensors_header(out / name)
        assert header.pop("__metadata__") == {"format": "pt", "source": "w.pt"}
        assert list(header) == keys
        shard = load_file(out / name)
        assert sorted(shard) == sorted(keys)
        with safe_open(out / name, "pt") as f:
            for k in keys:
                assert torch.equal(f.get_tensor(k), source[k])
        merged.update(shard)
    assert_identical({k: merged[k] for k in source}, source)
    assert_identical(ckpttool.load(str(out)), source)  # and ckpttool reads the folder back


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["complex32", "complex128", "qint8"])
def test_dtype_safetensors_cannot_store_refused_before_writing(tmp_path: Path, kind):
    ok = torch.randn(3)
    if kind.startswith("complex"):
        odd = torch.randn(4, dtype=torch.complex64).to(getattr(torch, kind))
    else:
        odd = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    torch.save({"a.ok": ok, "b.odd": odd, "c.ok": ok * 2}, tmp_path / "odd.pt")
    proc = run_cli("convert", tmp_path / "odd.pt", "--to", "safetensors", "-o", tmp_path / "o")
    check_error(proc, 2, "'b.odd'", kind, "safetensors cannot store")
    assert tree_files(tmp_path) == ["odd.pt"]
    with pytest.raises(CkptError, match=kind):
        convert([str(tmp_path / "odd.pt")], "safetensors", str(tmp_path / "o"), force=True)
    assert tree_files(tmp_path) == ["odd.pt"]


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("__metadata__", "the safetensors header's own entry"),  # it replaced the metadata
        ("w\ud800", "not valid Unicode"),  # written as an escape no safetensors reader takes
    ],
)
@pytest.mark.parametrize("shard", [False, True])
def test_names_safetensors_cannot_hold_refused_before_writing(tmp_path: Path, name, needle, shard):
    """Names come from the input: one a pickle holds may be no safetensors key."""
    torch.save({"a": torch.ones(2), name: torch.ones(3)}, tmp_path / "odd.pt")
    sharding = ["--max-shard-size", "1KB"] if shard else []
    out = tmp_path / "o"
    proc = run_cli("convert", tmp_path / "odd.pt", "--to", "safetensors", "-o", out, *sharding)
    check_error(proc, 2, needle)
    assert tree_files(tmp_path) == ["odd.pt"]
    proc = run_cli("convert", tmp_path / "odd.pt", "--to", "pt", "-o", tmp_path / "o.pt")
    assert proc.returncode == 0, proc.stderr  # a torch file holds any name
    assert list(torch.load(tmp_path / "o.pt", weights_only=True)) == ["a", name]


def test_an_undecodable_input_name_makes_valid_metadata(tmp_path: Path):
    """The output's metadata names its input; a file name's byte that is no UTF-8 (a
    lone surrogate in Python) was written as an escape the library refused."""
    name = b"\xffmodel.pt".decode("utf-8", "surrogateescape")
    torch.save({"w": torch.ones(2)}, tmp_path / name)
    out = tmp_path / "o.safetensors"
    convert([str(tmp_path / name)], "safetensors", str(out))
    with safe_open(out, "pt") as f:
        assert f.metadata()["source"] == "\\udcffmodel.pt"
        assert torch.equal(f.get_tensor("w"), torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.complex64])
def test_dtypes_safetensors_has_codes_for_round_trip(tmp_path: Path, dtype):
    t = torch.randn(5, dtype=torch.complex64 if dtype.is_complex else torch.float32).to(dtype)
    torch.save({"t": t}, tmp_path / "in.pt")
    out = tmp_path / "o.safetensors"
    assert run_cli("convert", tmp_path / "in.pt", "--to", "safetensors", "-o", out).returncode == 0
    got = load_file(out)["t"]
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
