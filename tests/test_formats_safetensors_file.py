"""``safetensors`` (formats/safetensors_file.py): one safetensors file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import FIXTURES, assert_identical, check_error, run_cli, tricky_tensors
from safetensors.torch import save_file

import ckpttool


def test_safetensors_file(tmp_path):
    original = {k: v for k, v in tricky_tensors().items() if k not in ("lm_head.weight",)}
    original = {k: v.contiguous() for k, v in original.items()}
    path = tmp_path / "model.safetensors"
    save_file(original, path, metadata={"format": "pt", "note": "hi"})
    ckpt = ckpttool.read(path)
    assert ckpt.format == "safetensors"
    assert ckpt.metadata == {"format": "pt", "note": "hi"}
    assert ckpt.globals == [] and ckpt.dangerous == []
    assert_identical(ckpttool.load(path), {k: original[k] for k in ckpt.root})
    assert sorted(ckpt.root) == sorted(original)


def _with_entry(tmp_path: Path, name: str, entry: dict) -> Path:
    """The committed fixture with one more header entry, its bytes after the others'."""
    data = (FIXTURES / "safetensors" / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]
    header[name] = {**entry, "data_offsets": [len(body), len(body)]}
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body)
    return path


@pytest.mark.parametrize("shape", [[0, 2**64], [0, 2**62, 4]], ids=["dim", "stride"])
def test_empty_tensor_whose_shape_torch_cannot_hold_is_refused(tmp_path, shape):
    # no bytes to check it against: an output naming it would not load in torch
    path = _with_entry(tmp_path, "empty", {"dtype": "F32", "shape": shape})
    out = tmp_path / "out"
    out.mkdir()
    for to in ("pt", "safetensors"):
        proc = run_cli("convert", path, "--to", to, "-o", out / f"x.{to}")
        check_error(proc, 2, "'empty'", "impossible shape")
    assert list(out.iterdir()) == []
    with pytest.raises(ckpttool.CkptError, match="impossible shape"):
        ckpttool.load(path)
