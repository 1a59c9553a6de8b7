"""The staging writer under every output: bytes appended, copied from files and patched
land exactly where they belong, through O_DIRECT or the page cache, across buffers."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import threading
import time
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttool.convert import convert
from ckpttool.errors import CkptError
from ckpttool.merge import merge
from ckpttool.writers import output_file
from ckpttool.writers.output_file import OutputFile

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _write_mixed(out: OutputFile, source: Path, rng: random.Random) -> tuple[bytearray, list]:
    """Appends, file copies and CRC ranges of random sizes; returns the expected bytes."""
    source_bytes = source.read_bytes()
    expected, crcs = bytearray(), []
    for step in range(60):
        if step % 7 == 0:
            out.begin_crc32()
            crc_start = len(expected)
        if rng.random() < 0.5:
            data = rng.randbytes(rng.choice([0, 1, 3, 4095, 4096, 4097, 9000, 20000]))
            out.write(data)
            expected += data
        else:
            offset = rng.randrange(len(source_bytes))
            nbytes = rng.randrange(min(30000, len(source_bytes) - offset) + 1)
            out.copy_from(str(source), offset, nbytes, None)
            expected += source_bytes[offset : offset + nbytes]
        if step % 7 == 6:
            crcs.append((out.end_crc32(), zlib.crc32(expected[crc_start:])))
        assert out.pos == len(expected)
    return expected, crcs


def test_appends_copies_patches_and_crcs_land_exactly(small_buffers, mode, tmp_path: Path):
    rng = random.Random(0)
    source = tmp_path / "source.bin"
    source.write_bytes(rng.randbytes(100_000))
    path = tmp_path / "out.bin"
    with OutputFile(str(path)) as out:
        assert out.direct == (mode == "direct")
        expected, crcs = _write_mixed(out, source, rng)
        # bytes long written, bytes in the buffer being filled, and a patch across both
        at_boundary = out._base - 2
        for offset in (5, 8190, at_boundary, len(expected) - 4):
            patch = rng.randbytes(4)
            out.patch(offset, patch)
            expected[offset : offset + 4] = patch
    assert path.read_bytes() == expected
    assert len(expected) % 4096  # the padded direct write was cut back to the real size
    assert [got for got, _ in crcs] == [want for _, want in crcs]


@pytest.mark.parametrize("hint_factor", [0.5, 1, 40])
@pytest.mark.parametrize("nbytes", [50_001, 12 * 4096])  # a padded last write, or none
def test_size_hint_allocates_up_front_and_the_file_ends_at_its_last_byte(
    small_buffers, mode, tmp_path: Path, hint_factor, nbytes
):
    """Blocks allocated for a size hint that was too large are cut off; a hint that was
    too small only means the rest grows the file as it goes."""
    data = random.Random(4).randbytes(nbytes)
    hint = int(len(data) * hint_factor)
    path = tmp_path / "out.bin"
    with OutputFile(str(path), size_hint=hint) as out:
        if output_file._libc_functions.get("fallocate"):  # Linux (glibc)
            assert os.fstat(out.fd).st_size == hint  # allocated before a byte is written
        out.write(data[:30_000])
        out.patch(10, b"patched")
        out.write(data[30_000:])
        assert out.pos == nbytes
    expected = data[:10] + b"patched" + data[17:]
    assert path.read_bytes() == expected
    assert path.stat().st_size == len(data)


def test_preallocation_refused_costs_nothing(small_buffers, tmp_path: Path):
    """A hint past RLIMIT_FSIZE (or a full disk) makes fallocate fail: the writes go on
    and meet the real limit, if any, themselves."""
    path = tmp_path / "out.bin"
    with OutputFile(str(path), size_hint=1 << 62) as out:
        out.write(b"abc" * 10_000)
    assert path.read_bytes() == b"abc" * 10_000


def test_o_direct_refused_midway_goes_on_through_the_page_cache(
    small_buffers, monkeypatch, tmp_path: Path
):
    """Some file systems accept O_DIRECT at open, then refuse the write (EINVAL)."""
    real_pwrite = os.pwrite

    def pwrite_refusing_direct(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & output_file._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite_refusing_direct)
    source = tmp_path / "source.bin"
    source.write_bytes(random.Random(1).randbytes(50_000))
    path = tmp_path / "out.bin"
    with OutputFile(str(path)) as out:
        expected, _ = _write_mixed(out, source, random.Random(2))
    assert not out.direct or not output_file._O_DIRECT
    assert path.read_bytes() == expected


def test_o_direct_refused_in_two_writer_threads_at_once(small_buffers, monkeypatch, tmp_path):
    """Two writes refused together: the one that sees O_DIRECT already given up by the
    other must still go on through the page cache, not fail the output."""
    if not output_file._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_pwrite = os.pwrite
    both_refused = threading.Barrier(2, timeout=10)
    seen = {"out": None}

    def pwrite_refusing_direct(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & output_file._O_DIRECT:
            if both_refused.wait() == 0:  # the second to be refused waits for the first
                deadline = time.monotonic() + 10
                while seen["out"].direct and time.monotonic() < deadline:
                    time.sleep(0.001)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite_refusing_direct)
    path = tmp_path / "out.bin"
    data = random.Random(3).randbytes(3 * 8192)
    with OutputFile(str(path)) as out:
        if not out.direct:
            pytest.skip("this file system refuses O_DIRECT")
        seen["out"] = out
        out.write(data)  # two full buffers go to two writer threads
    assert path.read_bytes() == data


def test_write_error_in_a_writer_thread_reaches_the_caller(small_buffers, tmp_path: Path):
    path = tmp_path / "out.bin"
    with pytest.raises(OSError) as caught, OutputFile(str(path)) as out:
        os.close(out.fd)  # every later write fails with EBADF
        out.fd = os.open(os.devnull, os.O_RDONLY)
        out.write(b"x" * 100_000)
    assert caught.value.errno == errno.EBADF


def test_input_read_errors_name_the_input(tmp_path: Path):
    with OutputFile(str(tmp_path / "out.bin")) as out:
        with pytest.raises(CkptError, match=r"cannot read the input \(Is a directory\)"):
            out.copy_from(str(tmp_path), 0, 10, None)
        short = tmp_path / "short.bin"
        short.write_bytes(b"abc")
        with pytest.raises(CkptError, match=r"input ends early \(truncated\)") as caught:
            out.copy_from(str(short), 0, 10, None)
        assert caught.value.path == str(short)


INPUTS = {
    "ddp": ["ddp/ep0-rank0.pt"],
    "composer": ["composer/ep0-ba4-rank0.pt", "composer/ep0-ba4-rank1.pt"],
    "dcp": ["dcp"],
}


def _convert_twice(monkeypatch, tmp_path: Path, run) -> tuple[bytes, bytes]:
    """``run(out)`` through 4 KiB buffers, then through the default ones."""
    monkeypatch.setattr(output_file, "BUFFER_BYTES", 4096)
    monkeypatch.setattr(output_file, "BUFFERS", 2)
    small, default = tmp_path / "small" / "out", tmp_path / "default" / "out"
    run(small)
    monkeypatch.undo()
    run(default)
    assert small.stat().st_size > 2 * 4096  # spread over three buffers at least
    return small.read_bytes(), default.read_bytes()


@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("to", ["safetensors", "pt"])
def test_conversions_through_tiny_buffers_are_identical(monkeypatch, tmp_path: Path, name, to):
    inputs = [str(FIXTURES / path) for path in INPUTS[name]]
    small, default = _convert_twice(
        monkeypatch, tmp_path, lambda out: convert(inputs, to, str(out), select="all")
    )
    assert small == default
    if to == "safetensors":
        assert load_file(tmp_path / "small" / "out")
    else:
        assert zipfile.ZipFile(tmp_path / "small" / "out").testzip() is None  # every CRC
        assert torch.load(tmp_path / "small" / "out", weights_only=True)


@pytest.mark.parametrize("name", ["composer", "dcp"])
def test_merges_through_tiny_buffers_are_identical(monkeypatch, tmp_path: Path, name):
    inputs = [str(FIXTURES / path) for path in INPUTS[name]]
    small, default = _convert_twice(monkeypatch, tmp_path, lambda out: merge(inputs, str(out)))
    assert small == default
    assert zipfile.ZipFile(tmp_path / "small" / "out").testzip() is None
    assert torch.load(tmp_path / "small" / "out", weights_only=True)
