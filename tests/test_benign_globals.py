"""What real snapshots hold besides tensors reads with exit 0: no global of theirs is
called dangerous or left unverified. The other side of the safety rules: a verdict that
cried wolf on RNG states or a Trainer's arguments would teach people to pass --unsafe.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import decimal
import fractions
import json
import pathlib
import random
import types
import uuid

import numpy as np
import pytest
import torch
from helpers import run_cli


def benign_snapshot() -> dict:
    """Values real training snapshots keep (RNG states of three libraries, configs, paths)."""
    return {
        "w": torch.ones(2),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "numpy_generator": np.random.default_rng(0),
        "numpy_random_state": np.random.RandomState(0),
        "bit_generator": np.random.PCG64(1),
        "torch_rng": torch.get_rng_state(),
        "when": datetime.datetime(2026, 1, 2, 3, 4, 5),
        "day": datetime.date(2026, 1, 2),
        "elapsed": datetime.timedelta(seconds=3),
        "path": pathlib.Path("/runs/a"),
        "args": argparse.Namespace(lr=0.1, name="run"),
        "simple": types.SimpleNamespace(a=1),
        "incompatible": torch.nn.modules.module._IncompatibleKeys([], []),
        "np_scalar": np.float32(3.5),
        "np_int": np.int64(3),
        "np_dtype": np.dtype("f4"),
        "array": np.arange(3),
        "queue": collections.deque([1, 2]),
        "counts": collections.Counter("aab"),
        "run_id": uuid.UUID(int=7),
        "exact": decimal.Decimal("1.5"),
        "third": fractions.Fraction(1, 3),
        "torch_version": torch.__version__,
        "device": torch.device("cuda", 1),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
    }


@pytest.mark.parametrize("how", ["zip", "legacy", "protocol4"])
def test_benign_snapshot_values_are_neither_dangerous_nor_unverified(tmp_path, how):
    path = tmp_path / "snap.pt"
    kwargs = {
        "zip": {},
        "legacy": {"_use_new_zipfile_serialization": False},
        "protocol4": {"pickle_protocol": 4},
    }[how]
    snapshot = benign_snapshot()
    torch.save(snapshot, path, **kwargs)
    proc = run_cli("inspect", "--json", path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["dangerous"] == []
    assert report["unverified"] == []
    out = tmp_path / "merged.pt"
    assert run_cli("merge", path, "-o", out).returncode == 0
    merged = torch.load(out, weights_only=True)
    assert torch.equal(merged["torch_rng"], snapshot["torch_rng"])
    assert merged["args"]["__class__"] == "argparse.Namespace"


def test_trainer_arguments_read_without_unverified_globals(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[])
    torch.save(args, tmp_path / "training_args.bin")  # as Trainer saves it
    proc = run_cli("inspect", "--json", tmp_path / "training_args.bin")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["dangerous"] == [] and report["unverified"] == []
    assert "transformers.training_args.TrainingArguments" in report["globals"]


# Checkpoints written by torch and the frameworks themselves (fixtures/): every global
# they name is one ckpttool knows, so inspect's security line has nothing to flag.
FRAMEWORK_FIXTURES = [
    "composer/ep0-ba4-rank0.pt",
    "fsdp_uneven/model-rank0.pt",
    "dtensor/dt-rank0.pt",
    "dcp",
    "torch1/dcp",
    "torch1/ep0-ba20-rank0.pt",
    "torchscript/model.pt",
    "legacy/model.pt",
    "ddp/ep0-rank0.pt",
    "snapshots/custom_objects.pt",
    "accelerate/fsdp2/state",
    "lightning/fsdp/last.ckpt",
    "lightning/ddp/last.ckpt",
    "megatron/gpt",
    "megatron/nemo2/model",
    "deepspeed/zero3",
    "transformers/gpt2_tied/checkpoint-2",
    "transformers/gpt2_bin/checkpoint-2",
]


@pytest.mark.parametrize("name", FRAMEWORK_FIXTURES)
def test_framework_fixtures_name_no_unverified_global(name):
    from helpers import FIXTURES

    proc = run_cli("inspect", "--json", FIXTURES / name)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["dangerous"], report["unverified"]) == ([], []), name
