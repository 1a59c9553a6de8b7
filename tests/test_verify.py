"""``ckpttool verify`` and the size checks of ``inspect``, as a user meets them: real
checkpoints saved by torch, safetensors and DCP, copied whole, truncated, or with one
byte flipped; the first damage named exactly (file and what is wrong)."""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from helpers import (
    check_error,
    completed,
    fixture_path,
    run_many,
    small_state_dict,
    tricky_tensors,
    write_dcp,
    write_hf_shards,
)
from safetensors.torch import save_file

import ckpttool
from ckpttool.formats.torch_save.zip_stream import stream_file, zip_tasks
from ckpttool.sources.source import OpenFiles


def data_offset(path: Path, name: str) -> int:
    """Where a zip entry's bytes start in its file (after its local header)."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    raw = path.read_bytes()[info.header_offset : info.header_offset + 30]
    name_len, extra_len = struct.unpack("<HH", raw[26:30])
    return info.header_offset + 30 + name_len + extra_len


def flip(path: Path, at: int) -> None:
    """Flip the lowest bit of one byte, in place."""
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def entry_of_tensor(path: Path, want: torch.Tensor) -> str:
    """The ``archive/data/N`` entry holding a tensor's bytes (found by content)."""
    raw = want.numpy().tobytes()
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if "/data/" in n and z.read(n) == raw]
    assert len(names) == 1, names
    return names[0]


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """A training snapshot saved by torch.save: model, optimizer state, epoch."""
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    path = tmp_path / "snap.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, path)
    return path


def test_a_whole_torch_file_is_read_once_and_every_record_checked(snapshot: Path, tmp_path):
    tricky = tmp_path / "tricky.pt"
    torch.save(tricky_tensors(), tricky)
    runs = run_many(
        [["verify", snapshot], ["verify", snapshot, "--json"], ["verify", tricky, "--quiet"]]
    )
    with zipfile.ZipFile(snapshot) as z:
        records = len(z.infolist())
    size = snapshot.stat().st_size
    assert runs[0]["code"] == 0 and runs[0]["stderr"] == ""
    from ckpttool.cli.text import human_bytes

    assert runs[0]["stdout"] == (
        f"whole: {snapshot} (torch-zip; 1 file, {records} zip records CRC-checked, "
        f"{human_bytes(size)} read)\n"
    )
    assert json.loads(runs[1]["stdout"]) == {
        "ok": True,
        "format": "torch-zip",
        "files": [
            {"file": str(snapshot), "bytes": size, "crc_checked": records, "crc_unrecorded": 0}
        ],
        "bytes_checked": size,
        "damage": None,
    }
    assert runs[2]["code"] == 0 and runs[2]["stderr"] == ""
    assert runs[2]["stdout"].startswith(f"whole: {tricky} (torch-zip; 1 file, ")


def test_a_flipped_storage_byte_is_named_by_its_record_and_crc(snapshot: Path, tmp_path):
    """One bit of the optimizer's exp_avg flipped: torch.load and inspect see nothing
    (tensor bytes are not checked); verify names the record and both CRC-32s."""
    state = torch.load(snapshot, weights_only=True)
    exp_avg = state["optimizer"]["state"][0]["exp_avg"]
    name = entry_of_tensor(snapshot, exp_avg)
    damaged = tmp_path / "damaged.pt"
    shutil.copy(snapshot, damaged)
    at = data_offset(damaged, name) + 5
    flip(damaged, at)
    with zipfile.ZipFile(damaged) as z:
        recorded = z.getinfo(name).CRC
    bad = bytearray(exp_avg.numpy().tobytes())
    bad[5] ^= 1
    reason = (
        f"zip entry {name!r}: CRC-32 mismatch (the zip records {recorded:08x}, its bytes "
        f"give {zlib.crc32(bad):08x}): damaged data"
    )
    before = damaged.read_bytes()
    runs = run_many(
        [["verify", damaged], ["verify", damaged, "--json"], ["inspect", damaged, "--json"]]
    )
    line = check_error(completed([], runs[0]), 2)
    assert line == f"ckpttool: error: {damaged}: {reason}"
    assert runs[1]["code"] == 2
    assert runs[1]["stderr"] == f"ckpttool: error: {damaged}: {reason}\n"
    result = json.loads(runs[1]["stdout"])
    assert result["ok"] is False and result["format"] == "torch-zip"
    assert result["damage"] == {"file": str(damaged), "reason": reason}
    assert runs[2]["code"] == 0  # metadata alone: the damage is in tensor bytes
    assert damaged.read_bytes() == before  # verify never writes
    # the Python API says the same, as a result
    got = ckpttool.verify(str(damaged))
    assert got["ok"] is False and got["damage"] == {"file": str(damaged), "reason": reason}
    assert ckpttool.verify(snapshot)["ok"] is True


def test_damaged_pickle_descriptor_and_truncation(snapshot: Path, tmp_path):
    pickle_damaged = tmp_path / "pickle.pt"
    shutil.copy(snapshot, pickle_damaged)
    with zipfile.ZipFile(snapshot) as z:
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        info = z.getinfo(pkl)
        last = max(z.infolist(), key=lambda i: i.header_offset)
    # a byte of a string inside data.pkl (its protocol header is 2 bytes)
    flip(pickle_damaged, data_offset(snapshot, pkl) + info.file_size - 3)
    # torch writes a data descriptor after each entry: its CRC-32 damaged
    descriptor = tmp_path / "descriptor.pt"
    shutil.copy(snapshot, descriptor)
    end = data_offset(snapshot, last.filename) + last.compress_size
    assert descriptor.read_bytes()[end : end + 4] == b"PK\x07\x08"
    flip(descriptor, end + 4)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(snapshot.read_bytes()[:-100])
    runs = run_many([["verify", p] for p in (pickle_damaged, descriptor, truncated)])
    check_error(
        completed([], runs[0]),
        2,
        f"ckpttool: error: {pickle_damaged}: corrupt zip entry {pkl!r} (CRC-32 mismatch)",
    )
    check_error(
        completed([], runs[1]),
        2,
        f"ckpttool: error: {descriptor}: zip entry {last.filename!r}: its data descriptor "
        "disagrees with the central directory (CRC-32 or sizes)",
    )
    check_error(completed([], runs[2]), 2, f"{truncated}: truncated or corrupt zip archive")


def test_records_saved_without_crc_are_counted_not_failed(tmp_path):
    import torch.utils.serialization as serialization

    path = tmp_path / "nocrc.pt"
    saved = serialization.config.save.compute_crc32
    serialization.config.save.compute_crc32 = False
    try:
        torch.save(small_state_dict(), path)
    finally:
        serialization.config.save.compute_crc32 = saved
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    assert {i.CRC for i in infos} == {0}
    result = ckpttool.verify(path)
    assert result["ok"] is True
    # an empty record's CRC-32 is 0 by right: checked (none here: every record holds bytes)
    assert result["files"][0]["crc_unrecorded"] == len(infos)
    assert result["files"][0]["crc_checked"] == 0


def test_a_truncated_distcp_is_named_by_inspect_and_verify(tmp_path):
    """DCP's .metadata places each chunk in a .distcp file: a short copy is found by
    inspect without reading data (convert would fail later), and by verify."""
    whole = tmp_path / "ckpt"
    write_dcp(whole, {"model": {"w": torch.randn(64, 8)}})
    short = tmp_path / "short"
    shutil.copytree(whole, short)
    data = short / "__0_0.distcp"
    size = data.stat().st_size
    with data.open("r+b") as f:
        f.truncate(size - 100)
    runs = run_many([["inspect", whole], ["inspect", short], ["verify", short], ["verify", whole]])
    assert runs[0]["code"] == 0
    reason = (
        f"file too short: {size - 100:,} bytes, but the checkpoint places the bytes of "
        f"'model.w' up to byte {size:,} (truncated?)"
    )
    assert check_error(completed([], runs[1]), 2) == f"ckpttool: error: {data}: {reason}"
    assert check_error(completed([], runs[2]), 2) == f"ckpttool: error: {data}: {reason}"
    assert runs[3]["code"] == 0 and runs[3]["stdout"].startswith(f"whole: {whole} (dcp; 2 files")


def test_a_flipped_distcp_byte_names_the_archive_and_record(tmp_path):
    whole = tmp_path / "ckpt"
    write_dcp(whole, {"model": {"w": torch.arange(64.0), "b": torch.ones(8)}})
    from ckpttool.formats.dcp import data_spans

    data = whole / "__0_0.distcp"
    spans = data_spans(str(whole))[str(data)]
    raw = data.read_bytes()
    # the chunk archive holding w's bytes, and its storage record
    wanted = torch.arange(64.0).numpy().tobytes()
    start, length = next((s, n) for s, n in spans if wanted in raw[s : s + n])
    at = raw.index(wanted, start)
    damaged = tmp_path / "damaged"
    shutil.copytree(whole, damaged)
    flip(damaged / "__0_0.distcp", at)
    result = ckpttool.verify(str(damaged))
    assert result["ok"] is False
    assert result["damage"]["file"] == str(damaged / "__0_0.distcp")
    reason = result["damage"]["reason"]
    where = f" of the archive at byte {start:,}" if start else ""
    assert reason.startswith("zip entry '") and f"/data/0'{where}: CRC-32 mismatch" in reason
    assert ckpttool.verify(str(whole))["ok"] is True
    # every record of every chunk archive was compared
    records = sum(
        len(zipfile.ZipFile(__import__("io").BytesIO(raw[s : s + n])).infolist()) for s, n in spans
    )
    files = ckpttool.verify(str(whole))["files"]
    assert [f["file"] for f in files] == [str(whole / ".metadata"), str(data)]
    assert files[1]["crc_checked"] == records


def test_a_missing_distcp_is_named(tmp_path):
    folder = tmp_path / "ckpt"
    write_dcp(folder, {"w": torch.ones(3)})
    (folder / "__0_0.distcp").unlink()
    runs = run_many([["inspect", folder], ["verify", folder, "--json"]])
    reason = "missing: the checkpoint names this file (incomplete copy?)"
    line = check_error(completed([], runs[0]), 2)
    assert line == f"ckpttool: error: {folder / '__0_0.distcp'}: {reason}"
    assert runs[1]["code"] == 2
    assert json.loads(runs[1]["stdout"])["damage"] == {
        "file": str(folder / "__0_0.distcp"),
        "reason": reason,
    }


def test_per_rank_dcp_and_sharded_inputs_read_every_file(tmp_path):
    """Committed fixtures of each multi-file format: every file listed and read whole."""
    composer = fixture_path("composer")
    dcp = fixture_path("dcp")
    shards = tmp_path / "hf"
    write_hf_shards(shards, small_state_dict())
    for path, fmt, names in (
        (composer / "ep0-ba4-rank0.pt", "per-rank", ["ep0-ba4-rank0.pt", "ep0-ba4-rank1.pt"]),
        (dcp, "dcp", [".metadata", "__0_0.distcp", "__1_0.distcp"]),
        (
            shards,
            "safetensors-sharded",
            [
                "model.safetensors.index.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
            ],
        ),
    ):
        result = ckpttool.verify(str(path))
        assert result["ok"] is True and result["format"] == fmt, result
        assert [Path(f["file"]).name for f in result["files"]] == names
        assert result["bytes_checked"] == sum(f["bytes"] for f in result["files"])
        assert [f["bytes"] for f in result["files"]] == [
            Path(f["file"]).stat().st_size for f in result["files"]
        ]
    # a rank file of a per-rank checkpoint damaged: named, whichever rank was given
    copy = tmp_path / "composer"
    shutil.copytree(composer, copy)
    rank1 = copy / "ep0-ba4-rank1.pt"
    with zipfile.ZipFile(rank1) as z:
        name = max(
            (i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size
        ).filename
    flip(rank1, data_offset(rank1, name) + 1)
    result = ckpttool.verify(str(copy / "ep0-ba4-rank0.pt"))
    assert result["damage"]["file"] == str(rank1)
    assert result["damage"]["reason"].startswith(f"zip entry {name!r}: CRC-32 mismatch")


def test_a_missing_shard_and_a_short_safetensors_file(tmp_path):
    shards = tmp_path / "hf"
    write_hf_shards(shards, small_state_dict())
    (shards / "model-00002-of-00002.safetensors").unlink()
    single = tmp_path / "model.safetensors"
    save_file(small_state_dict(), single)
    short = tmp_path / "short.safetensors"
    short.write_bytes(single.read_bytes()[:-4])
    runs = run_many([["verify", shards], ["verify", short], ["verify", single]])
    line = check_error(completed([], runs[0]), 2)
    index = shards / "model.safetensors.index.json"
    assert line == f"ckpttool: error: {index}: missing shard model-00002-of-00002.safetensors"
    check_error(completed([], runs[1]), 2, f"ckpttool: error: {short}: ")
    assert runs[2]["code"] == 0
    assert runs[2]["stdout"].startswith(f"whole: {single} (safetensors; 1 file, ")


def test_legacy_files_and_separate_checkpoints(tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save(small_state_dict(), legacy, _use_new_zipfile_serialization=False)
    short = tmp_path / "short.pt"
    short.write_bytes(legacy.read_bytes()[:-8])
    other = tmp_path / "other.safetensors"
    save_file(small_state_dict(1), other)
    runs = run_many(
        [
            ["verify", legacy],
            ["verify", short],
            ["verify", legacy, other, "--json"],
            ["verify", legacy, short, other],
        ]
    )
    assert runs[0]["code"] == 0 and runs[0]["stdout"].startswith(f"whole: {legacy} (torch-legacy")
    check_error(completed([], runs[1]), 2, f"ckpttool: error: {short}: file ends 8 bytes early")
    # several separate checkpoints: each in turn (--json: one object per line)
    assert runs[2]["code"] == 0
    objects = [json.loads(line) for line in runs[2]["stdout"].splitlines()]
    assert [(o["format"], o["files"][0]["file"]) for o in objects] == [
        ("torch-legacy", str(legacy)),
        ("safetensors", str(other)),
    ]
    # up to the first damaged one, which is named; nothing after it is read
    assert runs[3]["code"] == 2
    assert runs[3]["stdout"].startswith(f"whole: {legacy} (torch-legacy")
    assert len(runs[3]["stdout"].splitlines()) == 1
    assert runs[3]["stderr"].startswith(f"ckpttool: error: {short}: file ends 8 bytes early")


def test_verify_judges_pickles_as_every_command_does(tmp_path):
    import os

    from payloads import Reduce, write_malicious_zip

    bad = tmp_path / "bad.pt"
    write_malicious_zip(bad, Reduce(os.system, ("echo pwned",)))
    runs = run_many([["verify", bad], ["verify", bad, "--unsafe"]])
    check_error(completed([], runs[0]), 3, "refused:", "posix.system", "nothing was executed")
    assert runs[1]["code"] == 0 and runs[1]["stdout"].startswith(f"whole: {bad} (torch-zip")


def test_stream_checks_records_whatever_the_block_size(snapshot: Path, tmp_path):
    """Headers, data and descriptors cut across blocks of any size are checked alike."""
    damaged = tmp_path / "damaged.pt"
    shutil.copy(snapshot, damaged)
    with zipfile.ZipFile(snapshot) as z:
        name = next(n for n in z.namelist() if n.endswith("/data/0"))
    flip(damaged, data_offset(damaged, name))
    files = OpenFiles()
    try:
        for block in (1, 7, 64, 4096):
            tasks, counts = zip_tasks(str(snapshot))
            assert stream_file(str(snapshot), tasks, files, block_bytes=block) == (
                snapshot.stat().st_size
            )
            assert counts == [len(zipfile.ZipFile(snapshot).infolist()), 0]
            tasks, _ = zip_tasks(str(damaged))
            with pytest.raises(ckpttool.CkptError, match=rf"{name}'?: CRC-32 mismatch"):
                stream_file(str(damaged), tasks, files, block_bytes=block)
    finally:
        files.close()


def test_deflated_records_are_inflated_and_checked(snapshot: Path, tmp_path):
    """A re-zipped file whose data.pkl is deflated (torch reads it): its CRC-32 is that
    of the inflated bytes; damaged deflate data is named."""
    rezipped = tmp_path / "rezipped.pt"
    with zipfile.ZipFile(snapshot) as zin, zipfile.ZipFile(rezipped, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if info.filename.endswith("data.pkl") else 0
            zout.writestr(info.filename, zin.read(info.filename), compress_type=method)
    assert ckpttool.verify(str(rezipped))["ok"] is True
    with zipfile.ZipFile(rezipped) as z:
        pkl = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    damaged = tmp_path / "damaged.pt"
    shutil.copy(rezipped, damaged)
    flip(damaged, data_offset(damaged, pkl.filename) + pkl.compress_size // 2)
    tasks, _ = zip_tasks(str(damaged))
    files = OpenFiles()
    try:
        with pytest.raises(ckpttool.CkptError, match=rf"{pkl.filename}"):
            stream_file(str(damaged), tasks, files)
    finally:
        files.close()


def test_remote_inputs_are_verified_by_ranged_reads(snapshot: Path, tmp_path: Path):
    """A file on an HTTP server (and a DCP folder named by its .metadata) is verified
    as its local copy is: every byte read once, the same records checked."""
    from servers import RangeServer

    served = tmp_path / "served"
    served.mkdir()
    shutil.copy(snapshot, served / "snap.pt")
    shutil.copytree(fixture_path("dcp"), served / "dcp")
    damaged = served / "damaged.pt"
    shutil.copy(snapshot, damaged)
    with zipfile.ZipFile(snapshot) as z:
        name = next(n for n in z.namelist() if n.endswith("/data/1"))
    flip(damaged, data_offset(damaged, name))
    server = RangeServer(served)
    try:
        for local, url in (
            (served / "snap.pt", server.url("snap.pt")),
            (served / "dcp", server.url("dcp/.metadata")),
        ):
            here, there = ckpttool.verify(str(local)), ckpttool.verify(url)
            assert there["ok"] is True and there["format"] == here["format"]
            assert there["bytes_checked"] == here["bytes_checked"]
            strip = [{k: v for k, v in f.items() if k != "file"} for f in here["files"]]
            assert [{k: v for k, v in f.items() if k != "file"} for f in there["files"]] == strip
        result = ckpttool.verify(server.url("damaged.pt"))
        assert result["damage"]["file"] == server.url("damaged.pt")
        assert result["damage"]["reason"].startswith(f"zip entry {name!r}: CRC-32 mismatch")
    finally:
        server.close()


def test_progress_is_told_every_byte_read(snapshot: Path, tmp_path: Path):
    """The progress bar's total is the checkpoint's size, and every byte read is told."""
    import contextlib

    folder = tmp_path / "dcp"
    write_dcp(folder, {"model": small_state_dict(), "step": 4})
    for path in (snapshot, folder):
        told: list[tuple[int, str]] = []
        done: list[int] = []

        @contextlib.contextmanager
        def progress(total: int, description: str, told=told, done=done):
            told.append((total, description))
            yield done.append

        result = ckpttool.verify(str(path), progress=progress)
        total = sum(f["bytes"] for f in result["files"])
        assert told == [(total, "verifying")]
        assert sum(done) == result["bytes_checked"] == total
