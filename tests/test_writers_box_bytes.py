"""A sharded tensor split along other dims than its first (tensor-parallel columns, 2-D
DCP chunks, a TP x PP merge) is written a window of rows at a time from its blocks'
stored bytes (``writers.leaf_bytes.box_bytes``), never the whole tensor in memory: the
same bytes as torch assembling it, for any byte range a unit asks for, with a cast too."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import save_file

import ckpttool
from ckpttool.dtypes import dtype as dtype_named
from ckpttool.errors import CkptError
from ckpttool.tree import Shard, ShardedRef
from ckpttool.writers import box_bytes, box_layout, iter_chunks, leaf_bytes

# shape -> the block boxes (offsets, sizes) that tile it
LAYOUTS = {
    "columns": ((6, 10), [((0, 0), (6, 4)), ((0, 4), (6, 4)), ((0, 8), (6, 2))]),
    "grid": (
        (5, 6),
        [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (3, 3)), ((2, 3), (3, 3))],
    ),
    "3-d": ((4, 3, 6), [((0, 0, 0), (4, 3, 2)), ((0, 0, 2), (4, 3, 4))]),
    "middle dim": ((3, 4, 2), [((0, 0, 0), (3, 1, 2)), ((0, 1, 0), (3, 3, 2))]),
}


def sharded(tmp_path, name, dtype=torch.float32):
    shape, boxes = LAYOUTS[name]
    whole = torch.randn(shape).to(dtype)
    blocks = {}
    for i, (offsets, sizes) in enumerate(boxes):
        index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        blocks[f"b{i}"] = whole[index].contiguous()
    save_file(blocks, tmp_path / "blocks.safetensors")
    refs = ckpttool.read(tmp_path / "blocks.safetensors").root
    shards = [Shard(o, n, refs[f"b{i}"], i) for i, (o, n) in enumerate(boxes)]
    leaf = ShardedRef(dtype_named(str(dtype).removeprefix("torch.")), shape, shards)
    return whole, leaf


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_range_is_the_assembled_tensors_bytes(tmp_path, monkeypatch, name):
    monkeypatch.setattr(leaf_bytes, "WINDOW_BYTES", 24)  # (windows of a row or two)
    whole, leaf = sharded(tmp_path, name)
    want = whole.contiguous().numpy().tobytes()
    boxes = box_layout(leaf)
    assert boxes is not None
    assert b"".join(iter_chunks(leaf, None)) == want
    rng = random.Random(name)
    for _ in range(40):
        start = rng.randrange(len(want))
        length = rng.randrange(1, len(want) - start + 1)
        got = b"".join(box_bytes(boxes, leaf, None, start, length))
        assert got == want[start : start + length], (start, length)


def test_a_cast_is_made_a_window_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(leaf_bytes, "WINDOW_BYTES", 40)
    whole, leaf = sharded(tmp_path, "grid")
    bf16 = dtype_named("bfloat16")
    want = whole.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    assert b"".join(iter_chunks(leaf, bf16)) == want
    boxes = box_layout(leaf)
    assert b"".join(box_bytes(boxes, leaf, bf16, 6, 30)) == want[6:36]


def test_blocks_that_leave_a_gap_are_refused(tmp_path):
    _, leaf = sharded(tmp_path, "columns")
    holed = ShardedRef(leaf.dtype, leaf.shape, list(leaf.shards)[:2])  # columns 8, 9 unheld
    with pytest.raises(CkptError, match=r"its blocks fill 192 of 240 bytes of rows 0..6"):
        b"".join(iter_chunks(holed, None))
