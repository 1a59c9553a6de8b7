"""``--force`` never replaces a file that is not a checkpoint, even when ``-o`` names it:
``-o notes.txt --force`` is refused (exit 2, one line) and notes.txt stays as it was;
a checkpoint ckpttool could have written (safetensors, a torch.save file) is replaced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import check_error, completed, run_many
from safetensors.torch import load_file, save_file

from ckpttool.convert import convert
from ckpttool.errors import CkptError

WEIGHTS = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
REFUSED = (
    "output exists and is not a checkpoint; --force replaces only what ckpttool writes "
    "(safetensors, torch.save files) (move it away or choose another -o)"
)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.pt"
    torch.save(WEIGHTS, path)
    return path


def test_force_refuses_a_file_that_is_not_a_checkpoint(model: Path, tmp_path: Path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    legacy = tmp_path / "old.pt"  # a checkpoint, but one ckpttool never writes
    torch.save(WEIGHTS, legacy, _use_new_zipfile_serialization=False)
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    kept = {p: p.read_bytes() for p in (notes, legacy, empty)}
    runs = run_many(
        [
            ["convert", model, "--to", "safetensors", "-o", notes, "--force"],
            ["convert", model, "--to", "pt", "-o", notes, "--force"],
            ["merge", model, "-o", notes, "--force"],
            ["convert", model, "--to", "pt", "-o", legacy, "--force"],
            ["convert", model, "--to", "safetensors", "-o", empty, "--force"],
            ["convert", model, "--to", "safetensors", "-o", notes],  # no --force: as before
        ]
    )
    for run, path in zip(runs[:5], [notes, notes, notes, legacy, empty], strict=True):
        assert check_error(completed([], run), 2) == f"ckpttool: error: {path}: {REFUSED}"
    check_error(completed([], runs[5]), 2, f"ckpttool: error: {notes}: output exists")
    assert {p: p.read_bytes() for p in kept} == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "empty.safetensors",
        "model.pt",
        "notes.txt",
        "old.pt",
    ]
    with pytest.raises(CkptError, match="is not a checkpoint"):
        convert([str(model)], "safetensors", str(notes), force=True)


def test_force_replaces_a_checkpoint_output(model: Path, tmp_path: Path):
    out_st = tmp_path / "out.safetensors"
    save_file({"old": torch.zeros(1)}, out_st)
    out_pt = tmp_path / "out.pt"
    torch.save({"old": torch.zeros(1)}, out_pt)
    runs = run_many(
        [
            ["convert", model, "--to", "safetensors", "-o", out_st, "--force"],
            ["merge", model, "-o", out_pt, "--force"],
        ]
    )
    assert [r["code"] for r in runs] == [0, 0]
    got = load_file(out_st)
    assert list(got) == ["w", "b"] and all(torch.equal(got[k], WEIGHTS[k]) for k in WEIGHTS)
    merged = torch.load(out_pt, weights_only=True)
    assert list(merged) == ["w", "b"] and all(torch.equal(merged[k], WEIGHTS[k]) for k in WEIGHTS)
