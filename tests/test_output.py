"""Safe output: a temporary file beside the target, renamed at the end. A run killed midway
(SIGKILL), interrupted (SIGINT) or stopped by a full disk (RLIMIT_FSIZE) leaves no output,
no temporary file (or one the next run removes) and an untouched input.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import check_error, run_cli, sha256, subprocess_env, tree_files
from safetensors.torch import load_file

from ckpttool.convert import convert
from ckpttool.errors import CkptError, OutputExistsError
from ckpttool.merge import merge
from ckpttool.targets.local import TEMP_MARK, atomic_output, check_output
from ckpttool.writers.folder_layout import DCP_FILES, HF_SHARDS

BIG_TENSORS, BIG_ELEMENTS = 6, 12_500_000  # 6 x 50 MB = 300 MB of float32


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A ~300 MB torch.save file and its sha256."""
    path = tmp_path_factory.mktemp("big") / "big.pt"
    torch.save({f"layer{i}.weight": torch.full((BIG_ELEMENTS,), float(i)) for i in range(6)}, path)
    yield path, sha256(path)
    path.unlink()  # pytest keeps the temp folders of the last runs: do not keep 300 MB there


def start_convert(src: Path, out: Path, to: str, **kwargs) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ckpttool", "convert", str(src), "--to", to, "-o", str(out), "-q"]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        **kwargs,
    )


def wait_for_bytes(proc: subprocess.Popen, temp: Path, timeout: float = 60) -> None:
    """Until the run's temporary output exists and holds data (the run is midway)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the conversion ended before it could be stopped: {proc.communicate()}")
        try:
            if temp.stat().st_size > 0:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.001)
    proc.kill()
    pytest.fail(f"{temp} never appeared")


@pytest.mark.slow
@pytest.mark.parametrize("to", ["safetensors", "pt"])
def test_sigkill_midway_leaves_no_output_and_next_run_cleans_up(big, tmp_path: Path, to):
    src, digest = big
    out = tmp_path / f"out.{to}"
    proc = start_convert(src, out, to)
    temp = tmp_path / f".{out.name}{TEMP_MARK}{proc.pid}"
    wait_for_bytes(proc, temp)
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    assert tree_files(tmp_path) == [temp.name]  # only the dead run's temp file
    assert sha256(src) == digest

    result = convert([str(src)], to, str(out))  # the next run removes the stale temp file
    assert result.num_tensors == BIG_TENSORS
    assert tree_files(tmp_path) == [out.name]
    loaded = (
        load_file(out) if to == "safetensors" else torch.load(out, weights_only=True, mmap=True)
    )
    assert sorted(loaded) == [f"layer{i}.weight" for i in range(BIG_TENSORS)]
    assert torch.equal(loaded["layer5.weight"], torch.full((BIG_ELEMENTS,), 5.0))
    del loaded
    out.unlink()  # 300 MB: not for pytest's kept temp folders


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_sigint_midway_exit_130_nothing_left(big, tmp_path: Path):
    src, digest = big
    out = tmp_path / "out.pt"
    # a suite run in the background (`pytest &` from a script) ignores SIGINT, and so
    # would the child: give it the default disposition, as in a terminal
    proc = start_convert(src, out, "pt", preexec_fn=_default_sigint)
    wait_for_bytes(proc, tmp_path / f".out.pt{TEMP_MARK}{proc.pid}")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.splitlines() == ["ckpttool: interrupted; no output was written"]
    assert tree_files(tmp_path) == []
    assert sha256(src) == digest


def limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.fixture(scope="module")
def medium(tmp_path_factory) -> Path:
    """A 4 MB snapshot, to be written under a 1 MB file-size limit."""
    path = tmp_path_factory.mktemp("medium") / "medium.pt"
    model = {f"module.l{i}.weight": torch.full((256, 1024), float(i)) for i in range(4)}
    torch.save({"model": model, "epoch": 1}, path)
    return path


@pytest.mark.parametrize(
    "args",
    [
        ["convert", "--to", "safetensors"],
        ["convert", "--to", "safetensors", "--max-shard-size", "2MB"],  # 2 MB shards: too big
        ["convert", "--to", "pt"],
        ["convert", "--to", "dcp"],
        ["merge"],
    ],
    ids=["safetensors", "shards", "pt", "dcp", "merge"],
)
def test_file_size_limit_exit_2_one_line_nothing_left(medium: Path, tmp_path: Path, args):
    before = sha256(medium)
    out = tmp_path / "out"
    proc = run_cli(args[0], medium, *args[1:], "-o", out, preexec_fn=limit_file_size(1 << 20))
    check_error(proc, 2, str(out), "file too large", "nothing was written")
    assert tree_files(tmp_path) == []
    assert sha256(medium) == before


def test_folders_made_for_a_failed_output_are_removed(medium: Path, tmp_path: Path):
    """-o new/dir/out.pt creates new/dir; when the write fails, nothing of it remains,
    but a folder that existed before, or that holds something else, stays."""
    out = tmp_path / "new" / "dir" / "out.pt"
    proc = run_cli("convert", medium, "--to", "pt", "-o", out,
                   preexec_fn=limit_file_size(1 << 20))  # fmt: skip
    check_error(proc, 2, "file too large")
    assert tree_files(tmp_path) == []
    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "sub" / "out.pt"
    proc = run_cli("convert", medium, "--to", "pt", "-o", out,
                   preexec_fn=limit_file_size(1 << 20))  # fmt: skip
    assert proc.returncode == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    assert list((tmp_path / "kept").iterdir()) == []


def test_stale_temp_of_dead_run_removed_live_one_kept(tmp_path: Path):
    torch.save({"w": torch.ones(3)}, tmp_path / "in.pt")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = tmp_path / f".out.safetensors{TEMP_MARK}{dead.pid}"
        running = tmp_path / f".out.safetensors{TEMP_MARK}{live.pid}"
        # a --force run killed between its two renames also leaves the old output aside
        stale_old = tmp_path / f".out.safetensors{TEMP_MARK}old-{dead.pid}"
        other = tmp_path / f".other.safetensors{TEMP_MARK}{dead.pid}"
        for path in (stale, stale_old, running, other):
            path.write_bytes(b"partial")
        result = convert(
            [str(tmp_path / "in.pt")], "safetensors", str(tmp_path / "out.safetensors")
        )
        # another output's dead temp goes too: whatever it was for, its writer is gone
        assert tree_files(tmp_path) == sorted([running.name, "in.pt", "out.safetensors"])
        assert sorted(t.path for t in result.removed) == sorted(
            str(p) for p in (stale, stale_old, other)
        )
        assert torch.equal(load_file(tmp_path / "out.safetensors")["w"], torch.ones(3))
    finally:
        live.kill()
        live.wait()


# ------------------------------------------------------------- atomic_output itself


def test_atomic_output_success_renames_at_the_end(tmp_path: Path):
    out = tmp_path / "o.bin"
    with atomic_output(str(out), force=False) as temp:
        assert Path(temp).parent == tmp_path
        assert Path(temp).name == f".o.bin{TEMP_MARK}{os.getpid()}"
        Path(temp).write_bytes(b"new")
        assert not out.exists()
    assert out.read_bytes() == b"new"
    assert tree_files(tmp_path) == ["o.bin"]


def test_atomic_output_error_inside_leaves_nothing(tmp_path: Path):
    out = tmp_path / "o.bin"
    with pytest.raises(ValueError, match="boom"), atomic_output(str(out), force=False) as temp:
        Path(temp).write_bytes(b"half")
        raise ValueError("boom")
    assert tree_files(tmp_path) == []


def test_atomic_output_disk_full_becomes_ckpt_error(tmp_path: Path):
    out = tmp_path / "o.bin"
    out.write_bytes(b"old")
    with pytest.raises(CkptError, match="disk full or file too large"):
        with atomic_output(str(out), force=True) as temp:
            Path(temp).write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert tree_files(tmp_path) == ["o.bin"]
    assert out.read_bytes() == b"old"  # the old output survives a failed --force run


def test_atomic_output_into_folder_replaces_only_its_own_files(tmp_path: Path):
    """A folder output goes into an existing folder: an earlier run's files of the same
    layout are refused without force and replaced with it, stale ones removed, the rest kept."""
    out = tmp_path / "shards"
    out.mkdir()
    (out / "config.json").write_text("keep")
    with atomic_output(str(out), force=False, layout=HF_SHARDS) as temp:
        assert Path(temp).parent == out and tree_files(Path(temp)) == []
        (Path(temp) / "model-00001-of-00002.safetensors").write_text("1")
        (Path(temp) / "model-00002-of-00002.safetensors").write_text("2")
        (Path(temp) / "model.safetensors.index.json").write_text("i")
    assert tree_files(out) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    with pytest.raises(OutputExistsError, match="--force"):
        with atomic_output(str(out), force=False, layout=HF_SHARDS) as temp:
            pytest.fail("never reached")
    with atomic_output(str(out), force=True, layout=HF_SHARDS) as temp:
        (Path(temp) / "model-00001-of-00001.safetensors").write_text("new")
        (Path(temp) / "model.safetensors.index.json").write_text("new index")
    assert tree_files(out) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert (out / "model.safetensors.index.json").read_text() == "new index"
    assert (out / "config.json").read_text() == "keep"


def test_atomic_output_into_folder_error_leaves_folder_as_it_was(tmp_path: Path):
    out = tmp_path / "dcp"
    out.mkdir()
    (out / ".metadata").write_bytes(b"old")
    (out / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="boom"):
        with atomic_output(str(out), force=True, layout=DCP_FILES) as temp:
            (Path(temp) / ".metadata").write_bytes(b"half")
            raise ValueError("boom")
    assert tree_files(out) == [".metadata", "notes.txt"]
    assert (out / ".metadata").read_bytes() == b"old"


def test_check_output_refuses_input_as_output(tmp_path: Path):
    src = tmp_path / "in.pt"
    src.write_bytes(b"x")
    link = tmp_path / "link.pt"
    link.symlink_to(src)
    for out in (src, link, tmp_path):  # the file, a link to it, a folder holding it
        with pytest.raises(CkptError, match="overwrite the input"):
            check_output(str(out), [str(src)], force=True)
    existing = tmp_path / "in.pt.bak"
    torch.save({"w": torch.ones(2)}, existing)  # --force replaces a checkpoint only
    with pytest.raises(OutputExistsError, match="--force"):
        check_output(str(existing), [str(src)], force=False)
    check_output(str(existing), [str(src)], force=True)


def test_folder_output_into_the_folder_holding_the_input(tmp_path: Path):
    """``-o`` = the input's folder writes beside the input and never touches it; a folder
    output whose own files would replace an input, or one inside an input folder, is refused."""
    torch.save({"w": torch.ones(2)}, tmp_path / "in.pt")
    before = sha256(tmp_path / "in.pt")
    convert([str(tmp_path / "in.pt")], "dcp", str(tmp_path), force=True)
    merge(str(tmp_path / "in.pt"), str(tmp_path), force=True)  # in.pt taken: in-merged.pt
    assert tree_files(tmp_path) == [".metadata", "__0_0.distcp", "in-merged.pt", "in.pt"]
    assert sha256(tmp_path / "in.pt") == before
    assert torch.equal(torch.load(tmp_path / "in-merged.pt", weights_only=True)["w"], torch.ones(2))
    with pytest.raises(CkptError, match="overwrite the input"):  # its own files are the input
        convert([str(tmp_path)], "dcp", str(tmp_path), force=True)
    with pytest.raises(CkptError, match="overwrite the input"):  # inside the input
        convert([str(tmp_path)], "pt", str(tmp_path / "sub/"), force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".metadata", "__0_0.distcp", "in-merged.pt", "in.pt"
    ]  # fmt: skip


def test_output_beside_files_we_cannot_open_is_written(tmp_path: Path):
    """Only the output's folder entry is synced after the rename, never what else the folder
    holds: a dangling link (or a file we may not read) next to the output is no error, and a
    big folder (``-o ~/model.safetensors``) is not walked."""
    src = tmp_path / "in.pt"
    torch.save({"w": torch.arange(6.0)}, src)
    (tmp_path / "gone").symlink_to(tmp_path / "missing")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "gone").symlink_to(tmp_path / "missing")
    result = run_cli("convert", str(src), "--to", "safetensors", "-o", str(tmp_path / "o.st"))
    assert result.returncode == 0, result.stderr
    assert torch.equal(load_file(tmp_path / "o.st")["w"], torch.arange(6.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone", "in.pt", "o.st", "sub"]


def test_stale_temp_folder_inside_an_output_folder_removed(tmp_path: Path):
    """Shards written into an existing folder go through a temp folder inside it: a killed
    run's is removed by the next run into that folder, a running one's is kept."""
    torch.save({"w": torch.ones(3)}, tmp_path / "in.pt")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale, running = out / f"{TEMP_MARK}{dead.pid}", out / f"{TEMP_MARK}{live.pid}"
        for folder in (stale, running):
            folder.mkdir()
            (folder / "model-00001-of-00001.safetensors").write_bytes(b"partial")
        convert([str(tmp_path / "in.pt")], "safetensors", str(out), max_shard_size="1GB")
        assert tree_files(out) == sorted([
            "config.json",
            "model-00001-of-00001.safetensors",
            "model.safetensors.index.json",
            running.name,
            f"{running.name}/model-00001-of-00001.safetensors",
        ])  # fmt: skip
        assert torch.equal(load_file(out / "model-00001-of-00001.safetensors")["w"], torch.ones(3))
    finally:
        live.kill()
        live.wait()


def test_a_folder_asked_for_where_the_input_file_is_names_that_problem(tmp_path):
    """``-o ep0.pt/`` of the input ``ep0.pt``: the folder is the file, not an overwrite."""
    import torch

    src = tmp_path / "ep0.pt"
    torch.save({"w": torch.ones(2)}, src)
    digest = sha256(src)
    line = check_error(
        run_cli("convert", src, "--to", "safetensors", "-o", f"{src}/"), 2, "input file"
    )
    assert line == (
        f"ckpttool: error: {src}: -o asks for a folder where the input file ep0.pt is "
        "(drop the trailing slash, or name another folder)"
    )
    assert sha256(src) == digest and tree_files(tmp_path) == ["ep0.pt"]
    over = check_error(run_cli("convert", src, "--to", "pt", "-o", src), 2)
    assert over.endswith("output would overwrite the input (choose another -o)")
