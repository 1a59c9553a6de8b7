"""A seeded mutation fuzzer over the fixtures, through the real CLI.

Every mutant is converted with ``convert --to pt``: the answer is exit 0, 2 or 3, no
traceback, no "unexpected" error, nothing left in the output folder after an error, an
output ``torch.load(weights_only=True)`` reads after a success, and the input unchanged.
Mutants of a torch zip's ``data.pkl`` are made inside the entry (opcodes, not the zip's
CRCs, are what the unpickler sees). Seeded: every run checks the same mutants;
``CKPTTOOL_FUZZ_MUTANTS=5000`` runs a longer budget by hand.
"""

from __future__ import annotations

import os
import random
import shutil
import zipfile
from pathlib import Path

import torch
from helpers import FIXTURES, run_many, sha256
from test_mutations import mutate

MUTANTS = int(os.environ.get("CKPTTOOL_FUZZ_MUTANTS", "300"))
SOURCES = [
    "ddp/ep0-rank0.pt",
    "snapshots/custom_objects.pt",
    "snapshots/model_optimizer_epoch.pt",
    "gpu_saved.pt",
    "legacy/model.pt",
    "safetensors/model.safetensors",
    "torchscript/model.pt",
    "dtensor/dt-rank0.pt",
    "composer/ep0-ba4-rank0.pt",  # ShardedTensor ranks
    "fsdp_uneven/model-rank0.pt",
    "torch1/plain.pt",  # written by torch 1.13
    "deepspeed/zero1/global_step3/mp_rank_00_model_states.pt",  # torch.Size values
    "lightning/ddp/last.ckpt",
    "verl/ws2/model_world_size_2_rank_0.pt",
]


def _mutate_pickle_entry(original: Path, target: Path, rng: random.Random) -> None:
    """Copy a torch zip with its data.pkl mutated (stored, CRCs recomputed)."""
    with zipfile.ZipFile(original) as zin, zipfile.ZipFile(target, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("data.pkl"):
                data = bytes(mutate(bytearray(data), rng))
            zout.writestr(info.filename, data)


def test_mutants_get_a_result_or_one_clear_line(tmp_path: Path):
    rng = random.Random(1234)
    sources = [FIXTURES / name for name in SOURCES if (FIXTURES / name).exists()]
    assert len(sources) >= 6
    mutants = []
    for i in range(MUTANTS):
        source = rng.choice(sources)
        folder = tmp_path / f"m{i}"
        shutil.copytree(source.parent, folder / "in")  # siblings too: rank files
        target = folder / "in" / source.name
        if zipfile.is_zipfile(source) and rng.random() < 0.5:
            _mutate_pickle_entry(source, target, rng)
        else:
            target.write_bytes(bytes(mutate(bytearray(source.read_bytes()), rng)))
        (folder / "out").mkdir()
        mutants.append((target, folder / "out", sha256(folder / "in")))
    argvs = [["convert", str(t), "--to", "pt", "-o", str(out / "x.pt")] for t, out, _ in mutants]
    for (target, out, digest), result in zip(mutants, run_many(argvs), strict=True):
        where = (str(target), result["stderr"][-500:])
        assert result["code"] in (0, 2, 3), where
        assert "Traceback" not in result["stderr"], where
        assert "error: unexpected " not in result["stderr"], where
        if result["code"]:
            assert len(result["stderr"].splitlines()) == 1, where
            assert list(out.iterdir()) == [], where
        else:  # whatever the file held, the output is one torch reads
            torch.load(out / "x.pt", weights_only=True)
        assert sha256(target.parent) == digest, where


# Stack-neutral opcode runs that make torch.load construct or change what ckpttool
# cannot vouch for (issue 46's families): inserted between any two opcodes of a real
# data.pkl, the pickle stays valid, so the verdict must be exit 3 naming it.
def _glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _text(value: str) -> bytes:
    return b"\x8c" + bytes([len(value)]) + value.encode()


GADGETS = {
    "mylib.gadget.Thing": _glob("mylib.gadget", "Thing") + b")\x81" + b"0",  # NEWOBJ
    "mylib.gadget.Other": _glob("mylib.gadget", "Other") + b")}\x92" + b"0",  # NEWOBJ_EX
    "_compat_pickle.NAME_MAPPING": _glob("_compat_pickle", "NAME_MAPPING")
    + _text("k")
    + _text("v")
    + b"s0",  # SETITEM on a module-level object
    "argparse.Namespace": _glob("argparse", "Namespace")
    + b")\x81N}"
    + _text("__class__")
    + _glob("argparse", "Namespace")
    + b"s\x86b0",  # BUILD (None, {"__class__": ...}): a class swap
    "sympy.core.containers.Tuple": _glob("sympy.core.containers", "Tuple")
    + b"("
    + _text("1")
    + b"t\x81"
    + b"0",
}


def _insert_gadget(original: Path, target: Path, rng: random.Random) -> str:
    """Copy a torch zip with one gadget inserted between two opcodes of its data.pkl."""
    import pickletools

    name = rng.choice(sorted(GADGETS))
    with zipfile.ZipFile(original) as zin, zipfile.ZipFile(target, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("data.pkl"):
                ends = [pos for _, _, pos in pickletools.genops(data)][1:]  # after PROTO
                at = rng.choice(ends)  # (the STOP's own position: before it)
                data = data[:at] + GADGETS[name] + data[at:]
            zout.writestr(info.filename, data)
    return name


def test_gadgets_inserted_anywhere_in_a_real_pickle_are_refused(tmp_path: Path):
    rng = random.Random(46)
    zips = [FIXTURES / n for n in SOURCES if (FIXTURES / n).exists()]
    zips = [p for p in zips if zipfile.is_zipfile(p) and "torchscript" not in str(p)]
    assert len(zips) >= 6
    mutants = []
    for i in range(max(MUTANTS // 5, 40)):
        source = rng.choice(zips)
        folder = tmp_path / f"g{i}"
        shutil.copytree(source.parent, folder)  # siblings too: rank files
        target = folder / source.name
        mutants.append((target, _insert_gadget(source, target, rng)))
    results = run_many([["inspect", str(t)] for t, _ in mutants])
    for (target, name), result in zip(mutants, results, strict=True):
        where = (str(target), name, result["stderr"][-500:])
        assert result["code"] == 3, where
        assert name in result["stderr"] and len(result["stderr"].splitlines()) == 1, where
