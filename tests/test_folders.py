"""Folders that hold several checkpoints (issue 32, items 1-2): never read as one of them,
listed by ``inspect`` one row each in natural order, refused by every other command
naming them, newest last. The run folders are the reference trainer's own files
(fixtures/ddp, fixtures/dcp, with markers written by trainers/snapshot_io.py) and a
Trainer checkpoint-N/ written by transformers (fixtures/transformers)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, check_error, completed, fixture_path, run_many, subprocess_env
from safetensors.torch import save_file

import ckpttool
from ckpttool.convert import convert
from ckpttool.errors import SeveralCheckpointsError

sys.path.insert(0, str(ROOT / "trainers"))
from snapshot_io import write_complete_marker  # noqa: E402  (the trainer's own marker)


def ddp_run(folder: Path, epochs: list[int], *, marked: bool = True) -> Path:
    """A reference-trainer run folder: ep{E}-rank{R}.pt of world size 2 and, where
    ``marked``, the ep{E}.complete marker rank 0 writes after every rank saved."""
    folder.mkdir()
    for epoch in epochs:
        for rank in (0, 1):
            shutil.copy(
                fixture_path("ddp") / f"ep0-rank{rank}.pt", folder / f"ep{epoch}-rank{rank}.pt"
            )
        if marked:
            parts = [f"ep{epoch}-rank{r}.pt" for r in (0, 1)]
            write_complete_marker(folder, epoch, "ddp", 2, parts)
    return folder


def test_unrelated_files_are_named_never_picked(tmp_path):
    """a.pt (a training snapshot) beside b.safetensors: was read as b.safetensors."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    shutil.copy(fixture_path("ddp") / "ep0-rank0.pt", folder / "a.pt")
    save_file({"w": torch.ones(3)}, folder / "b.safetensors")
    os.utime(folder / "a.pt", (1, 1))  # written long before b.safetensors
    with pytest.raises(SeveralCheckpointsError) as raised:
        ckpttool.load(folder)
    assert raised.value.candidates == ["a.pt", "b.safetensors"]  # newest last
    out = tmp_path / "out.safetensors"
    runs = run_many(
        [
            ["convert", folder, "--to", "safetensors", "-o", out],
            ["diff", folder, folder / "b.safetensors"],
            ["merge", folder, "-o", tmp_path / "m.pt"],
            ["inspect", folder],
            ["inspect", folder, "--json"],
        ]
    )
    for argv, run in zip(["convert", "diff", "merge"], runs[:3], strict=True):
        line = check_error(completed([argv], run), 2, "holds 2 checkpoints (a.pt, b.safetensors;")
        assert "newest last" in line and "ckpttool inspect FOLDER" in line
    assert not out.exists() and not (tmp_path / "m.pt").exists()
    assert runs[3]["code"] == 0 and runs[3]["stderr"] == ""
    lines = runs[3]["stdout"].splitlines()
    assert lines[:2] == [
        str(folder),
        "a folder of 2 checkpoints (the other commands take one of them)",
    ]
    assert lines[3].split() == ["name", "format", "world", "size", "epoch", "step", "complete"]
    assert lines[4].split() == ["a.pt", "torch-zip", "-", "17.0", "KiB", "-", "-", "yes"]
    assert lines[5].split() == ["b.safetensors", "safetensors", "-", "76", "B", "-", "-", "yes"]
    rows = json.loads(runs[4]["stdout"])
    assert [(r["name"], r["format"], r["nbytes"], r["complete"]) for r in rows] == [
        ("a.pt", "torch-zip", 17456, True),
        ("b.safetensors", "safetensors", 76, True),
    ]


def test_trainer_run_folder_lists_in_natural_order_with_completeness(tmp_path):
    """26 rank files of 13 epochs beside a converted ep11.safetensors: was read as
    ep11.safetensors. Rows come ep2 before ep10; a missing rank or marker says so."""
    run = ddp_run(tmp_path / "run", list(range(13)))
    (run / "ep12-rank1.pt").unlink()  # rank 1 died before it saved epoch 12
    (run / "ep3.complete").unlink()  # rank 0 never marked epoch 3
    convert([str(run / "ep11-rank0.pt")], "safetensors", str(run / "ep11.safetensors"))
    runs = run_many([["inspect", run, "--json"], ["inspect", run], ["convert", run, "--to", "pt"]])
    rows = json.loads(runs[0]["stdout"])
    names = [r["name"] for r in rows]
    assert names == [f"ep{e}-rank*.pt" for e in range(12)] + [
        "ep11.safetensors",
        "ep12-rank*.pt",
    ]
    by_name = {r["name"]: r for r in rows}
    assert by_name["ep10-rank*.pt"] == {
        "name": "ep10-rank*.pt",
        "path": str(run / "ep10-rank*.pt"),
        "format": "torch-zip",  # full copies (DDP): no sharded tensors in them
        "world_size": 2,
        "nbytes": 2 * 17456,
        "epoch": 10,
        "step": None,
        "complete": True,
        "missing": None,
    }
    assert (by_name["ep3-rank*.pt"]["complete"], by_name["ep3-rank*.pt"]["missing"]) == (
        False,
        "ep3.complete",
    )
    assert by_name["ep12-rank*.pt"]["missing"] == "rank 1"
    assert by_name["ep11.safetensors"]["format"] == "safetensors"
    text = runs[1]["stdout"].splitlines()
    assert text[:2] == [
        str(run),
        "a folder of 14 checkpoints (the other commands take one of them)",
    ]
    assert [line.split()[0] for line in text[4:]] == names
    assert text[4 + names.index("ep12-rank*.pt")].endswith("no: rank 1 missing")
    assert max(len(line) for line in text[1:]) <= 100
    line = check_error(completed([], runs[2]), 2, "holds 14 checkpoints (ep0-rank*.pt, ")
    assert "ep11-rank*.pt, ep11.safetensors, ep12-rank*.pt; newest last)" in line
    assert "… 7 more …" in line  # the middle counted, one line still


def test_dcp_run_folder_and_trainer_output_dir(tmp_path):
    """The trainer's --save-format dcp folders ep0/ … and a Trainer output_dir with
    checkpoint-3/ and checkpoint-6/: were "folder holds no checkpoint ckpttool knows"."""
    dcp_run = tmp_path / "dcp_run"
    dcp_run.mkdir()
    for epoch in (0, 2, 10):
        shutil.copytree(fixture_path("dcp"), dcp_run / f"ep{epoch}")
        write_complete_marker(dcp_run, epoch, "dcp", 2, [f"ep{epoch}"])
    (dcp_run / "ep10" / ".metadata").unlink()  # killed before the metadata went in
    out_dir = tmp_path / "trainer_out"
    out_dir.mkdir()
    for step in (6, 3):
        shutil.copytree(
            fixture_path("transformers") / "gpt2_tied" / "checkpoint-2",
            out_dir / f"checkpoint-{step}",
        )
    runs = run_many([["inspect", dcp_run, "--json"], ["inspect", out_dir, "--json"]])
    rows = json.loads(runs[0]["stdout"])
    assert [(r["name"], r["format"], r["world_size"], r["epoch"], r["missing"]) for r in rows] == [
        ("ep0/", "dcp", 2, 0, None),
        ("ep2/", "dcp", 2, 2, None),
        ("ep10/", "dcp", 2, 10, ".metadata"),
    ]
    assert rows[0]["nbytes"] == sum(p.stat().st_size for p in (dcp_run / "ep0").iterdir())
    rows = json.loads(runs[1]["stdout"])
    assert [(r["name"], r["format"], r["step"], r["complete"]) for r in rows] == [
        ("checkpoint-3/", "safetensors", 3, True),
        ("checkpoint-6/", "safetensors", 6, True),
    ]
    with pytest.raises(SeveralCheckpointsError, match=r"\(checkpoint-3/, checkpoint-6/; newest"):
        ckpttool.read(out_dir)
    # one checkpoint folder alone is named too: the folder is not a checkpoint itself
    shutil.rmtree(out_dir / "checkpoint-6")
    with pytest.raises(SeveralCheckpointsError, match="holds a checkpoint in checkpoint-3/"):
        ckpttool.read(out_dir)


def test_documented_rules_still_read_one_checkpoint(tmp_path):
    """What stays one checkpoint: an HF folder (weights beside the Trainer's companions),
    the rank files of one step beside non-checkpoint files, a DCP folder."""
    hf = tmp_path / "checkpoint-2"
    shutil.copytree(fixture_path("transformers") / "gpt2_bin" / "checkpoint-2", hf)
    (hf / "trainer_state.json").unlink()  # not a run folder: the HF folder rule alone
    assert ckpttool.read(hf).files == [str(hf / "pytorch_model.bin")]
    run = ddp_run(tmp_path / "run", [0])
    (run / "notes.txt").write_text("lr 3e-3")
    assert ckpttool.read(run).files == [str(run / "ep0-rank0.pt")]
    # an unrelated checkpoint beside the HF weights: named, not skipped
    shutil.copy(run / "ep0-rank0.pt", hf / "extra.pt")
    with pytest.raises(SeveralCheckpointsError, match="holds 2 checkpoints") as raised:
        ckpttool.read(hf)
    assert sorted(raised.value.candidates) == ["extra.pt", "pytorch_model.bin"]


def test_listing_a_folder_imports_no_torch(tmp_path):
    """inspect never imports torch, on a folder of checkpoints either (rank files are told
    apart by their pickle's globals, scanned, never rebuilt)."""
    run = ddp_run(tmp_path / "run", [0, 1])
    code = (
        "import sys; from ckpttool.cli import main\n"
        "try:\n    main(['inspect', sys.argv[1]])\nexcept SystemExit as e:\n    code = e.code\n"
        "assert code == 0, code\nassert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(run)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ep1-rank*.pt" in proc.stdout


def test_deepspeed_and_megatron_save_folders_list_their_steps(tmp_path):
    """global_stepN/ without `latest`, iter_NNNNNNN/ without the tracker: listed by step."""
    ds = tmp_path / "ds"
    for step in (20, 10):
        shutil.copytree(
            fixture_path("deepspeed") / "zero2" / "global_step3", ds / f"global_step{step}"
        )
    mg = tmp_path / "mg"
    for step in (200, 100):
        shutil.copytree(fixture_path("megatron") / "gpt", mg / f"iter_{step:07d}")
    runs = run_many([["inspect", ds, "--json"], ["inspect", mg, "--json"], ["diff", ds, mg]])
    rows = json.loads(runs[0]["stdout"])
    assert [(r["name"], r["format"], r["world_size"], r["step"], r["complete"]) for r in rows] == [
        ("global_step10/", "deepspeed", 2, 10, True),
        ("global_step20/", "deepspeed", 2, 20, True),
    ]
    rows = json.loads(runs[1]["stdout"])
    assert [(r["name"], r["format"], r["world_size"], r["step"]) for r in rows] == [
        ("iter_0000100/", "megatron", 2, 100),
        ("iter_0000200/", "megatron", 2, 200),
    ]
    check_error(completed([], runs[2]), 2, "(global_step10/, global_step20/; newest last)")
