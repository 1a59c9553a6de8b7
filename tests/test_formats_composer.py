"""Checkpoints written by MosaicML Composer's own Trainer (fixtures/composer_real/, made by
fixtures/make_composer_fixtures.py with composer 0.32.1): the monolithic
``plain/ep0-ba2-rank0.pt`` and FSDP1 ``SHARDED_STATE_DICT``, which Composer 0.32 writes as
a DCP folder ``fsdp/ep0-ba2/``; each beside Composer's symlink ``latest-rank0.pt``. Their
values equal what Composer's own ``load_path`` gave a fresh Trainer (``truth.pt``).

Composer's model state dict is its ``ComposerClassifier``'s: the network is the attribute
``module``, so every key starts with ``module.``. ``--strip-prefix auto`` takes it off,
which gives what the bare network (``nn.Sequential``) loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from helpers import FIXTURES, assert_identical, run_cli, safetensors_header
from safetensors.torch import load_file

import ckpttool

COMPOSER = FIXTURES / "composer_real"
MODEL_KEYS = ["module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"]
# (fixture, the checkpoint Composer wrote, format, world size)
KINDS = [
    ("plain", "ep0-ba2-rank0.pt", "torch-zip", None),
    ("fsdp", "ep0-ba2", "dcp", 2),
]
KINDS_BY_NAME = {
    kind: {"name": ckpt, "fmt": fmt, "world": world} for kind, ckpt, fmt, world in KINDS
}
# each checkpoint by its own name and by Composer's symlink to it
PATHS = [(kind, name, fmt, world) for kind, ckpt, fmt, world in KINDS
         for name in (ckpt, "latest-rank0.pt")]  # fmt: skip
DCP_GLOBALS = [
    "pathlib.PosixPath",  # StorageMeta.checkpoint_id, Composer's relative save path
    "torch.Size",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.float32",
    "torch.serialization._get_layout",
    "torch.uint8",
]
# every global Composer's pickles name: the RNG states (numpy), the Timestamp's wall clock
# times (timedelta), the metadata's torch version; none is unverified or dangerous
GLOBALS = {
    "plain": sorted(
        ["_codecs.encode", "collections.OrderedDict", "datetime.timedelta",
         "numpy._core.multiarray._reconstruct", "numpy.dtype", "numpy.ndarray",
         "torch.ByteStorage", "torch.FloatStorage", "torch._utils._rebuild_tensor_v2",
         "torch.torch_version.TorchVersion"]
    ),
    "fsdp": sorted(
        ["_codecs.encode", "datetime.timedelta", "numpy._core.multiarray._reconstruct",
         "numpy.dtype", "numpy.ndarray", "torch.torch_version.TorchVersion", *DCP_GLOBALS]
    ),
}  # fmt: skip
# the plain objects kept as stand-ins ({"__class__": ..., "args": ...}) by --select all
STAND_INS = {"datetime.timedelta", "torch.torch_version.TorchVersion"}


def _truth(kind: str) -> dict:
    return torch.load(COMPOSER / kind / "truth.pt", weights_only=True)


def _stripped(model: dict) -> dict:
    return {k.removeprefix("module."): v for k, v in model.items()}


def _leaves(value, path=()):
    """Every leaf by its dotted key path; a stand-in is one leaf, named by its class."""
    if isinstance(value, dict) and value.get("__class__") in STAND_INS:
        yield ".".join(path), value["__class__"]
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, str(k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, str(i)))
    else:
        yield ".".join(path), value


@pytest.mark.parametrize("kind, name, fmt, world", PATHS)
def test_composer_inspect_finds_the_model_and_names_its_globals(kind, name, fmt, world):
    proc = run_cli("inspect", COMPOSER / kind / name, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["format"] == fmt and report["world_size"] == world
    assert report["model_key"] == ["state", "model"] and report["prefix"] == "module."
    model = [t["key"][2] for t in report["tensors"] if t["key"][:2] == ["state", "model"]]
    assert model == MODEL_KEYS
    assert report["num_params"] == 4 * 6 + 4 + 3 * 4 + 3
    assert report["globals"] == GLOBALS[kind]
    assert report["unverified"] == [] and report["dangerous"] == []


@pytest.mark.parametrize("kind, name, fmt, world", PATHS)
def test_composer_model_equals_composers_load_path(kind, name, fmt, world):
    path = COMPOSER / kind / name
    truth = _truth(kind)["model"]
    assert list(truth) == MODEL_KEYS
    ckpt = ckpttool.read(path)
    assert (ckpt.format, ckpt.world_size) == (fmt, world)
    assert ckpt.unverified == [] and ckpt.dangerous == []
    as_stored = ckpttool.load(path, strip_prefix="none")
    assert list(as_stored) == MODEL_KEYS
    assert_identical(as_stored, truth, exact_types=False)
    model = ckpttool.load(path)  # --strip-prefix auto: what the bare network loads
    assert list(model) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert_identical(model, _stripped(truth), exact_types=False)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    net.load_state_dict(model, strict=True)


@pytest.mark.parametrize("kind", ["plain", "fsdp"])
def test_composer_select_all_equals_the_whole_checkpoint(kind):
    ckpt = KINDS_BY_NAME[kind]
    truth = _truth(kind)
    full = ckpttool.load(COMPOSER / kind / ckpt["name"], select="all")
    assert sorted(full) == ["rng", "state"]
    # (DCP keeps no empty container: the FSDP one has no "scaler", no "integrations")
    assert sorted(full["state"]) == truth["raw_state_keys"]
    assert {"model", "optimizers", "schedulers", "timestamp"} <= set(full["state"])
    assert len(full["rng"]) == (ckpt["world"] or 1)  # one RNG state per rank
    optimizer = full["state"]["optimizers"]["AdamW"]
    assert_identical(optimizer["state"], truth["optimizer"], ordered=False, exact_types=False)
    assert optimizer["param_groups"][0]["params"] == MODEL_KEYS
    timestamp = full["state"]["timestamp"]["Timestamp"]
    assert {k: timestamp[k] for k in truth["timestamp"]} == truth["timestamp"]
    assert truth["timestamp"]["batch"] == 2
    # Composer steps a torch scheduler once per epoch: none ended yet
    assert full["state"]["schedulers"]["StepLR"]["last_epoch"] == 0
    # every leaf of torch.load (DCP: of torch's dcp_to_torch_save) is there by its key
    # path, numpy RNG states as tensors, every tensor bitwise
    leaves = dict(_leaves(full))
    assert sorted(leaves) == sorted(truth["raw_keys"])
    tensors = {k: v for k, v in leaves.items() if isinstance(v, torch.Tensor)}
    assert_identical(tensors, truth["raw"], ordered=False)
    assert {leaves["state.metadata.torch_version"]} <= STAND_INS


@pytest.mark.parametrize("kind, name, fmt, world", PATHS)
def test_composer_converts_to_safetensors(tmp_path, kind, name, fmt, world):
    out = tmp_path / "model.safetensors"
    proc = run_cli("convert", COMPOSER / kind / name, "--to", "safetensors", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert safetensors_header(out)["__metadata__"]["format"] == "pt"
    got = load_file(out)
    assert sorted(got) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert_identical(got, _stripped(_truth(kind)["model"]), ordered=False)


@pytest.mark.parametrize("kind", ["plain", "fsdp"])
def test_composer_merge_writes_one_file_with_everything(tmp_path, kind):
    source = COMPOSER / kind / KINDS_BY_NAME[kind]["name"]
    out = tmp_path / "merged.pt"
    proc = run_cli("merge", source, "-o", out)
    assert proc.returncode == 0, proc.stderr
    merged = torch.load(out, weights_only=True)
    truth = _truth(kind)
    assert_identical(merged["state"]["model"], truth["model"], exact_types=False)
    optimizer = merged["state"]["optimizers"]["AdamW"]["state"]
    assert_identical(optimizer, truth["optimizer"], ordered=False, exact_types=False)
    assert_identical(merged, ckpttool.load(source, select="all"), ordered=False)


def test_composer_fsdp_and_plain_runs_trained_the_same_model():
    # the same seed and the same four samples per batch (two per rank under FSDP, whose
    # gradient mean equals the one process's): the FSDP run's model is bitwise the plain one's
    proc = run_cli("diff", COMPOSER / "plain" / "latest-rank0.pt", COMPOSER / "fsdp" / "ep0-ba2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 tensors compared" in proc.stdout


def test_composer_save_folder_reads_as_its_checkpoint(tmp_path):
    # Composer's save folder: the checkpoint and latest-rank0.pt, a symlink to it, which
    # is the same checkpoint, not a second one
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(COMPOSER / "plain" / "ep0-ba2-rank0.pt", plain)
    os.symlink("ep0-ba2-rank0.pt", plain / "latest-rank0.pt")
    ckpt = ckpttool.read(plain)
    assert ckpt.format == "torch-zip" and ckpt.files == [str(plain / "ep0-ba2-rank0.pt")]
    assert_identical(ckpttool.load(plain), _stripped(_truth("plain")["model"]), exact_types=False)
    # two checkpoints beside the symlink: which one is not guessed, and the symlink is
    # not named as a third
    shutil.copy(plain / "ep0-ba2-rank0.pt", plain / "ep0-ba1-rank0.pt")
    want = "holds 2 checkpoints (ep0-ba1-rank*.pt, ep0-ba2-rank*.pt;"
    with pytest.raises(ckpttool.CkptError, match=re.escape(want)):
        ckpttool.read(plain)
    # FSDP: the DCP folder and latest-rank0.pt, a symlink to the folder
    fsdp = tmp_path / "fsdp"
    fsdp.mkdir()
    shutil.copytree(COMPOSER / "fsdp" / "ep0-ba2", fsdp / "ep0-ba2")
    os.symlink("ep0-ba2", fsdp / "latest-rank0.pt")
    ckpt = ckpttool.read(fsdp)
    assert (ckpt.format, ckpt.world_size) == ("dcp", 2)
    assert_identical(ckpttool.load(fsdp), _stripped(_truth("fsdp")["model"]), exact_types=False)


def test_a_symlink_to_a_file_elsewhere_still_counts(tmp_path):
    # only a link to a rank file beside it is that file: one to a file outside the folder
    # is a checkpoint of its own
    (tmp_path / "run").mkdir()
    shutil.copy(COMPOSER / "plain" / "ep0-ba2-rank0.pt", tmp_path / "ep0-ba2-rank0.pt")
    shutil.copy(COMPOSER / "plain" / "ep0-ba2-rank0.pt", tmp_path / "run" / "ep0-ba1-rank0.pt")
    os.symlink(tmp_path / "ep0-ba2-rank0.pt", tmp_path / "run" / "latest-rank0.pt")
    with pytest.raises(ckpttool.CkptError, match="holds 2 checkpoints") as raised:
        ckpttool.read(tmp_path / "run")
    assert sorted(raised.value.candidates) == ["ep0-ba1-rank*.pt", "latest-rank*.pt"]
