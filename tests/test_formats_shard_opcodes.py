"""A ShardedTensor rank file's pickle read at the opcode level (formats/shard_opcodes.py):
every rank's ShardMetadata as records, the rest a skeleton pickle. The same checkpoint,
verdict and bytes as the file read whole, for real rank files and for pickles built to
be irregular."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import random
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_per_rank, rewrite_zip, run_cli
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed.remote_device import _remote_device

import ckpttool
from ckpttool.formats.skeleton import shard_runs as shard_opcodes
from ckpttool.formats.torch_save import zip_pickle
from ckpttool.formats.torch_save.zip_pickle import ZipPickle
from ckpttool.tree import walk
from ckpttool.unpickler import LocalShards

GENERATOR = Path(__file__).parents[1] / "benchmarks" / "make_dcp_scale.py"


def generate(out: Path, ranks: int, *extra: str) -> Path:
    return make_per_rank(out, "sharded", ranks, *extra)


@pytest.fixture(scope="module")
def ranks8(tmp_path_factory) -> Path:
    """8 rank files of the tiny shape's 225 ShardedTensors, real data: each file's
    metadata names 1,800 shards."""
    return generate(tmp_path_factory.mktemp("sharded8"), 8, "--data")


def layouts(root) -> list:
    """Every ShardedTensor's (offsets, sizes, rank) of each shard, its local shards' blocks."""
    out = []
    for path, value in walk(root):
        if isinstance(value, LocalShards):
            places = []
            for item in value.layout:
                if isinstance(item, shard_opcodes.ShardRun):
                    tuples = item.tuples
                    places += [
                        (tuples[o], tuples[s], r)
                        for o, s, r in item.records()[["offsets", "sizes", "rank"]].tolist()
                    ]
                else:
                    places.append(item)
            blocks = [(s.offsets, s.sizes, s.tensor.storage.key) for s in value.shards]
            out.append((path, value.shape, value.dtype.name, places, blocks))
    return out


def load(path: Path) -> tuple:
    with ZipPickle(str(path)) as archive:
        root = archive.load()
    return root, layouts(root)


def test_a_rank_file_read_as_records_is_the_file_read_whole(ranks8, monkeypatch):
    for rank in (0, 5):
        path = ranks8 / f"ep0-rank{rank}.pt"
        with ZipPickle(str(path)) as archive:
            parsed = archive._shard_runs(archive._pickle_info("data.pkl"))
        assert parsed is not None
        # most of the 1,800 ShardMetadata are records (the first few, below memo slot
        # 256, and each tensor's own rank's, which names its local shard's placement,
        # are walked)
        assert sum(run.count for run in parsed.runs) > 1500
        _, fast = load(path)
        monkeypatch.setattr(zip_pickle, "SHARD_RUNS_FROM", 1 << 62)
        _, slow = load(path)
        monkeypatch.undo()
        assert len(fast) == 225 and fast == slow
        assert all(len(places) == 8 for _, _, _, places, _ in fast)


def test_conversion_from_records_is_byte_identical_and_right(ranks8, tmp_path, monkeypatch):
    sys.path.insert(0, str(GENERATOR.parent))
    try:
        import make_dcp_scale
    finally:
        sys.path.remove(str(GENERATOR.parent))
    outs = []
    for name in ("fast", "whole"):
        if name == "whole":
            monkeypatch.setattr(zip_pickle, "SHARD_RUNS_FROM", 1 << 62)
        out = tmp_path / f"{name}.safetensors"
        done = run_cli("convert", ranks8 / "ep0-rank0.pt", "--to", "safetensors", "-o", out)
        assert done.returncode == 0, done.stderr
        outs.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert outs[0] == outs[1]
    from safetensors.torch import load_file

    got = load_file(tmp_path / "fast.safetensors")
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    for index, (key, _, shape, dtype) in enumerate(make_dcp_scale.entries(8, make_dcp_scale.TINY)):
        if key.startswith("model."):
            expected = make_dcp_scale.tensor_values(index, shape, dtypes[dtype])
            assert torch.equal(got[key.removeprefix("model.")], expected), key


# --------------------------------------------------------------- built pickles


def _metadata(rng: random.Random, rank: int) -> ShardMetadata:
    dims = rng.choice([0, 1, 1, 2, 2, 3])
    number = lambda: rng.choice([0, 1, 7, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**40, 2**62])  # noqa: E731
    device = rng.choice(["cpu", "cuda", "meta", f"cuda:{rank % 8}", f"cuda:{rank % 100}"])
    return ShardMetadata(
        [number() for _ in range(dims)], [number() for _ in range(dims)], f"rank:{rank}/{device}"
    )


def _built(rng: random.Random):
    """A pickle's worth of ShardMetadata lists (past 256 memo slots), some named again."""
    value: dict = {"pad": [f"s{i}" for i in range(rng.choice([10, 300]))]}
    every = []
    for n in range(rng.randint(1, 6)):
        lst = [_metadata(rng, r) for r in range(rng.choice([0, 1, 2, 5, 40, 300]))]
        every += lst
        value[f"list{n}"] = lst
    if every and rng.random() < 0.5:  # a ShardingSpec's placements: the same objects
        value["placements"] = [m.placement for m in rng.sample(every, min(len(every), 30))]
    if every and rng.random() < 0.2:  # a run's object named as a dict's value
        value["again"] = rng.choice(every)
    if every and rng.random() < 0.2:  # or inside a tuple
        value["tuple"] = (rng.choice(every).placement,)
    return value


def _same(original, skeleton, parsed: shard_opcodes.Parsed) -> bool:
    """The skeleton's value, each token standing for its run's records and the marker for
    a run's object, is the original's."""
    runs = {parsed.token(n): run for n, run in enumerate(parsed.runs)}
    if isinstance(original, dict):
        return original.keys() == skeleton.keys() and all(
            _same(original[k], skeleton[k], parsed) for k in original
        )
    if isinstance(original, list):
        expanded: list = []
        for item in skeleton:
            if type(item) is bytes and item in runs:
                run = runs[item]
                expanded += [
                    (run.tuples[o], run.tuples[s], r)
                    for o, s, r in run.records()[["offsets", "sizes", "rank"]].tolist()
                ]
            else:
                expanded.append(item)
        return len(expanded) == len(original) and all(
            _same(a, b, parsed) for a, b in zip(original, expanded, strict=True)
        )
    if isinstance(original, ShardMetadata):
        if isinstance(skeleton, tuple):
            return skeleton == (
                tuple(original.shard_offsets),
                tuple(original.shard_sizes),
                original.placement.rank(),
            )
        return skeleton == original
    if isinstance(original, _remote_device) and skeleton == parsed.marker:
        return True
    return original == skeleton


def test_a_skeleton_and_its_records_are_the_pickle():
    """Pickles of real torch classes (protocol 2, as torch.save writes): where the parser
    vouches for one, the skeleton read by the real unpickler, its tokens expanded, is
    the original."""
    vouched = 0
    for seed in range(60):
        value = _built(random.Random(seed))
        data = pickle.dumps(value, protocol=2)
        parsed = shard_opcodes.parse(io.BytesIO(data).read)
        if parsed is not None:
            vouched += 1
            assert _same(pickle.loads(data), pickle.loads(parsed.skeleton), parsed), seed
    assert vouched > 30


def test_a_run_object_named_outside_a_list_is_not_vouched_for():
    rng = random.Random(1)
    metadata = [_metadata(rng, r) for r in range(300)]
    plain = {"pad": [f"s{i}" for i in range(300)], "list": metadata}
    assert shard_opcodes.parse(io.BytesIO(pickle.dumps(plain, protocol=2)).read) is not None
    for again in ({"x": metadata[200]}, (metadata[200].placement,), metadata[200].shard_sizes):
        data = pickle.dumps({**plain, "again": again}, protocol=2)
        assert shard_opcodes.parse(io.BytesIO(data).read) is None, again
    # a placement named again as a list's element is what a ShardingSpec does: vouched for
    data = pickle.dumps({**plain, "again": [metadata[200].placement]}, protocol=2)
    parsed = shard_opcodes.parse(io.BytesIO(data).read)
    assert parsed is not None and pickle.loads(parsed.skeleton)["again"] == [parsed.marker]


def test_irregular_pickles_are_not_vouched_for():
    rng = random.Random(2)
    plain = {"pad": [f"s{i}" for i in range(300)], "list": [_metadata(rng, r) for r in range(50)]}
    data = pickle.dumps(plain, protocol=2)
    assert shard_opcodes.parse(io.BytesIO(data).read) is not None
    import pickletools

    cases = {
        "memo slots not as the pickler numbers them": pickletools.optimize(data),
        "protocol 4": pickle.dumps(plain, protocol=4),
        "a bytes opcode": pickle.dumps({**plain, "b": b"ckpttool-run:"}, protocol=3),
        "truncated": data[:-1],
        "past its STOP": data + b".",
    }
    for why, irregular in cases.items():
        assert shard_opcodes.parse(io.BytesIO(irregular).read) is None, why


def test_tokens_are_new_for_each_parse():
    rng = random.Random(3)
    data = pickle.dumps(
        {"pad": [f"s{i}" for i in range(300)], "list": [_metadata(rng, r) for r in range(9)]},
        protocol=2,
    )
    one, two = (shard_opcodes.parse(io.BytesIO(data).read) for _ in range(2))
    assert one is not None and two is not None
    assert one.token(0) != two.token(0) and one.marker != two.marker


# --------------------------------------------------------------- whole files


def _outcome(path: Path):
    try:
        root, found = load(path)
    except Exception as exc:  # noqa: BLE001 (the outcome compared, whatever it is)
        return type(exc).__name__, getattr(exc, "dangerous", None)
    return "read", found


@pytest.mark.parametrize("seed", range(12))
def test_a_damaged_rank_file_reads_as_when_read_whole(ranks8, tmp_path, monkeypatch, seed):
    """Bytes changed anywhere in a real rank file's data.pkl: the opcode reader gives
    the same tree or the same kind of error as the file read whole."""
    rng = random.Random(seed)

    def damage(data: bytes) -> bytes:
        out = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(2, len(out))
            out[at] = rng.randrange(256) if rng.random() < 0.7 else out[at] ^ 1
        return bytes(out)

    target = tmp_path / "ep0-rank3.pt"
    rewrite_zip(
        ranks8 / "ep0-rank3.pt",
        target,
        lambda name, data: damage(data) if name.endswith("/data.pkl") else None,
    )
    fast = _outcome(target)
    monkeypatch.setattr(zip_pickle, "SHARD_RUNS_FROM", 1 << 62)
    assert fast == _outcome(target)


def test_a_dangerous_global_beside_the_runs_is_refused_as_when_read_whole(tmp_path, monkeypatch):
    rng = random.Random(4)
    state = {
        "pad": [f"s{i}" for i in range(300)],
        "list": [_metadata(rng, r) for r in range(2000)],  # (past SHARD_RUNS_FROM)
        "hook": os.system,
    }
    path = tmp_path / "evil.pt"
    torch.save(state, path)
    with ZipPickle(str(path)) as archive:
        assert archive._shard_runs(archive._pickle_info("data.pkl")) is not None
    fast = run_cli("inspect", str(path))
    monkeypatch.setattr(zip_pickle, "SHARD_RUNS_FROM", 1 << 62)
    slow = run_cli("inspect", str(path))
    assert fast.returncode == slow.returncode == 3
    assert fast.stderr == slow.stderr and "system" in fast.stderr


def test_runs_outside_a_sharded_tensor_leave_the_file_read_whole(tmp_path, monkeypatch):
    """ShardMetadata in a list of the checkpoint's own: the runs' tokens are not in a
    ShardedTensor's layout, so the file is read whole (its objects as they are)."""
    rng = random.Random(5)
    state = {"pad": [f"s{i}" for i in range(300)], "list": [_metadata(rng, r) for r in range(2000)]}
    path = tmp_path / "plain.pt"
    torch.save(state, path)
    with ZipPickle(str(path)) as archive:
        assert archive._shard_runs(archive._pickle_info("data.pkl")) is not None
    fast = ckpttool.read(str(path))
    monkeypatch.setattr(zip_pickle, "SHARD_RUNS_FROM", 1 << 62)
    slow = ckpttool.read(str(path))
    assert len(fast.root["list"]) == 2000
    assert repr(fast.root["list"]) == repr(slow.root["list"])


@pytest.mark.slow  # 8 and 64 generated rank files of 225 ShardedTensors each, under tracemalloc
def test_the_memory_of_reading_a_rank_file_does_not_grow_with_its_shards(tmp_path):
    """Every ShardedTensor rank file names every rank's shards: a 64-rank file holds
    14,400 ShardMetadata. As objects they cost ~1.4 KB each at the peak of its read
    (before the opcode reader: 1,393 bytes a shard more, 8 to 64 ranks); as records,
    nothing that grows with them but the records (16 bytes) and the skeleton's GETs of
    the ShardingSpec's placements (2 bytes). Here the spills leave memory past 64 KB."""
    import json
    import subprocess
    import sys

    from helpers import subprocess_env

    folders = {ranks: generate(tmp_path / f"r{ranks}", ranks) for ranks in (8, 64)}
    # measured in a process of its own, as a command reads: threads other tests of this
    # process left running would keep the other rank files' scans out of a forked child
    # (formats/prescan.py), and their pickles would count here
    named = json.dumps({ranks: str(folder) for ranks, folder in folders.items()})
    code = f"""
import json, tracemalloc, ckpttool
from ckpttool.formats import records
records.IN_MEMORY = 64 << 10
folders = {{int(k): v for k, v in json.loads({named!r}).items()}}
ckpttool.read(folders[8] + "/ep0-rank0.pt")  # (what a first read imports and caches)
figures = {{}}
for ranks, folder in folders.items():
    tracemalloc.start()
    ckpt = ckpttool.read(folder + "/ep0-rank0.pt")
    figures[ranks] = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert ckpt.world_size == ranks and len(ckpt.files) == ranks
    del ckpt
print(json.dumps(figures))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    figures = {int(k): v for k, v in json.loads(done.stdout).items()}
    more = 225 * (64 - 8)
    assert figures[64][0] - figures[8][0] < 100 * more, figures
    assert figures[64][1] - figures[8][1] < 200 * more, figures
