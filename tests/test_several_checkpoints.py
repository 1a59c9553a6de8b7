"""Several separate checkpoints on one command line (``ckpttool inspect *.pt``): inspect
reports each in turn; commands that read one checkpoint refuse with a true message."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from helpers import check_error, completed, fixture_path, run_many, small_state_dict, write_dcp
from payloads import Reduce, write_malicious_zip
from safetensors.torch import save_file


def separate(tmp_path: Path) -> tuple[Path, Path, Path]:
    """An unrelated training snapshot, a safetensors export, a DCP folder."""
    a = tmp_path / "a.pt"
    torch.save({"model": small_state_dict(0), "epoch": 1}, a)
    b = tmp_path / "b.safetensors"
    save_file(small_state_dict(1), b)
    c = tmp_path / "c"
    write_dcp(c, {"model": small_state_dict(2)})
    return a, b, c


def test_inspect_reports_each_in_turn(tmp_path: Path):
    a, b, c = separate(tmp_path)
    runs = run_many(
        [
            ["inspect", a, b, c],
            ["inspect", a, b, c, "--json"],
            ["inspect", a],
            ["inspect", b, "--json"],
            ["inspect", str(tmp_path / "*.pt"), b, "--json"],  # a quoted glob among them
        ]
    )
    assert runs[0]["code"] == 0 and runs[0]["stderr"] == ""
    text = runs[0]["stdout"]
    heads = [line for line in text.splitlines() if line.startswith("== ")]
    assert heads == [f"== {a} (1 of 3) ==", f"== {b} (2 of 3) ==", f"== {c} (3 of 3) =="]
    formats = [line for line in text.splitlines() if line.startswith("format: ")]
    assert formats == ["format: torch-zip", "format: safetensors", "format: dcp, world size 1"]
    # each section is what inspecting that file alone prints
    first = text.split(f"\n\n== {b} (2 of 3) ==\n")[0]
    assert first == f"== {a} (1 of 3) ==\n" + runs[2]["stdout"].rstrip("\n")
    objects = [json.loads(line) for line in runs[1]["stdout"].splitlines()]
    assert [o["format"] for o in objects] == ["torch-zip", "safetensors", "dcp"]
    assert objects[0]["files"] == [str(a)] and objects[1]["files"] == [str(b)]
    assert objects[2]["files"] == [str(c / ".metadata"), str(c / "__0_0.distcp")]
    single = json.loads(runs[3]["stdout"])
    assert {**objects[1], "transfer": None} == {**single, "transfer": None}
    assert [json.loads(line)["files"] for line in runs[4]["stdout"].splitlines()] == [
        [str(a)],
        [str(b)],
    ]


def test_commands_that_read_one_checkpoint_say_why_not(tmp_path: Path):
    a, b, c = separate(tmp_path)
    out = tmp_path / "out.pt"
    runs = run_many(
        [
            ["convert", a, b, "--to", "safetensors"],
            ["merge", a, c, "-o", out],
            ["convert", b, a, "--to", "pt"],
            ["inspect", a, b, "--names"],
        ]
    )
    hint = "(pass one of them; `ckpttool inspect` and `ckpttool verify` take several, each in turn)"
    assert check_error(completed([], runs[0]), 2) == (
        "ckpttool: error: 2 separate checkpoints given (a.pt, b.safetensors): a.pt is a whole "
        f"torch-zip checkpoint, not one rank's part of a sharded one, so they are not read as "
        f"one {hint}"
    )
    assert check_error(completed([], runs[1]), 2) == (
        "ckpttool: error: 2 separate checkpoints given (a.pt, c): a.pt is a whole torch-zip "
        f"checkpoint, not one rank's part of a sharded one, so they are not read as one {hint}"
    )
    assert not out.exists()
    assert check_error(completed([], runs[2]), 2) == (
        "ckpttool: error: 2 separate checkpoints given (b.safetensors, a.pt): b.safetensors is "
        "a whole safetensors checkpoint, not one rank's part of a sharded one, so they are not "
        f"read as one {hint}"
    )
    assert check_error(completed([], runs[3]), 2) == (
        "ckpttool: error: --names lists the tensors of one checkpoint; these are 2 separate "
        "ones (pass one of them, or use --json (one object per line, each with its files))"
    )
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.safetensors", "c"]


def test_ddp_rank_files_are_full_copies(tmp_path: Path):
    ddp = fixture_path("ddp")
    ranks = [ddp / "ep0-rank0.pt", ddp / "ep0-rank1.pt"]
    runs = run_many(
        [
            ["convert", *ranks, "--to", "safetensors", "-o", tmp_path / "x.safetensors"],
            ["inspect", *ranks, "--json"],
        ]
    )
    assert check_error(completed([], runs[0]), 2) == (
        "ckpttool: error: ep0-rank0.pt, ep0-rank1.pt: rank files without sharded tensors: "
        "each rank saved a full copy of the checkpoint (DDP), not a shard of it "
        "(pass just one of them)"
    )
    assert [json.loads(line)["files"] for line in runs[1]["stdout"].splitlines()] == [
        [str(r)] for r in ranks
    ]


def test_sharded_rank_files_are_still_one_checkpoint(tmp_path: Path):
    composer = fixture_path("composer")
    ranks = [composer / "ep0-ba4-rank0.pt", composer / "ep0-ba4-rank1.pt"]
    runs = run_many([["inspect", *ranks, "--json"]])
    (report,) = [json.loads(line) for line in runs[0]["stdout"].splitlines()]
    assert report["format"] == "per-rank" and report["files"] == [str(r) for r in ranks]


def test_one_bad_file_among_several_is_named(tmp_path: Path):
    a, b, _ = separate(tmp_path)
    bad = tmp_path / "bad.pt"
    write_malicious_zip(bad, Reduce(os.system, ("echo pwned",)))
    short = tmp_path / "short.pt"
    short.write_bytes(a.read_bytes()[:-50])
    runs = run_many([["inspect", a, bad, b], ["inspect", a, short]])
    check_error(completed([], runs[0]), 3, f"refused: {bad}: ", "posix.system")
    check_error(completed([], runs[1]), 2, f"error: {short}: truncated or corrupt zip archive")


def test_a_whole_checkpoint_given_with_rank_files_is_not_a_rank(tmp_path: Path):
    """A snapshot given after a sharded rank file was taken for rank 1 of it; it holds
    no sharded tensors, so it is a checkpoint of its own: inspected in turn, refused by
    convert with that reason."""
    a, _, _ = separate(tmp_path)
    rank0 = fixture_path("composer") / "ep0-ba4-rank0.pt"
    runs = run_many(
        [
            ["inspect", rank0, a, "--json"],
            ["convert", rank0, a, "--to", "pt", "-o", tmp_path / "out.pt"],
        ]
    )
    reports = [json.loads(line) for line in runs[0]["stdout"].splitlines()]
    assert [(r["format"], r["files"]) for r in reports] == [
        ("per-rank", [str(rank0), str(rank0.with_name("ep0-ba4-rank1.pt"))]),
        ("torch-zip", [str(a)]),
    ]
    assert check_error(completed([], runs[1]), 2) == (
        "ckpttool: error: a.pt holds no sharded tensors: it is a whole torch-zip checkpoint, "
        "not a rank file of the per-rank checkpoint ep0-ba4-rank0.pt (pass the rank files of "
        "one checkpoint; `ckpttool inspect` and `ckpttool verify` take separate checkpoints, "
        "each in turn)"
    )
    assert not (tmp_path / "out.pt").exists()
    # named like the next rank of it, but of another run: asked, and not taken either
    copy = tmp_path / "run"
    shutil.copytree(fixture_path("composer"), copy)
    shutil.copy(fixture_path("ddp") / "ep0-rank1.pt", copy / "ep9-rank1.pt")
    runs = run_many([["inspect", copy / "ep0-ba4-rank0.pt", copy / "ep9-rank1.pt", "--json"]])
    reports = [json.loads(line) for line in runs[0]["stdout"].splitlines()]
    assert [(r["format"], len(r["files"])) for r in reports] == [("per-rank", 2), ("torch-zip", 1)]
