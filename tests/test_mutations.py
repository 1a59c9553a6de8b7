"""Damaged copies of every fixture: reading, inspecting and loading them either works or
fails with ckpttool's own errors (exit 2 or 3 at the CLI), never with a stray exception.

Seeded, so every run checks the same mutations. Bit flips, truncation, zeroed and
duplicated runs of bytes, as disks, downloads and copies produce them.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from helpers import FIXTURES

import ckpttool
from ckpttool.errors import CkptError, UnsafeError
from ckpttool.inspection import inspect_report

MUTATIONS_PER_FILE = 100
# (fixture file to damage, what to read: the file itself or its folder)
TARGETS = [
    ("composer/ep0-ba4-rank1.pt", "file"),
    ("dcp/.metadata", "folder"),
    ("dcp/__1_0.distcp", "folder"),
    ("ddp/ep0-rank0.pt", "file"),
    ("dtensor/dt-rank0.pt", "file"),
    ("fsdp_uneven/model-rank2.pt", "file"),
    ("gpu_saved.pt", "file"),
    ("legacy/model.pt", "file"),
    ("safetensors/model.safetensors", "file"),
    ("safetensors_sharded/model.safetensors.index.json", "folder"),
    ("safetensors_sharded/model-00002-of-00002.safetensors", "folder"),
    ("snapshots/custom_objects.pt", "file"),
    ("snapshots/model_optimizer_epoch.pt", "file"),
    ("torchscript/model.pt", "file"),
]


def mutate(data: bytearray, rng: random.Random) -> bytearray:
    how = rng.choice(["flip", "flip", "truncate", "zero", "duplicate"])
    at = rng.randrange(len(data))
    if how == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif how == "truncate":
        del data[at:]
    elif how == "zero":
        end = min(len(data), at + rng.randint(1, 64))
        data[at:end] = bytes(end - at)
    else:
        data[at:at] = data[at : at + rng.randint(1, 64)]
    return data


@pytest.mark.parametrize(("name", "read_what"), TARGETS, ids=[t[0] for t in TARGETS])
def test_damaged_fixture_gives_a_result_or_a_clear_error(tmp_path: Path, name, read_what):
    source = FIXTURES / name
    if not source.exists():
        pytest.skip(f"fixture fixtures/{name} is not committed yet")
    rng = random.Random(name)
    original = source.read_bytes()
    for i in range(MUTATIONS_PER_FILE):
        folder = tmp_path / str(i)
        if source.parent == FIXTURES:
            folder.mkdir()
        else:
            shutil.copytree(source.parent, folder)  # the siblings too: rank files, shards
        damaged = folder / source.name
        damaged.write_bytes(mutate(bytearray(original), rng))
        target = str(folder if read_what == "folder" else damaged)
        try:
            inspect_report(ckpttool.read(target))
            ckpttool.load(target, select="all")
        except (CkptError, UnsafeError) as exc:
            assert str(exc).strip() and "\n" not in str(exc), exc
        except Exception as exc:  # what the CLI would report as "unexpected"
            pytest.fail(f"mutation {i} of {name}: {type(exc).__name__}: {exc}")
