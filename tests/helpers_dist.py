"""Real multi-process checkpoints for the convert/merge/diff tests, made once per session.

Two ``torchrun --standalone`` jobs on CPU/gloo, 2 and 3 ranks, started together (about
15 s on 2 cores). Each trains a tiny FSDP1 model for two Adam steps, then writes, from
the SAME state:

* ``full.pt``: ``FULL_STATE_DICT`` model + full optimizer state (the reference), and
  rank 0's side-optimizer state and RNG state as saved in its rank file;
* ``ep0-ba2-rank{R}.pt``: Composer-style per-rank files whose model AND optimizer
  leaves are ``ShardedTensor`` (``SHARDED_STATE_DICT``), beside plain values, a
  plain-optimizer state keyed by ints, an ``argparse.Namespace`` and a custom class;
* ``dt-rank{R}.pt`` (2 ranks only): the full model state as ``DTensor`` leaves
  (``Shard(0)``, ``Shard(1)``, ``Replicate()``) on a CPU device mesh;
* ``dcp/`` (2 ranks only): ``torch.distributed.checkpoint.save`` of the sharded state.

The results are memoized in this module: every test module's session fixture that calls
:func:`fsdp_checkpoints` shares the same run. Also here: the CLI runner and the checks
shared by the convert/merge/diff/output tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_TIMEOUT_S = 180

DIST_SCRIPT = r'''
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)


class RunInfo:
    """A custom class in the snapshot: must survive merge as a plain-data stand-in."""

    def __init__(self, name, tags):
        self.name = name
        self.tags = tags


def main(out, with_extras):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # Odd sizes: dim 0 of 5, 3, 7 and 2 never splits evenly; 2 rows over 3 ranks leave one empty.
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 2))
    model.register_buffer("scale", torch.tensor([0.5, 2.0]))
    fsdp = FSDP(model, device_id=torch.device("cpu"))
    opt = torch.optim.Adam(fsdp.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)
    for _ in range(2):
        opt.zero_grad()
        fsdp(torch.randn(4, 6)).square().sum().backward()
        opt.step()
    # A plain (unsharded) optimizer: its state is keyed by ints, as torch writes it.
    side = nn.Parameter(torch.arange(4, dtype=torch.float32))
    sgd = torch.optim.SGD([side], lr=0.1, momentum=0.9)
    side.grad = torch.ones(4)
    sgd.step()

    with FSDP.state_dict_type(
        fsdp,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=False),
        FullOptimStateDictConfig(rank0_only=False),
    ):
        full_model = fsdp.state_dict()
        full_optim = FSDP.optim_state_dict(fsdp, opt)
    rng = torch.get_rng_state()
    if rank == 0:
        reference = {"model": full_model, "optim": full_optim, "side": sgd.state_dict(), "rng": rng}
        torch.save(reference, os.path.join(out, "full.pt"))

    with FSDP.state_dict_type(
        fsdp,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(),
        ShardedOptimStateDictConfig(),
    ):
        model_sd = fsdp.state_dict()
        optim_sd = FSDP.optim_state_dict(fsdp, opt)
    snapshot = {
        "state": {
            "model": model_sd,
            "optimizers": {"Adam": optim_sd},
            "side_optimizer": sgd.state_dict(),
            "schedulers": [],
            "timestamp": {"epoch": 0, "batch": 2},
            "run_name": "demo",
        },
        "rng": [{"torch": rng, "rank": rank}],
        "args": argparse.Namespace(lr=0.01, tag="demo"),
        "info": RunInfo("demo", ["a", "b"]),
    }
    torch.save(snapshot, os.path.join(out, f"ep0-ba2-rank{rank}.pt"))

    if with_extras:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        placements = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1)}
        dtensors = {
            k: distribute_tensor(v, mesh, [placements.get(k, Replicate())])
            for k, v in full_model.items()
        }
        torch.save({"model": dtensors, "step": 2}, os.path.join(out, f"dt-rank{rank}.pt"))
        dcp.save(
            {"model": model_sd, "optim": optim_sd, "epoch": 3},
            checkpoint_id=os.path.join(out, "dcp"),
        )
    dist.barrier()
    # Every rank's files are written: say so before teardown, where gloo may abort under load.
    open(f"{out}.done-rank{rank}", "w").close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "extras")
'''


def subprocess_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def torchrun_all(jobs: dict[int, Path], script: Path) -> None:
    """Run ``script FOLDER extras|plain`` (extras on 2 ranks) under ``torchrun --standalone
    --nproc_per_node=N`` for every ``N: FOLDER`` of ``jobs``, all at the same time.

    A job counts as done when every rank wrote its ``FOLDER.done-rank{R}`` marker (after
    its last file), even if gloo then crashed in teardown; an unfinished job is retried once,
    then the test fails with its output.
    """
    pending, failures = dict(jobs), []
    for _attempt in range(2):
        procs = {}
        for nproc, folder in pending.items():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc}",
                str(script),
                str(folder),
                "extras" if nproc == 2 else "plain",
            ]
            procs[nproc] = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=subprocess_env(),
            )
        failures = []
        for nproc, proc in procs.items():
            output, _ = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
            folder = pending[nproc]
            if all(Path(f"{folder}.done-rank{r}").exists() for r in range(nproc)):
                del pending[nproc]
            else:
                failures.append(
                    f"--- torchrun, {nproc} ranks: exit {proc.returncode}\n{output[-5000:]}"
                )
        if not pending:
            return
    pytest.fail("\n".join(failures))


def run_cli(*args: object, **kwargs) -> subprocess.CompletedProcess:
    """``python -m ckpttool ARGS`` in a subprocess, text stdout/stderr captured."""
    return subprocess.run(
        [sys.executable, "-m", "ckpttool", *map(str, args)],
        capture_output=True,
        text=True,
        # 80 columns, as rich assumes without a terminal: messages must not wrap at it
        env={**subprocess_env(), "COLUMNS": "80"},
        timeout=TORCHRUN_TIMEOUT_S,
        **kwargs,
    )


def one_line_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """Exit ``code``, exactly ONE stderr line holding every needle, no traceback, no stdout."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckpttool: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert proc.stdout == ""
    return lines[0]


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file, in file order (read by hand, not by the library)."""
    import json

    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


def tree_files(folder: Path) -> list[str]:
    """Every entry under ``folder`` (hidden ones included), relative, sorted."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))


_RUNS: dict[int, Path] = {}


def fsdp_checkpoints(tmp_path_factory: pytest.TempPathFactory, nproc: int) -> Path:
    """The folder of the FSDP run on ``nproc`` (2 or 3) ranks; the first call runs both."""
    if not _RUNS:
        base = tmp_path_factory.mktemp("fsdp")
        script = base / "make_checkpoints.py"
        script.write_text(DIST_SCRIPT)
        folders = {n: base / f"ranks{n}" for n in (2, 3)}
        torchrun_all(folders, script)
        _RUNS.update(folders)
    return _RUNS[nproc]
