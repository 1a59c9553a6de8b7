"""A torchrun worker for tests/test_s3_output.py: every rank plans the same conversion
and calls ``ckpttool.s3_output.write_ranks`` with torch.distributed's object collectives
(gloo), as ``torchrun -m ckpttool convert ... -o s3://...`` will.

    torchrun --nproc_per_node=N s3_rank_worker.py CKPT TO URL [MAX_SHARD_SIZE]
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from ckpttool.api.reading import flatten_tensors, read, select_node
from ckpttool.errors import CkptError
from ckpttool.targets.s3 import write_ranks
from ckpttool.writers import writer_for
from ckpttool.writers.plan import WriteOptions


def main(ckpt: str, to: str, url: str, max_shard: str | None = None) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(obj):
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    loaded = read(ckpt)
    _, node = select_node(loaded, "auto", "auto")
    options = WriteOptions(
        location="cpu",
        max_shard_size=int(max_shard) if max_shard else None,
        metadata={"source": ckpt.rsplit("/", 1)[-1]},
    )
    writer = writer_for(to)
    code = 0
    try:
        write_ranks(
            writer.plan(flatten_tensors(node), options),
            url,
            layout=writer.layout(options),
            force=False,
            inputs=loaded.files,
            rank=rank,
            world=world,
            broadcast=broadcast,
            all_gather=all_gather,
        )
    except CkptError as exc:
        print(f"rank {rank}: {exc.one_line()}", file=sys.stderr)
        code = 2
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
