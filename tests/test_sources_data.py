"""Tensor bytes read through the byte-source interface: load, open().get_slice,
load_into, diff and the writers' copy path give the same bytes from a source with no
local path (``counting://``: every byte through ``read_into``) as from the local file,
each stored byte read once.

The readers still take the structure from local files here; the tree's byte spans are
then pointed at the same files behind ``counting://`` URLs, so every tensor byte the
commands read goes through the source.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import counting_url, write_dcp
from safetensors.torch import load_file, save_file

import ckpttool
from ckpttool import sources
from ckpttool.diff import RawReader, compare_tensors, diff
from ckpttool.errors import CkptError
from ckpttool.sources.spans import ByteSpan, read_span_into
from ckpttool.tensors.mapped import SpanReader, map_storage
from ckpttool.tree.checkpoint import iter_tensors
from ckpttool.tree.leaves import ShardedRef, TensorRef
from ckpttool.tree.sharding import raw_parts
from ckpttool.writers import write_leaf
from ckpttool.writers.output_file import OutputFile

# ---------------------------------------------------------------- checkpoints


def _zip_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    shared = torch.randn(4, 3, generator=g)
    return {
        "f32": torch.randn(7, 3, generator=g),
        "f16": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "i64": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "bool": torch.tensor([True, False, True]),
        "base": base,
        "base_t": base.t(),  # a non-contiguous view of a saved tensor
        "base_rows": base[2:5],  # a view at an offset into the same storage
        "embed": shared,
        "lm_head": shared,  # tied weights: one storage under two names
        "empty": torch.empty(0, 4),
    }


@pytest.fixture
def zip_file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path / "model.pt"
    torch.save(_zip_state(), path)
    return path, torch.load(path, weights_only=True)


@pytest.fixture
def safetensors_file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    state = {
        "w": torch.randn(8, 6, generator=g),
        "h": torch.randn(4, 4, generator=g).half(),
        "b": torch.randn(10, generator=g).to(torch.bfloat16),
        "n": torch.arange(12, dtype=torch.int32),
    }
    path = tmp_path / "model.safetensors"
    save_file(state, path, metadata={"format": "pt"})
    return path, load_file(path)


class _PinnedBlock:
    """A shard's block whose stored tensor is resolved once (the DCP reader opens the
    ``.distcp`` file to find it; the test then points its bytes at a URL)."""

    cast_to = None  # read as stored (tree.leaves.Block)

    def __init__(self, ref: TensorRef):
        self.ref = ref
        self.shape = ref.shape

    def tensor_ref(self) -> TensorRef:
        return self.ref


def _byte_sources(ckpt: Any) -> list[ByteSpan]:
    """Every distinct file-backed ByteSpan of the tree, DCP blocks pinned first."""
    found: dict[int, ByteSpan] = {}
    for _, leaf in iter_tensors(ckpt.root):
        refs = [leaf]
        if isinstance(leaf, ShardedRef):
            refs = []
            leaf.shards = list(leaf.shards)  # (a DCP tensor's chunks are made on reading)
            for shard in leaf.shards:
                if not isinstance(shard.tensor, _PinnedBlock):
                    shard.tensor = _PinnedBlock(shard.tensor.tensor_ref())
                refs.append(shard.tensor.ref)
        for ref in refs:
            source = ref.storage.source if ref.storage is not None else None
            if source is not None and source.path is not None:
                found[id(source)] = source
    return list(found.values())


def _behind_counting(ckpt: Any) -> list[ByteSpan]:
    """Point every tensor's bytes at ``counting://`` URLs of the same files."""
    spans = _byte_sources(ckpt)
    for source in spans:
        assert sources.local_path(source.path) is not None
        source.path = counting_url(source.path)
    return spans


def _headers(spans: list[ByteSpan]) -> int:
    """Bytes of the zip local headers the spans still have to look up (30 each)."""
    return 30 * sum(s._zip_header_offset is not None for s in spans)


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def _only_counting_reads(counting, files: list[Path]) -> None:
    allowed = {counting_url(f) for f in files}
    assert {path for path, _, _ in counting.reads} <= allowed


# ---------------------------------------------------------------- ByteSpan & spans


def test_byte_source_reads_a_span_through_the_source(counting_source, tmp_path: Path):
    path = tmp_path / "blob.bin"
    data = os.urandom(5000)
    path.write_bytes(data)
    span = ByteSpan(counting_url(path), 1000, 3000)
    assert span.read(10, 500) == data[1010:1510]
    assert span.read() == data[1000:4000]
    assert counting_source.bytes_read == 500 + 3000
    assert counting_source.reads == [
        (counting_url(path), 1010, 500),
        (counting_url(path), 1000, 3000),
    ]


def test_zip_entry_header_is_resolved_through_the_source(counting_source, zip_file):
    path, _ = zip_file
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
        stored = archive.read(info)
    span = ByteSpan(counting_url(path), 0, len(stored), zip_header_offset=info.header_offset)
    assert span.read() == stored
    assert counting_source.reads[0] == (counting_url(path), info.header_offset, 30)
    assert counting_source.bytes_read == 30 + len(stored)
    assert span.read(0, 4) == stored[:4]  # resolved once: no second header read
    assert counting_source.bytes_read == 30 + len(stored) + 4


def test_a_corrupt_zip_entry_header_is_one_clear_error(counting_source, tmp_path: Path):
    path = tmp_path / "not-a-zip.bin"
    path.write_bytes(b"y" * 100)
    for header_offset in (0, 90):  # wrong magic; a header cut short by the end of the file
        span = ByteSpan(counting_url(path), 0, 4, zip_header_offset=header_offset)
        with pytest.raises(CkptError, match="corrupt zip entry header"):
            span.read()


@pytest.mark.parametrize("files", [False, True], ids=["one-off", "open files"])
def test_truncated_spans_are_one_clear_error(counting_source, tmp_path: Path, files):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    url = counting_url(path)
    opened = sources.OpenFiles() if files else None
    try:
        with pytest.raises(CkptError, match=r"file ends 50 bytes early \(truncated\?\)"):
            read_span_into(ByteSpan(url, 50, 100), 0, memoryview(bytearray(100)), opened)
        with pytest.raises(CkptError, match=r"file ends 50 bytes early \(truncated\?\)"):
            ByteSpan(url, 50, 100).read()
        with pytest.raises(CkptError, match="outside of the stored bytes"):
            read_span_into(ByteSpan(url, 0, 10), 5, memoryview(bytearray(10)), opened)
    finally:
        if opened is not None:
            opened.close()


def test_a_huge_declared_span_allocates_nothing(counting_source, tmp_path: Path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    with pytest.raises(CkptError, match="truncated"):
        ByteSpan(counting_url(path), 0, 1 << 50).read()
    assert counting_source.bytes_read == 0


def test_map_storage_maps_local_files_and_declines_urls(counting_source, tmp_path: Path):
    path = tmp_path / "blob.bin"
    data = os.urandom(4096)
    path.write_bytes(data)
    maps: dict = {}
    local = map_storage(ByteSpan(str(path), 0, 4096), 64, 256, 4, maps)
    assert local.nbytes() == 256 and bytes(local) == data[64:320]
    assert map_storage(ByteSpan(counting_url(path), 0, 4096), 64, 256, 4, maps) is None
    assert counting_source.bytes_read == 0


def test_reader_fills_buffers_from_local_files_and_urls(counting_source, tmp_path: Path):
    path = tmp_path / "blob.bin"
    data = os.urandom(10_000)
    path.write_bytes(data)
    before = sources.LOCAL.bytes_read
    with SpanReader() as reader:
        for where in (str(path), counting_url(path)):
            buf = bytearray(3000)
            reader.read_into(ByteSpan(where, 100, 9000), 200, buf)
            assert buf == data[300:3300]
    assert sources.LOCAL.bytes_read - before == 3000  # the preadv fast path is counted
    assert counting_source.bytes_read == 3000


# ---------------------------------------------------------------- load / open / load_into


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "read"])
def test_load_of_a_zip_checkpoint_through_a_url(counting_source, zip_file, mmap):
    path, want = zip_file
    ckpt = ckpttool.read(str(path))
    spans = _behind_counting(ckpt)
    expected = sum(s.length for s in spans if s.length) + _headers([s for s in spans if s.length])
    got = ckpttool.load(ckpt, select="all", mmap=mmap)
    _assert_same(got, want)
    assert got["embed"].data_ptr() == got["lm_head"].data_ptr()  # still tied
    assert counting_source.bytes_read == expected  # each stored byte read once
    _only_counting_reads(counting_source, [path])


def test_load_of_a_zip_checkpoint_bitwise_equal_to_the_local_one(counting_source, zip_file):
    path, _ = zip_file
    local = ckpttool.load(str(path), select="all")
    ckpt = ckpttool.read(str(path))
    _behind_counting(ckpt)
    _assert_same(ckpttool.load(ckpt, select="all"), local)


def test_load_of_safetensors_through_a_url(counting_source, safetensors_file):
    path, want = safetensors_file
    ckpt = ckpttool.read(str(path))
    _behind_counting(ckpt)
    _assert_same(ckpttool.load(ckpt, select="all"), want)
    assert counting_source.bytes_read == sum(t.nbytes for t in want.values())


def test_get_slice_reads_only_the_rows_asked_for(counting_source, safetensors_file):
    path, want = safetensors_file
    ckpt = ckpttool.read(str(path))
    _behind_counting(ckpt)
    with ckpttool.open(ckpt) as f:
        rows = f.get_slice("w")[2:5]
        assert torch.equal(rows, want["w"][2:5])
        assert counting_source.bytes_read == 3 * 6 * 4
        assert torch.equal(f.get_tensor("h"), want["h"])
    assert counting_source.bytes_read == 3 * 6 * 4 + want["h"].nbytes


def test_load_of_a_dcp_folder_through_urls(counting_source, tmp_path: Path):
    g = torch.Generator().manual_seed(2)
    state = {
        "w": torch.randn(6, 4, generator=g),
        "b": torch.randn(4, generator=g).to(torch.bfloat16),
        "steps": torch.arange(5),
    }
    folder = tmp_path / "dcp"
    write_dcp(folder, state)
    ckpt = ckpttool.read(str(folder))
    spans = _behind_counting(ckpt)
    expected = sum(t.nbytes for t in state.values()) + _headers(spans)
    got = ckpttool.load(ckpt, select="all")
    _assert_same(got, state)
    assert counting_source.bytes_read == expected
    _only_counting_reads(counting_source, sorted(folder.glob("*.distcp")))


def test_load_into_a_model_through_a_url(counting_source, tmp_path: Path):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    ckpt = ckpttool.read(str(path))
    spans = _behind_counting(ckpt)
    expected = sum(p.nbytes for p in model.state_dict().values()) + _headers(spans)
    target = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    result = ckpttool.load_into(target, ckpt)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    for name, value in model.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    assert counting_source.bytes_read == expected


# ---------------------------------------------------------------- diff


def test_diff_compares_stored_bytes_through_urls(counting_source, zip_file, tmp_path: Path):
    path, want = zip_file
    contiguous = {n: want[n].clone() for n in ("f32", "bf16", "i64", "base")}
    other = tmp_path / "other.safetensors"
    save_file(contiguous, other)
    a, b = ckpttool.read(str(path)), ckpttool.read(str(other))
    _behind_counting(a)
    _behind_counting(b)
    readers = (RawReader(64), RawReader(64))  # small blocks: many reads per tensor
    try:
        for name in ("f32", "bf16", "i64", "base"):
            x, y = a[name], b[name]
            assert raw_parts(x) is not None and raw_parts(y) is not None
            assert compare_tensors(x, y, 0.0, 0.0, readers) == {
                "max_abs_diff": 0.0,
                "num_different": 0,
            }
        nbytes = sum(want[n].nbytes for n in ("f32", "bf16", "i64", "base"))
        data = [r for r in counting_source.reads if r[2] != 30]  # less the zip headers
        assert sum(size for _, _, size in data) == 2 * nbytes
    finally:
        for reader in readers:
            reader.files.close()


def test_diff_finds_a_changed_value_through_urls(counting_source, safetensors_file, tmp_path):
    path, want = safetensors_file
    changed = dict(want)
    changed["w"] = want["w"].clone()
    changed["w"][7, 5] += 1
    other = tmp_path / "changed.safetensors"
    save_file(changed, other)
    a, b = ckpttool.read(str(path)), ckpttool.read(str(other))
    _behind_counting(a)
    _behind_counting(b)
    result = diff(a, b)
    assert [d["name"] for d in result["different"]] == ["w"]
    assert result["different"][0]["num_different"] == 1
    _only_counting_reads(counting_source, [path, other])


# ---------------------------------------------------------------- writers


def test_copy_from_a_url_writes_what_the_local_copy_writes(
    counting_source, small_buffers, mode, tmp_path: Path
):
    source = tmp_path / "source.bin"
    data = os.urandom(60_000)
    source.write_bytes(data)
    copies = [(0, 0), (1, 1), (3, 4095), (5000, 20_000), (100, 33_333), (59_000, 1000)]
    outputs = {}
    for where in (str(source), counting_url(source)):
        out_path = tmp_path / f"out-{len(outputs)}.bin"
        with OutputFile(str(out_path)) as out:
            out.write(b"head")
            for offset, nbytes in copies:
                out.copy_from(where, offset, nbytes, None)
        outputs[where] = out_path.read_bytes()
    expected = b"head" + b"".join(data[o : o + n] for o, n in copies)
    assert outputs[str(source)] == outputs[counting_url(source)] == expected
    assert counting_source.bytes_read == sum(n for _, n in copies)
    # each copy is ranges that follow each other, none larger than a staging buffer
    reads = iter(counting_source.reads)
    for offset, nbytes in copies:
        at = offset
        while at < offset + nbytes:
            _, read_offset, size = next(reads)
            assert read_offset == at and 0 < size <= 8192
            at += size
        assert at == offset + nbytes
    assert next(reads, None) is None


def test_copy_from_a_truncated_url_is_one_clear_error(counting_source, tmp_path: Path):
    short = tmp_path / "short.bin"
    short.write_bytes(b"abc")
    with OutputFile(str(tmp_path / "out.bin")) as out:
        with pytest.raises(CkptError, match="truncated") as caught:
            out.copy_from(counting_url(short), 0, 10, None)
    assert caught.value.path == counting_url(short)


def test_write_leaf_copies_stored_bytes_from_urls(
    counting_source, small_buffers, zip_file, tmp_path
):
    path, want = zip_file
    ckpt = ckpttool.read(str(path))
    names = ["f32", "f16", "bf16", "i64", "bool", "embed"]
    headers = _headers([ckpt[n].storage.source for n in names])
    _behind_counting(ckpt)
    progressed: list[int] = []
    out_path = tmp_path / "raw.bin"
    with OutputFile(str(out_path)) as out:
        for name in names:
            assert raw_parts(ckpt[name]) is not None
            write_leaf(out, ckpt[name], None, progressed.append)
    expected = b"".join(
        bytes(want[n].contiguous().view(torch.uint8).reshape(-1).numpy()) for n in names
    )
    assert out_path.read_bytes() == expected
    assert sum(progressed) == len(expected)
    assert counting_source.bytes_read == len(expected) + headers
