"""``--force`` replaces only what ckpttool writes, never anything else.

Every kind of output (pt, safetensors, HF shards, DCP; ``convert`` and ``merge``) is
written into a folder that already holds unrelated files, beside and inside the output,
with and without ``--force``, through the CLI: those files survive every command
byte for byte, and the output is read back by its own consumer each time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import check_error, run_cli, tree_files
from safetensors.torch import load_file, save_file

import ckpttool
from ckpttool.convert import convert
from ckpttool.errors import CkptError, OutputExistsError
from ckpttool.merge import merge

WEIGHTS = {
    "emb.weight": torch.arange(24.0).reshape(6, 4),
    "head.weight": torch.linspace(-1, 1, 12).reshape(3, 4),
    "norm.bias": torch.tensor([0.5, -2.0, 3.25]),
}
# files a user keeps where outputs go: a model card, an HF config, a tokenizer, a hidden
# file, a single-file checkpoint of another name, and a folder with files of its own
UNRELATED = {
    "README.md": b"# my model\n",
    "config.json": b'{"architectures": ["Llama"]}\n',
    "tokenizer.json": b'{"version": "1.0"}\n',
    ".gitattributes": b"*.safetensors filter=lfs\n",
    "model.safetensors.bak": b"not ours",
    "pytorch_model.bin": b"someone else's weights",
    "llama/config.json": b'{"n_layers": 2}\n',
    "llama/model-00001-of-00002.safetensors": b"a shard in a subfolder: not ours either",
    "notes/.metadata": b"a .metadata in a subfolder",
}


@pytest.fixture
def snap(tmp_path: Path) -> Path:
    path = tmp_path / "in" / "ep1-rank0.pt"
    path.parent.mkdir()
    torch.save({"model": {f"module.{k}": v for k, v in WEIGHTS.items()}, "epoch": 1}, path)
    return path


def plant(folder: Path) -> dict[Path, bytes]:
    """Put the unrelated files into ``folder``; return them with their bytes."""
    planted = {}
    for name, data in UNRELATED.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        planted[path] = data
    return planted


def assert_untouched(planted: dict[Path, bytes]) -> None:
    for path, data in planted.items():
        assert path.read_bytes() == data, path


def assert_model(got: dict) -> None:
    assert sorted(got) == sorted(WEIGHTS)
    for name, tensor in WEIGHTS.items():
        assert torch.equal(got[name], tensor), name


def read_back(kind: str, out: Path) -> None:
    """The output, read by its own consumer, holds the model bitwise."""
    if kind == "pt":
        assert_model(torch.load(out, weights_only=True))
    elif kind == "merge":
        loaded = torch.load(out, weights_only=True)
        assert loaded["epoch"] == 1
        assert_model({k.removeprefix("module."): v for k, v in loaded["model"].items()})
    elif kind == "safetensors":
        assert_model(load_file(out))
    elif kind == "shards":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        got = {}
        for shard in sorted(set(index["weight_map"].values())):
            got.update(load_file(out / shard))
        assert sorted(index["weight_map"]) == sorted(got)
        assert_model(got)
    else:
        assert_model(ckpttool.load(str(out)))


# kind: (command line after the input, output path inside the folder given to -o)
COMMANDS = {
    "pt": (["convert", "--to", "pt"], "ep1.pt"),
    "safetensors": (["convert", "--to", "safetensors"], "ep1.safetensors"),
    "shards": (["convert", "--to", "safetensors", "--max-shard-size", "100B"], ""),
    "dcp": (["convert", "--to", "dcp"], ""),
    "merge": (["merge"], "ep1.pt"),
}
OWN_FILES = {
    "pt": ["ep1.pt"],
    "safetensors": ["ep1.safetensors"],
    "shards": [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ],
    "dcp": [".metadata", "__0_0.distcp"],
    "merge": ["ep1.pt"],
}


def cli(kind: str, snap: Path, out: str, *extra: str):
    command, _ = COMMANDS[kind]
    return run_cli(command[0], snap, *command[1:], "-o", out, "-q", *extra)


@pytest.mark.parametrize("kind", list(COMMANDS))
def test_into_a_folder_with_other_files_and_force(tmp_path: Path, snap: Path, kind: str):
    """``-o out/``: written beside what the folder holds; a second run is refused
    without --force (nothing changes) and replaces only the output's own files with it."""
    folder = tmp_path / "out"
    planted = plant(folder)
    before = sorted(tree_files(folder))
    out = folder / COMMANDS[kind][1]

    proc = cli(kind, snap, f"{folder}/")
    assert proc.returncode == 0, proc.stderr
    assert tree_files(folder) == sorted(before + OWN_FILES[kind])
    assert_untouched(planted)
    read_back(kind, out)
    first = {name: (folder / name).read_bytes() for name in OWN_FILES[kind]}

    # again: refused, nothing written or removed
    check_error(cli(kind, snap, f"{folder}/"), 2, "--force")
    assert tree_files(folder) == sorted(before + OWN_FILES[kind])
    assert_untouched(planted)

    # --force: the output's files replaced (new inodes, same content), nothing else touched
    inodes = {name: (folder / name).stat().st_ino for name in OWN_FILES[kind]}
    proc = cli(kind, snap, str(folder), "--force")  # an existing folder, no slash: the same
    assert proc.returncode == 0, proc.stderr
    assert tree_files(folder) == sorted(before + OWN_FILES[kind])
    assert_untouched(planted)
    read_back(kind, out)
    for name in OWN_FILES[kind]:
        assert (folder / name).stat().st_ino != inodes[name], name
        if kind != "dcp":  # DCP's .metadata pickles dicts whose order may vary
            assert (folder / name).read_bytes() == first[name], name
    assert not list(folder.glob(".*ckpttool-tmp*"))


@pytest.mark.parametrize("kind", ["pt", "safetensors", "merge"])
def test_named_file_output_beside_other_files(tmp_path: Path, snap: Path, kind: str):
    """``-o out/model.x``: only that file is written, refused, replaced."""
    planted = plant(tmp_path / "out")
    out = tmp_path / "out" / "model.x"
    assert cli(kind, snap, str(out)).returncode == 0
    check_error(cli(kind, snap, str(out)), 2, "output exists", "--force")
    proc = cli(kind, snap, str(out), "--force")
    assert proc.returncode == 0, proc.stderr
    assert_untouched(planted)
    read_back(kind, out)
    assert tree_files(tmp_path / "out") == sorted(
        [*map(str, UNRELATED), "llama", "notes", "model.x"]
    )


def test_force_replaces_stale_shards_and_old_index_only(tmp_path: Path, snap: Path):
    """Three shards, then one: the earlier run's shards and index go, the rest stays."""
    folder = tmp_path / "hf-model"
    planted = plant(folder)
    convert([str(snap)], "safetensors", str(folder), max_shard_size="50B")
    assert sorted(p.name for p in folder.glob("model-*")) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    with pytest.raises(OutputExistsError, match="model-00001-of-00003.safetensors"):
        convert([str(snap)], "safetensors", str(folder), max_shard_size="1GB")
    convert([str(snap)], "safetensors", str(folder), max_shard_size="1GB", force=True)
    assert sorted(p.name for p in folder.glob("model*")) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.bak",
        "model.safetensors.index.json",
    ]
    assert_untouched(planted)
    read_back("shards", folder)


def test_issue_example_folder_with_trailing_slash_is_kept(tmp_path: Path, snap: Path):
    """The report: ``-o out/models/ --force`` deleted ``models/`` with everything in it."""
    models = tmp_path / "out" / "models"
    planted = plant(models)
    proc = run_cli("convert", snap, "--to", "safetensors", "-o", f"{models}/", "--force", "-q")
    assert proc.returncode == 0, proc.stderr
    assert models.is_dir()
    assert_untouched(planted)
    read_back("safetensors", models / "ep1.safetensors")


def test_trailing_slash_creates_the_folder(tmp_path: Path, snap: Path):
    for kind in ("pt", "merge"):
        folder = tmp_path / f"new-{kind}" / "deeper"
        assert cli(kind, snap, f"{folder}/").returncode == 0
        assert tree_files(folder) == ["ep1.pt"]
        read_back(kind, folder / "ep1.pt")


# ---------------------------------------------------- a file where a folder goes, and back


@pytest.mark.parametrize("kind", ["shards", "dcp", "pt"])
def test_plain_file_where_a_folder_is_needed_is_never_replaced(
    tmp_path: Path, snap: Path, kind: str
):
    """A non-checkpoint file named like the output folder: exit 2 with and without --force."""
    target = tmp_path / "models"
    target.write_bytes(b"my notes")
    out = f"{target}/" if kind == "pt" else str(target)
    check_error(cli(kind, snap, out), 2, "--force")
    check_error(cli(kind, snap, out, "--force"), 2, "not a checkpoint", "only what ckpttool")
    assert target.read_bytes() == b"my notes"
    assert tree_files(tmp_path) == ["in", "in/ep1-rank0.pt", "models"]


@pytest.mark.parametrize("kind", ["shards", "dcp", "pt"])
def test_checkpoint_file_where_a_folder_is_needed_is_replaced_with_force(
    tmp_path: Path, snap: Path, kind: str
):
    """An earlier single-file output named like the folder: replaced with --force only."""
    target = tmp_path / "models"
    save_file({"x": torch.ones(2)}, str(target))
    out = f"{target}/" if kind == "pt" else str(target)
    check_error(cli(kind, snap, out), 2, "--force")
    assert target.is_file()
    proc = cli(kind, snap, out, "--force")
    assert proc.returncode == 0, proc.stderr
    assert tree_files(target) == sorted(OWN_FILES[kind])
    read_back(kind, target / "ep1.pt" if kind == "pt" else target)


def test_folder_where_a_file_is_needed(tmp_path: Path, snap: Path):
    """``-o out/`` whose default name is a folder: one holding other files is never
    replaced; an earlier folder output (only shards) is, with --force."""
    folder = tmp_path / "out"
    (folder / "ep1.safetensors").mkdir(parents=True)
    (folder / "ep1.safetensors" / "notes.txt").write_text("keep")
    with pytest.raises(OutputExistsError, match="--force"):
        convert([str(snap)], "safetensors", f"{folder}/")
    with pytest.raises(CkptError, match="only what ckpttool writes"):
        convert([str(snap)], "safetensors", f"{folder}/", force=True)
    assert tree_files(folder) == ["ep1.safetensors", "ep1.safetensors/notes.txt"]

    shards = folder / "ep1.pt"
    convert([str(snap)], "safetensors", str(shards), max_shard_size="1GB")
    merge(str(snap), f"{folder}/", force=True)
    assert shards.is_file()
    read_back("merge", shards)
    assert tree_files(folder) == ["ep1.pt", "ep1.safetensors", "ep1.safetensors/notes.txt"]


def test_a_folder_named_like_an_output_file_is_refused(tmp_path: Path, snap: Path):
    """A folder where a shard or the index goes is never removed, not even with --force."""
    folder = tmp_path / "hf"
    (folder / "model.safetensors.index.json").mkdir(parents=True)
    (folder / "model.safetensors.index.json" / "keep.txt").write_text("keep")
    for force in (False, True):
        with pytest.raises(CkptError, match="is a folder"):
            convert([str(snap)], "safetensors", str(folder), max_shard_size="1GB", force=force)
    assert tree_files(folder) == [
        "model.safetensors.index.json",
        "model.safetensors.index.json/keep.txt",
    ]


def test_shards_written_beside_their_input(tmp_path: Path):
    """The HF conversion: ``pytorch_model.bin`` -> shards in its own folder, the input kept."""
    folder = tmp_path / "hf"
    planted = plant(folder)
    (folder / "pytorch_model.bin").unlink()
    torch.save(WEIGHTS, folder / "pytorch_model.bin")
    before = (folder / "pytorch_model.bin").read_bytes()
    convert([str(folder / "pytorch_model.bin")], "safetensors", str(folder), max_shard_size="100B")
    assert (folder / "pytorch_model.bin").read_bytes() == before
    assert_untouched({p: d for p, d in planted.items() if p.name != "pytorch_model.bin"})
    read_back("shards", folder)
