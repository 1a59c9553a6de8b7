"""Temp names carry the host and the process id; a run cleans up only its own host's
dead runs' temp files, and nothing ckpttool did not name (a shared file system's
other nodes, other users, look-alike names)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tree_files

from ckpttool.convert import convert
from ckpttool.targets.local import HOST, TEMP_MARK, atomic_output
from ckpttool.writers.folder_layout import HF_SHARDS


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temp_names_carry_host_and_pid(tmp_path: Path):
    assert HOST == re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64]
    with atomic_output(str(tmp_path / "o.bin"), force=False) as temp:
        assert Path(temp).name == f".o.bin.ckpttool-tmp-{HOST}_{os.getpid()}"
        Path(temp).write_bytes(b"x")
    folder = tmp_path / "hf"
    folder.mkdir()
    with atomic_output(str(folder), force=False, layout=HF_SHARDS) as temp:
        assert Path(temp).name == f".ckpttool-tmp-{HOST}_{os.getpid()}"
        (Path(temp) / "model.safetensors.index.json").write_text("{}")


def test_cleanup_spares_other_hosts_and_names_it_did_not_give(tmp_path: Path, dead_pid: int):
    torch.save({"w": torch.ones(3)}, tmp_path / "in.pt")
    stem = ".out.safetensors"
    ours = [f"{stem}{TEMP_MARK}{dead_pid}", f"{stem}{TEMP_MARK}old-{dead_pid}"]
    kept = [
        f"{stem}.ckpttool-tmp-{HOST}x_{dead_pid}",  # a host whose name extends ours
        f"{stem}.ckpttool-tmp-{HOST}-old_{dead_pid}",
        f"{stem}.ckpttool-tmp-other-node_{dead_pid}",  # another node of a shared fs
        f"{stem}.ckpttool-tmp-{dead_pid}",  # no host: whose it is cannot be told
        f"{stem}{TEMP_MARK}{dead_pid}.bak",  # look-alikes: not names ckpttool gives
        f"{stem}{TEMP_MARK}0{dead_pid}",
        f"{stem}{TEMP_MARK}old-",
        f"{stem}{TEMP_MARK}99999999999999999999",
    ]
    for name in ours + kept:
        (tmp_path / name).write_bytes(b"partial")
    convert([str(tmp_path / "in.pt")], "safetensors", str(tmp_path / "out.safetensors"))
    assert tree_files(tmp_path) == sorted([*kept, "in.pt", "out.safetensors"])


def test_cleanup_inside_an_output_folder_spares_other_hosts(tmp_path: Path, dead_pid: int):
    torch.save({"w": torch.ones(3)}, tmp_path / "in.pt")
    out = tmp_path / "hf"
    out.mkdir()
    mine, other = out / f"{TEMP_MARK}{dead_pid}", out / f".ckpttool-tmp-node7_{dead_pid}"
    for folder in (mine, other):
        folder.mkdir()
        (folder / "model-00001-of-00001.safetensors").write_bytes(b"partial")
    convert([str(tmp_path / "in.pt")], "safetensors", str(out), max_shard_size="1GB")
    assert not mine.exists()
    assert (other / "model-00001-of-00001.safetensors").read_bytes() == b"partial"


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_cleanup_spares_another_users_file(tmp_path: Path, dead_pid: int):
    torch.save({"w": torch.ones(3)}, tmp_path / "in.pt")
    theirs = tmp_path / f".out.safetensors{TEMP_MARK}{dead_pid}"
    theirs.write_bytes(b"partial")
    os.chown(theirs, 4242, 4242)
    convert([str(tmp_path / "in.pt")], "safetensors", str(tmp_path / "out.safetensors"))
    assert theirs.read_bytes() == b"partial"
