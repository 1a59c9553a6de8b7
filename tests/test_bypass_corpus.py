"""Issue 46's bypass families (``support/bypass_corpus.py``): each case proven live, then
refused by every way in.

Proof of life first, so the corpus stays honest: one child process loads a copy of
every case with the real loader (``torch.load(weights_only=False)``; a DCP folder with
``FileSystemReader(...).read_metadata()``, which is ``pickle.load``), each in its own
folder as its working directory, and a hostile case whose marker does not appear fails.
Then, on another copy, ckpttool must refuse each: ``inspect --json`` exit 3 naming the
offender in ``dangerous``, ``convert --to safetensors`` exit 3 writing nothing (each with
one stderr line), ``ckpttool.load`` raising ``UnsafeError``; no marker, input unchanged.
The benign controls of the same shapes load under torch and read with exit 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bypass_corpus import BENIGN, CASES, HOSTILE, Case, write_case
from helpers import run_child, sha256, subprocess_env, write_dcp

# The proof child: what the real loaders do with each case. A payload that remaps
# ``_compat_pickle.NAME_MAPPING`` changes every later protocol-2 load of the process
# (``collections.OrderedDict`` in each tensor would become ``posix.system``), so the
# mapping is put back after each case; each case runs in its own folder because torch
# writes a ``.patch`` file into the working directory.
PROOF = r"""
import _compat_pickle, json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
from torch.distributed.checkpoint import FileSystemReader

results = {}
for name, container, path, folder in json.load(sys.stdin):
    saved = dict(_compat_pickle.NAME_MAPPING)
    os.chdir(folder)
    try:
        if container == "dcp":
            FileSystemReader(path).read_metadata()
        else:
            torch.load(path, weights_only=False)
        results[name] = None
    except Exception as exc:  # a payload may fail after it acted: the marker tells
        results[name] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        _compat_pickle.NAME_MAPPING.clear()
        _compat_pickle.NAME_MAPPING.update(saved)
print(json.dumps(results))
"""


def _templates(base: Path) -> tuple[Path, Path]:
    """A real DCP folder (``dcp.save``) and a real ``model.safetensors``."""
    import torch
    from safetensors.torch import save_file

    dcp = base / "dcp-template"
    write_dcp(dcp, {"model": {"w": torch.arange(4, dtype=torch.float32)}, "step": 3})
    st = base / "model.safetensors"
    save_file({"bert.embeddings.weight": torch.arange(8, dtype=torch.float32).reshape(2, 4)}, st)
    return dcp, st


def _write_all(base: Path, dcp: Path, st: Path) -> dict[str, tuple[Path, Path]]:
    """Every case under ``base/<name>/``: {name: (folder, path)}."""
    written = {}
    for case in CASES:
        folder = base / case.name
        folder.mkdir(parents=True)
        written[case.name] = (folder, write_case(case, folder, dcp, st))
    return written


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> tuple[Path, Path]:
    return _templates(tmp_path_factory.mktemp("bypass-templates"))


@pytest.fixture(scope="module")
def proof(tmp_path_factory, templates) -> dict[str, dict]:
    """Each case loaded by the real loader in one child: {name: {"error", "acted"}}."""
    base = tmp_path_factory.mktemp("bypass-proof")
    written = _write_all(base / "cases", *templates)
    script = base / "proof.py"
    script.write_text(PROOF)
    items = [[c.name, c.container, str(written[c.name][1]), str(written[c.name][0])]
             for c in CASES]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(script)],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=base,
        timeout=600,  # a hang guard, no timing
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.splitlines()[-1])
    return {
        c.name: {"error": errors[c.name], "acted": (written[c.name][0] / c.marker).exists()}
        for c in CASES
    }


def _commands(case: Case, folder: Path, path: Path) -> dict[str, list[str]]:
    def convert(source: Path, out: str) -> list[str]:
        return ["convert", str(source), "--to", "safetensors", "-o", str(folder / out)]

    cmds = {"inspect": ["inspect", "--json", str(path)]}
    if case.tensors or not case.benign:  # (a benign file without tensors has none to convert)
        cmds["convert"] = convert(path, "out.safetensors")
    if case.container == "hf":  # the Trainer's checkpoint-N/ as a whole too
        cmds["inspect-folder"] = ["inspect", "--json", str(path.parent)]
        cmds["convert-folder"] = convert(path.parent, "out-folder.safetensors")
    return cmds


@pytest.fixture(scope="module")
def checked(tmp_path_factory, templates) -> dict[str, dict]:
    """Every case through ckpttool's CLI, all in one child (``children.py cli-batch``)
    whose working directory is the cases' folder (where a ``.patch`` would appear)."""
    base = tmp_path_factory.mktemp("bypass-check")
    written = _write_all(base, *templates)
    runs, argvs = {}, []
    for case in CASES:
        folder, path = written[case.name]
        cmds = _commands(case, folder, path)
        files = sorted(p.relative_to(folder) for p in folder.rglob("*"))
        runs[case.name] = {"folder": folder, "path": path, "hash": sha256(path),
                           "files": files, "cmds": cmds}  # fmt: skip
        argvs.extend(cmds.values())
    proc = run_child("cli-batch", items=argvs, env={"COLUMNS": "200"}, cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = iter(json.loads(proc.stdout.splitlines()[-1]))
    for run in runs.values():
        run["results"] = {name: next(results) for name in run["cmds"]}
    runs["<base>"] = {"folder": base}
    return runs


ids = [c.name for c in HOSTILE]


@pytest.mark.parametrize("case", HOSTILE, ids=ids)
def test_each_bypass_runs_code_under_the_real_loader(proof, case: Case):
    """Not live: the recipe no longer acts with this torch/sympy, and "no marker" below
    would prove nothing."""
    assert proof[case.name]["acted"], (case.name, proof[case.name]["error"])


@pytest.mark.parametrize("case", BENIGN, ids=[c.name for c in BENIGN])
def test_each_benign_control_loads_under_the_real_loader(proof, case: Case):
    """The controls are real files of the same shapes: torch reads them, nothing acts."""
    assert proof[case.name] == {"error": None, "acted": False}


def _one_line(result: dict, word: str) -> str:
    lines = result["stderr"].splitlines()
    assert len(lines) == 1, result["stderr"][-2000:]
    assert lines[0].startswith(f"ckpttool: {word}: "), lines[0]
    assert "Traceback" not in result["stderr"] + result["stdout"]
    return lines[0]


def _refused(run: dict, commands: tuple[str, ...], case: Case) -> None:
    """Exit 3 with one stderr line; ``inspect --json`` names an offender."""
    for command in commands:
        result = run["results"][command]
        assert result["code"] == 3, (command, result["code"], result["stderr"][-500:])
        _one_line(result, "refused")
        if command.startswith("inspect"):
            dangerous = json.loads(result["stdout"])["dangerous"]
            assert set(case.dangerous) & set(dangerous), (command, case.dangerous, dangerous)


def _untouched(checked: dict, case: Case) -> None:
    """Nothing written, nothing run, the input unchanged."""
    run = checked[case.name]
    folder = run["folder"]
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == run["files"]
    assert not (folder / case.marker).exists()
    assert not (checked["<base>"]["folder"] / case.marker).exists()
    assert sha256(run["path"]) == run["hash"]


@pytest.mark.parametrize("case", HOSTILE, ids=ids)
def test_each_bypass_is_refused(checked, case: Case, monkeypatch):
    import ckpttool
    from ckpttool.errors import UnsafeError

    run = checked[case.name]
    _refused(run, ("inspect", "convert"), case)
    monkeypatch.chdir(run["folder"])  # where a .patch would be written
    with pytest.raises(UnsafeError):
        ckpttool.load(run["path"])
    _untouched(checked, case)


TRAINER = [c for c in HOSTILE if c.container == "hf"]


@pytest.mark.parametrize("case", TRAINER, ids=[c.name for c in TRAINER])
def test_a_trainer_checkpoint_is_refused_for_its_training_args(checked, case: Case):
    """The contract judges every pickle of a run folder: a ``checkpoint-N/`` whose
    ``training_args.bin`` runs code under ``torch.load`` is refused as a whole, even
    though a resume reads its model and optimizer files, not that one."""
    import ckpttool
    from ckpttool.errors import UnsafeError

    run = checked[case.name]
    _refused(run, ("inspect-folder", "convert-folder"), case)
    with pytest.raises(UnsafeError):
        ckpttool.load(run["path"].parent)
    _untouched(checked, case)


@pytest.mark.parametrize("case", BENIGN, ids=[c.name for c in BENIGN])
def test_each_benign_control_reads(checked, case: Case):
    import ckpttool

    run = checked[case.name]
    for command, result in run["results"].items():
        assert result["code"] == 0, (command, result["stderr"][-1000:])
        if command.startswith("inspect"):
            assert json.loads(result["stdout"])["dangerous"] == []
    assert (run["folder"] / "out.safetensors").exists() == case.tensors
    assert ckpttool.load(run["path"], select="auto" if case.tensors else "all")
    if case.container == "hf":
        assert (run["folder"] / "out-folder.safetensors").exists()
        assert ckpttool.load(run["path"].parent)
    assert sha256(run["path"]) == run["hash"]
