"""``merge``: per-rank shards (ShardedTensor, DTensor) and DCP folders -> ONE torch.save file
that ``torch.load(weights_only=True)`` reads, with the same nested structure and every
sharded tensor (model AND optimizer) full, bitwise equal to what FSDP itself gathers.
"""

from __future__ import annotations

import argparse
import collections
import enum
import pathlib
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    assert_identical,
    autograd_view,
    check_error,
    parameter_snapshot,
    run_cli,
    tree_files,
)

import ckpttool
from ckpttool.convert import convert
from ckpttool.errors import CkptError, OutputExistsError
from ckpttool.inspection import inspect_report
from ckpttool.merge import merge

pytestmark = pytest.mark.slow


def expected_snapshot(folder: Path) -> dict:
    """What merging ``ep0-ba2-rank*.pt`` must give: rank 0's tree, every shard gathered as
    FSDP's FULL_STATE_DICT / full optimizer state of the same run, objects as stand-ins."""
    full = torch.load(folder / "full.pt", weights_only=True)
    return {
        "state": {
            "model": full["model"],
            "optimizers": {"Adam": full["optim"]},
            "side_optimizer": full["side"],
            "schedulers": [],
            "timestamp": {"epoch": 0, "batch": 2},
            "run_name": "demo",
        },
        "rng": [{"torch": full["rng"], "rank": 0}],
        "args": {"__class__": "argparse.Namespace", "state": {"lr": 0.01, "tag": "demo"}},
        "info": {"__class__": "__main__.RunInfo", "state": {"name": "demo", "tags": ["a", "b"]}},
    }


@pytest.mark.parametrize(
    ("run", "inputs"),
    [
        ("fsdp2", lambda d: [str(d / "ep0-ba2-rank0.pt"), str(d / "ep0-ba2-rank1.pt")]),
        ("fsdp2", lambda d: [str(d / "ep0-ba2-rank*.pt")]),
        ("fsdp2", lambda d: str(d / "ep0-ba2-rank1.pt")),
        ("fsdp3", lambda d: str(d / "ep0-ba2-rank0.pt")),  # rank 2 holds no rows of 3.*
    ],
    ids=["paths", "glob", "one-rank-file", "3-ranks-empty-rank"],
)
def test_per_rank_merge_matches_fsdp_full_state(request, tmp_path: Path, run, inputs):
    folder = request.getfixturevalue(run)
    out = tmp_path / "merged.pt"
    result = merge(inputs(folder), str(out))
    assert result.output == str(out)
    assert result.stand_ins == ["__main__.RunInfo", "argparse.Namespace"]
    merged = torch.load(out, weights_only=True)
    want = expected_snapshot(folder)
    # 7 model tensors, 6 params x (step, exp_avg, exp_avg_sq), 1 momentum buffer, 1 RNG state
    assert assert_identical(merged, want) == 7 + 18 + 1 + 1
    assert result.num_tensors == 27
    # optimizer state keeps its keys: FQNs for FSDP, ints for a plain optimizer
    assert list(merged["state"]["side_optimizer"]["state"]) == [0]
    assert list(merged["state"]["optimizers"]["Adam"]["state"]) == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
        "3.weight",
        "3.bias",
    ]
    assert tree_files(tmp_path) == ["merged.pt"]


def test_cli_merge_warns_about_stand_ins(fsdp2: Path, tmp_path: Path):
    out = tmp_path / "m.pt"
    proc = run_cli("merge", fsdp2 / "ep0-ba2-rank*.pt", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    warning, wrote = proc.stderr.splitlines()
    assert warning.startswith("warning: ")
    assert "argparse.Namespace" in warning and "__main__.RunInfo" in warning
    assert wrote.startswith(f"wrote {out} (27 tensors, ")
    assert_identical(torch.load(out, weights_only=True), expected_snapshot(fsdp2))


def test_dcp_merge_equals_dcp_to_torch_save(fsdp2: Path, tmp_path: Path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(fsdp2 / "dcp"), str(tmp_path / "reference.pt"))
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    merge(str(fsdp2 / "dcp"), str(tmp_path / "merged.pt"))
    merged = torch.load(tmp_path / "merged.pt", weights_only=True)
    assert list(merged) == ["model", "optim", "epoch"]
    assert assert_identical(merged, reference) == 7 + 18
    # and DCP's chunks gathered are the full state FSDP gathered itself
    full = torch.load(fsdp2 / "full.pt", weights_only=True)
    assert_identical(dict(merged["model"]), dict(full["model"]))
    assert_identical(merged["optim"]["state"], full["optim"]["state"])
    assert merged["epoch"] == 3


def test_dtensor_merge(fsdp2: Path, tmp_path: Path):
    merge([str(fsdp2 / "dt-rank0.pt"), str(fsdp2 / "dt-rank1.pt")], str(tmp_path / "m.pt"))
    merged = torch.load(tmp_path / "m.pt", weights_only=True)
    full = torch.load(fsdp2 / "full.pt", weights_only=True)
    assert list(merged) == ["model", "step"]
    assert merged["step"] == 2
    assert_identical(dict(merged["model"]), dict(full["model"]))


def test_local_state_dict_pieces_are_refused_not_taken_from_rank_0(dist_runs, tmp_path):
    """FSDP LOCAL_STATE_DICT with use_orig_params: each rank's file holds a plain tensor
    that is its own piece of the parameter. Taking rank 0's as the whole was wrong data."""
    files = str(dist_runs.three / "local-rank*.pt")
    out = tmp_path / "m.pt"
    line = check_error(run_cli("merge", files, "-o", out), 2, "differs between rank files")
    assert "LOCAL_STATE_DICT" in line and "SHARDED_STATE_DICT" in line
    assert not out.exists()


def test_merge_refuses_missing_rank(fsdp3: Path, tmp_path: Path):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(fsdp3 / "ep0-ba2-rank1.pt", alone)
    proc = run_cli("merge", alone / "ep0-ba2-rank1.pt", "-o", tmp_path / "m.pt")
    check_error(proc, 2, "missing", "ep0-ba2-rank0.pt", "ep0-ba2-rank2.pt")
    assert tree_files(tmp_path) == ["alone", "alone/ep0-ba2-rank1.pt"]


def test_merge_refuses_existing_output_and_input_as_output(fsdp2: Path, tmp_path: Path):
    out = tmp_path / "m.pt"
    torch.save({"earlier": torch.zeros(1)}, out)  # an earlier output: --force replaces it
    kept = out.read_bytes()
    with pytest.raises(OutputExistsError, match="--force"):
        merge(str(fsdp2 / "ep0-ba2-rank0.pt"), str(out))
    assert out.read_bytes() == kept
    merge(str(fsdp2 / "ep0-ba2-rank0.pt"), str(out), force=True)
    assert_identical(torch.load(out, weights_only=True), expected_snapshot(fsdp2))
    # one rank file of the set as -o: refused even with --force, every rank file untouched
    before = (fsdp2 / "ep0-ba2-rank1.pt").read_bytes()
    with pytest.raises(CkptError, match="overwrite the input"):
        merge(str(fsdp2 / "ep0-ba2-rank0.pt"), str(fsdp2 / "ep0-ba2-rank1.pt"), force=True)
    assert (fsdp2 / "ep0-ba2-rank1.pt").read_bytes() == before


class Hyper:
    """A custom class in a plain (unsharded) snapshot."""

    def __init__(self):
        self.layers = 2
        self.scale = torch.tensor([1.5, -2.0])


def test_plain_snapshot_objects_numpy_and_class_refs(tmp_path: Path):
    """Any readable input merges; nothing is lost and the result needs no custom class."""
    model = collections.OrderedDict(w=torch.randn(3, 2), b=torch.arange(3))
    snapshot = {
        "model": model,
        "optimizer": {"state": {0: {"momentum_buffer": torch.ones(2)}}, "param_groups": []},
        "hparams": argparse.Namespace(lr=0.1, betas=(0.9, 0.99)),
        "hyper": Hyper(),
        "optimizer_cls": torch.optim.AdamW,
        "np_array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "np_scalar": np.float64(2.5),
        "dtype": torch.bfloat16,
        "device": torch.device("cuda", 1),
        "layout": torch.sparse_coo,
        "nested": [(1, "a"), {"x": None, 2: [torch.zeros(0)]}],
    }
    torch.save(snapshot, tmp_path / "plain.pt")
    with torch.serialization.safe_globals([Hyper]):  # constructed: trusted as torch takes it
        result = merge(str(tmp_path / "plain.pt"), str(tmp_path / "m.pt"))
    # objects and class references alike are named in the warning
    assert result.stand_ins == ["argparse.Namespace", "test_merge.Hyper", "torch.optim.adamw.AdamW"]
    merged = torch.load(tmp_path / "m.pt", weights_only=True)
    want = {
        "model": model,
        "optimizer": snapshot["optimizer"],
        "hparams": {"__class__": "argparse.Namespace", "state": {"lr": 0.1, "betas": (0.9, 0.99)}},
        "hyper": {
            "__class__": "test_merge.Hyper",
            "state": {"layers": 2, "scale": torch.tensor([1.5, -2.0])},
        },
        "optimizer_cls": {"__global__": "torch.optim.adamw.AdamW"},
        "np_array": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "np_scalar": 2.5,
        "dtype": torch.bfloat16,
        "device": torch.device("cuda", 1),
        "layout": torch.sparse_coo,
        "nested": [(1, "a"), {"x": None, 2: [torch.zeros(0)]}],
    }
    assert assert_identical(merged, want) == 6


class ConfigNode:
    """A config tree whose nodes point back at their parent (as omegaconf's DictConfig)."""

    def __init__(self, parent=None):
        self.parent = parent
        self.children = []


def test_objects_pointing_back_at_their_parent_merge_without_a_cycle(tmp_path: Path):
    """fairseq's cfg: the output loads with weights_only and ckpttool reads it back
    (it refused its own output: 'a container holds itself')."""
    root = ConfigNode()
    root.children.append(ConfigNode(root))
    torch.save({"model": {"w": torch.ones(2)}, "cfg": root}, tmp_path / "in.pt")
    node = "test_merge.ConfigNode"
    with torch.serialization.safe_globals([ConfigNode]):  # constructed: trusted
        merge(str(tmp_path / "in.pt"), str(tmp_path / "m.pt"))
    back = {"__class__": node, "back_reference": True}
    child = {"__class__": node, "state": {"parent": back, "children": []}}
    want = {
        "model": {"w": torch.ones(2)},
        "cfg": {"__class__": node, "state": {"parent": None, "children": [child]}},
    }
    assert assert_identical(torch.load(tmp_path / "m.pt", weights_only=True), want) == 1
    loaded = ckpttool.load(tmp_path / "in.pt", select="all", allow=[ConfigNode])
    assert assert_identical(loaded, want) == 1
    assert assert_identical(ckpttool.load(tmp_path / "m.pt", select="all"), want) == 1
    diff = run_cli("diff", tmp_path / "in.pt", tmp_path / "m.pt", "--allow", node)
    assert diff.returncode == 0, diff.stderr


def test_torch_size_values_stay_torch_size(tmp_path: Path):
    """DeepSpeed's param_shapes (name -> torch.Size): zero_to_fp32 calls .numel() on them,
    so they must not come back as plain tuples."""
    snapshot = {
        "module": {"w": torch.ones(2, 3)},
        "param_shapes": [collections.OrderedDict(w=torch.Size([2, 3]))],
        "empty": torch.Size([]),
    }
    torch.save(snapshot, tmp_path / "ds.pt")
    merge(str(tmp_path / "ds.pt"), str(tmp_path / "m.pt"))
    for loaded in (
        torch.load(tmp_path / "m.pt", weights_only=True),
        ckpttool.load(tmp_path / "ds.pt", select="all"),
    ):
        assert assert_identical(loaded, snapshot) == 1  # torch.Size, not tuple
        assert loaded["param_shapes"][0]["w"].numel() == 6
    values = inspect_report(ckpttool.read(tmp_path / "ds.pt"))["values"]
    assert values == [
        {"key": ["param_shapes", 0, "w"], "type": "torch.Size", "value": [2, 3]},
        {"key": ["empty"], "type": "torch.Size", "value": []},
    ]


def test_a_merged_pickled_module_is_still_the_model(tmp_path: Path):
    """torch.save({"model": module}) merges into the module's plain-data stand-in: ckpttool
    finds the model in it as in the original, so convert and diff agree on both."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)).half()
    source, merged = tmp_path / "best.pt", tmp_path / "m.pt"
    torch.save({"epoch": -1, "model": module, "optimizer": None}, source)
    merge(str(source), str(merged))
    assert inspect_report(ckpttool.read(merged))["model_key"] == ["model"]
    loaded = ckpttool.load(merged)
    assert assert_identical(loaded, dict(module.state_dict())) == 7
    proc = run_cli("diff", source, merged)
    assert proc.returncode == 0 and "7 tensors compared" in proc.stdout


def test_values_weights_only_refuses_become_stand_ins(tmp_path: Path):
    """frozenset, slice, Ellipsis and builtin classes as values have no global
    torch.load(weights_only=True) accepts;
    io.BytesIO and range are harmless classes (opaque, not refused as unsafe)."""
    import io

    snapshot = {
        "w": torch.ones(2),
        "tags": frozenset({"a"}),
        "window": slice(1, 5, 2),
        "index": (Ellipsis, 0),
        "steps": range(3),
        "buffer": io.BytesIO(b"state"),
        "hparams": {"dtype": float},  # a builtin class as a value
    }
    torch.save(snapshot, tmp_path / "in.pt")
    loaded = ckpttool.load(tmp_path / "in.pt", select="all")  # plain Python values stay
    assert (loaded["tags"], loaded["window"], loaded["index"]) == (
        frozenset({"a"}),
        slice(1, 5, 2),
        (Ellipsis, 0),
    )
    result = merge(str(tmp_path / "in.pt"), str(tmp_path / "m.pt"))
    assert result.stand_ins == [
        "_io.BytesIO",
        "builtins.Ellipsis",
        "builtins.float",
        "builtins.frozenset",
        "builtins.range",
        "builtins.slice",
    ]
    merged = torch.load(tmp_path / "m.pt", weights_only=True)
    assert torch.equal(merged["w"], torch.ones(2))
    assert merged["tags"] == {"__class__": "builtins.frozenset", "args": [["a"]]}
    assert merged["window"] == {"__class__": "builtins.slice", "args": [1, 5, 2]}
    assert merged["index"] == ({"__global__": "builtins.Ellipsis"}, 0)
    assert merged["steps"] == {"__class__": "builtins.range", "args": [0, 3, 1]}
    assert merged["buffer"]["__class__"] == "_io.BytesIO"
    assert merged["hparams"] == {"dtype": {"__global__": "builtins.float"}}
    assert merged["buffer"]["state"][0] == b"state"


class WrapperTensor(torch.Tensor):
    """A wrapper tensor subclass (as torchao's NF4Tensor or Float8Tensor are): its
    pickle holds no data of its own, only its attributes, here one inner tensor."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        out.inner = inner
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, WrapperTensor) else x  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, (args, kwargs or {}))[0])


def test_allowed_globals_named_as_values_and_wrapper_subclasses(tmp_path: Path):
    """Globals ckpttool rebuilds (torch.Size, torch._utils functions) saved as values,
    not called, are shown and written by their names, not as ckpttool's own functions;
    an unknown wrapper tensor subclass is an object of its class whose inner tensors
    are listed. The output loads with weights_only=True."""
    snapshot = {
        "model": {"w": torch.ones(2)},
        "shape_type": torch.Size,
        "rebuild": torch._utils._rebuild_tensor_v2,
        "nf4": WrapperTensor(torch.arange(4.0)),
    }
    torch.save(snapshot, tmp_path / "in.pt")
    report = inspect_report(ckpttool.read(tmp_path / "in.pt"))
    assert [t["key"] for t in report["tensors"]] == [["model", "w"], ["nf4", "inner"]]
    assert [v for v in report["values"] if v["key"] != ["nf4"]] == [
        {"key": ["shape_type"], "type": "global", "value": "<global torch.Size>"},
        {"key": ["rebuild"], "type": "global",
         "value": "<global torch._utils._rebuild_tensor_v2>"},
    ]  # fmt: skip
    result = merge(str(tmp_path / "in.pt"), str(tmp_path / "m.pt"))
    assert result.stand_ins == [
        "test_merge.WrapperTensor", "torch.Size", "torch._utils._rebuild_tensor_v2"
    ]  # fmt: skip
    merged = torch.load(tmp_path / "m.pt", weights_only=True)
    assert merged["shape_type"] == {"__global__": "torch.Size"}
    assert merged["rebuild"] == {"__global__": "torch._utils._rebuild_tensor_v2"}
    assert merged["nf4"]["__class__"] == "test_merge.WrapperTensor"
    assert torch.equal(merged["nf4"]["state"]["inner"], torch.arange(4.0))
    loaded = ckpttool.load(tmp_path / "in.pt", select="all")
    assert loaded["shape_type"] == {"__global__": "torch.Size"}


def test_a_stand_in_no_reader_resolves_is_refused_not_written(tmp_path: Path):
    """A crafted pickle calls _rebuild_wrapper_subclass outside the call that names
    the subclass: what it builds is ckpttool's own placeholder, which must not end up
    in an output only ckpttool could load."""
    from payloads import Reduce

    stub = Reduce(torch._utils._rebuild_wrapper_subclass,
                  (torch.Tensor, torch.float32, torch.Size([2]), (1,), 0, torch.strided,
                   torch.device("cpu"), False))  # fmt: skip
    torch.save({"model": {"w": torch.ones(2)}, "odd": stub}, tmp_path / "in.pt")
    out = tmp_path / "m.pt"
    check_error(run_cli("merge", tmp_path / "in.pt", "-o", out), 2,
                   "cannot write a WrapperStub stand-in")  # fmt: skip
    assert not out.exists()


def test_merging_whole_shards_does_not_import_torch(fsdp2: Path, tmp_path: Path):
    """Row-split shards are copied as bytes and the pickle only names torch's globals."""
    code = (
        "import sys\nfrom ckpttool.merge import merge\n"
        "from ckpttool.unpickler import allowing, parse_allow\n"
        "with allowing(parse_allow(['__main__.Holder', '__main__.RunInfo'])):\n"
        "    merge(sys.argv[1], sys.argv[2])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    out = tmp_path / "m.pt"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(fsdp2 / "ep0-ba2-rank*.pt"), str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert assert_identical(torch.load(out, weights_only=True), expected_snapshot(fsdp2)) == 27


class Strategy(str, enum.Enum):  # pickled by reference: an unknown class when read
    STEPS = "steps"
    EPOCH = "epoch"


def test_dict_keys_that_become_stand_ins_stay_keys(tmp_path: Path):
    """An Enum member or a frozenset as a dict key: its stand-in is a dict, which
    cannot be a key (load() raised TypeError, merge an internal error). The key's
    text is kept instead, one per distinct key."""
    snapshot = {
        "w": torch.ones(2),
        "stats": {Strategy.STEPS: 1.0, Strategy.EPOCH: 2.0},
        "by_set": {frozenset({1, 2}): 3},
    }
    torch.save(snapshot, tmp_path / "in.pt")
    # an Enum member of a module on no allow-list is pickled as a call of its class:
    # refused unless the user vouches for the file
    with pytest.raises(ckpttool.UnsafeError, match="test_merge.Strategy"):
        ckpttool.read(tmp_path / "in.pt")
    steps, epoch = (f"<opaque test_merge.Strategy({v!r})>" for v in ("steps", "epoch"))
    loaded = ckpttool.load(tmp_path / "in.pt", select="all", unsafe=True)
    assert loaded["stats"] == {steps: 1.0, epoch: 2.0}
    assert loaded["by_set"] == {frozenset({1, 2}): 3}  # a plain Python key stays itself
    merge(str(tmp_path / "in.pt"), str(tmp_path / "m.pt"), unsafe=True)
    merged = torch.load(tmp_path / "m.pt", weights_only=True)
    assert merged["stats"] == {steps: 1.0, epoch: 2.0}
    assert merged["by_set"] == {"frozenset({1, 2})": 3}
    report = inspect_report(ckpttool.read(tmp_path / "in.pt", unsafe=True))
    assert [v["key"] for v in report["values"]][:2] == [["stats", steps], ["stats", epoch]]


def test_set_elements_that_become_stand_ins_stay_elements(tmp_path: Path):
    """A set of paths (or of any object read inert): each element's stand-in is a dict,
    which no set can hold (merge said "corrupt or unsupported input (TypeError:
    unhashable type: 'dict')"). Each element's text is kept, as for dict keys."""
    paths = {pathlib.PurePosixPath("/runs/a"), pathlib.PurePosixPath("/runs/b")}
    torch.save({"w": torch.ones(2), "seen": paths}, tmp_path / "in.pt")
    texts = {f"<opaque pathlib.PurePosixPath('/', 'runs', {n!r})>" for n in "ab"}
    assert ckpttool.load(tmp_path / "in.pt", select="all")["seen"] == texts
    proc = run_cli("merge", tmp_path / "in.pt", "-o", tmp_path / "m.pt")
    assert proc.returncode == 0, proc.stderr
    merged = torch.load(tmp_path / "m.pt", weights_only=True)
    assert merged["seen"] == texts
    assert_identical(merged["w"], torch.ones(2))


@pytest.mark.parametrize("command", ["merge", "convert --to pt --select all"])
def test_parameters_and_requires_grad_are_written_as_torch_saves_them(tmp_path, command):
    """nn.Parameter (trainable, frozen, integer, sparse, quantized) stays a Parameter, and a tensor
    that requires grad still does, in a file torch.load(weights_only=True) reads."""
    source, out = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(parameter_snapshot(), source)
    if command == "merge":
        merge(str(source), str(out))
    else:
        convert([str(source)], "pt", str(out), select="all")
    want_flags, want = autograd_view(torch.load(source, weights_only=True))
    got_flags, got = autograd_view(torch.load(out, weights_only=True))
    assert got_flags == want_flags
    assert got_flags["quantized_param"] == ("Parameter", False, torch.qint8)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


@pytest.mark.parametrize("legacy", [False, True])
def test_storages_saved_on_their_own(tmp_path: Path, legacy: bool):
    """torch.save(t.storage()) or t.untyped_storage(): load() gave ckpttool's internal
    StorageRef, and merge pickled it (with no bytes) so the output did not load."""
    t = torch.arange(3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        snapshot = {
            "typed": t.storage(),
            "raw": torch.arange(4, dtype=torch.int16).untyped_storage(),
        }
    snapshot["t"] = t
    if legacy:  # torch cannot read back an untyped storage from a legacy file
        del snapshot["raw"]
    path = tmp_path / "storages.pt"
    torch.save(snapshot, path, _use_new_zipfile_serialization=not legacy)
    want = torch.load(path, weights_only=True)
    for got in (ckpttool.load(path, select="all"), None):
        if got is None:
            merge(str(path), str(tmp_path / "m.pt"))
            got = torch.load(tmp_path / "m.pt", weights_only=True)
        for name in set(snapshot) - {"t"}:
            assert type(got[name]) is type(want[name]) and got[name].dtype == want[name].dtype
            assert bytes(got[name].untyped()) == bytes(want[name].untyped())
        assert torch.equal(got["t"], t)
    values = {v["key"][0]: v for v in inspect_report(ckpttool.read(path))["values"]}
    assert values["typed"] == {
        "key": ["typed"],
        "type": "storage",
        "value": "<storage float32 [3]>",
    }
