"""The suite's fixtures: real checkpoints built with torch in temp dirs.

Everything is generated in ``tmp_path`` / ``tmp_path_factory`` from real ``torch.save`` /
``torch.jit.save`` / safetensors / torchrun + gloo runs; the expensive inputs (the torchrun
runs) are session-scoped and shared. The code the tests share (the CLI runner, servers,
the attack corpus, the programs child processes run) lives in ``support/``, importable
by its module names.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "support"))

import pytest  # noqa: E402
from helpers import CountingSource, finish, run_cli, start_torchrun
from payloads import MALICIOUS_KINDS, WRITERS, MaliciousFile, make_payloads


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per CPU this process may use, at most 4 (each imports torch:
    ~250 MiB; the suite's longest files bound what more would gain)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.fixture
def cli():
    return run_cli


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder ``name``, built by ``build`` once per test session: with pytest-xdist,
    the first worker to need it builds it (under a lock) and the others use it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


# ---------------------------------------------------------- torchrun + gloo runs

DIST_WORKERS = Path(__file__).parent / "support" / "dist_workers.py"
TORCHRUN_TIMEOUT_S = 300


@dataclass
class DistRuns:
    """Outputs of the torchrun runs of ``dist_workers.py`` (2, 3 and 4 ranks), one folder
    per scenario."""

    two: Path  # ep0-ba1-rank{0,1}.pt, dcp/, dtensor-/holder-rank{0,1}.pt, full.pt,
    # dtensor_full.pt
    three: Path  # ep0-ba1-rank{0,1,2}.pt, local-rank{0,1,2}.pt (LOCAL_STATE_DICT), full.pt
    mesh: Path  # model-/hsdp-/tp-fsdp-rank{0..3}.pt, dcp/, dcp-safetensors/, dcp-tuple/,
    # hf-dist/, hf-dist2/, full.pt, tp-fsdp-full.pt
    fsdp2: Path  # ep0-ba2-rank{0,1}.pt, dt-rank{0,1}.pt, dcp/, full.pt
    fsdp3: Path  # ep0-ba2-rank{0,1,2}.pt, full.pt


def _run_dist_workers(base: Path) -> None:
    pending = {world: base / f"ranks{world}" for world in (2, 3, 4)}
    failures: list[str] = []
    for _attempt in range(2):
        procs = {}
        for world, folder in pending.items():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            procs[world] = start_torchrun(DIST_WORKERS, folder, nproc=world, cwd=folder)
        failures = []
        for world, proc in procs.items():
            done = finish(proc, TORCHRUN_TIMEOUT_S)
            folder = pending[world]
            if all((folder / f"done-rank{r}").exists() for r in range(world)):
                del pending[world]
            else:
                output = (done.stdout + done.stderr)[-5000:]
                failures.append(f"--- torchrun, {world} ranks: exit {done.returncode}\n{output}")
        if not pending:
            break
    else:
        pytest.fail("\n".join(failures))


# dist_workers.py saves objects of its own classes (``__main__.Holder``, an EMA-like
# wrapper of sharded weights; ``__main__.RunInfo``, a config): a class on no list that
# a pickle constructs is refused until allowed, so the tests that read those runs trust
# them as a user would, with torch's add_safe_globals (ckpttool counts what a program
# registered there), from the first test that asks for the runs on. The commands run
# in other processes pass DIST_ALLOW instead.
DIST_CLASSES = ("__main__.Holder", "__main__.RunInfo")
DIST_ALLOW = [arg for name in DIST_CLASSES for arg in ("--allow", name)]


def _trust_the_dist_runs_classes() -> None:
    import torch.serialization

    torch.serialization.add_safe_globals([(type(n, (), {}), n) for n in DIST_CLASSES])


@pytest.fixture(scope="session")
def dist_runs(tmp_path_factory) -> DistRuns:
    """Run ``dist_workers.py`` on 2, 3 and 4 ranks at once (about 15 s together on 2
    cores) and share their files with every test module.

    A run whose ranks all finished writing counts even if teardown crashed; an
    incomplete run is retried once.
    """
    base = built_once(tmp_path_factory, "dist", _run_dist_workers)
    _trust_the_dist_runs_classes()
    return DistRuns(
        two=base / "ranks2" / "two",
        three=base / "ranks3" / "three",
        mesh=base / "ranks4" / "mesh",
        fsdp2=base / "ranks2" / "fsdp2",
        fsdp3=base / "ranks3" / "fsdp3",
    )


@pytest.fixture(scope="session")
def dist_reference(dist_runs):
    """The full (unsharded) model and optimizer state of the ``two`` and ``three`` runs,
    loaded with torch."""
    import torch

    return {
        "two": torch.load(dist_runs.two / "full.pt", weights_only=True),
        "three": torch.load(dist_runs.three / "full.pt", weights_only=True),
        "dtensor": torch.load(dist_runs.two / "dtensor_full.pt", weights_only=True),
    }


@pytest.fixture(scope="session")
def fsdp2(dist_runs) -> Path:
    """The FSDP snapshot run on 2 ranks (see ``dist_workers.fsdp_snapshot``)."""
    return dist_runs.fsdp2


@pytest.fixture(scope="session")
def fsdp3(dist_runs) -> Path:
    """The FSDP snapshot run on 3 ranks (see ``dist_workers.fsdp_snapshot``)."""
    return dist_runs.fsdp3


# ------------------------------------------- malicious checkpoints, three ways


@pytest.fixture(scope="session")
def malicious(tmp_path_factory) -> dict[tuple[str, str], MaliciousFile]:
    """Every payload embedded every way: ``{(kind, payload name): MaliciousFile}``."""
    base = tmp_path_factory.mktemp("malicious")
    out = {}
    for kind in MALICIOUS_KINDS:
        folder = base / kind
        folder.mkdir()
        for name, payload in make_payloads(base / f"work-{kind}").items():
            path = folder / (name if kind == "dcp" else f"{name}.pt")
            WRITERS[kind](path, payload.obj)
            out[(kind, name)] = MaliciousFile(kind, path, payload)
    return out


@pytest.fixture
def counting_source():
    """The ``counting://`` source (helpers.CountingSource), registered for this test."""
    from ckpttool import sources

    source = CountingSource()
    sources.register("counting", lambda scheme: source)
    sources.forget("counting")
    try:
        yield source
    finally:
        sources.unregister("counting")


@pytest.fixture
def small_buffers(monkeypatch):
    """OutputFile with three 8 KiB staging buffers: a few KB written or copied cross
    buffers (and O_DIRECT blocks) and start writes, a copy spans several ranges each."""
    from ckpttool.writers import output_file

    monkeypatch.setattr(output_file, "BUFFER_BYTES", 8192)
    monkeypatch.setattr(output_file, "BUFFERS", 3)


@pytest.fixture(params=["direct", "page cache"])
def mode(request, monkeypatch, tmp_path: Path) -> str:
    """OutputFile's two I/O modes: O_DIRECT (skipped where the file system refuses it)
    and the page cache."""
    import os

    from ckpttool.writers import output_file

    if request.param == "page cache":
        monkeypatch.setattr(output_file, "_O_DIRECT", 0)
    else:
        probe = str(tmp_path / "probe")
        fd, direct = output_file._open_output(probe)
        os.close(fd)
        os.remove(probe)
        if not direct:
            pytest.skip("this file system refuses O_DIRECT")
    return request.param
