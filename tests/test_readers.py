"""One test group per reader: format id, exact keys, and tensors bitwise equal to the originals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn as nn
from conftest import (
    assert_nested_equal,
    check_error,
    fixture_path,
    run_cli,
    small_state_dict,
    write_dcp,
)
from helpers_deepspeed import write_zero_tag
from safetensors.torch import load_file, save_file

import ckpttool
from ckpttool.report import inspect_report


def assert_same(actual: dict, expected: dict) -> None:
    """Same keys in the same order, every tensor bitwise equal with the same dtype/shape."""
    assert list(actual) == list(expected)
    for key, value in expected.items():
        got = actual[key]
        assert got.dtype == value.dtype, key
        assert got.shape == value.shape, key
        assert got.device.type == "cpu", key
        if value.dtype in (torch.float8_e4m3fn, torch.uint16):  # no equal kernel on CPU
            got, value = got.view(torch.uint8), value.view(torch.uint8)
        assert torch.equal(got, value), key


def tricky_tensors() -> dict:
    """Tied weights sharing one storage, views with offsets and strides, several dtypes."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 4, generator=g)
    ints = torch.arange(20, dtype=torch.int64)
    return {
        "embed.weight": w,
        "lm_head.weight": w,  # tied: the same tensor twice
        "cols": w[:, 1:3],  # non-contiguous, storage offset 1
        "transposed": w.t(),
        "every_other_row": w[::2],
        "ints_view": ints[5:9],
        "half": torch.randn(3, generator=g).half(),
        "bf16": torch.randn(2, 2, generator=g).bfloat16(),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "fp8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),  # an UntypedStorage
        "u16": torch.tensor([1, 60000], dtype=torch.int32).to(torch.uint16),
    }


# ------------------------------------------------------------ torch.save zip


@pytest.mark.parametrize(
    "fmt,kwargs",
    [("torch-zip", {}), ("torch-legacy", {"_use_new_zipfile_serialization": False})],
)
def test_torch_save_formats_bitwise(tmp_path, fmt, kwargs):
    original = tricky_tensors()
    path = tmp_path / "tricky.pt"
    torch.save(original, path, **kwargs)
    ckpt = ckpttool.read(path)
    assert ckpt.format == fmt
    assert ckpt.files == [str(path)]
    assert ckpt.world_size is None
    assert ckpt.dangerous == []
    # the tree keeps sharing: tied weights and views point at one storage
    assert ckpt.root["embed.weight"].storage is ckpt.root["lm_head.weight"].storage
    assert ckpt.root["cols"].storage is ckpt.root["embed.weight"].storage
    assert (ckpt.root["cols"].offset, ckpt.root["cols"].stride) == (1, (4, 1))
    loaded = ckpttool.load(path)
    assert_same(loaded, original)
    # tied weights and views share one storage, with their saved strides (as torch.load)
    shared = loaded["embed.weight"].untyped_storage().data_ptr()
    for name in ("lm_head.weight", "cols", "transposed", "every_other_row"):
        assert loaded[name].untyped_storage().data_ptr() == shared, name
        assert loaded[name].stride() == original[name].stride(), name


@pytest.mark.parametrize("protocol", [2, 1])
def test_legacy_reads_the_same_as_torch_load(tmp_path, protocol):
    """The legacy stream reader agrees with torch.load on every tensor, also for a file
    written with pickle_protocol=1 (its magic number is text: it was not detected)."""
    original = {"model": small_state_dict(), "epoch": 2}
    path = tmp_path / "legacy.pt"
    torch.save(original, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    # weights_only=True refuses protocol 1's opcodes; the file is torch's own here
    reference = torch.load(path, weights_only=protocol == 2)
    assert ckpttool.read(path).format == "torch-legacy"
    everything = ckpttool.load(path, select="all")
    assert_nested_equal(everything, reference)


# --------------------------------------------------------------- torchscript


class _Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.sub = _Sub()
        self.register_buffer("buf", torch.arange(5.0))
        self.scale = torch.tensor([2.0])  # a plain attribute: not in the state dict

    def forward(self, x):
        return self.sub(self.fc(x)) * self.scale + self.buf.sum()


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_torchscript_lists_parameters_and_buffers(tmp_path):
    torch.manual_seed(0)
    net = _Net()
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(net), path)
    ckpt = ckpttool.read(path)
    assert ckpt.format == "torchscript"
    assert sorted(ckpt.root) == ["buf", "fc.bias", "fc.weight", "sub.lin.bias", "sub.lin.weight"]
    assert list(ckpt.root) == list(torch.jit.load(path).state_dict())  # and in its order
    _check_torchscript(path, ckpt, net)


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("how", ["script", "trace"])
def test_torchscript_cnn(tmp_path, how):
    """A scripted conv net's pickle wraps typed lists in torch.jit._pickle.build_intlist
    & co. (identity functions): read, not refused."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    net.eval()
    module = (
        torch.jit.script(net) if how == "script" else torch.jit.trace(net, torch.randn(1, 3, 8, 8))
    )
    path = tmp_path / f"{how}.pt"
    torch.jit.save(module, path)
    ckpt = ckpttool.read(path)
    assert ckpt.format == "torchscript" and ckpt.dangerous == []
    _check_torchscript(path, ckpt, net)


def _check_torchscript(path, ckpt, net):
    loaded = ckpttool.load(path)
    expected = net.state_dict()
    assert sorted(loaded) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    report = inspect_report(ckpt)
    assert report["model_key"] == [] and report["prefix"] is None
    assert report["num_params"] == sum(v.numel() for v in expected.values())



class _NoState(nn.Module):
    def forward(self, x):
        return x.relu()


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_parameterless_torchscript_and_empty_safetensors_are_an_empty_model(tmp_path):
    """Their root is the model's state dict whatever it holds: an empty one loads as {}
    (as torch.jit.load(f).state_dict() and safetensors' load_file give it), not as
    "no model state dict found"; an empty torch.save dict is still not taken for one."""
    scripted, empty = tmp_path / "relu.pt", tmp_path / "empty.safetensors"
    torch.jit.save(torch.jit.script(_NoState()), scripted)
    save_file({}, empty)
    assert dict(torch.jit.load(scripted).state_dict()) == {} == load_file(empty)
    for path in (scripted, empty):
        assert ckpttool.load(path) == {}
        assert inspect_report(ckpttool.read(path))["model_key"] == []
    torch.save({}, tmp_path / "empty.pt")
    with pytest.raises(ckpttool.CkptError, match="no model state dict found"):
        ckpttool.load(tmp_path / "empty.pt")

# --------------------------------------------------------------- safetensors


def test_safetensors_file(tmp_path):
    original = {k: v for k, v in tricky_tensors().items() if k not in ("lm_head.weight",)}
    original = {k: v.contiguous() for k, v in original.items()}
    path = tmp_path / "model.safetensors"
    save_file(original, path, metadata={"format": "pt", "note": "hi"})
    ckpt = ckpttool.read(path)
    assert ckpt.format == "safetensors"
    assert ckpt.metadata == {"format": "pt", "note": "hi"}
    assert ckpt.globals == [] and ckpt.dangerous == []
    assert_same(ckpttool.load(path), {k: original[k] for k in ckpt.root})
    assert sorted(ckpt.root) == sorted(original)


def write_hf_shards(folder, sd, shard_format="safetensors"):
    """A Hugging Face style sharded checkpoint of ``sd`` in two shards; returns the index.

    ``safetensors``: ``model-0000k-of-00002.safetensors`` + ``model.safetensors.index.json``;
    ``zip`` / ``legacy``: ``pytorch_model-0000k-of-00002.bin`` (torch.save) +
    ``pytorch_model.bin.index.json``, as transformers 4 wrote them.
    """
    names = list(sd)
    stem, suffix = (
        ("model", "safetensors") if shard_format == "safetensors" else ("pytorch_model", "bin")
    )
    parts = [{k: sd[k] for k in names[:2]}, {k: sd[k] for k in names[2:]}]
    folder.mkdir(exist_ok=True)
    weight_map = {}
    for i, part in enumerate(parts, 1):
        file = f"{stem}-{i:05d}-of-00002.{suffix}"
        if shard_format == "safetensors":
            save_file(part, folder / file, metadata={"format": "pt"})
        else:
            torch.save(part, folder / file, _use_new_zipfile_serialization=shard_format == "zip")
        weight_map.update({k: file for k in part})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    index = folder / f"{stem}.{suffix}.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return index


@pytest.fixture
def sharded_safetensors(tmp_path):
    """A Hugging Face style folder: two shards and model.safetensors.index.json."""
    sd = small_state_dict()
    write_hf_shards(tmp_path / "hf", sd)
    return tmp_path / "hf", sd


@pytest.mark.parametrize("via", ["index", "folder"])
def test_sharded_safetensors(sharded_safetensors, via):
    folder, sd = sharded_safetensors
    path = folder / "model.safetensors.index.json" if via == "index" else folder
    ckpt = ckpttool.read(path)
    assert ckpt.format == "safetensors-sharded"
    assert ckpt.files[0] == str(folder / "model.safetensors.index.json")
    assert sorted(ckpt.files[1:]) == sorted(str(p) for p in folder.glob("*.safetensors"))
    assert_same(ckpttool.load(path), sd)


def test_sharded_safetensors_missing_shard(sharded_safetensors):
    folder, _ = sharded_safetensors
    (folder / "model-00002-of-00002.safetensors").unlink()
    check_error(run_cli("inspect", folder), 2, "missing shard model-00002-of-00002.safetensors")


@pytest.mark.parametrize("shard_format,fmt", [("zip", "torch-zip"), ("legacy", "torch-legacy")])
@pytest.mark.parametrize("via", ["index", "folder"])
def test_sharded_torch_bin(tmp_path, shard_format, fmt, via):
    """``pytorch_model.bin.index.json`` + torch.save shards: one checkpoint, the shards' format."""
    sd = small_state_dict()
    index = write_hf_shards(tmp_path / "hf", sd, shard_format)
    ckpt = ckpttool.read(index if via == "index" else index.parent)
    assert ckpt.format == fmt
    assert ckpt.files == [str(index)] + [
        str(index.parent / f"pytorch_model-0000{i}-of-00002.bin") for i in (1, 2)
    ]
    assert list(ckpt.root) == list(sd)
    assert "torch._utils._rebuild_tensor_v2" in ckpt.globals and ckpt.dangerous == []
    assert_same(ckpttool.load(index), sd)
    out = tmp_path / "one.safetensors"
    assert run_cli("convert", index.parent, "--to", "safetensors", "-o", out).returncode == 0
    assert_same(ckpttool.load(out), sd)


def test_sharded_torch_bin_tensor_missing_from_its_shard(tmp_path):
    index = write_hf_shards(tmp_path / "hf", small_state_dict(), "zip")
    data = json.loads(index.read_text())
    data["weight_map"]["extra.weight"] = "pytorch_model-00001-of-00002.bin"
    index.write_text(json.dumps(data))
    check_error(
        run_cli("inspect", index),
        2,
        "'extra.weight' is not in pytorch_model-00001-of-00002.bin",
    )


def test_hf_folder_with_both_serializations_reads_the_safetensors(tmp_path):
    """A model repo often holds the same weights as safetensors and as .bin; like
    ``from_pretrained``, the safetensors copy is read (sharded or single file)."""
    sd = small_state_dict()
    sharded = tmp_path / "sharded"
    write_hf_shards(sharded, sd, "zip")
    write_hf_shards(sharded, sd, "safetensors")
    ckpt = ckpttool.read(sharded)
    assert ckpt.format == "safetensors-sharded"
    assert ckpt.files[0] == str(sharded / "model.safetensors.index.json")
    single = tmp_path / "single"
    single.mkdir()
    torch.save(sd, single / "pytorch_model.bin")
    save_file(sd, single / "model.safetensors")
    (single / "config.json").write_text("{}")
    assert ckpttool.read(single).files == [str(single / "model.safetensors")]
    (single / "model.safetensors").rename(single / "other.pt")
    (single / "pytorch_model.bin").rename(single / "weights.bin")  # two pickles: ambiguous
    check_error(run_cli("inspect", single), 2, "not exactly one checkpoint file")


def test_trainer_checkpoint_folder_reads_its_weights(tmp_path):
    """HF Trainer's checkpoint-N/ keeps pytorch_model.bin beside optimizer.pt,
    scheduler.pt, rng_state.pth and training_args.bin: the folder is its weights."""
    sd = small_state_dict()
    folder = tmp_path / "checkpoint-500"
    folder.mkdir()
    torch.save(sd, folder / "pytorch_model.bin")
    torch.save({"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}, folder / "optimizer.pt")
    torch.save({"last_epoch": 500, "base_lrs": [0.1]}, folder / "scheduler.pt")
    torch.save({"cpu": torch.random.get_rng_state()}, folder / "rng_state.pth")
    torch.save({"output_dir": "out", "seed": 42}, folder / "training_args.bin")
    (folder / "trainer_state.json").write_text("{}")
    ckpt = ckpttool.read(folder)
    assert ckpt.files == [str(folder / "pytorch_model.bin")]
    loaded = ckpttool.load(folder)
    assert list(loaded) == list(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)


def _deepspeed_tag(folder, sd, mp_ranks=1, dp_ranks=2):
    """A DeepSpeed ZeRO-2 tag folder: model states beside each rank's optimizer states."""
    write_zero_tag(
        folder, sd, world=dp_ranks, buffers=("bn.num_batches_tracked",), mp_ranks=mp_ranks
    )


def test_deepspeed_folders_read_their_model_states(tmp_path):
    """A run folder follows its ``latest`` file to the tag folder, whose fp32 weights are
    rebuilt from the ranks' partitions (as zero_to_fp32.py finds them); a pytorch_model.bin
    written beside ``latest`` comes first."""
    sd = small_state_dict()
    run = tmp_path / "checkpoints"
    _deepspeed_tag(run / "global_step10", {k: v + 1 for k, v in sd.items()})
    _deepspeed_tag(run / "global_step20", sd)
    (run / "latest").write_text("global_step20")
    for folder in (run, run / "global_step20"):
        ckpt = ckpttool.read(folder)
        assert ckpt.format == "deepspeed"
        assert ckpt.files[0] == str(run / "global_step20" / "mp_rank_00_model_states.pt")
        assert_same(ckpttool.load(folder), sd)
    torch.save({k: v * 2 for k, v in sd.items()}, run / "pytorch_model.bin")
    assert ckpttool.read(run).files == [str(run / "pytorch_model.bin")]

    (run / "latest").write_text("../elsewhere")  # only a folder beside it
    (run / "pytorch_model.bin").unlink()
    with pytest.raises(ckpttool.CkptError, match="folder holds no checkpoint"):
        ckpttool.read(run)


def test_deepspeed_model_parallel_states_are_refused_by_name(tmp_path):
    folder = tmp_path / "global_step5"
    _deepspeed_tag(folder, small_state_dict(), mp_ranks=2)
    with pytest.raises(ckpttool.CkptError, match="model states of several model-parallel ranks"):
        ckpttool.read(folder)
    assert ckpttool.read(folder / "mp_rank_01_model_states.pt").format == "torch-zip"


# ------------------------------------------------------ detection by content


@pytest.mark.parametrize(
    "name,writer,fmt",
    [
        ("x.pt", "safetensors", "safetensors"),
        ("x.bin", "zip", "torch-zip"),
        ("checkpoint", "zip", "torch-zip"),
        ("weights.safetensors", "legacy", "torch-legacy"),
        ("noext", "legacy", "torch-legacy"),
        ("model.json", "zip", "torch-zip"),
    ],
)
def test_format_is_detected_from_content_not_extension(tmp_path, name, writer, fmt):
    sd = small_state_dict()
    path = tmp_path / name
    if writer == "safetensors":
        save_file(sd, path)
    else:
        torch.save(sd, path, _use_new_zipfile_serialization=writer == "zip")
    assert ckpttool.read(path).format == fmt
    loaded = ckpttool.load(path)
    assert_same(loaded, sd) if writer != "safetensors" else assert_same(
        loaded, {k: sd[k] for k in loaded}
    )


def test_folder_with_exactly_one_checkpoint_file_is_read(tmp_path):
    sd = small_state_dict()
    torch.save(sd, tmp_path / "only.pth")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    ckpt = ckpttool.read(tmp_path)
    assert ckpt.format == "torch-zip" and ckpt.files == [str(tmp_path / "only.pth")]


# ----------------------------------------------------------------------- dcp


def test_dcp_single_process(tmp_path):
    sd = small_state_dict()
    write_dcp(tmp_path / "ckpt", {"model": sd, "epoch": 4, "name": "run"})
    ckpt = ckpttool.read(tmp_path / "ckpt")
    assert ckpt.format == "dcp"
    assert ckpt.files[0] == str(tmp_path / "ckpt" / ".metadata")
    everything = ckpttool.load(tmp_path / "ckpt", select="all")
    assert everything["epoch"] == 4 and everything["name"] == "run"
    assert_same({k: everything["model"][k] for k in sd}, sd)
    assert sorted(everything["model"]) == sorted(sd)


@pytest.mark.slow
def test_dcp_two_ranks(dist_runs, dist_reference):
    path = dist_runs.two / "dcp"
    ckpt = ckpttool.read(path)
    assert ckpt.format == "dcp"
    assert ckpt.world_size == 2
    assert sorted(ckpt.files[1:]) == [str(path / "__0_0.distcp"), str(path / "__1_0.distcp")]
    everything = ckpttool.load(path, select="all")
    assert everything["step"] == 7
    full = dist_reference["two"]
    assert_same({k: everything["model"][k] for k in full["model"]}, full["model"])
    assert_nested_equal(everything["optim"]["state"], full["optim"]["state"])
    assert_same(ckpttool.load(path), full["model"])  # auto: the model state dict
    report = inspect_report(ckpt)
    weight = next(t for t in report["tensors"] if t["key"] == ["model", "0.weight"])
    assert weight == {
        "key": ["model", "0.weight"],
        "dtype": "float32",
        "shape": [5, 4],
        "device": "cpu",
        "nbytes": 80,
        "sharded": True,
        "shards": 2,
        "file": None,  # its shards lie in both ranks' files
    }


# ------------------------------------------------------------------ per-rank


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
    assert_same(everything["state"]["model"], full["model"])
    assert_nested_equal(everything["state"]["optimizers"]["Adam"], full["optim"])
    assert everything["state"]["timestamp"] == {"epoch": 0, "batch": 1}
    assert_same(ckpttool.load(arg), full["model"])


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
    assert_same(ckpttool.load(files), dist_reference["dtensor"])
    assert_same(ckpttool.load(files[1]), dist_reference["dtensor"])  # siblings found


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
    assert_same(merged["ema"]["state"]["weights"], dist_reference["dtensor"])


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
    assert_same(everything["state"]["model"], full["model"])
    assert_nested_equal(everything["state"]["optimizers"]["Adam"], full["optim"])


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
    assert_same(everything["model"], full["model"])
    assert_same(ckpttool.load(path), full["model"])


@pytest.mark.slow
def test_dtensors_on_a_mesh_with_a_size_1_dimension(dist_runs):
    """HSDP with one replica, a (1, 2, 2) mesh: the layout torch >= 2.9 pickles records
    the size-1 dimension as an empty shape; it still counts as a mesh dimension."""
    run = dist_runs.mesh
    ckpt = ckpttool.read(run / "hsdp-rank0.pt")
    assert (ckpt.format, ckpt.world_size) == ("per-rank", 4)
    full = torch.load(run / "full.pt", weights_only=True)["model"]
    assert_same(ckpttool.load(run / "hsdp-rank*.pt"),
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
    assert_same(load_file(out), full)


@pytest.mark.slow
def test_dcp_tuple_holding_one_ranks_dtensor_block(dist_runs, tmp_path):
    """DCP does not flatten a tuple: rank 0 pickles it whole, with its own block of the
    DTensor in it. inspect shows the global tensor; reading it is refused by name."""
    folder = dist_runs.mesh / "dcp-tuple"
    report = inspect_report(ckpttool.read(folder))
    pair = next(t for t in report["tensors"] if t["key"] == ["pair", 0])
    assert (pair["shape"], pair["sharded"]) == ([5, 6], True)
    out = tmp_path / "out.pt"
    check_error(run_cli("merge", folder, "-o", out), 2,
                "tensor 'pair.0' holds rank 0's shards only (9 of 30 elements)")  # fmt: skip
    assert not out.exists()
    assert ckpttool.load(folder, select="step") == 1


@pytest.mark.slow
@pytest.mark.parametrize("given", ["hf-dist", "hf-dist2", "one-file"])
def test_hf_storage_writer_distributed_shards(dist_runs, given):
    """HuggingFaceStorageWriter(save_distributed=True): each rank's blocks in its own
    ``shard-R-model-K-of-N.safetensors``, placed by DCP_SHARDING_INFO, no .metadata or
    index. Given one of its files, the folder is read (a block alone is not the tensor)."""
    folder = dist_runs.mesh / ("hf-dist" if given == "one-file" else given)
    one = folder / "shard-00003-model-00001-of-00001.safetensors"
    path = one if given == "one-file" else folder
    ckpt = ckpttool.read(path)
    assert (ckpt.format, ckpt.world_size) == ("dcp", 4)
    assert ckpt.files == sorted(str(p) for p in folder.glob("shard-*.safetensors"))
    full = torch.load(dist_runs.mesh / "full.pt", weights_only=True)["model"]
    assert {k: v.shape for k, v in ckpt.root.items()} == {k: v.shape for k, v in full.items()}
    assert len(ckpt.root["lin.weight"].shards) == 4  # replicated blocks were written once
    assert len(ckpt.root["lin.bias"].shards) == 2
    assert_same(ckpttool.load(path), full)


@pytest.mark.slow
def test_hf_distributed_shards_with_a_rank_missing(dist_runs, tmp_path):
    for file in (dist_runs.mesh / "hf-dist").glob("shard-*.safetensors"):
        if not file.name.startswith("shard-00004"):
            shutil.copy(file, tmp_path)
    check_error(run_cli("inspect", tmp_path), 2, "'lin.weight'", "a rank file is missing?")


@pytest.mark.slow
def test_hf_distributed_shard_with_damaged_sharding_info(dist_runs, tmp_path):
    """No file of the folder may be read without the damaged one, nor the damaged one alone."""
    import struct

    folder = tmp_path / "ckpt"
    shutil.copytree(dist_runs.mesh / "hf-dist", folder)
    bad = folder / "shard-00003-model-00001-of-00001.safetensors"
    data = bad.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["DCP_SHARDING_INFO"] = "{not json"
    raw = json.dumps(header).encode().ljust(n)  # same length: the data does not move
    assert len(raw) == n
    bad.write_bytes(data[:8] + raw + data[8 + n :])
    for given in (folder, folder / "shard-00001-model-00001-of-00001.safetensors", bad):
        check_error(run_cli("inspect", given), 2, str(bad), "corrupt DCP_SHARDING_INFO")


def test_distcp_file_without_its_metadata_is_refused(tmp_path):
    write_dcp(tmp_path / "ckpt", {"w": torch.ones(3)})
    (tmp_path / "ckpt" / ".metadata").unlink()
    check_error(run_cli("inspect", tmp_path / "ckpt" / "__0_0.distcp"), 2, "has no .metadata")


@pytest.mark.slow
@pytest.mark.parametrize("run, given", [("two", "dcp"), ("mesh", "dcp-safetensors")])
def test_one_distcp_file_reads_its_folder(dist_runs, run, given):
    folder = getattr(dist_runs, run) / given
    ckpt = ckpttool.read(folder / "__1_0.distcp")
    assert ckpt.format == "dcp"
    assert ckpt.files == ckpttool.read(folder).files
    assert_same(ckpttool.load(folder / "__1_0.distcp"), ckpttool.load(folder))


@pytest.mark.slow
def test_one_dcp_data_file_converts_to_a_file_named_after_its_folder(dist_runs, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(dist_runs.mesh / "hf-dist", folder)
    proc = run_cli("convert", folder / "shard-00002-model-00001-of-00001.safetensors",
                   "--to", "safetensors")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    full = torch.load(dist_runs.mesh / "full.pt", weights_only=True)["model"]
    assert_same(load_file(tmp_path / "ckpt.safetensors"), full)


@pytest.mark.slow
def test_dcp_safetensors_blob_that_lacks_a_chunk_is_refused(dist_runs, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(dist_runs.mesh / "dcp-safetensors", folder)
    distcp = folder / "__0_0.distcp"
    data = distcp.read_bytes()
    name = b'"model.lin.weight"'
    assert data.count(name) == 1  # the header's key (DCP_SHARDING_INFO escapes its quotes)
    distcp.write_bytes(data.replace(name, b'"model.lin.weighs"'))
    check_error(
        run_cli("convert", folder, "--to", "safetensors", "-o", tmp_path / "o.safetensors"),
        2,
        "holds no chunk of 'model.lin.weight' at [0, 0]",
    )
    assert not (tmp_path / "o.safetensors").exists()


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


def test_several_full_copies_are_not_per_rank(tmp_path):
    for r in (0, 1):
        torch.save({"MODEL_STATE": small_state_dict()}, tmp_path / f"ep0-rank{r}.pt")
    with pytest.raises(ckpttool.CkptError, match=r"full cop(y|ies).*pass just one"):
        ckpttool.read([str(tmp_path / "ep0-rank0.pt"), str(tmp_path / "ep0-rank1.pt")])
    # one DDP rank file alone is an ordinary torch-zip checkpoint
    assert ckpttool.read(tmp_path / "ep0-rank0.pt").format == "torch-zip"


# ------------------------------------------------------- committed fixtures


def test_committed_ddp_fixture():
    path = fixture_path("ddp/ep0-rank0.pt")
    report = inspect_report(ckpttool.read(path))
    assert report["format"] == "torch-zip"
    assert report["prefix"] == "module."
    assert report["dangerous"] == []


def test_committed_fsdp_uneven_fixture():
    path = fixture_path("fsdp_uneven/model-rank0.pt")
    ckpt = ckpttool.read(path)
    assert ckpt.format == "per-rank"
    assert ckpt.world_size == 3
    sd = ckpttool.load(path)
    assert all(t.device.type == "cpu" for t in sd.values())


def test_central_directory_names_every_entry_with_and_without_zip64(monkeypatch, tmp_path):
    """TorchScript is told from torch.save by entry names, read from the raw central
    directory (found through the zip64 end record when there is one)."""
    import zipfile

    from ckpttool.formats.zip_pickle import central_directory
    from ckpttool.merge import merge
    from ckpttool.writers import torch_zip

    torch.save({"a": torch.ones(3), "b": torch.zeros(2)}, tmp_path / "plain.pt")
    monkeypatch.setattr(torch_zip, "_ZIP64_LIMIT", 10)
    merge(str(tmp_path / "plain.pt"), str(tmp_path / "zip64.pt"))
    assert b"PK\x06\x06" in (tmp_path / "zip64.pt").read_bytes()
    for name in ("plain.pt", "zip64.pt"):
        directory = central_directory(str(tmp_path / name))
        names = zipfile.ZipFile(tmp_path / name).namelist()
        assert all(n.encode() in directory for n in names), name
        assert ckpttool.read(str(tmp_path / name)).format == "torch-zip"
    assert ckpttool.read(fixture_path("torchscript/model.pt")).format == "torchscript"
    raw = (tmp_path / "plain.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) - 30])
    assert central_directory(str(tmp_path / "cut.pt")) == b""
    # a zip64 locator whose record offset is damaged (past the end, beyond 2**63)
    raw = bytearray((tmp_path / "zip64.pt").read_bytes())
    at = raw.rfind(b"PK\x06\x07")
    raw[at + 8 : at + 16] = (2**63 + 5).to_bytes(8, "little")
    (tmp_path / "bad64.pt").write_bytes(raw)
    assert central_directory(str(tmp_path / "bad64.pt")) == b""
    assert ckpttool.read(str(tmp_path / "bad64.pt")).format == "torch-zip"  # zipfile copes


@pytest.mark.parametrize("enabled", [True, False])
def test_trees_are_built_with_the_garbage_collector_paused(tmp_path, enabled):
    """No collections while a tree is built; the caller's setting comes back, even on error."""
    import gc

    # thousands of containers: with GC on, building them would trigger collections
    torch.save(
        {f"step{i}": {"lr": 0.1, "betas": [0.9, 0.99]} for i in range(5000)}, tmp_path / "ok.pt"
    )
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 not really a zip")
    collections = []

    def record(phase, info):
        collections.append(phase)

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        ckpttool.read(str(tmp_path / "ok.pt"))  # imports done: they allocate too
        gc.callbacks.append(record)
        assert len(ckpttool.read(str(tmp_path / "ok.pt")).root) == 5000
        # none while the tree is built, at most one once the collector is back on
        assert collections.count("start") <= (1 if enabled else 0)
        assert gc.isenabled() is enabled
        with pytest.raises(ckpttool.CkptError):
            ckpttool.read(str(tmp_path / "bad.pt"))
        assert gc.isenabled() is enabled
    finally:
        if record in gc.callbacks:
            gc.callbacks.remove(record)
        gc.enable() if was else gc.disable()


def test_folder_of_one_checkpoints_rank_files_is_read_as_that_checkpoint(tmp_path):
    """``ckpttool inspect ckpt_dir/``: a folder holding the rank files of one checkpoint."""
    composer = fixture_path("composer")
    ckpt = ckpttool.read(composer)
    assert ckpt.format == "per-rank" and ckpt.world_size == 2
    assert ckpt.files == [str(composer / f"ep0-ba4-rank{r}.pt") for r in (0, 1)]
    assert_nested_equal(
        ckpttool.load(composer, select="all"), ckpttool.load(ckpt.files, select="all")
    )
    # DDP rank files are full copies: the folder reads as the lowest rank's file
    ddp = tmp_path / "ddp"
    shutil.copytree(fixture_path("ddp"), ddp)
    (ddp / "notes.txt").write_text("not a checkpoint")
    ckpt = ckpttool.read(ddp)
    assert ckpt.format == "torch-zip" and ckpt.files == [str(ddp / "ep0-rank0.pt")]
    # a trainer's snapshot folder holds several checkpoints: which one is not guessed
    shutil.copy(ddp / "ep0-rank1.pt", ddp / "ep1-rank1.pt")
    shutil.copy(ddp / "ep0-rank0.pt", ddp / "ep1-rank0.pt")
    check_error(
        run_cli("inspect", ddp),
        2,
        "folder holds the rank files of several checkpoints (ep0-rank*.pt, ep1-rank*.pt)",
        "quoted glob",
    )


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_conjugate_and_negative_views_read_as_torch_load_gives_them(tmp_path, zip_format):
    """torch.save keeps a lazy conj / neg view as the original bytes plus a bit; the bit
    must be applied when reading and writing (not the raw bytes copied)."""
    sd = {
        "c": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "n": torch.tensor([1.0, -2.0])._neg_view(),
        "cn": torch.tensor([[1 + 1j, 2 - 2j]]).conj().t(),
    }
    path = tmp_path / "views.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=zip_format)
    want = torch.load(path, weights_only=True)
    assert want["c"].is_conj() and want["n"].is_neg()  # the bits really are in the file
    assert_same(ckpttool.load(path), {k: v.resolve_conj().resolve_neg() for k, v in want.items()})
    for to, name in (("safetensors", "o.safetensors"), ("pt", "o.pt")):
        proc = run_cli("convert", path, "--to", to, "-o", tmp_path / name)
        assert proc.returncode == 0, proc.stderr
        assert_same(ckpttool.load(tmp_path / name), ckpttool.load(path))
        assert run_cli("diff", path, tmp_path / name).returncode == 0


def test_file_saved_without_crcs_is_read(tmp_path):
    """``torch.utils.serialization.config.save.compute_crc32 = False`` writes every CRC as 0;
    torch.load reads such files, so do we (a real CRC mismatch is still corruption)."""
    import zipfile

    import torch.utils.serialization

    config = torch.utils.serialization.config.save
    sd = small_state_dict()
    # not monkeypatch: its undo deletes the option from torch's config module for good
    was, config.compute_crc32 = config.compute_crc32, False
    try:
        torch.save(sd, tmp_path / "nocrc.pt")
    finally:
        config.compute_crc32 = was
    assert {i.CRC for i in zipfile.ZipFile(tmp_path / "nocrc.pt").infolist()} == {0}
    assert_same(ckpttool.load(tmp_path / "nocrc.pt"), sd)
    proc = run_cli("convert", tmp_path / "nocrc.pt", "--to", "pt", "-o", tmp_path / "o.pt")
    assert proc.returncode == 0, proc.stderr
    assert_same(torch.load(tmp_path / "o.pt", weights_only=True), sd)


def test_numpy_arrays_of_strings_or_objects_are_placeholders_not_tensors(tmp_path):
    import numpy as np

    sd = {"w": torch.ones(2), "f": np.arange(3.0)}
    torch.save(
        {"model": sd, "names": np.array(["a", "b"]), "objs": np.array([{"x": 1}])},
        tmp_path / "np.pt",
    )
    ckpt = ckpttool.read(tmp_path / "np.pt")
    report = inspect_report(ckpt)
    assert [t["key"] for t in report["tensors"]] == [["model", "w"], ["model", "f"]]
    assert {v["key"][0]: v["value"] for v in report["values"]} == {
        "names": "<opaque numpy.ndarray>",
        "objs": "<opaque numpy.ndarray>",
    }
    everything = ckpttool.load(tmp_path / "np.pt", select="all")
    assert everything["names"]["__class__"] == "numpy.ndarray"
    assert torch.equal(everything["model"]["f"], torch.arange(3.0, dtype=torch.float64))
    out = tmp_path / "all.safetensors"
    proc = run_cli(
        "convert", tmp_path / "np.pt", "--to", "safetensors", "--select", "all", "-o", out
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(ckpttool.load(out)) == ["model.f", "model.w"]


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_numpy_arrays_read_as_tensors_with_any_pickle_protocol(tmp_path, protocol, legacy):
    """numpy pickles a contiguous array with protocol 5 as ``_frombuffer(bytes, dtype,
    shape, order)``, not ``_reconstruct``: it was kept as an opaque object."""
    import numpy as np

    arrays = {
        "c": np.arange(6, dtype=np.float32).reshape(2, 3),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 2)),
        "big_endian": np.arange(3, dtype=">f4"),
        "bool": np.array([True, False]),
    }
    path = tmp_path / "np.pt"
    torch.save({"extra_state": arrays}, path, pickle_protocol=protocol,
               _use_new_zipfile_serialization=not legacy)  # fmt: skip
    got = ckpttool.load(path, select="all")["extra_state"]
    for name, array in arrays.items():
        want = torch.from_numpy(array.astype(array.dtype.newbyteorder("=")))
        assert torch.is_tensor(got[name]), name
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    report = inspect_report(ckpttool.read(path))
    assert len(report["tensors"]) == len(arrays)


@pytest.mark.parametrize("length", [1, 100, 4096, 8191, 8192, 8193, 30000])
def test_file_span_reads_any_range_exactly(tmp_path, length):
    """A span serves small reads at its two ends from memory: every range, across
    those edges and between them, must give the file's bytes."""
    import random

    from ckpttool.formats.zip_pickle import FileSpan

    data = random.Random(length).randbytes(length + 300)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    start = 150
    want = data[start : start + length]
    span = FileSpan(str(path), start, length)
    try:
        points = sorted(
            {0, 1, length // 2, length - 1, length, 4095, 4096, 4097}
            | {length - 4097, length - 4096, length - 4095}
        )
        points = [p for p in points if 0 <= p <= length]
        for a in points:
            for b in points:
                if a <= b:
                    span.seek(a)
                    assert span.read(b - a) == want[a:b], (a, b)
        span.seek(length - 5)
        assert span.read(100) == want[-5:]  # reads stop at the span's end
        assert span.read(10) == b""
    finally:
        span.close()
