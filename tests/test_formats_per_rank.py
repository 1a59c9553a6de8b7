"""``per-rank`` (formats/per_rank.py): one checkpoint over one torch.save file per rank,
ShardedTensor (FSDP) or DTensor leaves, from real torchrun runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import assert_identical, check_error, fixture_path, make_per_rank, run_cli
from safetensors.torch import load_file

import ckpttool
from ckpttool.inspection import inspect_report


@pytest.mark.slow
@pytest.mark.parametrize("given", ["paths", "glob", "rank0", "rank1"])
def test_per_rank_fsdp_sharded_state_dict(dist_runs, dist_reference, given):
    folder = dist_runs.two
    files = [folder / "ep0-ba1-rank0.pt", folder / "ep0-ba1-rank1.pt"]
    arg = {
        "paths": [str(f) for f in files],
        "glob": str(folder / "ep0-ba1-rank*.pt"),
        "rank0": str(files[0]),
        "rank1": str(files[1]),
    }[given]
    ckpt = ckpttool.read(arg)
    assert ckpt.format == "per-rank"
    assert ckpt.world_size == 2
    assert ckpt.files == [str(f) for f in files]
    assert ckpt.dangerous == []
    everything = ckpttool.load(arg, select="all")
    full = dist_reference["two"]
    assert_identical(everything["state"]["model"], full["model"], exact_types=False)
    assert_identical(
        everything["state"]["optimizers"]["Adam"], full["optim"], ordered=False, exact_types=False
    )
    assert everything["state"]["timestamp"] == {"epoch": 0, "batch": 1}
    assert_identical(ckpttool.load(arg), full["model"], exact_types=False)


@pytest.mark.slow
def test_per_rank_uneven_shards_in_the_report(dist_runs):
    report = inspect_report(ckpttool.read(dist_runs.two / "ep0-ba1-rank0.pt"))
    assert report["model_key"] == ["state", "model"]
    by_key = {tuple(t["key"]): t for t in report["tensors"]}
    # 5 rows over 2 ranks: 3 + 2; the shape and size are the global ones
    assert by_key[("state", "model", "0.weight")] == {
        "key": ["state", "model", "0.weight"],
        "dtype": "float32",
        "shape": [5, 4],
        "device": "cpu",
        "nbytes": 80,
        "sharded": True,
        "shards": 2,
        "file": None,  # its shards lie in both ranks' files
    }
    assert by_key[("state", "model", "2.bias")]["shape"] == [3]
    assert by_key[("state", "optimizers", "Adam", "state", "2.weight", "exp_avg")]["shape"] == [
        3,
        5,
    ]
    assert report["num_params"] == 5 * 4 + 5 + 3 * 5 + 3


@pytest.mark.slow
def test_per_rank_dtensor_pair(dist_runs, dist_reference):
    files = [str(dist_runs.two / f"dtensor-rank{r}.pt") for r in (0, 1)]
    ckpt = ckpttool.read(files)
    assert ckpt.format == "per-rank" and ckpt.world_size == 2
    assert ckpt.root["w"].kind == "dtensor"
    assert [s.sizes for s in ckpt.root["w"].shards] == [(3, 3), (2, 3)]
    assert len(ckpt.root["b"].shards) == 1  # replicated: one copy is enough
    assert_identical(ckpttool.load(files), dist_reference["dtensor"])
    assert_identical(ckpttool.load(files[1]), dist_reference["dtensor"])  # siblings found


@pytest.mark.slow
def test_per_rank_sharded_tensors_inside_a_custom_object(dist_runs, dist_reference, tmp_path):
    """DTensors held by an object of a class ckpttool does not rebuild (an EMA helper)
    are merged too: the object is kept as a stand-in holding full tensors."""
    files = str(dist_runs.two / "holder-rank*.pt")
    report = inspect_report(ckpttool.read(files))
    assert [(t["key"], t["sharded"]) for t in report["tensors"]] == [
        (["ema", "weights", "w"], True), (["ema", "weights", "b"], True)
    ]  # fmt: skip
    out = tmp_path / "merged.pt"
    proc = run_cli("merge", files, "-o", out)
    assert proc.returncode == 0, proc.stderr
    merged = torch.load(out, weights_only=True)
    assert merged["ema"]["__class__"] == "__main__.Holder"
    assert merged["ema"]["state"]["decay"] == 0.99 and merged["step"] == 3
    assert_identical(merged["ema"]["state"]["weights"], dist_reference["dtensor"])


@pytest.mark.slow
def test_per_rank_three_ranks_one_holds_nothing(dist_runs, dist_reference):
    """A 2-row weight and a 2-element bias over 3 ranks: rank 2's shards are empty."""
    ckpt = ckpttool.read(dist_runs.three / "ep0-ba1-rank2.pt")
    assert ckpt.world_size == 3
    assert len(ckpt.files) == 3
    bias = ckpt.root["state"]["model"]["0.bias"]
    assert bias.shape == (2,)
    assert sorted(s.offsets for s in bias.shards) == [(0,), (1,)]
    everything = ckpttool.load(dist_runs.three / "ep0-ba1-rank*.pt", select="all")
    full = dist_reference["three"]
    assert_identical(everything["state"]["model"], full["model"], exact_types=False)
    assert_identical(
        everything["state"]["optimizers"]["Adam"], full["optim"], ordered=False, exact_types=False
    )


@pytest.mark.slow
@pytest.mark.parametrize("given", ["per-rank", "dcp", "dcp-safetensors"])
def test_2d_mesh_dtensors_and_a_submesh(dist_runs, given):
    """4 ranks on a (dp=2, tp=2) mesh: a weight sharded over both dims (uneven rows), a
    bias sharded over dp and replicated over tp, an embedding on the dp submesh (whose
    coordinate cannot be told from the rank number), a replicated scalar. Saved per rank,
    with dcp.save, and with dcp.save's safetensors serialization format (every chunk's
    span points at the file's safetensors blob; its header says where the bytes are)."""
    run = dist_runs.mesh
    path = str(run / "model-rank*.pt") if given == "per-rank" else run / given
    ckpt = ckpttool.read(path)
    assert ckpt.format == ("per-rank" if given == "per-rank" else "dcp")
    assert ckpt.world_size == 4
    full = torch.load(run / "full.pt", weights_only=True)
    everything = ckpttool.load(path, select="all")
    assert everything["epoch"] == 2
    assert_identical(everything["model"], full["model"])
    assert_identical(ckpttool.load(path), full["model"])


@pytest.mark.slow
def test_dtensors_on_a_mesh_with_a_size_1_dimension(dist_runs):
    """HSDP with one replica, a (1, 2, 2) mesh: the layout torch >= 2.9 pickles records
    the size-1 dimension as an empty shape; it still counts as a mesh dimension."""
    run = dist_runs.mesh
    ckpt = ckpttool.read(run / "hsdp-rank0.pt")
    assert (ckpt.format, ckpt.world_size) == ("per-rank", 4)
    full = torch.load(run / "full.pt", weights_only=True)["model"]
    assert_identical(ckpttool.load(run / "hsdp-rank*.pt"),
                {k: full[k] for k in ("lin.weight", "lin.bias")})  # fmt: skip


@pytest.mark.slow
def test_fsdp2_over_tensor_parallel_strided_shards_merge(dist_runs, tmp_path):
    """FSDP2 over TP: column-parallel weights are _StridedShard(0) on dp then Shard(0)
    on tp, so rank (dp=1, tp=0) holds rows 2-3, not 4-5; uneven at both levels."""
    run = dist_runs.mesh
    full = torch.load(run / "tp-fsdp-full.pt", weights_only=True)
    ckpt = ckpttool.read(run / "tp-fsdp-rank2.pt")
    assert (ckpt.format, ckpt.world_size) == ("per-rank", 4)
    head = ckpt.root["2.weight"]
    assert sorted((s.rank, s.offsets, s.sizes) for s in head.shards) == [
        (0, (0, 0), (2, 6)), (1, (4, 0), (2, 6)), (2, (2, 0), (2, 6)), (3, (6, 0), (1, 6))
    ]  # fmt: skip
    out = tmp_path / "model.safetensors"
    proc = run_cli("convert", run / "tp-fsdp-rank*.pt", "--to", "safetensors", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert_identical(load_file(out), full, exact_types=False)


@pytest.mark.slow
def test_missing_rank_file_is_named(dist_runs, tmp_path):
    for r in (0, 2):
        shutil.copy(dist_runs.three / f"ep0-ba1-rank{r}.pt", tmp_path)
    expected = str(tmp_path / "ep0-ba1-rank1.pt")
    line = check_error(
        run_cli("inspect", tmp_path / "ep0-ba1-rank0.pt", tmp_path / "ep0-ba1-rank2.pt"),
        2,
        expected,
    )
    assert "Traceback" not in line
    check_error(run_cli("inspect", tmp_path / "ep0-ba1-rank2.pt"), 2, expected)
    with pytest.raises(ckpttool.CkptError, match="ep0-ba1-rank1.pt"):
        ckpttool.load(str(tmp_path / "ep0-ba1-rank*.pt"))


@pytest.mark.slow
def test_lone_rank_file_without_siblings(dist_runs, tmp_path):
    shutil.copy(dist_runs.two / "ep0-ba1-rank1.pt", tmp_path)
    check_error(run_cli("inspect", tmp_path / "ep0-ba1-rank1.pt"), 2, "ep0-ba1-rank0.pt")


def test_committed_fsdp_uneven_fixture():
    path = fixture_path("fsdp_uneven/model-rank0.pt")
    ckpt = ckpttool.read(path)
    assert ckpt.format == "per-rank"
    assert ckpt.world_size == 3
    sd = ckpttool.load(path)
    assert all(t.device.type == "cpu" for t in sd.values())


@pytest.mark.parametrize(("names", "refused"), [(16, False), (1_000, True)])
def test_one_rank_block_named_as_thousands_of_tensors_is_refused(names, refused):
    # a rank file's memo can name one ShardedTensor or DTensor under a thousand keys (a
    # few bytes each, as a 26 KB copy of fixtures/dtensor with 2,000 did): merged, each
    # is written in full, so its block counts at every path, as a tied tensor's does
    from ckpttool.dtypes import DTYPES
    from ckpttool.errors import CkptError
    from ckpttool.tree.leaves import StorageRef, TensorRef
    from ckpttool.tree.sharding import Shard
    from ckpttool.unpickler.policy import check_structure
    from ckpttool.unpickler.sharded import LocalShards

    f32 = DTYPES["float32"]
    storage = StorageRef("0", f32, 1 << 20, "cpu")
    block = TensorRef(f32, (1 << 20,), (1,), 0, storage)
    local = LocalShards("sharded_tensor", f32, (2 << 20,), "cpu")
    local.shards.append(Shard((0,), (1 << 20,), block, 0))
    root = {"model": {f"w{i}": local for i in range(names)}}
    if refused:
        with pytest.raises(CkptError, match="name the same stored bytes over and over"):
            check_structure(root)
    else:
        check_structure(root)


class _Members:
    """Rank ``rank`` of ``size`` processes sharing a read (:mod:`ckpttool.sharing`): what
    it hands the gather is kept; the gather answers ``answers`` (every process's), or
    stops the read where there are none."""

    def __init__(self, rank, size, answers=None):
        self.rank, self.size, self.answers, self.sent = rank, size, answers, []

    def all_gather(self, mine):
        self.sent.append(mine)
        if self.answers is None:
            raise _Gathered
        return self.answers

    def each_gathered(self, mine):
        return iter(self.all_gather(mine))


class _Gathered(Exception):
    pass


@pytest.mark.parametrize("files", ["dtensor/dt-rank{}.pt", "composer/ep0-ba4-rank{}.pt"])
def test_rank_files_are_dealt_among_processes(monkeypatch, files):
    """Under several processes each reads only its share of the rank files and hands
    the others what it found (plain data: each file's verdict, its DTensors' places,
    where its blocks lie), so no process reads another share's file, even for its
    data. In one process a DTensor file is read to place its blocks (each records
    its own mesh coordinate); a ShardedTensor file only when its data is."""
    from ckpttool import formats, sharing
    from ckpttool.tree import iter_tensors

    files = [str(fixture_path(files.format(r))) for r in (0, 1)]
    read = []
    real = formats._read_rank
    monkeypatch.setattr(
        formats, "_read_rank", lambda path, *a, **k: read.append(path) or real(path, *a, **k)
    )

    def blocks(ckpt):
        return [
            (key, s.rank, s.offsets, s.sizes)
            for key, ref in iter_tensors(ckpt.root)
            for s in getattr(ref, "shards", ())
        ]

    alone = ckpttool.read(files)
    dtensors = "dtensor" in files[0]
    assert read == ([files[1]] if dtensors else [])  # (the first was read to begin with)
    expected = ckpttool.load(alone)
    assert read == [files[1]]  # read once, for its places or for its data
    shares = []
    for rank in (0, 1):
        read.clear()
        members = _Members(rank, 2)
        with sharing.joined(members), pytest.raises(_Gathered):
            ckpttool.read(files)
        assert read == ([] if rank == 0 else [files[1]])  # its share only
        shares.append(members.sent[0])
    read.clear()
    members = _Members(0, 2, shares)
    with sharing.joined(members):
        ckpt = ckpttool.read(files)
    assert read == [] and members.sent == [shares[0]]
    assert blocks(ckpt) == blocks(alone) and ckpt.globals == alone.globals
    assert len(blocks(ckpt)) > 2
    assert_identical(ckpttool.load(ckpt), expected)
    assert read == []  # rank 1's blocks: where they lie came from the process that read it


@pytest.mark.slow  # 8 and 64 generated rank files of 225 DTensors each, read under tracemalloc
def test_the_memory_of_a_per_rank_read_does_not_grow_with_the_blocks(tmp_path, monkeypatch):
    """Every rank of a distributed conversion reads where every block of every rank file
    lies: past a few MB those places are records on disk (formats/rank_blocks.py), and
    a block's stored tensor is made again when asked for, not kept. So 8x the rank
    files costs the read, and resolving every block, little more memory: as objects
    each block held ~2 KB (its Shard, its TensorRef and storage, the leaf of the file
    it came from). Here the spills leave memory past 64 KB."""
    import tracemalloc

    from ckpttool.formats import records as dcp_table
    from ckpttool.tree import iter_tensors

    monkeypatch.setattr(dcp_table, "IN_MEMORY", 64 << 10)
    figures = []
    for ranks in (8, 64):
        out = make_per_rank(tmp_path / f"r{ranks}", "dtensor", ranks)
        tracemalloc.start()
        ckpt = ckpttool.read(str(out / "ep0-rank0.pt"))
        held, peak = tracemalloc.get_traced_memory()
        blocks = 0
        for _, ref in iter_tensors(ckpt.root):
            for shard in ref.shards:  # every block's stored tensor, as a writer asks for it
                stored = shard.tensor.tensor_ref()
                assert stored.shape == shard.sizes and stored.storage.source.path.endswith(
                    f"ep0-rank{shard.rank}.pt"
                )
                blocks += 1
        resolved, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert ckpt.world_size == ranks and len(ckpt.files) == ranks
        figures.append((held, peak, resolved, blocks))
        del ckpt
    (held_a, peak_a, resolved_a, blocks_a), (held_b, peak_b, resolved_b, blocks_b) = figures
    more = blocks_b - blocks_a
    assert more > 5000, figures
    assert held_b - held_a < 100 * more, figures
    assert resolved_b - resolved_a < 100 * more, figures
    assert peak_b - peak_a < 200 * more, figures


def test_block_locations_remake_each_stored_tensor():
    """A rank file's blocks are kept as records (formats/rank_blocks.Locations) and each
    block's TensorRef is made again from them, field for field; what a record cannot
    say (a conjugate view, a remote zip entry not yet checked, a number past 64 bits)
    keeps its object. A file
    with several blocks of a tensor, and none of another, is found too."""
    from ckpttool.dtypes import DTYPES
    from ckpttool.formats.per_rank.blocks import Locations
    from ckpttool.formats.records import Interned
    from ckpttool.sources import ByteSpan
    from ckpttool.tree import StorageRef, TensorRef

    f32, bf16 = DTYPES["float32"], DTYPES["bfloat16"]

    def stored(shape, offset, start, dtype=f32, path="r1.pt", **kw):
        storage = StorageRef("7", dtype, 64, "cuda:1", ByteSpan(path, start, 64 * dtype.itemsize))
        return TensorRef(dtype, shape, (shape[1], 1), offset, storage, device="cuda:1", **kw)

    plain = stored((2, 4), 8, 1000, requires_grad=True, parameter=True)
    second = stored((1, 4), 0, 5000, dtype=bf16)
    conj = stored((2, 4), 0, 3000, conj=True)
    unchecked = TensorRef(
        f32,
        (2, 4),
        (4, 1),
        0,
        StorageRef("9", f32, 8, "cpu", ByteSpan("r1.pt", 0, 32, zip_header_offset=64)),
    )
    huge = TensorRef(f32, (2, 4), (4, 1), 0, StorageRef("5", f32, 2**63, "cpu", ByteSpan("r1.pt")))
    locations = Locations(Interned())
    blocks = [(0, (0, 0), plain), (0, (2, 0), second), (2, (0, 0), conj), (3, (0, 0), unchecked)]
    locations.add_file(1, "r1.pt", [*blocks, (3, (2, 0), huge)], 4, disagree={1})
    assert locations.has(1) and not locations.has(0) and locations.disagrees(1, 1)

    def fields(ref):
        s = ref.storage
        return (
            ref.dtype, ref.shape, ref.stride, ref.offset, ref.device, ref.requires_grad,
            ref.parameter, ref.kind, ref.conj, s.key, s.dtype, s.numel, s.device,
            s.big_endian, s.source.path, s.source.offset, s.source.length,
        )  # fmt: skip

    for tensor, offsets, ref in blocks[:2]:
        again = locations.ref(1, "r1.pt", tensor, offsets, ref.shape)
        assert again is not ref and fields(again) == fields(ref)
    assert locations.ref(1, "r1.pt", 2, (0, 0), (2, 4)) is conj
    assert locations.ref(1, "r1.pt", 3, (0, 0), (2, 4)) is unchecked
    assert locations.ref(1, "r1.pt", 3, (2, 0), (2, 4)) is huge  # past a record's 64 bits
    assert locations.ref(1, "r1.pt", 0, (1, 0), (2, 4)) is None  # no block there
    assert locations.ref(1, "r1.pt", 1, (0, 0), (2, 4)) is None

    # handed to another process, whose numbering differs: the same blocks there
    assert locations.export(1) is None  # (objects stay in the process that read them)
    plain2 = stored((2, 4), 8, 1000, path="r2.pt", requires_grad=True)
    second2 = stored((1, 4), 0, 5000, dtype=bf16, path="r2.pt")
    locations.add_file(2, "r2.pt", [(0, (0, 0), plain2), (1, (2, 0), second2)], 4, {3})
    other = Locations(Interned())
    other.tuples.id((9, 9, 9))
    other.take(2, json.loads(json.dumps(locations.export(2))), 4)
    assert other.has(2) and other.disagrees(2, 3) and not other.disagrees(2, 1)
    for tensor, offsets, ref in ((0, (0, 0), plain2), (1, (2, 0), second2)):
        assert fields(other.ref(2, "r2.pt", tensor, offsets, ref.shape)) == fields(ref)


def test_a_dangerous_rank_file_comes_first_whichever_process_read_it(tmp_path):
    """Two processes, four ShardedTensor rank files: process 0 reads ranks 0 and 2 (a
    damaged file), process 1 ranks 1 and 3 (a dangerous one). Each hands the other
    what its files gave, errors too, and reads its share through: both refuse with
    the dangerous file's verdict, the same line, as one process does (the verdict
    comes first), never the damaged file's error because it was posted first."""
    from helpers import rewrite_zip

    from ckpttool import sharing
    from ckpttool.errors import UnsafeError

    generated = make_per_rank(tmp_path / "generated", "sharded", 4, "--data")
    evil = b"X\x04\x00\x00\x00evilcposix\nsystem\n(X\x04\x00\x00\x00truetRs."
    edits = {
        2: lambda name, data: data[:-20] if name.endswith("/data.pkl") else None,
        3: lambda name, data: data[:-1] + evil if name.endswith("/data.pkl") else None,
    }
    files = []
    for rank in range(4):
        path = tmp_path / f"ep0-rank{rank}.pt"
        rewrite_zip(generated / path.name, path, edits.get(rank, lambda name, data: None))
        files.append(str(path))
    with pytest.raises(UnsafeError) as alone:
        ckpttool.read(files)
    sent = []
    for rank in (0, 1):
        members = _Members(rank, 2)
        with sharing.joined(members), pytest.raises(_Gathered):
            ckpttool.read(files)
        sent.append(members.sent[0])
    assert set(sent[0]) == {0, 2} and set(sent[1]) == {1, 3}
    for rank in (0, 1):
        with sharing.joined(_Members(rank, 2, sent)), pytest.raises(UnsafeError) as refused:
            ckpttool.read(files)
        assert refused.value.one_line() == alone.value.one_line()
        assert (
            "posix.system" in refused.value.one_line()
            and "ep0-rank3.pt" in refused.value.one_line()
        )
        assert refused.value.dangerous == alone.value.dangerous == ["posix.system"]
