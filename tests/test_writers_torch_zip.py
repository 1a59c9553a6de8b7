"""The torch.save zip writer (writers/torch_zip.py): a zip that zipfile and torch.load (also
mmap) read, data 64-byte aligned, zip64 records past the limit, dtypes torch cannot cast."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import assert_identical, check_error, run_cli

from ckpttool.merge import merge
from ckpttool.writers import torch_zip


@pytest.mark.slow
def test_merged_zip_is_valid_and_aligned(fsdp2: Path, tmp_path: Path):
    """Our own zip writer: every CRC-32 right (zipfile checks them), data 64-byte aligned,
    and torch's mmap loader maps it."""
    out = tmp_path / "m.pt"
    merge(str(fsdp2 / "ep0-ba2-rank*.pt"), str(out))
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None
        names = z.namelist()
        assert names[-5:] == [
            f"archive/{n}"
            for n in ("data.pkl", "byteorder", "version", ".format_version", ".storage_alignment")
        ]
        # 27 tensors over 22 storages: FSDP's Adam keeps one `step` tensor for all six
        # parameters, saved once (torch.save writes it once; so does merge, kept shared)
        assert names[:-5] == [f"archive/data/{i}" for i in range(22)]
    raw = out.read_bytes()
    for info in z.infolist():
        name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
        data_start = info.header_offset + 30 + name_len + extra_len
        if info.filename.startswith("archive/data/"):
            assert data_start % 64 == 0, info.filename
    plain = torch.load(out, weights_only=True)
    mapped = torch.load(out, weights_only=True, mmap=True)
    assert assert_identical(mapped, plain) == 27
    steps = [s["step"] for s in plain["state"]["optimizers"]["Adam"]["state"].values()]
    assert len({t.untyped_storage().data_ptr() for t in steps}) == 1


def test_zip64_records_when_sizes_pass_the_limit(monkeypatch, tmp_path: Path):
    """Sizes and offsets past the zip64 limit (2 GiB, lowered here so the records appear in
    a small file) go to zip64 extra fields and end records that zipfile and torch read."""
    monkeypatch.setattr(torch_zip, "_ZIP64_LIMIT", 100)
    tensors = {f"t{i}": torch.arange(40, dtype=torch.float32) + i for i in range(5)}
    torch.save(tensors, tmp_path / "in.pt")
    merge(str(tmp_path / "in.pt"), str(tmp_path / "out.pt"))
    raw = (tmp_path / "out.pt").read_bytes()
    assert b"PK\x06\x06" in raw and b"PK\x06\x07" in raw  # zip64 end record and locator
    with zipfile.ZipFile(tmp_path / "out.pt") as z:
        assert z.testzip() is None
        assert [i.file_size for i in z.infolist()][:5] == [160] * 5
    assert assert_identical(torch.load(tmp_path / "out.pt", weights_only=True), tensors) == 5


def test_float4_packed_pairs_round_trip_through_pt(tmp_path: Path):
    t = torch.arange(0, 256, 37, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    torch.save({"f4": t, "w": torch.ones(2)}, tmp_path / "in.pt")
    out = tmp_path / "o.pt"
    proc = run_cli("convert", tmp_path / "in.pt", "--to", "pt", "--dtype", "bfloat16", "-o", out)
    assert proc.returncode == 0, proc.stderr
    got = torch.load(out, weights_only=True)
    assert got["f4"].dtype == torch.float4_e2m1fn_x2  # not cast: torch cannot convert it
    assert torch.equal(got["f4"].view(torch.uint8), t.view(torch.uint8))
    assert got["w"].dtype == torch.bfloat16
    proc = run_cli("convert", tmp_path / "in.pt", "--to", "safetensors", "-o", tmp_path / "o.st")
    check_error(proc, 2, "'f4'", "float4_e2m1fn_x2", "safetensors cannot store")
