"""OutputFile writing a part of a file at an offset: only its own bytes change, with
O_DIRECT and through the page cache, whatever the alignment of the part's ends."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from ckpttool.writers import output_file
from ckpttool.writers.output_file import OutputFile

BLOCK = output_file.ALIGNMENT


# every part crosses buffers and blocks (conftest: three 8 KiB buffers)
pytestmark = pytest.mark.usefixtures("small_buffers")


def _cuts(size: int, rng: random.Random) -> list[int]:
    """Part boundaries: some on block boundaries, most not."""
    inner = {rng.randrange(1, size) for _ in range(12)} | {BLOCK, 3 * BLOCK, 3 * BLOCK + 1}
    return [0, *sorted(c for c in inner if c < size), size]


@pytest.mark.parametrize("seed", range(4))
def test_parts_in_any_order_give_the_whole_file(tmp_path: Path, mode: str, seed: int):
    rng = random.Random(seed)
    size = rng.randrange(5 * 8192, 9 * 8192)
    data = rng.randbytes(size)
    whole = tmp_path / "whole"
    with OutputFile(str(whole)) as out:
        out.write(data)
    cuts = _cuts(size, rng)
    parts = list(zip(cuts, cuts[1:], strict=False))
    rng.shuffle(parts)
    parted = tmp_path / "parted"
    parted.write_bytes(b"\xee" * size)  # what a part must not leave behind
    for start, end in parts:
        with OutputFile(str(parted), offset=start) as out:
            assert out.pos == start
            # in pieces of odd sizes, as writers append headers and tensors
            at = start
            while at < end:
                step = min(end - at, rng.choice([1, 7, 4096, 5000, 20000]))
                out.write(data[at : at + step])
                at += step
            assert out.pos == end
    assert parted.read_bytes() == whole.read_bytes() == data


def test_a_part_touches_nothing_outside_it(tmp_path: Path, mode: str):
    """Neither the block it starts in nor the one it ends in is padded or cut: the
    neighbours' bytes stay, and so does the file's size."""
    path = tmp_path / "f"
    path.write_bytes(b"\xaa" * (40 * BLOCK))
    start, payload = BLOCK + 100, bytes(range(256)) * 100  # 25600 bytes, ends unaligned
    with OutputFile(str(path), offset=start) as out:
        out.write(payload)
        out.patch(start + 5, b"PATCH")  # still buffered
    expected = bytearray(b"\xaa" * (40 * BLOCK))
    expected[start : start + len(payload)] = payload
    expected[start + 5 : start + 10] = b"PATCH"
    assert path.read_bytes() == bytes(expected)


def test_a_part_copies_from_a_file_at_its_offset(tmp_path: Path, mode: str):
    source = tmp_path / "src"
    source.write_bytes(os.urandom(30000))
    path = tmp_path / "f"
    path.write_bytes(bytes(40000))
    seen: list[int] = []
    with OutputFile(str(path), offset=777) as out:
        out.begin_crc32()
        out.copy_from(str(source), 123, 20000, seen.append)
        crc = out.end_crc32()
    import zlib

    assert sum(seen) == 20000
    assert crc == zlib.crc32(source.read_bytes()[123:20123])
    assert path.read_bytes()[777:20777] == source.read_bytes()[123:20123]
    assert path.read_bytes()[:777] == bytes(777) and path.read_bytes()[20777:] == bytes(19223)


def test_a_whole_file_is_still_cut_at_its_last_byte(tmp_path: Path, mode: str):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100000)  # an earlier, longer file: truncated on open
    with OutputFile(str(path), size_hint=50000) as out:
        out.write(b"y" * 12345)
    assert path.read_bytes() == b"y" * 12345


def test_negative_offset_refused(tmp_path: Path):
    with pytest.raises(ValueError):
        OutputFile(str(tmp_path / "f"), offset=-1)
