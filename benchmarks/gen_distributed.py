"""torchrun worker: write a sharded training snapshot as FSDP would, on CPU with gloo.

``--layout per-rank``: each rank ``torch.save``s ``ep0-rank{R}.pt`` whose model and
Adam state are ``ShardedTensor``s split along dim 0 like FSDP1's
``SHARDED_STATE_DICT`` (``torch.chunk`` blocks). ``--layout dcp``: the same state as
``DTensor``s (``Shard(0)``, as FSDP2 holds them) saved with
``torch.distributed.checkpoint.save``. Building the shards directly instead of
wrapping a 700 MB model in FSDP keeps generation fast on a 2-core machine; the
files have the same structure.

    torchrun --standalone --nproc_per_node=4 benchmarks/gen_distributed.py \
        --layout per-rank --out bench-data/rank4 --model-bytes 715827882
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from shapes import ADAM_HYPERPARAMS, chunk_rows, fill, transformer_params

SNAPSHOT_EPOCH = 3


def sharded_tensor_factory(rank: int, world: int):
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    def make(shape, *seed_parts, positive=False):
        start, length = chunk_rows(shape[0], rank, world)
        local = fill((length, *shape[1:]), *seed_parts, rank, positive=positive)
        offsets = [start] + [0] * (len(shape) - 1)
        shards = [Shard.from_tensor_and_offsets(local, offsets, rank)] if length else []
        return init_from_local_shards(shards, *shape)

    return make


def dtensor_factory(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))

    def make(shape, *seed_parts, positive=False):
        _, length = chunk_rows(shape[0], rank, world)
        local = fill((length, *shape[1:]), *seed_parts, rank, positive=positive)
        full = torch.empty(shape, device="meta")
        return DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )

    return make


def sharded_snapshot(model_bytes: int, make) -> dict:
    """FSDP's sharded ``{"model", "optimizer", "epoch"}``: optimizer state keyed by FQN."""
    params = transformer_params(model_bytes)
    model = {name: make(shape, "model", name) for name, shape in params}
    state = {
        name: {
            "step": torch.tensor(10.0),
            "exp_avg": make(shape, "exp_avg", name),
            "exp_avg_sq": make(shape, "exp_avg_sq", name, positive=True),
        }
        for name, shape in params
    }
    groups = [{**ADAM_HYPERPARAMS, "params": [name for name, _ in params]}]
    return {
        "model": model,
        "optimizer": {"state": state, "param_groups": groups},
        "epoch": SNAPSHOT_EPOCH,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["per-rank", "dcp"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model-bytes", type=int, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = args.out + ".tmp"
    if args.layout == "per-rank":
        state = sharded_snapshot(args.model_bytes, sharded_tensor_factory(rank, world))
        if rank == 0:
            os.makedirs(tmp, exist_ok=True)
        dist.barrier()
        torch.save(state, os.path.join(tmp, f"ep0-rank{rank}.pt"))
    else:
        import torch.distributed.checkpoint as dcp

        state = sharded_snapshot(args.model_bytes, dtensor_factory(rank, world))
        dcp.save(state, checkpoint_id=tmp)
    dist.barrier()
    if rank == 0:
        os.replace(tmp, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
