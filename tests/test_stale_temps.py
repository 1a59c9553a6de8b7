"""Leftovers of a killed run (issue 32, item 3): the next ckpttool write into that folder
removes this host's temp outputs whose writer is gone, whatever output they were for,
and says so in one stderr line; another host's are never touched; a folder that refuses
new files is named in the error, never the hidden temp path (docs/folders.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import check_error, completed, run_many, tree_files
from safetensors.torch import load_file

from ckpttool.convert import convert
from ckpttool.targets.local import TEMP_MARK, _boot_time


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_next_write_into_the_folder_removes_a_killed_runs_temp(tmp_path: Path, dead_pid: int):
    """`kill -9` of `convert … -o k2.safetensors` left a hidden full-size temp file; a later
    convert (or merge) to ANOTHER name in that folder removes it, with one line."""
    torch.save({"w": torch.ones(3)}, tmp_path / "in.pt")
    left = tmp_path / f".k2.safetensors{TEMP_MARK}{dead_pid}"
    left.write_bytes(b"\0" * (1 << 20))
    left_folder = tmp_path / f".k2-dcp{TEMP_MARK}{dead_pid}"  # a folder output's
    left_folder.mkdir()
    (left_folder / "__0_0.distcp").write_bytes(b"\0" * 1024)
    other_host = tmp_path / f".k3.safetensors.ckpttool-tmp-node7_{dead_pid}"
    other_host.write_bytes(b"partial")
    runs = run_many(
        [
            [
                "convert",
                tmp_path / "in.pt",
                "--to",
                "safetensors",
                "-o",
                tmp_path / "a.safetensors",
            ],
            ["merge", tmp_path / "in.pt", "-o", tmp_path / "m.pt"],
        ]
    )
    assert runs[0]["code"] == 0, runs[0]["stderr"]
    lines = runs[0]["stderr"].splitlines()
    assert lines == [
        f"ckpttool: removed 2 temporary files of killed runs (1.0 MiB): {left_folder} "
        f"(pid {dead_pid}), {left} (pid {dead_pid})",
        f"wrote {tmp_path / 'a.safetensors'} (1 tensor, 12 B)",
    ] or lines == [
        f"ckpttool: removed 2 temporary files of killed runs (1.0 MiB): {left} "
        f"(pid {dead_pid}), {left_folder} (pid {dead_pid})",
        f"wrote {tmp_path / 'a.safetensors'} (1 tensor, 12 B)",
    ]
    assert runs[1]["code"] == 0 and "removed" not in runs[1]["stderr"]  # nothing left
    assert tree_files(tmp_path) == sorted([other_host.name, "a.safetensors", "in.pt", "m.pt"])
    assert torch.equal(load_file(tmp_path / "a.safetensors")["w"], torch.ones(3))


@pytest.mark.skipif(_boot_time() is None, reason="needs /proc/stat's boot time (Linux)")
def test_temp_older_than_boot_is_removed_though_its_pid_is_taken(tmp_path: Path):
    """After a reboot a dead run's pid may be a live process's: a temp older than the
    boot cannot be a running write."""
    torch.save({"w": torch.ones(3)}, tmp_path / "in.pt")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        before_boot = tmp_path / f".x.pt{TEMP_MARK}{live.pid}"
        running = tmp_path / f".y.pt{TEMP_MARK}{live.pid}"
        for path in (before_boot, running):
            path.write_bytes(b"partial")
        booted = _boot_time()
        assert booted is not None
        os.utime(before_boot, (booted - 60, booted - 60))
        result = convert([str(tmp_path / "in.pt")], "pt", str(tmp_path / "out.pt"))
        assert [t.path for t in result.removed] == [str(before_boot)]
        assert tree_files(tmp_path) == sorted(["in.pt", "out.pt", running.name])
    finally:
        live.kill()
        live.wait()


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="needs /sys")
@pytest.mark.parametrize(
    "args",
    [
        ["--to", "pt", "-o", "/sys/out.pt"],
        ["--to", "dcp", "-o", "/sys/out-dcp"],
        ["--to", "safetensors", "--max-shard-size", "1KB", "-o", "/sys/"],
    ],
)
def test_a_folder_that_refuses_files_is_named_not_the_temp(tmp_path: Path, args):
    torch.save({"w": torch.ones(3)}, tmp_path / "in.pt")
    if _can_create_in("/sys"):
        pytest.skip("needs a folder that refuses new files to every user: /sys takes them here")
    (run,) = run_many([["convert", tmp_path / "in.pt", *args]])
    line = check_error(completed([], run), 2, "ckpttool: error: /sys: cannot write into this")
    assert "ckpttool-tmp" not in line and "nothing was written" in line


def _can_create_in(folder: str) -> bool:
    try:
        fd = os.open(os.path.join(folder, ".ckpttool-probe"), os.O_CREAT | os.O_WRONLY)
    except OSError:
        return False
    os.close(fd)
    os.remove(os.path.join(folder, ".ckpttool-probe"))
    return True
