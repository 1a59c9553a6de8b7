"""A DCP ``.metadata`` read at the opcode level (formats/dcp_opcodes.py, dcp_runs.py):
the same checkpoint as the generic reader for every shape of metadata, and for any
file it does not vouch for, None (the readers after it decide, as ever).

The folders are built here with torch's own metadata classes on sparse data files;
the fuzz cases change bytes of a real one, seeded."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import pprint
import random
import sys
import types

import pytest
import torch
from helpers import run_cli
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpttool.formats import dcp
from ckpttool.formats.dcp import metadata as dcp_metadata
from ckpttool.formats.dcp import runs as dcp_runs
from ckpttool.formats.skeleton import metadata_runs as dcp_opcodes
from ckpttool.tree.checkpoint import iter_tensors

SHAPES = {
    "w": (64, 8),
    "b": (64,),
    "e": (10, 8),  # 10 rows over 16 ranks: uneven, and empty chunks (one span for many)
    "s": (),  # a scalar: one chunk
    "c": (6, 4, 2),
    "d": (8, 2, 2, 2, 2),  # (a torch.Size of 5: MARK ... TUPLE)
    "big": (3_000_000_000, 2),  # offsets past 2**31 (LONG1)
}


@dataclasses.dataclass
class OlmoStorageInfo:
    """OLMo-core's own ``_StorageInfo`` (olmo_core/distributed/checkpoint/filesystem.py:
    a dataclass of these three fields), pickled under its name as its writer pickles it
    (``fixtures/olmo_core/`` is a real save, small: this one makes the scale reader's runs)."""

    relative_path: str
    offset: int
    length: int


def _as_olmo_core_class() -> None:
    module = "olmo_core.distributed.checkpoint.filesystem"
    OlmoStorageInfo.__module__, OlmoStorageInfo.__qualname__ = module, "_StorageInfo"
    parts = module.split(".")
    for i in range(1, len(parts) + 1):  # (pickle imports the module by name to check it)
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    sys.modules[module]._StorageInfo = OlmoStorageInfo


_as_olmo_core_class()


def build_metadata(ranks, shapes, *, fresh_keys=False, share=None, value=True, writer="torch-2.13"):
    """(Metadata, each data file's size, rank 0's byte value blob) as DCP saves ``shapes``
    split along dim 0 over ``ranks`` ranks, each chunk's objects its own (gathered from
    its rank). ``share``: "sizes" gives a tensor's chunks one torch.Size object,
    "offsets" gives each index its chunk's offsets object (one process, no gather).
    ``writer``: the layout of another writer (see :data:`WRITERS`)."""
    md, storage, planner, sizes = {}, {}, {}, [0] * ranks
    blob = b""
    if value:
        buf = io.BytesIO()
        torch.save({"lr": 0.1, "names": ["a", "b"]}, buf)
        blob = buf.getvalue()
        md["extra"] = BytesStorageMetadata()
        planner["extra"] = ("extra",)
        info = OlmoStorageInfo if writer == "olmo-core" else _StorageInfo
        storage[MetadataIndex("extra")] = info("__0_0.distcp", 0, len(blob))
        sizes[0] = len(blob)
    for fqn, shape in shapes.items():
        md[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size(shape), []
        )
        planner[fqn] = ("model", fqn)
    for rank in range(ranks):
        for fqn, shape in shapes.items():
            if not shape:
                if rank:
                    continue
                offsets, chunk, nbytes = (), (), 4
            else:
                rows = -(-shape[0] // ranks)
                start = min(rank * rows, shape[0])
                length = min(rows, shape[0] - start)
                offsets, chunk = (start, *[0] * (len(shape) - 1)), (length, *shape[1:])
                nbytes = 4 * length * (shape[1] if len(shape) > 1 else 1) + 1000
            chunks = md[fqn].chunks
            size_obj = torch.Size(chunk)
            if share == "sizes" and chunks and chunks[0].sizes == size_obj:
                size_obj = chunks[0].sizes
            item = ChunkStorageMetadata(torch.Size(offsets), size_obj)
            chunks.append(item)
            key_fqn = "".join(fqn) if fresh_keys else fqn
            hint = None if writer == "no-index-hints" else len(chunks) - 1
            key = MetadataIndex(key_fqn, torch.Size(offsets), hint)
            if share == "offsets" and offsets:  # (its __init__ copies: the object itself)
                object.__setattr__(key, "offset", item.offsets)
            info = OlmoStorageInfo if writer == "olmo-core" else _StorageInfo
            storage[key] = info(f"__{rank}_0.distcp", sizes[rank], nbytes)
            sizes[rank] += nbytes
    if writer == "by-tensor":
        storage = dict(sorted(storage.items(), key=lambda kv: (kv[0].fqn, kv[0].offset or ())))
    if writer == "shuffled":
        items = list(storage.items())
        random.Random(0).shuffle(items)
        storage = dict(items)
    meta = Metadata(
        md,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id="/x", save_id="s", load_id=None),
        version="1.0.0",
    )
    if writer == "torch-2.3":  # (and no transform_descriptors in a _StorageInfo: 2.9's)
        del meta.storage_meta, meta.version
        for info in storage.values():
            del info.transform_descriptors
    return meta, sizes, blob


def write_folder(folder, ranks, shapes, *, protocol=4, frames=True, **kwargs):
    meta, sizes, blob = build_metadata(ranks, shapes, **kwargs)
    os.makedirs(folder, exist_ok=True)
    for rank, size in enumerate(sizes):
        with open(folder / f"__{rank}_0.distcp", "wb") as f:
            if rank == 0:
                f.write(blob)
            f.truncate(size)  # sparse: no bytes written
    data = pickle.dumps(meta, protocol=protocol)
    if not frames:
        data = unframed(data)
    (folder / ".metadata").write_bytes(data)
    return data


def unframed(data):
    """A protocol 4/5 pickle without its FRAME opcodes (their payloads joined)."""
    assert data[2] == 0x95
    out, pos = [data[:2]], 2
    while pos < len(data):
        n = int.from_bytes(data[pos + 1 : pos + 9], "little")
        out.append(data[pos + 9 : pos + 9 + n])
        pos += 9 + n
    return b"".join(out)


def summary(ckpt):
    """Everything a command plans from: files, world size, globals, every chunk."""
    out = [ckpt.format, ckpt.files, ckpt.world_size, ckpt.globals, ckpt.dangerous]
    out.append(ckpt.unverified)
    for key, ref in iter_tensors(ckpt.root):
        out.append((key, ref.dtype.name, ref.shape, type(ref.shape), ref.requires_grad, ref.kind))
        # (the opcode reader's chunks are columns, the others' a list: either a sequence)
        out.append((ref.world_size, ref.device, len(ref.shards)))
        for i, s in enumerate(ref.shards):
            c = s.tensor
            assert ref.shards[i].offsets == s.offsets and ref.shards[i].tensor.path == c.path
            out.append((s.offsets, s.sizes, s.rank, type(c), c.path, c.offset, c.length))
            out.append((type(s.offsets), type(s.sizes), type(c.offset), type(c.length)))
            out.append((c.sizes, c.offsets, c.shared, c.dtype, c.fqn, c.transforms))
    return out


def outcome(read, folder):
    """The checkpoint's summary, or the error (type and message) a read ends with (any
    error: the generic reader raises a TypeError on some corrupt files, the same with
    the fast readers in front of it)."""
    try:
        return ("ok", summary(read(str(folder))))
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


def fast(folder):
    return dcp_runs.read(str(folder), str(folder / ".metadata"), False)


def generic(folder, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(dcp_runs, "read", lambda *args: None)
        m.setattr(dcp_metadata, "read", lambda *args: None)
        return outcome(dcp.read, folder)


# How writers other than torch 2.13's DefaultSavePlanner lay the same .metadata out:
# a planner that leaves MetadataIndex.index None (create_default_global_save_plan with
# rewrite_index_hints=False), storage entries grouped by tensor or in no order (a writer
# that builds storage_data otherwise than rank by rank), and torch before 2.4 (no
# storage_meta, no version in the Metadata's state), OLMo-core (its own _StorageInfo class)
WRITERS = ("no-index-hints", "by-tensor", "shuffled", "torch-2.3", "olmo-core")
CASES = {
    **{writer: {"protocol": 4, "writer": writer} for writer in WRITERS},
    "protocol-4": {"protocol": 4},
    "protocol-5": {"protocol": 5},
    "unframed": {"protocol": 4, "frames": False},
    "fresh-keys": {"protocol": 4, "fresh_keys": True},
    "no-value": {"protocol": 5, "value": False},
}


@pytest.mark.parametrize("ranks", [1, 3, 16, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_the_opcode_reader_gives_the_generic_readers_checkpoint(tmp_path, monkeypatch, case, ranks):
    folder = tmp_path / "ckpt"
    write_folder(folder, ranks, SHAPES, **CASES[case])
    ckpt = fast(folder)
    assert ckpt is not None  # taken: every entry plain
    assert ("ok", summary(ckpt)) == generic(folder, monkeypatch)
    bulk = dcp_metadata.read(str(folder), str(folder / ".metadata"), False)
    assert bulk is not None and summary(bulk) == summary(ckpt)
    assert ckpt.world_size == ranks
    assert [k for k, _ in iter_tensors(ckpt.root)] == [("model", k) for k in SHAPES]


def test_many_frames_and_runs(tmp_path, monkeypatch):
    """Frames of 64 KB cut entries (walked one by one there) and every run batch."""
    folder = tmp_path / "ckpt"
    data = write_folder(folder, 256, {f"l{i}.w": (1024, 4) for i in range(12)})
    assert len(data) > 4 * 65536
    parsed = dcp_opcodes.parse(data)
    assert parsed is not None and len(parsed.skeleton) < len(data) // 4
    assert ("ok", summary(fast(folder))) == generic(folder, monkeypatch)


@pytest.mark.parametrize("writer", ["torch-2.13", *WRITERS])
def test_other_writers_layouts_are_runs_too(tmp_path, monkeypatch, writer):
    """The fast path vouches for the format, not for one writer's order: another layout
    of the same entries is matched as runs (not walked entry by entry), and reads as the
    generic reader reads it."""
    folder = tmp_path / "ckpt"
    data = write_folder(folder, 256, {f"l{i}.w": (1024, 4) for i in range(12)}, writer=writer)
    parsed = dcp_opcodes.parse(data)
    assert parsed is not None and len(parsed.skeleton) < len(data) // 4
    runs = [r for r in parsed.runs if isinstance(r, dcp_opcodes.StorageRun)]
    assert sum(r.count for r in runs) > 0.9 * 256 * 12
    assert ("ok", summary(fast(folder))) == generic(folder, monkeypatch)


def test_inspect_says_the_same(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    write_folder(folder, 16, SHAPES)
    taken = run_cli("inspect", folder, "--full", columns=200)
    with monkeypatch.context() as m:
        m.setattr(dcp_runs, "read", lambda *args: None)
        m.setattr(dcp_metadata, "read", lambda *args: None)
        before = run_cli("inspect", folder, "--full", columns=200)
    assert taken.returncode == before.returncode == 0
    assert (taken.stdout, taken.stderr) == (before.stdout, before.stderr)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"protocol": 2},  # BINPUT: not a file this reader vouches for
        {"protocol": 3},
        {"share": "sizes"},  # a chunk's torch.Size named again by BINGET
        {"share": "offsets"},  # an index names its chunk's offsets (one process saving)
    ],
    ids=["protocol-2", "protocol-3", "shared-sizes", "shared-offsets"],
)
def test_what_it_does_not_vouch_for_goes_to_the_next_reader(tmp_path, monkeypatch, kwargs):
    folder = tmp_path / "ckpt"
    write_folder(folder, 8, SHAPES, **kwargs)
    assert fast(folder) is None
    assert outcome(dcp.read, folder) == generic(folder, monkeypatch)
    assert outcome(dcp.read, folder)[0] == "ok"


class _Call:
    """Pickles as a call of ``func(*args)`` (never called here: the file is only read)."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _tweaked(folder, change, ranks=16, shapes=None):
    """A folder whose Metadata ``change(meta)`` edits before it is pickled."""
    meta, sizes, blob = build_metadata(ranks, shapes or SHAPES)
    change(meta)
    os.makedirs(folder, exist_ok=True)
    for rank, size in enumerate(sizes):
        with open(folder / f"__{rank}_0.distcp", "wb") as f:
            if rank == 0:
                f.write(blob)
            f.truncate(size)
    (folder / ".metadata").write_bytes(pickle.dumps(meta, protocol=4))


def _chunk_call(meta):
    meta.state_dict_metadata["w"].chunks[9] = _Call(os.system, "true")


def _chunk_unverified(meta):
    meta.state_dict_metadata["w"].chunks[9] = _Call(pprint.PrettyPrinter, 4)


def _info_call(meta):
    key = list(meta.storage_data)[40]
    info = meta.storage_data[key]
    meta.storage_data[key] = _StorageInfo(_Call(os.system, "true"), info.offset, info.length)


def _outside(meta):
    key = list(meta.storage_data)[-5]
    info = meta.storage_data[key]
    meta.storage_data[key] = _StorageInfo("../outside.distcp", info.offset, info.length)


def _overlap(meta):
    keys = list(meta.storage_data)
    info = meta.storage_data[keys[30]]
    meta.storage_data[keys[30]] = _StorageInfo(info.relative_path, info.offset + 8, info.length)


def _gap(meta):
    chunks = meta.state_dict_metadata["w"].chunks
    chunks[5] = ChunkStorageMetadata(torch.Size((21, 0)), chunks[5].sizes)


def _missing_span(meta):
    key = next(k for k in meta.storage_data if k.fqn == "b" and k.offset == torch.Size((12,)))
    del meta.storage_data[key]


def _chunk_in_a_tuple(meta):
    entry = meta.state_dict_metadata["w"]
    meta.state_dict_metadata["w"] = TensorStorageMetadata(
        entry.properties,
        entry.size,
        tuple(entry.chunks),  # type: ignore[arg-type]
    )


def _negative_offset(meta):
    chunks = meta.state_dict_metadata["b"].chunks
    chunks[3] = ChunkStorageMetadata(torch.Size((-4,)), chunks[3].sizes)


@pytest.mark.parametrize(
    "change",
    [
        _chunk_call,
        _chunk_unverified,
        _info_call,
        _outside,
        _overlap,
        _gap,
        _missing_span,
        _chunk_in_a_tuple,
        _negative_offset,
    ],
)
def test_trouble_anywhere_is_decided_by_the_generic_reader(tmp_path, monkeypatch, change):
    folder = tmp_path / "ckpt"
    _tweaked(folder, change)
    assert fast(folder) is None
    got = outcome(dcp.read, folder)
    assert got == generic(folder, monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(dcp_runs, "read", lambda *args: None)
        m.setattr(dcp_metadata, "read", lambda *args: None)
        before = run_cli("inspect", folder)
    after = run_cli("inspect", folder)
    assert (after.returncode, after.stdout, after.stderr) == (
        before.returncode,
        before.stdout,
        before.stderr,
    )


def _shuffled_storage(meta):
    """storage_data in another order: each file's spans in many places, each tensor's
    entries in another order than its chunks."""
    items = list(meta.storage_data.items())
    random.Random(1).shuffle(items)
    meta.storage_data = dict(items)


@pytest.mark.parametrize(
    "change", [None, _shuffled_storage, _overlap, _missing_span, _negative_offset]
)
def test_the_chunk_table_on_disk_reads_the_same(tmp_path, monkeypatch, change):
    """Past a few MB the chunk records are in temporary files, read a block at a time:
    here past 256 bytes, 5 records at a time (blocks cut every run and group). The same
    checkpoint, or the same refusal, as the generic reader's."""
    from ckpttool.formats import records as dcp_table
    from ckpttool.formats.dcp.chunks import DcpChunks

    folder = tmp_path / "ckpt"
    _tweaked(folder, change or (lambda meta: None), ranks=64)
    expected = generic(folder, monkeypatch)
    monkeypatch.setattr(dcp_table, "IN_MEMORY", 256)
    monkeypatch.setattr(dcp_table, "BLOCK_ROWS", 5)
    ckpt = fast(folder)
    if change in (None, _shuffled_storage):
        assert ckpt is not None and ("ok", summary(ckpt)) == expected
        shards = dict(iter_tensors(ckpt.root))[("model", "w")].shards
        assert isinstance(shards, DcpChunks) and shards._spill._memory is None  # on disk
    else:
        assert ckpt is None and expected[0] == "error"


@pytest.fixture(scope="module", params=["names", "fresh-keys"])
def fuzz_base(tmp_path_factory, request):
    """A folder of ~1,300 chunks (3 frames), its .metadata bytes: each storage entry's
    data file a string of its own, and (``fresh-keys``) its tensor's name too, as
    torch's saves pickle them (runs of new names)."""
    folder = tmp_path_factory.mktemp("fuzz") / "ckpt"
    shapes = {"w": (64, 8), "b": (64,), "e": (10, 8), "s": (), "d": (8, 2, 2, 2, 2)}
    shapes |= {f"l{i}": (96, 4) for i in range(16)}
    data = write_folder(folder, 64, shapes, fresh_keys=request.param == "fresh-keys")
    return folder, data


def _mutations(data, seed, n):
    """About ``n`` seeded changes of ``data``, each alone."""
    rng = random.Random(seed)
    opcodes = b"hjKMJ\x8a\x8c\x94()t\x85\x86\x87ub\x81R}]eNCXq\x95."
    for _ in range(n * 4 // 9):  # byte flips
        out = bytearray(data)
        at = rng.randrange(2, len(data))
        out[at] = rng.randrange(256)
        yield "flip", bytes(out)
    for _ in range(n * 2 // 9):  # an opcode byte put in another's place
        out = bytearray(data)
        at = rng.randrange(2, len(data))
        out[at] = rng.choice(opcodes)
        yield "opcode", bytes(out)
    for _ in range(n // 7):  # two bytes swapped
        out = bytearray(data)
        at = rng.randrange(2, len(data) - 1)
        out[at], out[at + 1] = out[at + 1], out[at]
        yield "swap", bytes(out)
    for _ in range(n // 9):  # truncated
        yield "cut", data[: rng.randrange(len(data))]
    for _ in range(n // 13):  # a byte dropped (frames no longer tile the file)
        at = rng.randrange(2, len(data))
        yield "drop", data[:at] + data[at + 1 :]


@pytest.mark.parametrize(
    ("seed", "n"),
    [
        # (few mutations leave the file plain; the quick suite's share is small: the two
        # of 400 below take ~3 minutes, within the slow suite)
        (0, 20),
        pytest.param(1, 400, marks=pytest.mark.slow),
        pytest.param(2, 400, marks=pytest.mark.slow),
    ],
)
def test_fuzzed_metadata_reads_as_the_generic_reader_reads_it(fuzz_base, monkeypatch, seed, n):
    folder, data = fuzz_base
    meta = folder / ".metadata"
    taken = 0
    try:
        for kind, mutated in _mutations(data, seed, n):
            meta.write_bytes(mutated)
            expected = generic(folder, monkeypatch)
            try:
                ckpt = fast(folder)
            except Exception as exc:  # pragma: no cover (a failure to report)
                raise AssertionError(f"{kind}: the opcode reader raised {exc!r}") from exc
            if ckpt is not None:  # vouched for: the very same checkpoint
                taken += 1
                assert ("ok", summary(ckpt)) == expected, kind
            assert outcome(dcp.read, folder) == expected, kind
    finally:
        meta.write_bytes(data)
    assert taken  # (some mutations change only a number, a name: still plain)


def test_spans_apart_as_a_pairwise_check_says(monkeypatch):
    """``_apart`` (in the order saved, else each file's spans grouped and sorted apart)
    against every pair of spans, on random layouts read a few records at a time (the
    generic reader refuses overlaps and leaves a shared start to the safetensors check)."""
    import itertools

    import numpy as np

    from ckpttool.formats import records as dcp_table
    from ckpttool.formats.dcp.runs import _apart

    monkeypatch.setattr(dcp_table, "BLOCK_ROWS", 3)  # (blocks cut the runs)

    def apart(paths, starts, lengths):
        records = np.array(
            [(0, p, 0, s, n) for p, s, n in zip(paths, starts, lengths, strict=True)],
            dcp_table.STORAGE,
        )
        found = _apart(lambda: dcp_table.blocks([records], dcp_table.STORAGE), 3)
        assert found is None or found == sorted(set(paths))
        return found is not None

    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randrange(1, 8)
        paths = [rng.randrange(3) for _ in range(n)]
        starts = [rng.randrange(0, 20) for _ in range(n)]
        lengths = [rng.randrange(1, 6) for _ in range(n)]
        expected = not any(
            paths[i] == paths[j]
            and max(starts[i], starts[j]) < min(starts[i] + lengths[i], starts[j] + lengths[j])
            for i, j in itertools.combinations(range(n), 2)
        )
        assert apart(paths, starts, lengths) == expected, (paths, starts, lengths)
    assert not apart([0], [0], [0]) and not apart([0], [-1], [2])
    assert not apart([0], [2**63 - 2], [2]) and apart([0], [2**63 - 2], [1])


def test_a_short_data_file_is_named_as_before(tmp_path, monkeypatch):
    """inspect's size check reduces a DCP tensor's chunk ends in numpy (``span_ends``),
    or lists its spans in bulk, or one by one: the same message."""
    from ckpttool import integrity
    from ckpttool.formats.dcp.chunks import DcpChunks

    folder = tmp_path / "ckpt"
    write_folder(folder, 16, SHAPES)
    with open(folder / "__3_0.distcp", "r+b") as f:
        f.truncate(os.path.getsize(folder / "__3_0.distcp") - 100)
    reduced = run_cli("inspect", folder)
    with monkeypatch.context() as m:
        m.delattr(DcpChunks, "span_ends")
        bulk = run_cli("inspect", folder)
        m.setattr(integrity, "_add_spans_in_bulk", lambda *args: False)
        one_by_one = run_cli("inspect", folder)
    assert reduced.returncode == bulk.returncode == one_by_one.returncode == 2
    assert reduced.stderr == bulk.stderr == one_by_one.stderr
    assert "file too short" in reduced.stderr and "__3_0.distcp" in reduced.stderr


def test_chunks_are_columns_made_into_objects_on_reading(tmp_path):
    """A tensor's chunks from the opcode reader are columns (``DcpChunks``): no chunk
    object is held after the read (millions of them, at thousands of ranks), and
    reading one by index, by slice or by iterating gives the same chunks."""
    import gc

    from ckpttool.errors import CkptError
    from ckpttool.formats.dcp.chunks import DcpChunk, DcpChunks
    from ckpttool.formats.records import Spill

    folder = tmp_path / "ckpt"
    write_folder(folder, 16, SHAPES)
    ckpt = fast(folder)
    gc.collect()
    assert DcpChunk not in set(map(type, gc.get_objects()))
    ref = dict(iter_tensors(ckpt.root))[("model", "e")]
    shards = ref.shards
    assert isinstance(shards, DcpChunks) and len(shards) == 16

    def row(s):
        c = s.tensor
        return (s.offsets, s.sizes, c.path, c.offset, c.length, c.sizes, c.offsets, c.fqn)

    rows = list(map(row, shards))
    assert [row(shards[i]) for i in range(16)] == rows
    assert [row(shards[i]) for i in range(-16, 0)] == rows
    assert list(map(row, shards[3:9:2])) == rows[3:9:2]
    assert rows[0][2].endswith("__0_0.distcp") and rows[15][2].endswith("__15_0.distcp")
    files, starts, lengths = shards.block_spans()  # (what inspect's size check reads)
    assert list(zip(files, starts, lengths, strict=True)) == [r[2:5] for r in rows]
    with pytest.raises(IndexError):
        shards[16]
    # one rank: each tensor's one chunk
    one = tmp_path / "one"
    write_folder(one, 1, SHAPES)
    chunks = dict(iter_tensors(fast(one).root))[("model", "e")].shards
    (only,) = chunks
    files, starts, lengths = chunks.block_spans()
    assert (list(files), list(starts), list(lengths)) == (
        [only.tensor.path],
        [only.tensor.offset],
        [only.tensor.length],
    )
    with pytest.raises(CkptError, match="internal error"):
        DcpChunks(Spill(), 0, 1, [(0,)], ["f"], ref.dtype, "x")


@pytest.mark.slow  # two folders of 25,600 and 204,800 chunks, read under tracemalloc
def test_the_memory_of_a_read_does_not_grow_with_the_chunks(tmp_path, monkeypatch):
    """Every rank of a distributed conversion reads the whole ``.metadata``: past a few
    MB its chunk table is on disk, read a block at a time, so 8x the chunks (8x the
    ranks) costs the read little more memory: under 12 bytes a chunk more at the peak
    (the skeleton: each frame's entry cut by its end), under 1 MiB more held (as
    columns in memory a chunk cost ~36 bytes held, ~90 at the peak). Each storage entry
    here names its data file by a string of its own (as a torch save names each rank's
    tensors): the reader's runs of new names. Here the spills leave memory past 64 KB
    and a block is 4,096 records."""
    import tracemalloc

    from ckpttool.formats import records as dcp_table

    monkeypatch.setattr(dcp_table, "IN_MEMORY", 64 << 10)
    monkeypatch.setattr(dcp_table, "BLOCK_ROWS", 4096)
    shapes = {f"layers.{i}.w": (512, 4) for i in range(400)}
    figures = []
    for ranks in (64, 512):
        folder = tmp_path / f"r{ranks}"
        write_folder(folder, ranks, shapes)
        tracemalloc.start()
        ckpt = fast(folder)
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert ckpt is not None and ckpt.world_size == ranks
        assert sum(len(ref.shards) for _, ref in iter_tensors(ckpt.root)) == 400 * ranks
        figures.append((held, peak))
        del ckpt
    (held_a, peak_a), (held_b, peak_b) = figures
    assert held_b - held_a < 1 << 20 and peak_b - peak_a < 12 * 400 * (512 - 64), figures


def test_the_walkers_opcodes_are_pickles_own():
    """The scale readers' opcodes come from one table, CPython's ``pickletools.opcodes``:
    every byte they test by name is that opcode's (checked again here as at import), and
    every opcode the two walkers push or pop has pickletools' stack effect."""
    import pickletools

    from ckpttool.formats.skeleton import opcodes as opcode_runs

    by_name = {op.name: op for op in pickletools.opcodes}
    assert all(by_name[n].code.encode("latin-1")[0] == b for n, b in opcode_runs.WALKED.items())
    for code in opcode_runs.PUSHES:
        op = next(o for o in pickletools.opcodes if o.code.encode("latin-1")[0] == code)
        assert (op.stack_before, len(op.stack_after)) == ([], 1), op.name
    for code, popped in opcode_runs.POP_PUSH.items():
        op = next(o for o in pickletools.opcodes if o.code.encode("latin-1")[0] == code)
        assert (len(op.stack_before), len(op.stack_after)) == (popped, 1), op.name


def test_torchs_own_writers_metadata_is_runs(tmp_path, monkeypatch):
    """torch's own ``torch_save_to_dcp`` (its DefaultSavePlanner, one process): the
    ``.metadata`` a real save pickles is read as runs, as the generic reader reads it."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    state = {f"layers.{i}.w": torch.full((4, 2), float(i)) for i in range(3000)}
    torch.save(state, tmp_path / "model.pt")
    folder = tmp_path / "ckpt"
    torch_save_to_dcp(str(tmp_path / "model.pt"), str(folder))
    parsed = dcp_opcodes.parse((folder / ".metadata").read_bytes())
    # (one chunk a tensor: each tensor's entry is skeleton, its storage entries runs)
    assert parsed is not None
    runs = [r for r in parsed.runs if isinstance(r, dcp_opcodes.StorageRun)]
    assert sum(r.count for r in runs) > 0.9 * len(state)
    assert ("ok", summary(fast(folder))) == generic(folder, monkeypatch)
