"""What each rank computes before and while it writes units, at any input size: the
work's key names where every block's bytes are without reading any of them, and a
tensor's blocks are resolved once per tensor, not once per unit."""

from __future__ import annotations

import pytest
from helpers import FIXTURES

from ckpttool.api import flatten_tensors, read
from ckpttool.distributed import units
from ckpttool.writers.output_file import OutputFile
from ckpttool.writers.plan import WriteOptions, allocate, file_path
from ckpttool.writers.safetensors import plan as plan_safetensors

INPUTS = {
    "dcp": ["counting://" + str(FIXTURES / "dcp")],
    "per-rank": [f"counting://{FIXTURES}/fsdp_uneven/model-rank{r}.pt" for r in range(3)],
}


@pytest.mark.parametrize("name", list(INPUTS))
def test_the_work_key_reads_no_block(counting_source, name):
    """The key (plan_digest) of a plan of sharded tensors: not a byte read for it (it
    used to open every DCP chunk's zip, every other rank file: 12 minutes of every
    rank's CPU for a 405B folder saved by 2048 ranks)."""
    ckpt = read(INPUTS[name])
    plan = plan_safetensors(flatten_tensors(ckpt.root, ""), WriteOptions())
    assert any(p.leaf is not None and p.leaf.sharded for p in plan.files[0].pieces)
    before = list(counting_source.reads)
    digest = units.plan_digest(plan, 4096)
    assert counting_source.reads == before
    # the same plan, the same key; another unit size, another
    assert units.plan_digest(plan, 4096) == digest != units.plan_digest(plan, 8192)


def test_blocks_are_resolved_once_per_tensor_not_per_unit(tmp_path, monkeypatch):
    """Tiny units, so that every tensor spans several: each sharded tensor's parts are
    resolved once, and the file is the single-process one."""
    from ckpttool.writers.plan import write_plan

    calls: list[int] = []
    resolve = units.raw_parts

    def counted(leaf, cast):
        calls.append(id(leaf))
        return resolve(leaf, cast)

    monkeypatch.setattr(units, "raw_parts", counted)
    ckpt = read([str(FIXTURES / "dcp")])
    plan = plan_safetensors(flatten_tensors(ckpt.root, ""), WriteOptions())
    want = tmp_path / "want.safetensors"
    write_plan(plan, str(want))
    target = str(tmp_path / "got.safetensors")
    allocate(plan, target)
    cut = units.plan_units(plan, 64)
    tensors = [p for p in plan.files[0].pieces if p.leaf is not None]
    assert len(cut) > 2 * len(tensors)  # most tensors span several units
    for unit in cut:
        with OutputFile(file_path(target, plan.files[unit.file]), offset=unit.start) as out:
            units.write_unit(plan, unit, out)
    assert sorted(calls) == sorted(id(p.leaf) for p in tensors)
    with open(target, "rb") as got:
        assert got.read() == want.read_bytes()
