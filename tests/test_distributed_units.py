"""What each rank computes before and while it writes units, at any input size: the
work's key names where every block's bytes are without reading any of them, and a
tensor's blocks are resolved once per tensor, not once per unit."""

from __future__ import annotations

import pytest
from helpers import FIXTURES

from ckpttool.api import flatten_tensors, read
from ckpttool.targets import units
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


def test_a_unit_resolves_only_the_blocks_its_bytes_lie_in(tmp_path, monkeypatch):
    """Tiny units, so that most tensors span several: writing a unit resolves exactly
    the chunks its byte range overlaps (a unit of a tensor saved by 2048 ranks used to
    open all 2048 chunk zips), and the file is the single-process one."""
    from ckpttool.formats.dcp.chunks import DcpChunk
    from ckpttool.tree import sharding
    from ckpttool.writers.plan import write_plan

    resolved: list[object] = []
    resolve = DcpChunk.tensor_ref

    def recorded(self):
        resolved.append(self)
        return resolve(self)

    monkeypatch.setattr(DcpChunk, "tensor_ref", recorded)
    ckpt = read([str(FIXTURES / "dcp")])
    plan = plan_safetensors(flatten_tensors(ckpt.root, ""), WriteOptions())
    want = tmp_path / "want.safetensors"
    write_plan(plan, str(want))
    target = str(tmp_path / "got.safetensors")
    allocate(plan, target)
    cut = units.plan_units(plan, 64)
    sharded = [p for p in plan.files[0].pieces if p.leaf is not None and p.leaf.sharded]
    assert sharded and len(cut) > 2 * len(plan.files[0].pieces)
    for unit in cut:
        expected = set()
        for piece, start, length in units.pieces_in(plan.files[0], unit.start, unit.end):
            if piece.leaf is None or not piece.leaf.sharded:
                continue
            size = piece.leaf.dtype.itemsize
            for first, count, shard in sharding.flat_runs(piece.leaf):
                if first * size < start + length and start < (first + count) * size:
                    expected.add(id(shard.tensor))
        resolved.clear()
        with OutputFile(file_path(target, plan.files[unit.file]), offset=unit.start) as out:
            units.write_unit(plan, unit, out)
        assert {id(block) for block in resolved} == expected, unit
    with open(target, "rb") as got:
        assert got.read() == want.read_bytes()


def _plan_of(sizes: list[int]):
    from ckpttool.writers.plan import FilePlan, Plan

    return Plan([FilePlan(f"f{i}", size, []) for i, size in enumerate(sizes)])


@pytest.mark.parametrize(
    ("sizes", "want"),
    [
        ([0], 4 << 20),  # never under 4 MiB
        ([100 << 20], 4 << 20),
        ([1 << 30], 8 << 20),  # 1 GiB: 128 units, a slow rank's last one a small tail
        ([1 << 29, 1 << 29], 8 << 20),  # every file of the output counts
        ([(1 << 30) + 1], 9 << 20),  # rounded up to whole MiB (O_DIRECT alignment)
        ([8 << 30], 64 << 20),
        ([800 << 30], 64 << 20),  # never over 64 MiB
    ],
)
def test_the_unit_size_follows_the_output_size(monkeypatch, sizes, want):
    monkeypatch.delenv(units.UNIT_BYTES_ENV, raising=False)
    assert units.unit_bytes(_plan_of(sizes)) == want


def test_the_unit_size_variable_wins_and_is_checked(monkeypatch):
    monkeypatch.setenv(units.UNIT_BYTES_ENV, "4096")
    assert units.unit_bytes(_plan_of([1 << 30])) == 4096
    monkeypatch.setenv(units.UNIT_BYTES_ENV, "4MiB")  # one size parser: units as --max-shard-size
    assert units.unit_bytes(_plan_of([1 << 30])) == 4 << 20
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv(units.UNIT_BYTES_ENV, bad)
        with pytest.raises(units.CkptError, match="bad CKPTTOOL_UNIT_BYTES"):
            units.unit_bytes(_plan_of([1 << 30]))
