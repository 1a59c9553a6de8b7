"""OLMo-core checkpoints (issue 45): DCP folders whose ``.metadata`` pickles OLMo-core's
own ``_StorageInfo`` class, where generic DCP readers fail.

The fixture is OLMo-core 3.0's own save (``fixtures/make_olmo_core_fixtures.py``: an
FSDP2 model over 2 gloo ranks and its AdamW state, ``save_model_and_optim_state``);
``truth.pt`` is OLMo-core's own ``unshard_checkpoint`` of it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import fixture_path, run_many

import ckpttool
from ckpttool.formats.dcp import metadata as dcp_metadata
from ckpttool.formats.dcp import runs as dcp_runs
from ckpttool.tree import iter_tensors

STEP = fixture_path("olmo_core") / "step1"
OLMO_STORAGE_INFO = "olmo_core.distributed.checkpoint.filesystem._StorageInfo"


@pytest.fixture(scope="module")
def truth():
    return torch.load(STEP.parent / "truth.pt", weights_only=False)


def test_the_model_is_olmo_cores_own_unsharded_model(truth):
    ckpt = ckpttool.read(STEP)
    assert (ckpt.format, ckpt.world_size, ckpt.dangerous) == ("dcp", 2, [])
    assert OLMO_STORAGE_INFO in ckpt.globals and OLMO_STORAGE_INFO not in ckpt.unverified
    model = ckpttool.load(STEP)
    assert list(model) == list(truth["model"])
    for name, want in truth["model"].items():
        assert torch.equal(model[name], want), name


def test_the_bulk_reader_vouches_for_it_as_the_generic_reader_reads_it(monkeypatch):
    """The readers of plain ``.metadata`` files (the bulk reader here; the opcode walk of
    huge ones: test_formats_dcp_opcodes' ``olmo-core`` writer) read OLMo-core's class as
    torch's: the same chunks as the restricted unpickler's reading of the whole file."""
    bulk = dcp_metadata.read(str(STEP), str(STEP / ".metadata"), False)
    assert bulk is not None
    monkeypatch.setattr(dcp_runs, "read", lambda *args: None)
    monkeypatch.setattr(dcp_metadata, "read", lambda *args: None)
    generic = ckpttool.read(STEP)
    assert (bulk.globals, bulk.unverified) == (generic.globals, generic.unverified)

    def chunks(ckpt):
        return {
            key: (ref.dtype.name, tuple(ref.shape),
                  [(tuple(s.offsets), tuple(s.sizes), s.tensor.path, s.tensor.offset)
                   for s in ref.shards])
            for key, ref in iter_tensors(ckpt.root)
        }  # fmt: skip

    assert chunks(bulk) == chunks(generic)


def test_merge_writes_the_optimizer_state_olmo_core_unshards(tmp_path, truth):
    (done,) = run_many([["merge", STEP, "-o", tmp_path / "all.pt"]])
    assert done["code"] == 0, done["stderr"]
    merged = torch.load(tmp_path / "all.pt", weights_only=True)
    assert sorted(merged) == ["model", "optim"]
    state = truth["optim"]["state"]
    assert sorted(merged["optim"]["state"]) == sorted(state)
    for param, moments in state.items():
        for key, want in moments.items():
            assert torch.equal(merged["optim"]["state"][param][key], want), (param, key)
    assert merged["optim"]["param_groups"] == truth["optim"]["param_groups"]
