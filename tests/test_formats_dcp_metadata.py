"""A large DCP ``.metadata`` read in bulk (formats/dcp_metadata.py): the same checkpoint as
the generic reader, and every check as strict, wherever in the file the trouble lies.

The folders are built here with torch's own metadata classes, as a save by many ranks
pickles them (each chunk's objects its own), on sparse data files."""

from __future__ import annotations

import os
import pickle
import pprint

import pytest
import torch
from helpers import run_many
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import ckpttool
from ckpttool.errors import CkptError, UnsafeError
from ckpttool.formats import dcp
from ckpttool.formats.dcp import metadata as dcp_metadata
from ckpttool.tree.checkpoint import iter_tensors
from ckpttool.tree.sharding import row_blocks
from ckpttool.unpickler.restricted import load_pickle


def write_folder(folder, ranks, shapes, tweak=None, value=None):
    """A DCP folder of ``shapes`` (name -> shape) saved by ``ranks`` ranks along dim 0,
    each chunk's objects its own (as gathered from its rank); ``tweak(n, key, info)``
    may replace the n-th storage entry (in saved order). A byte value ``extra`` if given."""
    md, storage, sizes = {}, {}, [0] * ranks
    planner = {}
    for fqn, shape in shapes.items():
        props = TensorProperties(dtype=torch.float32)
        md[fqn] = TensorStorageMetadata(props, torch.Size(shape), [])
        planner[fqn] = ("model", fqn)
    n = 0
    for rank in range(ranks):
        for fqn, shape in shapes.items():
            rows = -(-shape[0] // ranks)
            start = min(rank * rows, shape[0])
            length = min(rows, shape[0] - start)
            offsets, chunk = (start, *[0] * (len(shape) - 1)), (length, *shape[1:])
            md[fqn].chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(chunk)))
            key = MetadataIndex("".join(fqn), torch.Size(offsets), len(md[fqn].chunks) - 1)
            nbytes = 4 * length * (shape[1] if len(shape) > 1 else 1) + 1000
            info = _StorageInfo(f"__{rank}_0.distcp", sizes[rank], nbytes)
            if tweak is not None:
                key, info = tweak(n, key, info)
            storage[key] = info
            sizes[rank] += nbytes
            n += 1
    os.makedirs(folder, exist_ok=True)
    if value is not None:
        import io

        buf = io.BytesIO()
        torch.save(value, buf)
        md["extra"] = BytesStorageMetadata()
        planner["extra"] = ("extra",)
        storage[MetadataIndex("extra")] = _StorageInfo(
            "__0_0.distcp", sizes[0], len(buf.getvalue())
        )
        with open(folder / "__0_0.distcp", "wb") as f:
            f.seek(sizes[0])
            f.write(buf.getvalue())
        sizes[0] += len(buf.getvalue())
    for rank, size in enumerate(sizes):
        with open(folder / f"__{rank}_0.distcp", "ab") as f:
            f.truncate(size)  # sparse: no bytes written
    meta = Metadata(md, planner_data=planner, storage_data=storage, version="1.0.0")
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def summary(ckpt):
    """Everything a command plans from: files, world size, globals, and every chunk."""
    out = [ckpt.format, ckpt.files, ckpt.world_size, ckpt.globals, ckpt.dangerous]
    for key, ref in iter_tensors(ckpt.root):
        out.append((key, ref.dtype.name, ref.shape, type(ref.shape), ref.requires_grad))
        for s in ref.shards:
            c = s.tensor
            out.append(
                (s.offsets, s.sizes, c.path, c.offset, c.length, c.sizes, c.offsets, c.shared)
            )
    return out


def generic_read(folder, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(dcp_metadata, "read", lambda *args: None)
        return dcp.read(str(folder))


def generic_error(folder, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(dcp_metadata, "read", lambda *args: None)
        with pytest.raises(CkptError) as err:
            dcp.read(str(folder))
    return err


SHAPES = {"w": (64, 8), "b": (64,), "e": (10, 8)}  # e: 10 rows over 16 ranks, empty chunks


def test_plain_folder_is_read_in_bulk_as_the_generic_reader_reads_it(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    write_folder(folder, 16, SHAPES, value={"lr": 0.1, "names": ["a", "b"]})
    fast = dcp_metadata.read(str(folder), str(folder / ".metadata"), False)
    assert fast is not None  # taken: the file is plain
    assert summary(fast) == summary(generic_read(folder, monkeypatch))
    assert fast.world_size == 16
    assert ckpttool.load(folder, select="extra") == {"lr": 0.1, "names": ["a", "b"]}
    assert [k for k, _ in iter_tensors(fast.root)] == [
        ("model", "w"),
        ("model", "b"),
        ("model", "e"),
    ]


def test_chunk_sizes_shared_with_the_index_go_to_the_generic_reader(tmp_path, monkeypatch):
    """One process saving (no gather) shares each chunk's offsets with its index: not
    plain; the generic reader reads it, with the same result."""
    folder = tmp_path / "ckpt"

    write_folder(folder, 4, {"w": (64, 8), "b": (64,)})
    meta = pickle.load(open(folder / ".metadata", "rb"))  # noqa: SIM115 (our own file)
    for entry in meta.state_dict_metadata.values():
        for chunk in entry.chunks:
            chunk.sizes = entry.chunks[0].sizes  # one Size for every chunk of a tensor
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    assert dcp_metadata.read(str(folder), str(folder / ".metadata"), False) is None
    assert summary(ckpttool.read(folder)) == summary(generic_read(folder, monkeypatch))


CHUNKS = 100_000  # the trouble lies at the 100,000th chunk
RANKS = 100
MANY = {f"layers.{i}.w": (RANKS, 4) for i in range(CHUNKS // RANKS)}


@pytest.mark.parametrize("path", ["../outside.distcp", "sub/__0_0.distcp"])
@pytest.mark.slow  # a .metadata of 100,000 chunks
def test_a_data_file_outside_the_folder_is_refused_at_the_100000th_chunk(
    tmp_path, monkeypatch, path
):
    folder = tmp_path / "ckpt"

    def outside(n, key, info):
        if n == CHUNKS - 1:
            info = _StorageInfo(path, 0, info.length)
        return key, info

    write_folder(folder, RANKS, MANY, outside)
    with pytest.raises(CkptError) as err:
        ckpttool.read(folder)
    assert f"storage path {path!r} leaves the folder" in str(err.value)
    assert str(err.value) == str(generic_error(folder, monkeypatch).value)


class _Call:
    """Pickles as a call of ``func(*args)`` (never called here: the file is only read)."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (_Call(os.system, "true"), "posix.system"),
        (_Call(pprint.PrettyPrinter, 4), "pprint.PrettyPrinter"),  # a class on no list, called
        (_Call(ChunkStorageMetadata, pprint.PrettyPrinter), "pprint.PrettyPrinter"),
    ],
    ids=["os.system", "unverified-class-called", "record-class-called-with-one"],
)
@pytest.mark.slow  # a .metadata of a million chunks, read twice
def test_a_hostile_global_deep_in_a_huge_metadata_is_refused(tmp_path, monkeypatch, value, named):
    folder = tmp_path / "ckpt"

    def hostile(n, key, info):
        if n == CHUNKS - 1:
            info = _StorageInfo(value, info.offset, info.length)  # type: ignore[arg-type]
        return key, info

    write_folder(folder, RANKS, MANY, hostile)
    with pytest.raises(UnsafeError) as err:
        ckpttool.read(folder)
    assert named in err.value.dangerous
    with monkeypatch.context() as m:
        m.setattr(dcp_metadata, "read", lambda *args: None)
        with pytest.raises(UnsafeError) as generic:
            dcp.read(str(folder))
    assert err.value.dangerous == generic.value.dangerous
    (result,) = run_many([["inspect", folder]])
    assert result["code"] == 3 and named in result["stderr"], result


def test_a_gap_or_an_overlap_among_many_chunks_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    write_folder(folder, 64, {"w": (64, 4)})
    meta = pickle.load(open(folder / ".metadata", "rb"))  # noqa: SIM115
    chunks = meta.state_dict_metadata["w"].chunks
    chunks[40] = ChunkStorageMetadata(torch.Size((41, 0)), chunks[40].sizes)  # overlaps 41
    keys = [k for k in meta.storage_data if k.fqn == "w" and k.offset == torch.Size((40, 0))]
    meta.storage_data[MetadataIndex("w", torch.Size((41, 0)))] = meta.storage_data.pop(keys[0])
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(CkptError) as err:
        ckpttool.read(folder)
    assert str(err.value) == str(generic_error(folder, monkeypatch).value)
    assert "shards" in str(err.value)


def test_row_blocks():
    assert row_blocks((6, 2), [(0, 0), (3, 0), (6, 0)], [(3, 2), (3, 2), (0, 2)])
    assert row_blocks((6,), [(3,), (0,)], [(3,), (3,)])
    assert not row_blocks((6, 2), [(0, 0), (2, 0)], [(3, 2), (3, 2)])  # overlap: 2 < 3
    assert not row_blocks((6, 2), [(0, 0), (4, 0)], [(3, 2), (2, 2)])  # gap at row 3
    assert not row_blocks((6, 2), [(0, 0), (3, 1)], [(3, 2), (3, 1)])  # not whole rows
    assert not row_blocks((6, 2), [(0, 0), (3, 0)], [(3, 2), (3, 2, 1)])
    assert not row_blocks((6, 2), [(0, 0), (3, 0), (5, 0)], [(3, 2), (3, 2), (-1, 2)])


@pytest.mark.parametrize(
    ("values", "ok"),
    [((3, 4), True), ([3, 4], True), ((), True), ((2**63 - 1, -(2**63)), True),
     ((2**63,), False), ((True,), False), ((1.0,), False), ("ab", False)],
)  # fmt: skip
def test_torch_size_is_checked_as_before(values, ok):
    data = pickle.dumps({"s": _Call(torch.Size, values)})
    if ok:
        assert load_pickle(data)["s"] == tuple(values)
    else:
        with pytest.raises(CkptError, match="corrupt torch.Size"):
            load_pickle(data)
