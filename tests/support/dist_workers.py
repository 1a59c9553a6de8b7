"""The torchrun workers behind the suite's multi-process checkpoints (CPU, gloo).

Run as ``torchrun --nproc_per_node=N tests/support/dist_workers.py OUT`` (see ``dist_runs`` in
conftest.py, which starts N = 2, 3 and 4 at once). Each world size writes, in one process
group, what its scenarios need, each scenario into a folder of its own under ``OUT``:

* 2 ranks: ``two/`` (:func:`fsdp_and_dtensors`) and ``fsdp2/`` (:func:`fsdp_snapshot`);
* 3 ranks: ``three/`` (:func:`fsdp_and_dtensors`) and ``fsdp3/`` (:func:`fsdp_snapshot`);
* 4 ranks: ``mesh/`` (:func:`mesh_dtensors`).

Then every rank writes ``OUT/done-rank{R}``: its files are complete even if gloo then
crashes in teardown (it sometimes does under load).

Classes whose instances are saved are defined at module level: the checkpoints name them
``__main__.Holder`` and ``__main__.RunInfo``, and tests expect those names.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


class Holder:
    """A custom object (an EMA, a wrapper) whose attributes are sharded."""

    def __init__(self, weights):
        self.weights = weights
        self.decay = 0.99


class RunInfo:
    """A custom class in the snapshot: must survive merge as a plain-data stand-in."""

    def __init__(self, name, tags):
        self.name = name
        self.tags = tags


def gather(node, world: int):
    """Independent reference: every rank's local shards, assembled by hand."""
    if isinstance(node, dict):
        return {k: gather(v, world) for k, v in node.items()}
    if isinstance(node, list):
        return [gather(v, world) for v in node]
    if isinstance(node, ShardedTensor):
        mine = [(s.metadata.shard_offsets, s.tensor.clone()) for s in node.local_shards()]
        every = [None] * world
        dist.all_gather_object(every, mine)
        t = torch.empty(node.size(), dtype=node.dtype)
        for blocks in every:
            for offsets, block in blocks:
                t[tuple(slice(o, o + n) for o, n in zip(offsets, block.shape, strict=True))] = block
        return t
    return node


def fsdp_and_dtensors(out: Path) -> None:
    """FSDP1 after one Adam step, as per-rank ``ep0-ba1-rank{R}.pt`` (ShardedTensor leaves)
    and ``full.pt`` (the reference); 2 ranks also ``dcp/``, DTensor pairs
    (``dtensor-rank{R}.pt``, ``dtensor_full.pt``) and DTensors inside a custom object
    (``holder-rank{R}.pt``); 3 ranks ``local-rank{R}.pt`` (LOCAL_STATE_DICT)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if world == 2:  # first dims 5 and 3: uneven shards over 2 ranks
        model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    else:  # a 2-row weight and a 2-element bias over 3 ranks: rank 2 holds nothing
        model = nn.Sequential(nn.Linear(4, 2))
    fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.Adam(fsdp.parameters(), lr=0.1)
    torch.manual_seed(1)
    fsdp(torch.randn(8, 4)).sum().backward()
    opt.step()
    with FSDP.state_dict_type(
        fsdp, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)
    ):
        full = {k: v.clone() for k, v in fsdp.state_dict().items()}
    with FSDP.state_dict_type(
        fsdp,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(),
        ShardedOptimStateDictConfig(),
    ):
        sd = fsdp.state_dict()
        osd = FSDP.optim_state_dict(fsdp, opt)

    reference = {"model": full, "optim": gather(osd, world)}
    if rank == 0:
        torch.save(reference, out / "full.pt")
    snapshot = {
        "state": {
            "model": sd,
            "optimizers": {"Adam": osd},
            "schedulers": {},
            "timestamp": {"epoch": 0, "batch": 1},
        },
        "rng": [{"torch": torch.get_rng_state()}],
    }
    torch.save(snapshot, out / f"ep0-ba1-rank{rank}.pt")
    if world == 3:  # each rank's own piece of each parameter, as a plain tensor
        with FSDP.state_dict_type(fsdp, StateDictType.LOCAL_STATE_DICT):
            torch.save({"model": fsdp.state_dict()}, out / f"local-rank{rank}.pt")
    if world == 2:
        dcp.save({"model": sd, "optim": osd, "step": 7}, checkpoint_id=str(out / "dcp"))
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(2)
        w, b = torch.randn(5, 3), torch.randn(3)
        if rank == 0:
            torch.save({"w": w, "b": b}, out / "dtensor_full.pt")
        local = {
            "w": distribute_tensor(w, mesh, [Shard(0)]),
            "b": distribute_tensor(b, mesh, [Replicate()]),
        }
        torch.save(local, out / f"dtensor-rank{rank}.pt")
        torch.save({"ema": Holder(local), "step": 3}, out / f"holder-rank{rank}.pt")


def fsdp_snapshot(out: Path) -> None:
    """FSDP1 after two Adam steps, from the SAME state:

    * ``full.pt``: ``FULL_STATE_DICT`` model + full optimizer state (the reference), and
      rank 0's side-optimizer state and RNG state as saved in its rank file;
    * ``ep0-ba2-rank{R}.pt``: Composer-style per-rank files whose model AND optimizer
      leaves are ``ShardedTensor`` (``SHARDED_STATE_DICT``), beside plain values, a
      plain-optimizer state keyed by ints, an ``argparse.Namespace`` and a custom class;
    * ``dt-rank{R}.pt`` (2 ranks only): the full model state as ``DTensor`` leaves
      (``Shard(0)``, ``Shard(1)``, ``Replicate()``) on a CPU device mesh;
    * ``dcp/`` (2 ranks only): ``torch.distributed.checkpoint.save`` of the sharded state.
    """
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
        torch.save(reference, out / "full.pt")

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
    torch.save(snapshot, out / f"ep0-ba2-rank{rank}.pt")

    if world == 2:
        mesh = init_device_mesh("cpu", (world,))
        placements = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1)}
        dtensors = {
            k: distribute_tensor(v, mesh, [placements.get(k, Replicate())])
            for k, v in full_model.items()
        }
        torch.save({"model": dtensors, "step": 2}, out / f"dt-rank{rank}.pt")
        dcp.save({"model": model_sd, "optim": optim_sd, "epoch": 3}, checkpoint_id=str(out / "dcp"))


def mesh_dtensors(out: Path) -> None:
    """4 ranks on a 2-D (dp=2, tp=2) CPU mesh: DTensors on the mesh and on its dp submesh,
    saved per rank with torch.save (``model-rank{R}.pt``), with dcp.save (``dcp/``), with
    dcp.save in the safetensors serialization format (``dcp-safetensors/``), and with
    HuggingFaceStorageWriter(save_distributed=True) in one and in two files per rank
    (``hf-dist/``, ``hf-dist2/``); on a (1, 2, 2) mesh per rank (``hsdp-rank{R}.pt``);
    FSDP2 over tensor parallel per rank (``tp-fsdp-rank{R}.pt``, ``tp-fsdp-full.pt``); a
    DTensor in a tuple with dcp.save (``dcp-tuple/``); plus the full tensors (``full.pt``)."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = {
        "lin.weight": torch.randn(5, 6),  # rows over dp (3 + 2), columns over tp
        "lin.bias": torch.randn(5),  # rows over dp, replicated over tp
        "emb.weight": torch.randn(7, 3).to(torch.bfloat16),  # on the dp submesh only
        "step": torch.tensor(3),  # replicated everywhere
    }
    placements = {
        "lin.weight": (mesh, [Shard(0), Shard(1)]),
        "lin.bias": (mesh, [Shard(0), Replicate()]),
        "emb.weight": (mesh["dp"], [Shard(0)]),
        "step": (mesh, [Replicate(), Replicate()]),
    }
    model = {k: distribute_tensor(v, *placements[k]) for k, v in full.items()}
    if rank == 0:
        torch.save({"model": full, "epoch": 2}, out / "full.pt")
    torch.save({"model": model, "epoch": 2}, out / f"model-rank{rank}.pt")
    dcp.save({"model": model, "epoch": 2}, checkpoint_id=str(out / "dcp"))
    writer = dcp.FileSystemWriter(
        str(out / "dcp-safetensors"), serialization_format=SerializationFormat.SAFETENSORS
    )
    dcp.save({"model": model, "epoch": 2, "name": "run"}, storage_writer=writer)
    for name, files in (("hf-dist", None), ("hf-dist2", {"lin.weight": 1, "lin.bias": 1})):
        files = files and {**files, "emb.weight": 2, "step": 2}
        writer = dcp.HuggingFaceStorageWriter(
            str(out / name), save_distributed=True, fqn_to_index_mapping=files
        )
        dcp.save(model, storage_writer=writer)
    # HSDP with one replica: a size-1 mesh dimension, which the mesh layout records as
    # an empty shape (torch >= 2.9)
    hsdp = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    hsdp_placements = {
        "lin.weight": [Replicate(), Shard(0), Shard(1)],
        "lin.bias": [Replicate(), Shard(0), Replicate()],
    }
    torch.save(
        {k: distribute_tensor(full[k], hsdp, p) for k, p in hsdp_placements.items()},
        out / f"hsdp-rank{rank}.pt",
    )
    # FSDP2 over tensor parallel: a column-parallel weight is _StridedShard(0) on dp,
    # Shard(0) on tp (7 rows: 4 + 3 over tp, then 2 + 2 and 2 + 1 over dp)
    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 6), nn.Linear(6, 7))
    if rank == 0:
        torch.save(mlp.state_dict(), out / "tp-fsdp-full.pt")
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": ColwiseParallel()}
    parallelize_module(mlp, mesh["tp"], plan)
    fully_shard(mlp, mesh=mesh["dp"])
    torch.save(mlp.state_dict(), out / f"tp-fsdp-rank{rank}.pt")
    # a tuple is not flattened by DCP: rank 0 pickles it whole, its DTensor's block only
    pair = {"pair": (model["lin.weight"], 1), "step": 1}
    dcp.save(pair, checkpoint_id=str(out / "dcp-tuple"))


# Which scenarios each world size runs, and the folder each writes into.
SCENARIOS = {
    2: {"two": fsdp_and_dtensors, "fsdp2": fsdp_snapshot},
    3: {"three": fsdp_and_dtensors, "fsdp3": fsdp_snapshot},
    4: {"mesh": mesh_dtensors},
}


def main(out: Path) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for folder, scenario in SCENARIOS[dist.get_world_size()].items():
        (out / folder).mkdir(exist_ok=True)
        dist.barrier()  # the folder exists before any rank writes into it
        scenario(out / folder)
        dist.barrier()
    # Every file is written: say so before teardown, where gloo sometimes aborts under load.
    open(os.path.join(out, f"done-rank{rank}"), "w").close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
