"""Build a 70B-shaped ``torch.distributed.checkpoint`` folder as N ranks save it, on sparse files.

The ``.metadata`` is a real ``torch.distributed.checkpoint.metadata.Metadata`` pickled
as ``FileSystemWriter.finish`` pickles it (``pickle.dump``, the default protocol), with
the object graph a real save leaves: every rank's write items go through a
``gather_object`` (a pickle round trip) before rank 0 builds the metadata, and its
write results through another, so each chunk's ``MetadataIndex`` and
``ChunkStorageMetadata`` hold their own ``torch.Size``s, as in a real file. The key
string is pickled once per tensor (the folder issue 31 measured: 72 MB at 256 ranks,
531 MB at 2048); ``--fresh-keys`` gives every index its own string, as a gather does
(101 MB at 256). The state is what ``get_state_dict`` gives for a Llama-2-70B-shaped model
trained with Adam under FSDP2 (``Shard(0)`` on every rank): the model in bf16 and both
Adam moments in fp32, 723 parameters x 3 = 2,169 tensors, one chunk per rank each,
plus the optimizer's param groups as byte values (real ``torch.save`` bytes).

Every ``__R_0.distcp`` file is truncated to its size and holds no bytes (a sparse
file: ~1 TB apparent, a few KB on disk), except rank 0's byte values.

    .venv/bin/python benchmarks/make_dcp_scale.py --ranks 256 --out bench-data/scale-dcp-256

``--per-rank dtensor|sharded``: instead, one ``torch.save`` file per rank
(``ep0-rank{R}.pt``) holding that rank's DTensors or ShardedTensors, written with
``torch.serialization.skip_data`` on fake tensors (sparse storages: the zip's
records are laid out but their bytes never written). ``--layers`` trims the model
(ShardedTensor files repeat every rank's shard metadata in every file: 256 ranks of
the full model are 256 x 555k records).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import io
import os
import pickle
import struct
import sys
import time
import zipfile

LLAMA70B = {"hidden": 8192, "intermediate": 28672, "kv": 1024, "vocab": 32000, "layers": 80}
# Llama-3.1-405B: 128 heads, 8 KV heads of 128, untied embeddings
LLAMA405B = {"hidden": 16384, "intermediate": 53248, "kv": 1024, "vocab": 128256, "layers": 126}
# the same layout, small: what a test generates in seconds (8 rows of K and V: with
# more ranks than that, some hold nothing of them)
TINY = {"hidden": 64, "intermediate": 128, "kv": 8, "vocab": 256, "layers": 8}
SHAPES = {"70b": LLAMA70B, "405b": LLAMA405B, "tiny": TINY}
# the same .metadata as other writers lay it out: ``torch`` (torch 2.13's DefaultSavePlanner,
# storage rank by rank, index hints rewritten), ``no-hints`` (a planner that leaves
# ``MetadataIndex.index`` None), ``tensor-order`` (storage entries grouped by tensor),
# ``shuffled`` (storage entries in no order), ``torch-2.3`` (a Metadata without the
# ``storage_meta`` and ``version`` fields torch 2.4 added)
VARIANTS = ("torch", "no-hints", "tensor-order", "shuffled", "torch-2.3")
# bf16 model, fp32 Adam moments
MODEL_BYTES, MOMENT_BYTES = 2, 4
# torch.save of one chunk: the tensor's bytes plus the zip's records around them
ZIP_OVERHEAD = 1088


def llama_params(layers: int, shape: dict = LLAMA70B) -> list[tuple[str, tuple[int, ...]]]:
    h, i, kv, v = (shape[k] for k in ("hidden", "intermediate", "kv", "vocab"))
    params = [("model.embed_tokens.weight", (v, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        params += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    params += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return params


def chunk_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s rows under ``Shard(0)`` (``torch.chunk``)."""
    size = -(-rows // world)
    start = min(rank * size, rows)
    return start, min(size, rows - start)


def entries(
    layers: int, model: dict = LLAMA70B
) -> list[tuple[str, tuple[str, ...], tuple[int, ...], str]]:
    """(flat key, object path, global shape, dtype name) of every tensor, as DCP flattens
    ``{"model": model_sd, "optim": optim_sd}``."""
    out = []
    for name, shape in llama_params(layers, model):
        out.append((f"model.{name}", ("model", name), shape, "bfloat16"))
    for name, shape in llama_params(layers, model):
        for moment in ("exp_avg", "exp_avg_sq"):
            path = ("optim", "state", name, moment)
            out.append((".".join(path), path, shape, "float32"))
    return out


def param_groups(layers: int, model: dict = LLAMA70B) -> dict[tuple[str, ...], object]:
    names = [name for name, _ in llama_params(layers, model)]
    group = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    group.update({"amsgrad": False, "maximize": False, "foreach": None, "capturable": False})
    group.update({"differentiable": False, "fused": None, "params": names})
    return {("optim", "param_groups", 0, k): v for k, v in group.items()}  # type: ignore[misc]


def build_dcp(
    out: str,
    ranks: int,
    layers: int,
    fresh_keys: bool = False,
    model: dict = LLAMA70B,
    chunk_zips: str = "none",
    variant: str = "torch",
) -> None:
    """``variant``: how another writer lays the same ``.metadata`` out (:data:`VARIANTS`)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    tensors = entries(layers, model)
    values = param_groups(layers, model)
    planner_data: dict[str, tuple] = {}
    md: dict[str, object] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    file_sizes = [0] * ranks
    # rank 0's byte values: real torch.save bytes at their offsets
    byte_blobs: list[tuple[int, bytes]] = []
    for path, value in values.items():
        fqn = ".".join(map(str, path))
        planner_data[fqn] = path
        md[fqn] = BytesStorageMetadata()
        buf = io.BytesIO()
        torch.save(value, buf)
        blob = buf.getvalue()
        byte_blobs.append((file_sizes[0], blob))
        storage[MetadataIndex(fqn)] = _StorageInfo("__0_0.distcp", file_sizes[0], len(blob))
        file_sizes[0] += len(blob)
    for fqn, path, shape, dtype in tensors:
        planner_data[fqn] = path
        props = TensorProperties(dtype=dtypes[dtype])
        md[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=[])
    zips: list[list[tuple[int, bytes, int, bytes]]] = [[] for _ in range(ranks)]
    for rank in range(ranks):
        rel = f"__{rank}_0.distcp"  # one string per rank's results, as gathered
        for fqn, _, shape, dtype in tensors:
            start, length = chunk_rows(shape[0], rank, ranks)
            offsets = (start, *[0] * (len(shape) - 1))
            sizes = (length, *shape[1:])
            # the plan's chunk (gathered from the rank: its own Size objects)...
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            chunks = md[fqn].chunks  # type: ignore[attr-defined]
            index = len(chunks)
            chunks.append(chunk)
            # ...and the write result's index (another gather: its own Size; the key
            # string is pickled once, as in the folder issue 31 measured: 77 MB at 256
            # ranks; --fresh-keys gives each index a string of its own)
            hint = None if variant == "no-hints" else index
            key = MetadataIndex("".join(fqn) if fresh_keys else fqn, torch.Size(offsets), hint)
            item = MODEL_BYTES if dtype == "bfloat16" else MOMENT_BYTES
            nbytes = item * length * (shape[1] if len(shape) > 1 else 1) + ZIP_OVERHEAD
            if chunk_zips == "all" or (chunk_zips == "model" and fqn.startswith("model.")):
                head, gap, tail = zip_template(dtypes[dtype], sizes)
                zips[rank].append((file_sizes[rank], head, gap, tail))
                nbytes = len(head) + gap + len(tail)
            storage[key] = _StorageInfo(rel, file_sizes[rank], nbytes)
            file_sizes[rank] += nbytes
    if variant == "tensor-order":  # storage entries tensor by tensor, not rank by rank
        storage = dict(sorted(storage.items(), key=lambda kv: (kv[0].fqn, kv[0].index or 0)))
    if variant == "shuffled":  # storage entries in no order at all
        import random

        rng = random.Random(0)
        items = list(storage.items())
        rng.shuffle(items)
        storage = dict(items)
    meta = Metadata(
        state_dict_metadata=md,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=out, save_id="generated", load_id=None),
        version="1.0.0",
    )
    if variant == "torch-2.3":  # before storage_meta and version (torch 2.4 added them)
        del meta.storage_meta, meta.version
    os.makedirs(out, exist_ok=True)
    for rank, size in enumerate(file_sizes):
        with open(os.path.join(out, f"__{rank}_0.distcp"), "wb") as f:
            if rank == 0:
                for offset, blob in byte_blobs:
                    f.seek(offset)
                    f.write(blob)
            for offset, head, gap, tail in zips[rank]:
                f.seek(offset)
                f.write(head)
                f.seek(gap, os.SEEK_CUR)  # the tensor's bytes: zeros, never written
                f.write(tail)
            zips[rank] = []
            f.truncate(size)
    tmp = os.path.join(out, ".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(meta, f)  # as FileSystemWriter.finish
    os.replace(tmp, os.path.join(out, ".metadata"))


@functools.cache
def zip_template(dtype, sizes: tuple[int, ...]) -> tuple[bytes, int, bytes]:
    """A chunk as DCP's ``FileSystemWriter`` writes it (``torch.save`` of the tensor) when
    the tensor is zeros: (the zip's records before the tensor's bytes, how many bytes
    those are, the records after them). Written around a hole, the chunk is the real
    ``torch.save`` bytes of a zero tensor (its CRC-32 too), with no data block on disk."""
    import torch

    buf = io.BytesIO()
    torch.save(torch.zeros(sizes, dtype=dtype), buf)
    blob = buf.getvalue()
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack(
        "<HH", blob[info.header_offset + 26 : info.header_offset + 30]
    )
    start = info.header_offset + 30 + name_len + extra_len
    end = start + info.file_size
    if any(blob[start:end]):
        raise AssertionError("a zero tensor saved other bytes")
    return blob[:start], end - start, blob[end:]


def tensor_values(index: int, shape: tuple[int, ...], dtype):
    """The values a generated tensor holds with ``--data``: the ``index``-th tensor is
    ``index + arange`` over its elements, wrapped to stay exact in bfloat16."""
    import math

    import torch

    return ((torch.arange(math.prod(shape)) + index) % 251).reshape(shape).to(dtype)


def build_per_rank(
    out: str,
    ranks: int,
    layers: int,
    kind: str,
    model: dict = LLAMA70B,
    data: bool = False,
    files: int | None = None,
) -> None:
    """One ``torch.save`` per rank of its DTensors or ShardedTensors (a fake process group
    of ``ranks`` joined as each rank in turn, fake tensors, ``skip_data``: the storages'
    records are laid out, their bytes never written). With ``data``, real tensors: each
    rank's rows of :func:`tensor_values` (for shapes a test converts). ``files``: only the
    first ranks' files (each still names every rank: one file of thousands measured)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.makedirs(out, exist_ok=True)
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    tensors = entries(layers, model)
    shared: dict[tuple, dict] = {}  # ShardedTensor: what every rank's file repeats, built once
    for rank in range(ranks if files is None else min(files, ranks)):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
        try:
            mesh = None
            if kind == "dtensor":
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh("cpu", (ranks,))
            with contextlib.nullcontext() if data else FakeTensorMode():
                state: dict = {}
                for index, (_, path, shape, dtype) in enumerate(tensors):
                    start, length = chunk_rows(shape[0], rank, ranks)
                    if data:
                        local = tensor_values(index, shape, dtypes[dtype])[start : start + length]
                        local = local.clone()
                    else:
                        local = torch.empty((length, *shape[1:]), dtype=dtypes[dtype])
                    if kind == "dtensor":
                        value = _dtensor(local, mesh, shape)
                    else:
                        value = _sharded(local, shape, rank, ranks, shared.setdefault(path, {}))
                    node = state
                    for part in path[:-1]:
                        node = node.setdefault(part, {})
                    node[path[-1]] = value
                state["optim"]["param_groups"] = [
                    {k[-1]: v for k, v in param_groups(layers, model).items()}
                ]
                tmp = os.path.join(out, f".ep0-rank{rank}.pt.tmp")
                with (
                    contextlib.nullcontext()
                    if data
                    else torch.serialization.skip_data(materialize_fake_tensors=True)
                ):
                    torch.save(state, tmp)
            os.replace(tmp, os.path.join(out, f"ep0-rank{rank}.pt"))
        finally:
            dist.destroy_process_group()
        if rank % 32 == 0:
            print(f"  rank {rank}", file=sys.stderr, flush=True)


def _dtensor(local, mesh, shape):
    import torch
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def _sharded(local, shape, rank, ranks, shared: dict):
    """FSDP1's ``SHARDED_STATE_DICT``: every rank's file names every rank's shard.

    That list (the ``ShardedTensorMetadata``) and the sharding spec torch infers from it
    are the same in every rank's file: they are built, and checked by torch's own
    constructor, once per tensor (in ``shared``, the first rank's), and every other
    rank's ShardedTensor is made of the same objects and its own local shard, as that
    constructor makes it but without checking every rank's shards against all the
    others again (at 256 ranks: 256 x 256 shards per tensor per file, the ~40 minutes
    this generator took before). The pickled bytes are the same."""
    import torch
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    if not shared:
        shards_md = []
        for r in range(ranks):
            s, n = chunk_rows(shape[0], r, ranks)
            shards_md.append(
                ShardMetadata([s, *[0] * (len(shape) - 1)], [n, *shape[1:]], f"rank:{r}/cpu")
            )
        props = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False)
        meta = ShardedTensorMetadata(shards_md, torch.Size(shape), props)
        own = [Shard(local, shards_md[rank])]
        tensor = ShardedTensor._init_from_local_shards_and_global_metadata(own, meta)
        shared.update(meta=meta, spec=tensor.sharding_spec())
        return tensor
    meta, props = shared["meta"], shared["meta"].tensor_properties
    tensor = ShardedTensor.__new__(
        ShardedTensor,
        shared["spec"],
        meta.size,
        dtype=props.dtype,
        layout=props.layout,
        pin_memory=props.pin_memory,
        requires_grad=props.requires_grad,
    )
    tensor._local_shards = [Shard(local, meta.shards_metadata[rank])]
    tensor._prepare_init()
    tensor._post_init()
    return tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="70b", help="the model's shape")
    parser.add_argument("--layers", type=int, help="fewer layers (default: the shape's)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-rank", choices=["dtensor", "sharded"])
    parser.add_argument("--fresh-keys", action="store_true", help="a key string per chunk")
    parser.add_argument(
        "--data", action="store_true", help="per-rank: real tensors (each rank's rows written)"
    )
    parser.add_argument("--files", type=int, help="per-rank: only the first FILES ranks' files")
    parser.add_argument(
        "--chunk-zips",
        choices=["none", "model", "all"],
        default="none",
        help="write each chunk's torch.save records around its (sparse) bytes, for the "
        "model's tensors or all: a folder that converts (default: no byte, inspect only)",
    )
    parser.add_argument(
        "--variant", choices=VARIANTS, default="torch", help="as another writer lays it out"
    )
    args = parser.parse_args()
    model = SHAPES[args.shape]
    layers = model["layers"] if args.layers is None else args.layers
    gc.disable()  # millions of long-lived objects: the collector's passes would be most of it
    t0 = time.perf_counter()
    if args.per_rank:
        build_per_rank(args.out, args.ranks, layers, args.per_rank, model, args.data, args.files)
    else:
        build_dcp(
            args.out, args.ranks, layers, args.fresh_keys, model, args.chunk_zips, args.variant
        )
    print(f"{args.out}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    os._exit(0)  # freeing millions of objects one by one would take minutes: all written


if __name__ == "__main__":
    main()
