"""Framework run folders written by the frameworks themselves (fixtures/accelerate/,
fixtures/lightning/, fixtures/transformers/; fixtures/verl/ is verl's layout written with
torch): the model is
found by rule, the other parts come with ``--select all``, and the values equal what
the framework's own loader gave back (stored beside them as ``truth.pt``)."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from helpers import FIXTURES, assert_identical, check_error, run_cli
from safetensors.torch import save_file

import ckpttool

ACCELERATE = FIXTURES / "accelerate"
LIGHTNING = FIXTURES / "lightning"
VERL = FIXTURES / "verl"
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # the optimizer's order


def _truth(path):
    return torch.load(path, weights_only=False)  # our own fixture, written by the generator


# ------------------------------------------------------------------------ accelerate


@pytest.mark.parametrize(
    "kind, fmt, model_key",
    [
        ("fsdp1", "dcp", ["pytorch_model_fsdp_0", "model"]),
        ("fsdp2", "dcp", ["pytorch_model_fsdp_0", "model"]),
        ("ddp", "safetensors", ["model"]),
    ],
)
def test_accelerate_model_is_found_by_rule_and_equals_load_state(kind, fmt, model_key):
    state = ACCELERATE / kind / "state"
    truth = _truth(ACCELERATE / kind / "truth.pt")
    proc = run_cli("inspect", state, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["format"], report["model_key"]) == (fmt, model_key)
    assert report["world_size"] == (2 if fmt == "dcp" else None)
    model = ckpttool.load(state)
    assert sorted(model) == sorted(truth["model"])
    assert_identical(model, truth["model"], ordered=False, exact_types=False)


def test_accelerate_deepspeed_state_reads_the_engines_checkpoint(tmp_path):
    # accelerate's save_state under DeepSpeed: model.save_checkpoint(output_dir,
    # "pytorch_model"), DeepSpeed's tag folder and its latest, beside random_states_N.pkl
    state = tmp_path / "state"
    state.mkdir()
    shutil.copytree(FIXTURES / "deepspeed" / "zero2" / "global_step3", state / "pytorch_model")
    (state / "latest").write_text("pytorch_model")
    shutil.copy(ACCELERATE / "ddp" / "state" / "random_states_0.pkl", state)
    report = json.loads(run_cli("inspect", state, "--json").stdout)
    assert (report["format"], report["model_key"]) == ("deepspeed", ["pytorch_model", "module"])
    truth = torch.load(FIXTURES / "deepspeed" / "zero2_fp32.pt", weights_only=True)
    assert_identical(ckpttool.load(state), truth, ordered=False, exact_types=False)
    assert sorted(ckpttool.load(state, select="all")) == ["pytorch_model", "random_states_0"]


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2", "ddp"])
def test_accelerate_optimizer_scheduler_and_rng_come_with_select_all(kind):
    state = ACCELERATE / kind / "state"
    truth = _truth(ACCELERATE / kind / "truth.pt")["optimizer"]
    full = ckpttool.load(state, select="all")
    if kind == "ddp":
        assert sorted(full) == ["model", "optimizer", "random_states_0", "random_states_1",
                                "scheduler"]  # fmt: skip
        optim = {name: full["optimizer"]["state"][i] for i, name in enumerate(PARAMS)}
    else:
        assert sorted(full) == ["optimizer_0", "pytorch_model_fsdp_0", "random_states_0",
                                "random_states_1", "scheduler"]  # fmt: skip
        optim = full["optimizer_0"]["optimizer"]["state"]
    assert_identical(optim, truth, ordered=False, exact_types=False)
    # accelerate steps a prepared scheduler once per process: 2 steps x 2 processes
    assert full["scheduler"]["last_epoch"] == 4
    scheduler = torch.load(state / "scheduler.bin", weights_only=True)
    assert_identical(full["scheduler"], scheduler, ordered=False, exact_types=False)
    assert isinstance(full["random_states_1"]["torch_manual_seed"], torch.Tensor)


def test_accelerate_folder_diffs_equal_to_its_exported_model(tmp_path):
    # the report: convert said "no model state dict found", diff "only in B"
    out = tmp_path / "model.safetensors"
    state = ACCELERATE / "fsdp2" / "state"
    assert run_cli("convert", state, "--to", "safetensors", "-o", out).returncode == 0
    proc = run_cli("diff", state, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equal: 4 tensors" in proc.stdout


def test_accelerate_folder_without_a_model_names_the_candidates(tmp_path):
    state = tmp_path / "state"
    shutil.copytree(ACCELERATE / "fsdp1" / "state", state)
    shutil.rmtree(state / "pytorch_model_fsdp_0")
    out = tmp_path / "out.safetensors"
    proc = run_cli("convert", state, "--to", "safetensors", "-o", out)
    check_error(proc, 2, "accelerate save_state folder without a model",
                "pytorch_model_fsdp_0/, pytorch_model_fsdp.bin, model.safetensors, "
                "pytorch_model.bin")  # fmt: skip
    assert not out.exists()


def test_accelerate_folder_with_two_models_is_refused_by_name(tmp_path):
    state = tmp_path / "state"
    shutil.copytree(ACCELERATE / "ddp" / "state", state)
    shutil.copy(state / "model.safetensors", state / "model_1.safetensors")
    proc = run_cli("inspect", state)
    check_error(proc, 2, "several models (model.safetensors, model_1.safetensors)",
                "pass one of them")  # fmt: skip


def test_accelerate_full_state_dict_folder_reads_its_bin(tmp_path):
    # FSDP FULL_STATE_DICT: save_fsdp_model writes pytorch_model_fsdp.bin on rank 0
    state = tmp_path / "state"
    state.mkdir()
    truth = _truth(ACCELERATE / "fsdp1" / "truth.pt")
    torch.save(truth["model"], state / "pytorch_model_fsdp.bin")
    shutil.copy(ACCELERATE / "fsdp1" / "state" / "random_states_0.pkl", state)
    report = json.loads(run_cli("inspect", state, "--json").stdout)
    assert (report["format"], report["model_key"]) == ("torch-zip", ["pytorch_model_fsdp"])
    assert_identical(ckpttool.load(state), truth["model"], ordered=False, exact_types=False)


# ------------------------------------------------------------------------- Lightning


def test_lightning_sharded_merge_holds_what_its_consolidation_holds(tmp_path):
    folder = LIGHTNING / "fsdp" / "last.ckpt"
    truth = _truth(LIGHTNING / "fsdp" / "truth.pt")
    out = tmp_path / "merged.pt"
    proc = run_cli("merge", folder, "-o", out)
    assert proc.returncode == 0, proc.stderr
    merged = torch.load(out, weights_only=True)
    assert sorted(merged) == sorted(truth)
    for key in ("epoch", "global_step", "loops", "lr_schedulers", "hyper_parameters"):
        assert key in merged
    for key in truth:
        assert_identical(merged[key], truth[key], path=(key,), ordered=False, exact_types=False)


def test_lightning_sharded_folder_reads_its_state_dict_as_the_model():
    folder = LIGHTNING / "fsdp" / "last.ckpt"
    truth = _truth(LIGHTNING / "fsdp" / "truth.pt")
    report = json.loads(run_cli("inspect", folder, "--json").stdout)
    assert (report["format"], report["model_key"], report["world_size"]) == (
        "dcp",
        ["state_dict"],
        2,
    )
    values = {tuple(v["key"]): v["value"] for v in report["values"]}
    assert values[("global_step",)] == 2 and values[("epoch",)] == truth["epoch"]
    assert_identical(ckpttool.load(folder), truth["state_dict"], ordered=False, exact_types=False)


def test_lightning_ddp_checkpoint_equals_load_from_checkpoint():
    truth = _truth(LIGHTNING / "ddp" / "truth.pt")["state_dict"]
    model = ckpttool.load(LIGHTNING / "ddp" / "last.ckpt")
    assert list(model) == list(truth)
    assert_identical(model, truth, ordered=False, exact_types=False)


# ----------------------------------------------------------------------- verl/SkyRL


def test_verl_rank_files_merge_without_concatenating_replicated_buffers():
    truth = _truth(VERL / "truth.pt")
    report = json.loads(run_cli("inspect", VERL / "ws2", "--json").stdout)
    assert (report["format"], report["world_size"], report["model_key"]) == (
        "per-rank",
        2,
        ["model"],
    )
    model = ckpttool.load(VERL / "ws2")
    assert list(model) == ["scale", "counts", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert model["scale"].shape == () and model["counts"].shape == (3,)  # not [2], [6]
    assert_identical(model, truth["model"], ordered=False, exact_types=False)
    full = ckpttool.load(VERL / "ws2", select="all")
    assert sorted(full) == ["extra_state_rank_0", "extra_state_rank_1", "model", "optim"]
    optim = {name: full["optim"]["state"][i] for i, name in enumerate(PARAMS)}
    assert_identical(optim, truth["optimizer"], ordered=False, exact_types=False)


def test_verl_world_size_1_is_plain_tensors():
    truth = _truth(VERL / "ws1_truth.pt")["model"]
    assert ckpttool.read(VERL / "ws1").format == "torch-zip"
    assert_identical(ckpttool.load(VERL / "ws1"), truth, ordered=False, exact_types=False)


def test_verl_missing_rank_file_is_named(tmp_path):
    folder = tmp_path / "actor"
    shutil.copytree(VERL / "ws2", folder)
    (folder / "optim_world_size_2_rank_1.pt").unlink()
    proc = run_cli("convert", folder, "--to", "safetensors", "-o", tmp_path / "o.safetensors")
    check_error(proc, 2, "rank file missing: optim_world_size_2_rank_1.pt")
    assert not (tmp_path / "o.safetensors").exists()


def test_verl_world_size_from_a_file_name_is_counted_not_listed(tmp_path):
    # the world size is a number in a file name: a billion must not become a list
    folder = tmp_path / "actor"
    folder.mkdir()
    for rank in (0, 1):
        shutil.copy(
            VERL / "ws2" / f"model_world_size_2_rank_{rank}.pt",
            folder / f"model_world_size_1000000000_rank_{rank}.pt",
        )
    check_error(run_cli("inspect", folder), 2,
                "rank file missing: model_world_size_1000000000_rank_2.pt")  # fmt: skip


def test_verl_rank_files_of_two_world_sizes_are_refused_by_name(tmp_path):
    folder = tmp_path / "actor"
    shutil.copytree(VERL / "ws2", folder)
    shutil.copy(VERL / "ws1" / "model_world_size_1_rank_0.pt", folder)
    check_error(run_cli("inspect", folder), 2, "several world sizes",
                "model_world_size_1_rank_*.pt, model_world_size_2_rank_*.pt")  # fmt: skip


# ------------------------------------------------------------------------- torchtune


def test_torchtune_output_folder_reads_its_one_epoch(tmp_path):
    from safetensors.torch import save_file

    weights = {"tok.weight": torch.arange(6.0).reshape(2, 3), "norm.weight": torch.ones(3)}
    (tmp_path / "epoch_0").mkdir()
    save_file(weights, tmp_path / "epoch_0" / "model-00001-of-00001.safetensors")
    (tmp_path / "recipe_state").mkdir()
    torch.save({"epochs_run": 1, "seed": 0}, tmp_path / "recipe_state" / "recipe_state.pt")
    assert_identical(ckpttool.load(tmp_path), weights, ordered=False, exact_types=False)
    full = ckpttool.load(tmp_path, select="all")
    assert full["recipe_state"] == {"epochs_run": 1, "seed": 0}
    (tmp_path / "epoch_1").mkdir()
    save_file(weights, tmp_path / "epoch_1" / "model-00001-of-00001.safetensors")
    check_error(run_cli("inspect", tmp_path), 2, "several models (epoch_0, epoch_1)")


# -------------------------------------------------------------- Hugging Face Trainer


def _trainer_deepspeed_checkpoint(tmp_path):
    """transformers.Trainer's checkpoint-N/ under ZeRO-3 without gathered weights: no
    weights file, DeepSpeed's own checkpoint (latest, global_step3/) beside
    trainer_state.json, rng_state_R.pth and training_args.bin."""
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    zero3 = FIXTURES / "deepspeed" / "zero3"
    shutil.copytree(zero3 / "global_step3", ckpt / "global_step3")
    shutil.copy(zero3 / "latest", ckpt / "latest")
    (ckpt / "trainer_state.json").write_text('{"global_step": 3}')
    for rank in range(2):
        torch.save({"cpu": torch.get_rng_state()}, ckpt / f"rng_state_{rank}.pth")
    torch.save({"output_dir": "out"}, ckpt / "training_args.bin")
    return ckpt


def test_trainer_deepspeed_checkpoint_reads_deepspeeds_own(tmp_path):
    ckpt = _trainer_deepspeed_checkpoint(tmp_path)
    proc = run_cli("inspect", ckpt, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["format"], report["model_key"]) == ("deepspeed", ["global_step3", "module"])
    truth = torch.load(FIXTURES / "deepspeed" / "zero3_fp32.pt", weights_only=True)
    assert_identical(ckpttool.load(ckpt), truth, ordered=False, exact_types=False)
    full = ckpttool.load(ckpt, select="all")
    assert sorted(full) == ["global_step3", "rng_state_0", "rng_state_1"]
    # with a weights file beside it (ZeRO-1/2, or gathered ZeRO-3), that file is the model
    save_file({"w": torch.ones(2)}, ckpt / "model.safetensors")
    assert ckpttool.read(ckpt).format == "safetensors"
    assert list(ckpttool.load(ckpt)) == ["w"]


def test_trainer_fsdp_checkpoint_reads_its_dcp_model(tmp_path):
    # transformers.Trainer saves FSDP through accelerate's save_fsdp_model/optimizer:
    # the same DCP folders, beside trainer_state.json, scheduler.pt and rng_state_R.pth
    src = ACCELERATE / "fsdp2" / "state"
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    shutil.copytree(src / "pytorch_model_fsdp_0", ckpt / "pytorch_model_fsdp_0")
    shutil.copytree(src / "optimizer_0", ckpt / "optimizer_0")
    shutil.copy(src / "scheduler.bin", ckpt / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, ckpt / "rng_state_0.pth")
    (ckpt / "trainer_state.json").write_text('{"global_step": 2}')
    truth = _truth(ACCELERATE / "fsdp2" / "truth.pt")
    assert ckpttool.read(ckpt).format == "dcp"
    assert_identical(ckpttool.load(ckpt), truth["model"], ordered=False, exact_types=False)
    full = ckpttool.load(ckpt, select="all")
    assert sorted(full) == ["optimizer_0", "pytorch_model_fsdp_0", "rng_state_0", "scheduler"]
    optim = full["optimizer_0"]["optimizer"]["state"]
    assert_identical(optim, truth["optimizer"], ordered=False, exact_types=False)


# fixtures/transformers/: checkpoint-2/ folders written by transformers.Trainer itself;
# truth.pt is what its resume path loads from each file. (run, weights file, format id)
TRANSFORMERS = FIXTURES / "transformers"
TRAINER_RUNS = [
    ("gpt2_tied", "model.safetensors", "safetensors"),  # transformers 5: lm_head dropped
    ("gpt2_untied", "model.safetensors", "safetensors"),
    ("gpt2_bin", "pytorch_model.bin", "torch-zip"),  # transformers 4.57: lm_head shares wte
]
TRAINER_PARTS = ["optimizer", "rng_state", "scheduler"]  # what resuming reads
# training_args.bin: TrainingArguments, its enums, AcceleratorConfig and accelerate's
# PartialState (NEWOBJ with no arguments, then its __dict__: __init__ never runs)
TRAINING_ARGS_GLOBALS = [
    "accelerate.state.PartialState",
    "accelerate.utils.dataclasses.DistributedType",
    "torch.device",
    "transformers.trainer_pt_utils.AcceleratorConfig",
    "transformers.trainer_utils.HubStrategy",
    "transformers.trainer_utils.IntervalStrategy",
    "transformers.trainer_utils.SaveStrategy",
    "transformers.trainer_utils.SchedulerType",
    "transformers.training_args.OptimizerNames",
    "transformers.training_args.TrainingArguments",
]


@pytest.mark.parametrize("run, weights, fmt", TRAINER_RUNS)
def test_trainer_checkpoint_model_is_its_weights_file_as_transformers_loads_it(run, weights, fmt):
    ckpt = TRANSFORMERS / run / "checkpoint-2"
    truth = torch.load(TRANSFORMERS / run / "truth.pt", weights_only=True)["model"]
    proc = run_cli("inspect", ckpt, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    part = weights.split(".")[0]
    assert (report["format"], report["model_key"]) == (fmt, [part])
    assert report["files"][0] == str(ckpt / weights)
    assert (report["dangerous"], report["unverified"]) == ([], [])
    model = ckpttool.load(ckpt)
    assert list(model) == list(truth)  # the stored keys, in the stored order
    assert_identical(model, truth, exact_types=False)
    # a tied lm_head: transformers 5 leaves it out of model.safetensors; 4.x's
    # pytorch_model.bin keeps it as a second name for wte's storage
    assert ("lm_head.weight" in model) == (run != "gpt2_tied")
    if run == "gpt2_bin":
        assert torch.equal(model["lm_head.weight"], model["transformer.wte.weight"])


@pytest.mark.parametrize("run, weights, fmt", TRAINER_RUNS)
def test_trainer_checkpoint_optimizer_scheduler_and_rng_come_with_select_all(run, weights, fmt):
    ckpt = TRANSFORMERS / run / "checkpoint-2"
    truth = torch.load(TRANSFORMERS / run / "truth.pt", weights_only=True)
    full = ckpttool.load(ckpt, select="all")
    part = weights.split(".")[0]
    assert sorted(full) == sorted([part, *TRAINER_PARTS])
    assert_identical(full[part], truth["model"], exact_types=False)
    assert_identical(full["optimizer"], truth["optimizer"], exact_types=False)
    assert len(full["optimizer"]["state"]) == len(truth["model"]) - (run == "gpt2_bin")
    assert_identical(full["scheduler"], truth["scheduler"], exact_types=False)
    assert full["scheduler"]["last_epoch"] == 2
    # python's and numpy's states as plain values, numpy's key array a uint32 tensor
    assert_identical(full["rng_state"], truth["rng"], exact_types=False)


@pytest.mark.parametrize(
    "run, name",
    [
        *(("gpt2_tied", n) for n in ["optimizer.pt", "scheduler.pt", "rng_state.pth"]),
        ("gpt2_tied", "training_args.bin"),
        ("gpt2_bin", "training_args.bin"),
        ("gpt2_bin", "pytorch_model.bin"),
    ],
)
def test_trainer_checkpoint_files_read_alone_with_no_dangerous_or_unverified_global(run, name):
    path = TRANSFORMERS / run / "checkpoint-2" / name
    proc = run_cli("inspect", path, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["format"] == "torch-zip"
    assert (report["dangerous"], report["unverified"]) == ([], [])
    if name == "training_args.bin":
        assert report["globals"] == TRAINING_ARGS_GLOBALS
        args = ckpttool.load(path, select="all")
        assert args["__class__"] == "transformers.training_args.TrainingArguments"
        assert (args["state"]["max_steps"], args["state"]["save_steps"]) == (2, 2)
    truth = torch.load(TRANSFORMERS / run / "truth.pt", weights_only=True)
    want = {"optimizer.pt": "optimizer", "scheduler.pt": "scheduler", "rng_state.pth": "rng",
            "pytorch_model.bin": "model"}.get(name)  # fmt: skip
    if want is not None:
        assert_identical(ckpttool.load(path, select="all"), truth[want], exact_types=False)


@pytest.mark.parametrize("run, weights, fmt", TRAINER_RUNS)
def test_trainer_checkpoint_converts_to_safetensors_equal_to_its_weights(
    tmp_path, run, weights, fmt
):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    proc = run_cli("convert", TRANSFORMERS / run / "checkpoint-2", "--to", "safetensors", "-o", out)
    assert proc.returncode == 0, proc.stderr
    truth = torch.load(TRANSFORMERS / run / "truth.pt", weights_only=True)["model"]
    written = load_file(out)
    # a tied head (4.x's pytorch_model.bin keeps it, over the embedding's storage) is
    # written once, as save_pretrained writes it; ckpttool reads the name back
    tied = sorted(set(truth) - set(written))
    assert tied in ([], ["lm_head.weight"])
    assert_identical({**written, **{k: ckpttool.load(out)[k] for k in tied}}, truth, ordered=False)


def test_trainer_checkpoint_weights_are_taken_in_from_pretrained_order(tmp_path):
    # sharded weights: the index is the model; beside a model.safetensors, that file is
    # (Trainer._load_from_checkpoint takes it first)
    from safetensors.torch import save_file

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(TRANSFORMERS / "gpt2_untied" / "checkpoint-2", ckpt)
    truth = torch.load(TRANSFORMERS / "gpt2_untied" / "truth.pt", weights_only=True)["model"]
    (ckpt / "model.safetensors").unlink()
    names = list(truth)
    shards = {"model-00001-of-00002.safetensors": names[:9],
              "model-00002-of-00002.safetensors": names[9:]}  # fmt: skip
    for shard, keys in shards.items():
        save_file({k: truth[k] for k in keys}, ckpt / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    report = json.loads(run_cli("inspect", ckpt, "--json").stdout)
    assert (report["format"], report["model_key"]) == ("safetensors-sharded", ["model"])
    assert_identical(ckpttool.load(ckpt), truth, ordered=False, exact_types=False)
    assert sorted(ckpttool.load(ckpt, select="all")) == ["model", *TRAINER_PARTS]
    save_file({"only": torch.ones(1)}, ckpt / "model.safetensors")
    assert list(ckpttool.load(ckpt)) == ["only"]


def test_folder_of_weights_and_training_args_without_trainer_state_is_its_weights(tmp_path):
    # Trainer.save_model's output_dir: no trainer_state.json, no run folder rule
    shutil.copy(TRANSFORMERS / "gpt2_tied" / "checkpoint-2" / "model.safetensors", tmp_path)
    shutil.copy(TRANSFORMERS / "gpt2_tied" / "checkpoint-2" / "training_args.bin", tmp_path)
    ckpt = ckpttool.read(tmp_path)
    assert ckpt.files == [str(tmp_path / "model.safetensors")]
    assert ckpt.format == "safetensors"


def test_trainer_checkpoint_with_a_hostile_part_is_refused_naming_it(tmp_path):
    from payloads import Reduce, write_malicious_zip

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(TRANSFORMERS / "gpt2_tied" / "checkpoint-2", ckpt)
    write_malicious_zip(ckpt / "optimizer.pt", Reduce(os.system, ("echo owned",)))
    out = tmp_path / "model.safetensors"
    proc = run_cli("convert", ckpt, "--to", "safetensors", "-o", out)
    check_error(proc, 3, str(ckpt / "optimizer.pt"), "posix.system")
    assert not out.exists()


@pytest.fixture(scope="module")
def hostile_run_folders(tmp_path_factory):
    """Run folders with a pickle beside the model that no resume reads but anyone may
    ``torch.load`` (what transformers' own code does with training_args.bin), each
    proven live: one child torch.loads every such file, and each makes its marker."""
    from helpers import run_child
    from payloads import Reduce, write_malicious_legacy, write_malicious_zip

    base = tmp_path_factory.mktemp("run-folder-pickles")
    src = TRANSFORMERS / "gpt2_tied" / "checkpoint-2"
    folders, files = {}, []

    def evil(name):
        return Reduce(os.system, (f"touch {base / ('marker-' + name)}",))

    trainer = base / "trainer" / "checkpoint-2"  # with trainer_state.json: the Trainer rule
    shutil.copytree(src, trainer)
    write_malicious_zip(trainer / "training_args.bin", evil("trainer"))
    folders["trainer"] = (trainer, ["training_args.bin"])
    model = base / "model" / "checkpoint-500"  # no trainer_state.json: the weights' folder
    model.mkdir(parents=True)
    shutil.copy(src / "model.safetensors", model)
    write_malicious_zip(model / "training_args.bin", evil("model"))
    folders["model"] = (model, ["training_args.bin"])
    accelerate = base / "accelerate"  # a pickle of one's own, and a second copy of the weights
    shutil.copytree(ACCELERATE / "ddp" / "state", accelerate)
    (accelerate / "custom.pkl").write_bytes(pickle.dumps(evil("pkl"), protocol=2))
    write_malicious_legacy(accelerate / "extra.pt", evil("legacy"))
    folders["accelerate"] = (accelerate, ["custom.pkl", "extra.pt"])
    for folder, names in folders.values():
        files += [str(folder / n) for n in names]
    run_child("run-payloads", items=files, cwd=base)
    markers = sorted(p.name for p in base.glob("marker-*"))
    assert markers == ["marker-legacy", "marker-model", "marker-pkl", "marker-trainer"], markers
    for marker in base.glob("marker-*"):
        marker.unlink()
    return base, folders


@pytest.mark.parametrize("kind", ["trainer", "model", "accelerate"])
def test_a_run_folders_every_pickle_is_judged(hostile_run_folders, kind, tmp_path):
    base, folders = hostile_run_folders
    folder, names = folders[kind]
    line = check_error(run_cli("inspect", folder), 3, str(folder / names[0]), "posix.system")
    for name in names:  # each file named with what it calls
        assert name in line, (name, line)
    out = tmp_path / "model.safetensors"
    check_error(run_cli("convert", folder, "--to", "safetensors", "-o", out), 3, "posix.system")
    assert not out.exists()
    with pytest.raises(ckpttool.UnsafeError):
        ckpttool.load(folder)
    assert list(base.glob("marker-*")) == []
    # --unsafe: the model, as before
    assert ckpttool.read(folder, unsafe=True).dangerous == []


def test_a_run_folders_benign_pickles_read(tmp_path):
    # training_args.bin with TrainingArguments and its enums, a second copy of the weights
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(TRANSFORMERS / "gpt2_bin" / "checkpoint-2", ckpt)
    shutil.copy(TRANSFORMERS / "gpt2_tied" / "checkpoint-2" / "model.safetensors", ckpt)
    (ckpt / "notes.txt").write_text("cat\ndog\n")  # protocol 0 text, naming a global only
    assert ckpttool.read(ckpt).format == "safetensors"
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(ckpt / "model.safetensors", alone)
    shutil.copy(ckpt / "training_args.bin", alone)
    assert ckpttool.read(alone).files == [str(alone / "model.safetensors")]


def test_a_run_folders_parts_are_not_read_as_run_folders(tmp_path, monkeypatch):
    """Each level's model and optimizer link to the next level's folder, itself an
    accelerate folder: read by rule at every level, 30 levels of 60 symlinks were 2**30
    reads (a depth of 14 took 10 s). A part is one checkpoint of a known format; a run
    folder inside a run folder is not one."""
    import ckpttool.formats as formats

    torch.save({"step": 1}, tmp_path / "rng.pt")
    save_file({"w": torch.ones(2)}, tmp_path / "leaf.safetensors")
    depth = 30
    for i in range(depth):
        level = tmp_path / f"d{i}"
        level.mkdir()
        os.symlink("../rng.pt", level / "random_states_0.pkl")
        target = f"../d{i + 1}" if i + 1 < depth else "../leaf.safetensors"
        os.symlink(target, level / "pytorch_model_fsdp_0")
        os.symlink(target, level / "optimizer_0")
    reads = []
    read_one = formats._read_one

    def counted(*args, **kwargs):
        reads.append(args[0])
        assert len(reads) < 100, "a run folder read its parts as run folders"
        return read_one(*args, **kwargs)

    monkeypatch.setattr(formats, "_read_one", counted)
    # d1 (d0's model) is no checkpoint by a rule: its one sub-folder is named, not read
    with pytest.raises(ckpttool.CkptError, match="holds a checkpoint in optimizer_0/"):
        ckpttool.read(tmp_path / "d0")
    monkeypatch.undo()
    check_error(run_cli("convert", tmp_path / "d0", "--to", "pt", timeout=60), 2, "holds a check")


def test_a_run_folder_reads_a_file_once_however_many_parts_name_it(tmp_path, monkeypatch):
    """600 symlinks to one 550 KB optimizer file, each a part of an accelerate folder: 600
    reads (a thousand took 65 s) and a tree of 1.2 million tensors. The file is read
    once, and a tree that names it over and over is refused as a pickle's shared
    containers are; a few names for one file read as before."""
    import ckpttool.formats as formats

    folder = tmp_path / "run"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, folder / "model.safetensors")
    torch.save({"step": 1}, folder / "random_states_0.pkl")
    torch.save({f"k{i}": torch.ones(1) for i in range(2000)}, tmp_path / "opt.bin")
    os.link(tmp_path / "opt.bin", folder / "optimizer.bin")  # a hard link is one file too
    for i in range(600):
        os.symlink("optimizer.bin", folder / f"optimizer_{i}.bin")
    reads = []
    read_one = formats._read_one

    def counted(path, *args, **kwargs):
        reads.append(os.path.basename(path))
        return read_one(path, *args, **kwargs)

    monkeypatch.setattr(formats, "_read_one", counted)
    with pytest.raises(ckpttool.CkptError, match="shared by many paths"):
        ckpttool.read(folder)
    assert sum(1 for r in reads if r.startswith("optimizer")) == 1, reads[:5]
    for i in range(2, 600):
        os.unlink(folder / f"optimizer_{i}.bin")
    ckpt = ckpttool.read(folder)
    assert len(ckpt["optimizer_0"]) == len(ckpt["optimizer_1"]) == len(ckpt["optimizer"]) == 2000
