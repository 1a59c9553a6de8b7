"""``safetensors`` (formats/safetensors_file.py): one safetensors file."""

from __future__ import annotations

from helpers import assert_identical, tricky_tensors
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
