"""``dcp`` as ``HuggingFaceStorageWriter(save_distributed=True)`` writes it: safetensors only.

Each rank writes its own blocks to ``shard-{rank+1}-model-{k}-of-{n}.safetensors``, with
no ``.metadata`` and no index: each file's ``DCP_SHARDING_INFO`` metadata says where every
block it holds lies in its global tensor. As torch's ``HuggingFaceStorageReader`` does, a
global tensor ends where its farthest block ends; ckpttool also checks that the blocks
cover it exactly once (a missing rank's file leaves a hole). Given one of the files, the
folder is read: a block alone is not the tensor.
"""

from __future__ import annotations

import re

from ... import sources
from ...errors import CkptError
from ...tree import Checkpoint, Shard, ShardedRef, check_coverage
from ..safetensors_file import (
    DCP_SHARDING_KEY,
    dcp_saved_offsets,
    has_dcp_sharding,
    read_header,
    tensor_ref,
)
from ..safetensors_file import detect as is_safetensors

FORMAT = "dcp"
# torch.distributed.checkpoint._hf_utils.SHARDED_FILE_NAME
SHARD_FILE_RE = re.compile(r"^shard-(\d+)-model-\d+-of-\d+\.safetensors$")


def detect(path: str, head: bytes) -> bool:
    """A folder whose safetensors files are all DCP shard files, or one of those files."""
    if sources.isdir(path):
        names = [n for n in sources.listdir(path) if n.endswith(".safetensors")]
        shards = _shard_files(path)
        return bool(names) and len(shards) == len(names) and _written_by_dcp(list(shards))
    if not SHARD_FILE_RE.match(sources.basename(path)) or not is_safetensors(path, head):
        return False
    # its own metadata may be the damaged part: a sibling DCP wrote says what it is
    return _written_by_dcp([path]) or _written_by_dcp(
        list(_shard_files(sources.dirname(path) or "."))
    )


def _shard_files(folder: str) -> dict[str, int]:
    """The folder's files named as DCP names its shard files, with the number each name
    gives (from 1)."""
    found: dict[str, int] = {}
    for name in sources.listdir(folder):
        m = SHARD_FILE_RE.match(name)
        if m:
            found[sources.join(folder, name)] = int(m.group(1))
    return found


def _written_by_dcp(paths: list[str]) -> bool:
    for path in paths:
        try:
            if has_dcp_sharding(read_header(path)[0]):
                return True
        except (CkptError, OSError):  # read names what is wrong with it
            continue
    return False


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    folder = path if sources.isdir(path) else sources.dirname(path) or "."
    numbers = _shard_files(folder)
    files = list(numbers)
    blocks: dict[str, list[Shard]] = {}
    for file in files:
        header, data_start = read_header(file)
        data_len = sources.getsize(file) - data_start
        offsets = dcp_saved_offsets(header, file)
        if offsets is None:
            raise CkptError(
                f"no {DCP_SHARDING_KEY} in its metadata: its blocks cannot be placed", path=file
            )
        rank = numbers[file] - 1  # DCP numbers its shard files from 1
        for name, info in header.items():
            if name == "__metadata__":
                continue
            ref = tensor_ref(file, name, info, data_start, data_len)
            where = offsets.get(name)
            if where is None or len(where) != len(ref.shape):
                raise CkptError(
                    f"tensor {name!r} has no offsets of its rank in {DCP_SHARDING_KEY}",
                    path=file,
                )
            blocks.setdefault(name, []).append(Shard(where, ref.shape, ref, rank))
    world_size = max(numbers.values())
    root = {name: _global(name, shards, world_size) for name, shards in blocks.items()}
    return Checkpoint(format=FORMAT, files=files, root=root, world_size=world_size)


def _global(name: str, shards: list[Shard], world_size: int) -> ShardedRef:
    dtypes = {s.tensor.tensor_ref().dtype.name for s in shards}  # blocks are stored tensors
    if len(dtypes) > 1:
        raise CkptError(f"tensor {name!r}: its blocks have different dtypes {sorted(dtypes)}")
    shape = tuple(
        max(s.offsets[d] + s.sizes[d] for s in shards) for d in range(len(shards[0].sizes))
    )
    check_coverage(name, shape, shards)
    dtype = shards[0].tensor.tensor_ref().dtype
    return ShardedRef(dtype, shape, shards, kind="dcp", world_size=world_size)
