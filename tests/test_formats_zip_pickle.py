"""The zip of torch.save and torch.jit.save (formats/zip_pickle.py): its central directory
and the file spans its entries are read through."""

from __future__ import annotations

import pytest
import torch
from helpers import fixture_path

import ckpttool


def test_central_directory_names_every_entry_with_and_without_zip64(monkeypatch, tmp_path):
    """TorchScript is told from torch.save by entry names, read from the raw central
    directory (found through the zip64 end record when there is one)."""
    import zipfile

    from ckpttool.formats.torch_save.zip_pickle import central_directory
    from ckpttool.merge import merge
    from ckpttool.writers import torch_zip

    torch.save({"a": torch.ones(3), "b": torch.zeros(2)}, tmp_path / "plain.pt")
    monkeypatch.setattr(torch_zip, "_ZIP64_LIMIT", 10)
    merge(str(tmp_path / "plain.pt"), str(tmp_path / "zip64.pt"))
    assert b"PK\x06\x06" in (tmp_path / "zip64.pt").read_bytes()
    for name in ("plain.pt", "zip64.pt"):
        directory = central_directory(str(tmp_path / name))
        names = zipfile.ZipFile(tmp_path / name).namelist()
        assert all(n.encode() in directory for n in names), name
        assert ckpttool.read(str(tmp_path / name)).format == "torch-zip"
    assert ckpttool.read(fixture_path("torchscript/model.pt")).format == "torchscript"
    raw = (tmp_path / "plain.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) - 30])
    assert central_directory(str(tmp_path / "cut.pt")) == b""
    # a zip64 locator whose record offset is damaged (past the end, beyond 2**63)
    raw = bytearray((tmp_path / "zip64.pt").read_bytes())
    at = raw.rfind(b"PK\x06\x07")
    raw[at + 8 : at + 16] = (2**63 + 5).to_bytes(8, "little")
    (tmp_path / "bad64.pt").write_bytes(raw)
    assert central_directory(str(tmp_path / "bad64.pt")) == b""
    assert ckpttool.read(str(tmp_path / "bad64.pt")).format == "torch-zip"  # zipfile copes


@pytest.mark.parametrize("length", [1, 100, 4096, 8191, 8192, 8193, 30000])
def test_file_span_reads_any_range_exactly(tmp_path, length):
    """A span serves small reads at its two ends from memory: every range, across
    those edges and between them, must give the file's bytes."""
    import random

    from ckpttool.formats.torch_save.zip_pickle import FileSpan

    data = random.Random(length).randbytes(length + 300)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    start = 150
    want = data[start : start + length]
    span = FileSpan(str(path), start, length)
    try:
        points = sorted(
            {0, 1, length // 2, length - 1, length, 4095, 4096, 4097}
            | {length - 4097, length - 4096, length - 4095}
        )
        points = [p for p in points if 0 <= p <= length]
        for a in points:
            for b in points:
                if a <= b:
                    span.seek(a)
                    assert span.read(b - a) == want[a:b], (a, b)
        span.seek(length - 5)
        assert span.read(100) == want[-5:]  # reads stop at the span's end
        assert span.read(10) == b""
    finally:
        span.close()
