"""DeepSpeed ZeRO-1/2/3 and universal checkpoints, against DeepSpeed's own consolidation.

fixtures/deepspeed/ was written by DeepSpeed 0.19.8 (fixtures/make_deepspeed_fixtures.py):
``zeroN/`` is the run folder, ``zeroN_fp32.pt`` what ``get_fp32_state_dict_from_zero_checkpoint``
gives, ``zeroN_optim.pt`` the live optimizer's state gathered per parameter.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import FIXTURES, assert_identical, check_error, run_cli, small_state_dict
from helpers_deepspeed import write_zero_tag
from payloads import Reduce, write_malicious_zip
from safetensors.torch import load_file

import ckpttool
from ckpttool.formats.deepspeed.flat import blocks
from ckpttool.writers import raw_parts

DS = FIXTURES / "deepspeed"
STAGES = (1, 2, 3)
TRAINED = [
    "embed.weight",
    "fc1.weight",
    "fc2.weight",
    "fc1.bias",
    "norm.weight",
    "norm.bias",
    "fc2.bias",
]  # param_shapes order: group 0 (decay), group 1 (no decay)
MODEL_KEYS = [
    "scale",
    "embed.weight",
    "frozen.weight",
    "frozen.bias",
    "fc1.weight",
    "fc1.bias",
    "norm.weight",
    "norm.bias",
    "fc2.weight",
    "fc2.bias",
    "head.weight",
]


def truth(stage):
    return torch.load(DS / f"zero{stage}_fp32.pt", weights_only=True)


def optim_truth(stage):
    return torch.load(DS / f"zero{stage}_optim.pt", weights_only=True)


@pytest.mark.parametrize("stage", STAGES)
def test_fp32_weights_are_deepspeeds_own_consolidation(stage):
    """Run folder (follows ``latest``) and tag folder give zero_to_fp32's state dict,
    bitwise, in the model's own key order; the tied head is the embedding."""
    expected = truth(stage)
    for path in (DS / f"zero{stage}", DS / f"zero{stage}" / "global_step3"):
        sd = ckpttool.load(path)
        assert list(sd) == MODEL_KEYS
        for name, tensor in expected.items():
            assert_identical(sd[name], tensor)
        assert sd["fc1.weight"].dtype == torch.float32  # the masters, not the bf16 states
        assert torch.equal(sd["head.weight"], sd["embed.weight"])
    if stage == 1:
        # ZeRO-1 records no frozen_param_shapes and zero_to_fp32 drops the frozen layer;
        # the model states hold it whole, as stored (bf16)
        assert sorted(set(MODEL_KEYS) - set(expected)) == ["frozen.bias", "frozen.weight"]
        stored = ckpttool.load(DS / "zero1", select="model_states.module")
        assert_identical(sd["frozen.weight"], stored["frozen.weight"])
        assert sd["frozen.weight"].dtype == torch.bfloat16
    else:
        assert sorted(expected) == sorted(MODEL_KEYS)


@pytest.mark.parametrize("stage", STAGES)
def test_adam_moments_per_parameter_name_are_the_live_optimizers(stage):
    full = ckpttool.load(DS / f"zero{stage}", select="all")
    optimizer = full["optimizer"]
    assert list(optimizer["state"]) == TRAINED
    for name, own in optim_truth(stage).items():
        state = optimizer["state"][name]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
        assert_identical(state["exp_avg"], own["exp_avg"])
        assert_identical(state["exp_avg_sq"], own["exp_avg_sq"])
        assert_identical(full["module"][name], own["fp32"])
        assert state["step"].item() == 3.0
    groups = optimizer["param_groups"]
    assert [g["params"] for g in groups] == [TRAINED[:3], TRAINED[3:]]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert optimizer["zero_stage"] == stage
    assert full["model_states"]["global_steps"] == 3


@pytest.mark.parametrize("stage", STAGES)
def test_inspect_shows_stage_full_shapes_and_dtypes(stage):
    proc = run_cli("inspect", DS / f"zero{stage}", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["format"] == "deepspeed" and report["world_size"] == 2
    assert report["model_key"] == ["module"] and report["prefix"] is None
    model = {t["key"][1]: t for t in report["tensors"] if t["key"][0] == "module"}
    assert list(model) == MODEL_KEYS
    assert model["fc1.weight"]["shape"] == [7, 6] and model["fc1.weight"]["dtype"] == "float32"
    assert model["fc1.weight"]["nbytes"] == 7 * 6 * 4
    assert report["num_params"] == sum(truth(3)[k].numel() for k in MODEL_KEYS)
    values = {tuple(v["key"]): v["value"] for v in report["values"]}
    assert values[("optimizer", "zero_stage")] == stage
    assert report["dangerous"] == []
    assert "deepspeed.runtime.fp16.loss_scaler.LossScaler" in report["globals"]
    names = [os.path.basename(f) for f in report["files"]]
    assert names[0].endswith("mp_rank_00_model_states.pt")
    assert names[-2:] == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]


@pytest.mark.parametrize("stage", STAGES)
def test_convert_writes_the_fp32_weights_or_the_dtype_asked(tmp_path, stage):
    out = tmp_path / "model.safetensors"
    proc = run_cli("convert", DS / f"zero{stage}", "--to", "safetensors", "-o", out, "--quiet")
    assert proc.returncode == 0, proc.stderr
    written = load_file(out)
    assert list(written) == MODEL_KEYS
    for name, tensor in truth(stage).items():
        assert_identical(written[name], tensor)
    half = tmp_path / "half.pt"
    proc = run_cli("convert", DS / f"zero{stage}", "--to", "pt", "--dtype", "bfloat16", "-o", half)
    assert proc.returncode == 0, proc.stderr
    cast = torch.load(half, weights_only=True)
    assert_identical(cast["fc2.weight"], truth(stage)["fc2.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("stage", STAGES)
def test_merge_writes_the_whole_state_with_moments_per_name(tmp_path, stage):
    out = tmp_path / "merged.pt"
    proc = run_cli("merge", DS / f"zero{stage}", "-o", out, "--quiet")
    assert proc.returncode == 0, proc.stderr
    merged = torch.load(out, weights_only=True)
    assert list(merged) == ["module", "optimizer", "model_states"]
    for name, tensor in truth(stage).items():
        assert_identical(merged["module"][name], tensor)
    for name, own in optim_truth(stage).items():
        assert_identical(merged["optimizer"]["state"][name]["exp_avg"], own["exp_avg"])
        assert_identical(merged["optimizer"]["state"][name]["exp_avg_sq"], own["exp_avg_sq"])
    stored = merged["model_states"]["module"]["fc1.weight"]
    assert stored.dtype == torch.bfloat16
    assert stored.shape == ((0,) if stage == 3 else (7, 6))  # ZeRO-3: the placeholder
    # ckpttool reads its own output as the same model
    assert run_cli("diff", DS / f"zero{stage}", out).returncode == 0


@pytest.mark.parametrize("stage", (2, 3))
def test_diff_against_zero_to_fp32_output_is_equal(stage):
    proc = run_cli("diff", DS / f"zero{stage}", DS / f"zero{stage}_fp32.pt")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("stage", (2, 3))
def test_universal_checkpoint_reads_as_one_checkpoint(stage):
    folder = DS / f"zero{stage}" / "global_step3_universal"
    ckpt = ckpttool.read(folder)
    assert ckpt.format == "deepspeed" and ckpt.world_size == 2
    full = ckpttool.load(folder, select="all")
    assert list(full["module"]) == MODEL_KEYS
    for name, tensor in truth(stage).items():
        if stage == 2 and name.startswith("frozen."):
            # ds_to_universal --inject_missing_state writes them in fp32
            assert_identical(full["module"][name], tensor.float())
        else:
            assert_identical(full["module"][name], tensor)
    for name, own in optim_truth(stage).items():
        assert_identical(full["optimizer"]["state"][name]["exp_avg"], own["exp_avg"])
        assert_identical(full["optimizer"]["state"][name]["exp_avg_sq"], own["exp_avg_sq"])
    groups = full["optimizer"]["param_groups"]
    assert [g["params"] for g in groups] == [TRAINED[:3], TRAINED[3:]]
    if stage == 3:
        assert run_cli("diff", DS / "zero3", folder).returncode == 0


@pytest.mark.parametrize("stage", (2, 3))
@pytest.mark.parametrize("world", (1, 3, 4))
def test_partitions_over_any_world_size(tmp_path, stage, world):
    """Odd sizes over 1, 3 and 4 ranks (parameters split mid-row between ranks, a rank
    holding nothing of the last one); an int buffer keeps its dtype."""
    g = torch.Generator().manual_seed(world)
    sd = {
        "a.weight": torch.randn(5, 3, generator=g),
        "conv.weight": torch.randn(2, 3, 2, 2, generator=g),
        "b.bias": torch.randn(1, generator=g),
        "bn.num_batches_tracked": torch.tensor(7),
    }
    moments = write_zero_tag(
        tmp_path / "tag", sd, stage=stage, world=world, buffers=("bn.num_batches_tracked",)
    )
    full = ckpttool.load(tmp_path / "tag", select="all")
    assert list(full["module"]) == list(sd)
    for name, tensor in sd.items():
        assert_identical(full["module"][name], tensor)
    for name, own in moments.items():
        assert_identical(full["optimizer"]["state"][name]["exp_avg"], own["exp_avg"])
        assert_identical(full["optimizer"]["state"][name]["exp_avg_sq"], own["exp_avg_sq"])


def test_rebuilt_tensors_stream_from_the_partitions():
    """Written without torch: the output bytes are runs of the stored partitions."""
    ckpt = ckpttool.read(DS / "zero3")
    leaf = ckpt.root["module"]["fc1.weight"]
    parts = raw_parts(leaf, None)
    assert parts is not None and sum(p.numel for p in parts) == 42
    assert {p.storage.source.path for p in parts} == {
        str(DS / "zero3" / "global_step3" / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        for r in (0, 1)
    }


@pytest.mark.parametrize(
    "shape,start,count,expected",
    [
        ((4, 3), 0, 12, [((0, 0), (4, 3), 0)]),
        ((4, 3), 2, 8, [((0, 2), (1, 1), 0), ((1, 0), (2, 3), 1), ((3, 0), (1, 1), 7)]),
        (
            (2, 2, 3),
            4,
            6,
            [((0, 1, 1), (1, 1, 2), 0), ((1, 0, 0), (1, 1, 3), 2), ((1, 1, 0), (1, 1, 1), 5)],
        ),
        ((5,), 1, 0, []),
    ],
)
def test_a_run_of_elements_is_cut_into_rectangular_blocks(shape, start, count, expected):
    assert blocks(shape, start, count) == expected


def _copy(tmp_path, stage):
    run = tmp_path / f"zero{stage}"
    shutil.copytree(DS / f"zero{stage}", run)
    return run


@pytest.mark.parametrize(
    "stage,remove,message",
    [
        (
            3,
            "global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "missing: the optimizer states of rank 1 of 2 (incomplete checkpoint?)",
        ),
        (
            2,
            "global_step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "missing: the optimizer states of rank 0 (incomplete checkpoint?)",
        ),
        (
            2,
            "global_step3/mp_rank_00_model_states.pt",
            "missing: the model states of rank 0 (incomplete checkpoint?)",
        ),
        (
            3,
            "global_step3/zero_pp_rank_1_mp_rank_00_model_states.pt",
            "missing: the model states of rank 1 (incomplete checkpoint?)",
        ),
        (
            2,
            "global_step3_universal/zero/fc1.weight/fp32.pt",
            "missing: fp32 of parameter 'fc1.weight' (incomplete checkpoint?)",
        ),
        (
            3,
            "global_step3_universal/zero/norm.bias/exp_avg_sq.pt",
            "missing: exp_avg_sq of parameter 'norm.bias' (incomplete checkpoint?)",
        ),
    ],
)
@pytest.mark.parametrize("command", ["convert", "merge", "inspect"])
def test_a_missing_file_is_named_and_nothing_is_written(tmp_path, stage, remove, message, command):
    run = _copy(tmp_path, stage)
    missing = run / remove
    missing.unlink()
    folder = run / remove.split("/")[0]
    target = folder if "universal" in remove else run
    out = tmp_path / "out"
    args = {"convert": ["--to", "safetensors", "-o", out], "merge": ["-o", out], "inspect": []}
    proc = run_cli(command, target, *args[command])
    line = check_error(proc, 2)
    assert line == f"ckpttool: error: {missing}: {message}"
    assert not out.exists()


def test_a_universal_checkpoint_without_a_parameter_folder(tmp_path):
    folder = _copy(tmp_path, 3) / "global_step3_universal"
    shutil.rmtree(folder / "zero" / "fc2.weight")
    out = tmp_path / "out.pt"
    line = check_error(run_cli("merge", folder, "-o", out), 2)
    assert line == (
        f"ckpttool: error: {folder / 'zero' / 'fc2.weight' / 'fp32.pt'}: missing: fp32 of "
        "parameter 'fc2.weight' (incomplete checkpoint?)"
    )
    assert not out.exists()


def test_partitions_that_do_not_hold_the_parameters_are_refused(tmp_path):
    sd = {"w": torch.arange(10.0).reshape(2, 5)}
    write_zero_tag(tmp_path / "tag", sd, stage=3, world=2)
    optim = tmp_path / "tag" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = torch.load(optim, weights_only=True)
    state["optimizer_state_dict"]["fp32_flat_groups"][0] = torch.zeros(3)
    torch.save(state, optim)
    line = check_error(run_cli("inspect", tmp_path / "tag"), 2)
    assert line == (
        f"ckpttool: error: {tmp_path / 'tag'}: rank 1's flat groups differ in size from rank 0's"
    )


def test_a_dangerous_global_in_a_ranks_optimizer_states_is_refused(tmp_path):
    run = _copy(tmp_path, 2)
    optim = run / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    write_malicious_zip(optim, Reduce(os.system, ("echo owned",)))
    out = tmp_path / "out.safetensors"
    proc = run_cli("convert", run, "--to", "safetensors", "-o", out)
    check_error(proc, 3, "posix.system", str(optim))
    assert "owned" not in proc.stdout and not out.exists()


def test_a_stage_0_folder_reads_as_its_model_states(tmp_path):
    """Without ZeRO the model states hold the weights and the optimizer whole."""
    sd = {"fc.weight": torch.randn(3, 2), "fc.bias": torch.randn(3)}
    optimizer = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"params": [0]}]}
    states = {"module": sd, "optimizer": optimizer, "global_steps": 4, "ds_version": "0.19.8"}
    tag = tmp_path / "run" / "global_step4"
    tag.mkdir(parents=True)
    torch.save(states, tag / "mp_rank_00_model_states.pt")
    (tmp_path / "run" / "latest").write_text("global_step4")
    ckpt = ckpttool.read(tmp_path / "run")
    assert ckpt.format == "deepspeed" and ckpt.files == [str(tag / "mp_rank_00_model_states.pt")]
    loaded = ckpttool.load(tmp_path / "run")
    assert list(loaded) == list(sd)
    for name, tensor in sd.items():
        assert_identical(loaded[name], tensor)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("param_shapes", 5, "the model states hold no param_shapes (not a ZeRO checkpoint?)"),
        ("param_shapes", [{"w": (2, -5)}], "corrupt shape recorded for 'w': (2, -5)"),
        ("frozen_param_shapes", {"f": "x"}, "corrupt shape recorded for 'f': 'x'"),
        ("buffer_names", 3, None),  # ignored: no buffer is taken
        ("shared_params", {"alias": ["w"]}, None),  # ignored: names no tensor
    ],
)
def test_garbled_model_states_are_one_line_or_ignored(tmp_path, field, value, message):
    sd = {"w": torch.arange(10.0).reshape(2, 5)}
    tag = tmp_path / "tag"
    write_zero_tag(tag, sd, stage=2, world=2)
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    states[field] = value
    torch.save(states, tag / "mp_rank_00_model_states.pt")
    proc = run_cli("convert", tag, "--to", "safetensors", "-o", tmp_path / "out.safetensors")
    if message is None:
        assert proc.returncode == 0, proc.stderr
        assert_identical(load_file(tmp_path / "out.safetensors")["w"], sd["w"])
    else:
        assert check_error(proc, 2) == f"ckpttool: error: {tag}: {message}"
        assert not (tmp_path / "out.safetensors").exists()


def test_a_universal_parameter_name_never_leads_outside_its_folder(tmp_path):
    folder = _copy(tmp_path, 3) / "global_step3_universal"
    for rank in (0, 1):
        path = folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        states = torch.load(path, weights_only=True)
        states["param_shapes"][0]["../../zero3_fp32"] = torch.Size([4])
        torch.save(states, path)
    line = check_error(run_cli("inspect", folder), 2)
    assert line == (
        f"ckpttool: error: {folder}: parameter name '../../zero3_fp32' cannot name a folder "
        "of zero/"
    )


def _deepspeed_tag(folder, sd, mp_ranks=1, dp_ranks=2):
    """A DeepSpeed ZeRO-2 tag folder: model states beside each rank's optimizer states."""
    write_zero_tag(
        folder, sd, world=dp_ranks, buffers=("bn.num_batches_tracked",), mp_ranks=mp_ranks
    )


def test_deepspeed_folders_read_their_model_states(tmp_path):
    """A run folder follows its ``latest`` file to the tag folder, whose fp32 weights are
    rebuilt from the ranks' partitions (as zero_to_fp32.py finds them); a pytorch_model.bin
    written beside ``latest`` comes first."""
    sd = small_state_dict()
    run = tmp_path / "checkpoints"
    _deepspeed_tag(run / "global_step10", {k: v + 1 for k, v in sd.items()})
    _deepspeed_tag(run / "global_step20", sd)
    (run / "latest").write_text("global_step20")
    for folder in (run, run / "global_step20"):
        ckpt = ckpttool.read(folder)
        assert ckpt.format == "deepspeed"
        assert ckpt.files[0] == str(run / "global_step20" / "mp_rank_00_model_states.pt")
        assert_identical(ckpttool.load(folder), sd)
    torch.save({k: v * 2 for k, v in sd.items()}, run / "pytorch_model.bin")
    assert ckpttool.read(run).files == [str(run / "pytorch_model.bin")]

    (run / "latest").write_text("../elsewhere")  # only a folder beside it
    (run / "pytorch_model.bin").unlink()
    # the tag folders are named, never one of them picked (`inspect` lists them)
    with pytest.raises(ckpttool.CkptError, match=r"holds 2 checkpoints \(global_step10/, global"):
        ckpttool.read(run)


def test_deepspeed_model_parallel_states_are_refused_by_name(tmp_path):
    folder = tmp_path / "global_step5"
    _deepspeed_tag(folder, small_state_dict(), mp_ranks=2)
    with pytest.raises(ckpttool.CkptError, match="model states of several model-parallel ranks"):
        ckpttool.read(folder)
    assert ckpttool.read(folder / "mp_rank_01_model_states.pt").format == "torch-zip"
