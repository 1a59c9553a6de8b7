"""Hostile containers (``tests/support/hostile_zips.py``): bounded work on any input.

Every case, through every command: the contract's exit code (2 with one stderr line
naming what is wrong, or 0 for the valid controls), nothing written, the input
unchanged, and the child's work bounded by resource limits, not by timing: its CPU
time under ``RLIMIT_CPU`` (5 s beyond what the same command costs on a valid file,
torch's import included) and its peak RSS (``ru_maxrss``) at most 256 MiB above it.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import hostile_zips
import pytest
import torch
from helpers import check_error, run_child, sha256, tree_files
from hostile_zips import CASES

import ckpttool
from ckpttool.errors import CkptError

MiB = 1 << 20
WORK_CPU_S = 5  # CPU seconds a hostile file may cost beyond a valid one
WORK_RSS = 256 * MiB  # memory it may cost beyond a valid one

COMMANDS = {
    "inspect": ["inspect", "--json"],
    "stats": ["inspect", "--stats"],
    "convert": ["convert", "--to", "safetensors", "-o", "{out}"],
    "merge": ["merge", "-o", "{out}"],
}


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    cpu_s: float
    max_rss: int  # bytes


def run_limited(jobs: list[tuple[list[str], int]]) -> list[Run]:
    """``ckpttool ARGS`` in a child of its own under ``RLIMIT_CPU`` for each (ARGS,
    limit); each one's exit code, output, CPU time and peak RSS."""
    with tempfile.TemporaryDirectory() as folder:
        specs = [
            [
                limit,
                f"{folder}/{i}.out",
                f"{folder}/{i}.err",
                a,
            ]
            for i, (a, limit) in enumerate(jobs)
        ]
        # a small launcher forks the commands: see children.limited
        specs_json = json.dumps(specs)
        launcher = run_child("limited", specs_json, env={"COLUMNS": "80"}, timeout=None)
        assert launcher.returncode == 0, launcher.stderr[-3000:]
        return [
            Run(code, Path(spec[1]).read_text(), Path(spec[2]).read_text(), cpu_s, max_rss)
            for spec, (code, cpu_s, max_rss) in zip(specs, json.loads(launcher.stdout), strict=True)
        ]


def command_args(command: str, path: Path, out: Path) -> list[str]:
    words = [w.format(out=out) for w in COMMANDS[command]]
    return [words[0], str(path), *words[1:]]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict[str, Run]:
    """Each command on a valid file: what any file costs (the interpreter, torch)."""
    folder = tmp_path_factory.mktemp("baseline")
    path = folder / "valid.pt"
    path.write_bytes(hostile_zips.valid_zip())
    jobs = [(command_args(c, path, folder / f"{c}.out"), 120) for c in COMMANDS]
    runs = dict(zip(COMMANDS, run_limited(jobs), strict=True))
    for run in runs.values():
        assert run.returncode == 0, run.stderr
    return runs


BOUNDED = list(CASES)


# four CLI processes a case (~2 s on 2 cores): the quick suite takes every other case,
# the slow suite the rest (the API test below takes every case in-process)
@pytest.mark.parametrize(
    "name",
    [n if i % 2 == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(BOUNDED)],
)
def test_hostile_input_bounded_one_line_nothing_written(
    tmp_path: Path, baseline: dict[str, Run], name: str
):
    """inspect --json, inspect --stats, convert and merge of one case."""
    case = CASES[name]
    path = tmp_path / "in" / f"{name}{case.suffix}"
    path.parent.mkdir()
    path.write_bytes(case.build())
    before = sha256(path)
    outs = {command: tmp_path / command / "result" for command in COMMANDS}
    jobs = [
        (command_args(c, path, outs[c]), math.ceil(baseline[c].cpu_s) + WORK_CPU_S)
        for c in COMMANDS
    ]
    for command, run in zip(COMMANDS, run_limited(jobs), strict=True):
        base = baseline[command]
        assert run.max_rss <= base.max_rss + WORK_RSS, (command, run.max_rss // MiB)
        assert "Traceback" not in run.stderr, command
        if case.code == 0:
            assert run.returncode == 0, (command, run.stderr)
            if command in ("convert", "merge"):
                assert outs[command].is_file()
        else:
            check_error(run, case.code, case.needle)  # type: ignore[arg-type]
            assert not outs[command].parent.exists(), command
    assert sha256(path) == before
    assert tree_files(path.parent) == [path.name]


# -------------------------------------------------------------- the same through the API


@pytest.mark.parametrize("name", [n for n in BOUNDED if CASES[n].code == 2])
def test_api_raises_ckpt_error(tmp_path: Path, name: str):
    case = CASES[name]
    path = tmp_path / f"{name}{case.suffix}"
    path.write_bytes(case.build())
    with pytest.raises(CkptError, match=case.needle.replace("'", ".").replace("(", ".")):
        ckpttool.load(str(path), select="all")


def test_zip_span_past_the_end_of_its_file(tmp_path: Path):
    """A DCP chunk's (start, length) comes from its metadata: a span longer than the file
    is refused before anything is read or allocated from it."""
    from ckpttool.formats.torch_save.zip_pickle import ZipPickle

    path = tmp_path / "chunk.distcp"
    path.write_bytes(hostile_zips.valid_zip())
    for start, length in ((0, 3_000_000_000), (-8, 100), (10, path.stat().st_size)):
        with pytest.raises(CkptError, match="runs past the end of the file"):
            ZipPickle(str(path), start, length)
    with ZipPickle(str(path), 0, path.stat().st_size) as archive:
        assert archive.prefix == "archive/"


def test_valid_controls_load_bitwise(tmp_path: Path):
    """The controls are real checkpoints: torch.load and ckpttool read the same values."""
    for name in ("valid_zip", "compressed_pickle", "no_data_descriptor", "legacy_valid"):
        path = tmp_path / f"{name}.pt"
        path.write_bytes(CASES[name].build())
        expected = torch.tensor([1.0, 2.0, 3.0, 4.0])
        assert torch.equal(torch.load(path, weights_only=True)["w"], expected), name
        assert torch.equal(ckpttool.load(str(path), select="all")["w"], expected), name


def test_bombs_really_inflate(tmp_path: Path):
    """The bombs are what they claim: a reader without caps would inflate gigabytes."""
    import zlib

    stream = hostile_zips.deflate_zeros(64 * MiB)
    assert len(stream) < 128 * 1024
    assert len(zlib.decompressobj(-15).decompress(stream)) == 64 * MiB
    assert len(CASES["byteorder_bomb"].build()) < 3 * MiB  # declares 2 GiB


# -------------------------------------------------------------- many-entry safetensors


def test_many_entry_safetensors_header_linear_memory(tmp_path: Path, baseline: dict[str, Run]):
    """10x the tensors costs at most ~10x the memory and CPU (no quadratic step), and the
    work per tensor is small. A 10^6-entry file is refused (``many_empty_tensors``)."""
    counts = (10_000, 100_000)
    jobs = []
    for count in counts:
        path = tmp_path / f"empty{count}.safetensors"
        path.write_bytes(hostile_zips.many_empty_tensors(count))
        jobs.append((["inspect", "--json", str(path)], 120))
    costs = {}
    for count, run in zip(counts, run_limited(jobs), strict=True):
        assert run.returncode == 0, run.stderr
        assert f'"num_tensors": {count}' in run.stdout
        costs[count] = run.max_rss - baseline["inspect"].max_rss
    small, large = costs[10_000], costs[100_000]
    assert large <= 12 * max(small, 8 * MiB), (small // MiB, large // MiB)
    assert large / 100_000 <= 4096  # bytes per tensor, the JSON output included
