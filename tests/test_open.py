"""``ckpttool.open``: a lazy mapping of tensor names like ``safetensors.safe_open``, for every
format; ``get_slice`` reads only what it returns, also across the shards of a tensor."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import ROOT, small_state_dict, write_dcp
from safetensors import safe_open
from safetensors.torch import save_file

import ckpttool
from ckpttool.tree.leaves import ShardedRef
from ckpttool.tree.sharding import Shard

INDEXES = [
    slice(None),
    slice(0, 3),
    slice(2, 9, 3),
    (slice(1, None, 2), slice(None, None, 3)),
    4,
    -1,
    (Ellipsis, 2),
    (3, slice(1, 4)),
    (slice(5, 5),),
    (slice(None), -2),
]


@pytest.fixture
def weight():
    return torch.arange(10 * 7, dtype=torch.float32).reshape(10, 7)


def test_open_is_a_lazy_mapping_of_the_model_state_dict(tmp_path):
    sd = small_state_dict()
    path = tmp_path / "snap.pt"
    torch.save({"MODEL_STATE": {f"module.{k}": v for k, v in sd.items()}, "EPOCHS_RUN": 3}, path)
    with ckpttool.open(path) as f:
        assert list(f.keys()) == list(sd) == list(ckpttool.load(path))
        assert len(f) == 4 and "fc.weight" in f and "module.fc.weight" not in f
        assert f.metadata() == {}
        for name, tensor in sd.items():
            assert torch.equal(f.get_tensor(name), tensor)
            assert torch.equal(f[name], tensor)
        with pytest.raises(ckpttool.CkptError, match="no tensor 'nope'"):
            f.get_tensor("nope")
        kept = f.get_tensor("fc.weight")
    assert torch.equal(kept, sd["fc.weight"])  # valid after close
    with pytest.raises(ckpttool.CkptError, match="closed"):
        f.get_tensor("fc.weight")
    with ckpttool.open(path, select="all") as f:
        assert list(f) == [f"MODEL_STATE.module.{k}" for k in sd]


def test_open_agrees_with_safe_open(tmp_path, weight):
    path = tmp_path / "w.safetensors"
    tensors = {"embed.weight": weight, "norm": torch.ones(7, dtype=torch.bfloat16)}
    save_file(tensors, path, metadata={"format": "pt", "ss_network_dim": "8"})
    with safe_open(path, framework="pt") as ref, ckpttool.open(path) as f:
        assert sorted(f.keys()) == sorted(ref.keys())
        assert f.metadata() == ref.metadata()
        for name in ref.keys():
            assert torch.equal(f.get_tensor(name), ref.get_tensor(name))
            assert f.get_slice(name).get_shape() == ref.get_slice(name).get_shape()
        for index in INDEXES:
            assert torch.equal(f.get_slice("embed.weight")[index], weight[index]), index
            if not isinstance(index, tuple) or Ellipsis not in index:
                assert torch.equal(f.get_slice("embed.weight")[index],
                                   ref.get_slice("embed.weight")[index]), index  # fmt: skip


def test_get_tensor_writes_never_reach_the_file_or_the_next_read(tmp_path, weight):
    path = tmp_path / "w.safetensors"
    save_file({"w": weight}, path)
    with ckpttool.open(path) as f:
        first = f.get_tensor("w")
        first.zero_()
        assert torch.equal(f.get_tensor("w"), weight)
        rows = f.get_slice("w")[:2]
        rows.zero_()
        assert torch.equal(f.get_slice("w")[:2], weight[:2])
    assert torch.equal(ckpttool.load(path)["w"], weight)


@pytest.mark.parametrize("mmap", [True, False])
def test_get_slice_reads_only_the_rows_asked_for(tmp_path, weight, mmap):
    """The rows outside the slice are garbage in the file: a read of them would show."""
    path = tmp_path / "w.safetensors"
    save_file({"w": weight}, path)
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    row = 7 * 4
    data[header : header + 2 * row] = b"\xff" * (2 * row)  # rows 0-1
    data[header + 6 * row :] = b"\xff" * (4 * row)  # rows 6-9
    path.write_bytes(bytes(data))
    with ckpttool.open(path, mmap=mmap) as f:
        assert torch.equal(f.get_slice("w")[2:6], weight[2:6])
        assert torch.equal(f.get_slice("w")[3, 1:5], weight[3, 1:5])
        assert not torch.equal(f.get_tensor("w"), weight)


@pytest.mark.parametrize("index", INDEXES, ids=str)
def test_get_slice_across_shard_boundaries_equals_slicing_the_full_tensor(tmp_path, weight, index):
    """A 10x7 tensor in a 2x2 grid of blocks of uneven sizes, each saved on its own."""
    blocks = {(0, 0): weight[:4, :3], (0, 3): weight[:4, 3:], (4, 0): weight[4:, :3],
              (4, 3): weight[4:, 3:]}  # fmt: skip
    path = tmp_path / "blocks.pt"
    torch.save({f"{r}_{c}": b.clone() for (r, c), b in blocks.items()}, path)
    ckpt = ckpttool.read(path)
    shards = [Shard((r, c), tuple(b.shape), ckpt[f"{r}_{c}"]) for (r, c), b in blocks.items()]
    sharded = ShardedRef(ckpt["0_0"].dtype, (10, 7), shards)
    lazy = ckpttool.LazyCheckpoint(ckpt, {"w": sharded}, "cpu", True)
    assert torch.equal(lazy.get_slice("w")[index], weight[index])
    assert torch.equal(lazy.get_tensor("w"), weight)


@pytest.mark.slow
def test_get_slice_of_dcp_and_per_rank_shards(dist_runs, dist_reference):
    full = dist_reference["two"]["model"]
    for source in (dist_runs.two / "dcp", str(dist_runs.two / "ep0-ba1-rank*.pt")):
        with ckpttool.open(source) as f:
            assert sorted(f) == sorted(full)
            for name, tensor in full.items():
                assert torch.equal(f.get_tensor(name), tensor)
                if tensor.dim():
                    n = tensor.shape[0]
                    for index in (slice(1, n - 1), slice(n // 2, None), slice(None, None, 2)):
                        assert torch.equal(f.get_slice(name)[index], tensor[index]), (name, index)


def test_get_slice_of_a_dcp_tensor(tmp_path, weight):
    write_dcp(tmp_path / "dcp", {"model": {"w": weight}, "step": 1})
    with ckpttool.open(tmp_path / "dcp") as f:
        assert list(f) == ["w"]
        assert torch.equal(f.get_slice("w")[3:8, 2], weight[3:8, 2])


@pytest.mark.parametrize(
    "index, error",
    [((0, 0, 0), "too many indices"), (10, "out of bounds"), (slice(None, None, -1), "positive"),
     ([1, 2], "only ints"), ((Ellipsis, Ellipsis), "single ellipsis")],
)  # fmt: skip
def test_get_slice_refuses_what_it_cannot_index(tmp_path, weight, index, error):
    path = tmp_path / "w.pt"
    torch.save({"w": weight}, path)
    with ckpttool.open(path) as f, pytest.raises(IndexError, match=error):
        f.get_slice("w")[index]


def test_open_imports_torch_only_when_a_tensor_is_asked_for(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(3)}, path)
    code = (
        "import sys, ckpttool\n"
        f"f = ckpttool.open({str(path)!r})\n"
        "print(list(f), f.metadata(), f.get_slice('w').get_shape(), 'torch' in sys.modules)\n"
        "f.get_tensor('w'); print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.splitlines() == ["['w'] {} [3] False", "True"], out.stderr


def test_star_import_keeps_the_builtin_open():
    namespace: dict = {}
    exec("from ckpttool import *", namespace)
    assert "open" not in namespace and "load_into" in namespace
    assert "open" in dir(ckpttool) and ckpttool.open is ckpttool.api.lazy_file.open_checkpoint


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize(
    "fmt", ["torch-zip", "torch-legacy", "safetensors", "safetensors-sharded", "torchscript", "dcp"]
)
def test_open_reads_every_format_as_load_does(tmp_path, fmt):
    from helpers import write_hf_shards

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    path = tmp_path / "ckpt"
    if fmt == "torch-zip":
        torch.save(sd, path)
    elif fmt == "torch-legacy":
        torch.save(sd, path, _use_new_zipfile_serialization=False)
    elif fmt == "safetensors":
        save_file(sd, path)
    elif fmt == "safetensors-sharded":
        write_hf_shards(path, sd)
    elif fmt == "torchscript":
        torch.jit.save(torch.jit.script(net), path)
    else:
        write_dcp(path, {"model": sd})
    loaded = ckpttool.load(path)
    with ckpttool.open(path) as f:
        assert f.checkpoint.format == fmt
        assert sorted(f) == sorted(loaded) == sorted(sd)
        for name, tensor in sd.items():
            assert torch.equal(f.get_tensor(name), tensor), name
            assert torch.equal(f.get_slice(name)[1:], tensor[1:]), name
            assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("stride", [2**64, 2**63])
def test_empty_tensor_with_a_stride_torch_cannot_hold_is_corrupt(tmp_path, stride):
    # an empty shard of fixtures/fsdp_uneven with its stride made 2**64 read fine, but
    # get_slice(...)[:] raised TypeError from torch.as_strided instead of CkptError
    import collections

    from helpers import fixture_path, rewrite_zip
    from payloads import Reduce, _Storage, torch_pickle_bytes

    empty = Reduce(
        torch._utils._rebuild_tensor_v2,
        (_Storage("16", 1264), 0, (0,), (stride,), False, collections.OrderedDict()),
    )
    data = torch_pickle_bytes({"w": empty})
    path = tmp_path / "empty.pt"
    source = fixture_path("ddp/ep0-rank0.pt")
    rewrite_zip(source, path, lambda name, old: data if name.endswith("/data.pkl") else None)
    with pytest.raises(ckpttool.CkptError, match="impossible stride"):
        with ckpttool.open(path) as f:
            f.get_slice("w")[:]
