"""writers/parts.py without a store: a planned file cut into parts, written as runs of
parts in any order (as ranks would), the parts whose CRC fields lie in other runs
written again with every run's CRCs: the same bytes as the local output, and only the
parts each run should send."""

from __future__ import annotations

import threading

import pytest
import torch

from ckpttool import convert as convert_module
from ckpttool.api.reading import flatten_tensors, read, select_node
from ckpttool.targets.s3_parts import part_count, part_size_for, write_parts
from ckpttool.writers import writer_for
from ckpttool.writers.plan import WriteOptions


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parts")
    gen = torch.Generator().manual_seed(1)
    sd = {f"w{i}": torch.randn(17 * i + 1, 33, generator=gen) for i in range(8)}
    sd["empty"] = torch.empty(0)
    sd["big"] = torch.randn(300, 100, generator=gen)  # spans several parts
    sd["half"] = torch.randn(40, 40, generator=gen).half()
    torch.save(sd, folder / "in.pt")
    return folder / "in.pt"


def plan_of(ckpt, to: str, **options):
    _, node = select_node(read(str(ckpt)), "auto", "auto")
    opts = WriteOptions(location="cpu", metadata={"source": ckpt.name}, **options)
    return writer_for(to).plan(flatten_tensors(node), opts)


class Parts:
    """A store of parts: the last bytes sent for each number win, as in S3."""

    def __init__(self) -> None:
        self.parts: dict[int, bytes] = {}
        self.sends: list[int] = []
        self.lock = threading.Lock()

    def send(self, number: int, data: memoryview) -> int:
        with self.lock:
            self.parts[number] = bytes(data)
            self.sends.append(number)
        return number

    def joined(self) -> bytes:
        return b"".join(self.parts[n] for n in sorted(self.parts))


@pytest.mark.parametrize("to", ["pt", "safetensors", "dcp"])
@pytest.mark.parametrize("run_parts", [1, 3, None])
def test_runs_give_the_local_bytes(ckpt, tmp_path, to, run_parts):
    plan = plan_of(ckpt, to)
    local = tmp_path / "local"
    convert_module.convert([str(ckpt)], to, str(local))
    part = 4096
    for file in plan.files:
        want = (local / file.name).read_bytes() if file.name else local.read_bytes()
        count = part_count(file.size, part)
        store = Parts()
        step = run_parts or count
        runs = [(a, min(count, a + step - 1)) for a in range(1, count + 1, step)]
        crcs: dict[int, int] = {}
        deferred: list[int] = []
        for first, last in reversed(runs):  # any order
            result = write_parts(file, part, store.send, first=first, last=last)
            assert set(result.sent) | set(result.deferred) == set(range(first, last + 1))
            crcs.update(result.crcs)
            deferred += result.deferred
        if run_parts is None or to == "safetensors" or file.name == ".metadata":
            assert deferred == []  # one run, or nothing built from CRCs
        for number in deferred:
            again = write_parts(file, part, store.send, first=number, last=number, crcs=crcs)
            assert again.deferred == [] and list(again.sent) == [number]
        assert store.joined() == want
        assert sorted(store.sends) == sorted([*range(1, count + 1)])  # each part once


def test_part_size_for():
    assert part_size_for(10) == 8 << 20
    assert part_size_for(10, 1 << 16) == 1 << 16
    assert part_size_for(200 << 30) == 21 << 20  # 10,000 parts at most, a whole MiB
    assert part_count(0, 8) == 1 and part_count(17, 8) == 3
    with pytest.raises(Exception, match="cannot be one S3 object"):
        part_size_for(10_000 * (5 << 30) + 1)
