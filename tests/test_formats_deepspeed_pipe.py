"""DeepSpeed pipeline-parallel checkpoints (issue 45): each layer's ``state_dict()`` in
``layer_NN-model_states.pt``, read as one model under ``PipelineModule``'s own names.

The fixture is DeepSpeed 0.19's own save (``fixtures/make_deepspeed_pipe_fixtures.py``:
a ``PipelineModule`` of 5 layers over 2 stages on gloo, ZeRO-1); ``pipe_truth.pt`` holds
every layer's ``state_dict()`` gathered from the live stages.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import check_error, completed, fixture_path, run_many

import ckpttool

RUN = fixture_path("deepspeed") / "pipe"
TAG = RUN / "global_step2"


def test_the_layers_are_the_live_pipelines_layers():
    truth = torch.load(RUN.parent / "pipe_truth.pt", weights_only=True)["model"]
    ckpt = ckpttool.read(RUN)  # the run folder: its `latest` names the tag
    assert (ckpt.format, ckpt.world_size, ckpt.dangerous) == ("deepspeed", 2, [])
    model = ckpttool.load(RUN)
    assert list(model) == list(truth)
    for name, want in truth.items():
        assert torch.equal(model[name], want), name


def test_merge_keeps_each_stages_states_as_stored(tmp_path):
    (done,) = run_many([["merge", TAG, "-o", tmp_path / "all.pt"]])
    assert done["code"] == 0, done["stderr"]
    whole = torch.load(tmp_path / "all.pt", weights_only=True)
    assert sorted(whole) == ["model_states", "module", "optimizer_states"]
    assert sorted(whole["model_states"]) == ["mp_rank_00_model_states", "mp_rank_01_model_states"]
    assert sorted(whole["optimizer_states"]) == [
        "zero_pp_rank_0_mp_rank_00_optim_states",
        "zero_pp_rank_0_mp_rank_01_optim_states",
    ]


def _tensor_parallel(tag):
    (tag / "layer_01-model_states.pt").rename(tag / "layer_01-model_01-model_states.pt")


def _missing_layer(tag):
    (tag / "layer_02-model_states.pt").unlink()


def _wrong_shape(tag):
    torch.save({"weight": torch.ones(3)}, tag / "layer_03-model_states.pt")
    torch.save({"weight": torch.ones(3, 3)}, tag / "layer_04-model_states.pt")
    state = torch.load(tag / "layer_01-model_states.pt", weights_only=True)
    state["fc.weight"] = torch.ones(2, 6)
    torch.save(state, tag / "layer_01-model_states.pt")


BROKEN = {
    "tensor parallel": (_tensor_parallel, "layer files of several tensor-parallel ranks "
                        "(layer_01-model_01-model_states.pt)"),
    "missing layer": (_missing_layer, "without parameter '2.fc.weight', which "
                      "mp_rank_00_model_states records (a layer file missing?)"),
    "wrong shape": (_wrong_shape, "layer tensor '1.fc.weight' [2, 6], which "
                    "mp_rank_00_model_states records as [6, 6]"),
}  # fmt: skip


@pytest.mark.parametrize("case", BROKEN)
def test_layer_files_the_run_contradicts_are_refused_naming_them(tmp_path, case):
    tag = tmp_path / "global_step2"
    shutil.copytree(TAG, tag)
    breaks, needle = BROKEN[case]
    breaks(tag)
    argvs = [["inspect", tag], ["convert", tag, "--to", "safetensors", "-o", tmp_path / "o" / "m"]]
    for argv, done in zip(argvs, run_many(argvs), strict=True):
        check_error(completed(argv, done), 2, needle)
    assert not (tmp_path / "o").exists()
