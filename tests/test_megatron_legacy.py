"""Legacy Megatron-LM iteration folders split over tensor x pipeline (x virtual pipeline)
ranks (issue 45), merged from the run's own layout, checked against megatron's own view.

The fixtures are megatron-core 0.16's ``GPTModel`` (the Llama layout: SwiGLU, grouped
query attention, RoPE), tensor parallel 2 x pipeline parallel 2 on gloo, each rank's
``state_dict_for_save_checkpoint()`` saved as Megatron-LM's ``--ckpt-format torch`` does
(``fixtures/make_megatron_legacy_fixtures.py``); ``*_truth.pt`` holds megatron's forward
through the pipeline and every tensor as megatron-core's own ``torch_dist`` save holds it
globally (``load_plain_tensors``).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import check_error, completed, fixture_path, run_many, sha256, tree_files

import ckpttool

MEGATRON = fixture_path("megatron")
RUNS = ("legacy_tp2_pp2", "legacy_tp2_pp2_vp2")
ITERATION = "iter_0000002"
RANKS = ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
# the local layer spec's norm names, and megatron-core's torch_dist names of them
TORCH_DIST_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
LAYER_TENSORS = [
    "input_layernorm.weight", "self_attention.linear_proj.weight",
    "self_attention.linear_proj._extra_state", "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv._extra_state", "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.weight", "mlp.linear_fc1._extra_state", "mlp.linear_fc2.weight",
    "mlp.linear_fc2._extra_state",
]  # fmt: skip


def torch_dist_name(name: str) -> str:
    for local, fused in TORCH_DIST_NAMES.items():
        if name.endswith(local):
            return name[: -len(local)] + fused
    return name


def expected_names(tied: bool) -> list[str]:
    layers = [f"decoder.layers.{layer}.{n}" for layer in range(4) for n in LAYER_TENSORS]
    head = [] if tied else ["output_layer.weight", "output_layer._extra_state"]
    return ["embedding.word_embeddings.weight", *layers, "decoder.final_layernorm.weight", *head]


@pytest.mark.parametrize("run", RUNS)
def test_the_merged_model_is_megatrons_own_global_model(run):
    """Every tensor bitwise megatron-core's own global tensor (its torch_dist save of the
    same model), the layers in pipeline order (virtual stages: chunk 0 of every stage,
    then chunk 1), SwiGLU's per-rank [gate; up] made [all gate; all up]; a tied head,
    megatron's copy of the embedding on the last stage, left out."""
    truth = torch.load(MEGATRON / f"{run}_truth.pt")
    got = ckpttool.load(MEGATRON / run)  # the save folder: its tracker names the iteration
    assert list(got) == expected_names(truth["tied"])
    tensors = {torch_dist_name(k): v for k, v in got.items() if not k.endswith("_extra_state")}
    assert sorted(tensors) == sorted(truth["tensors"])
    for name, want in truth["tensors"].items():
        assert torch.equal(tensors[name], want), name
    read = ckpttool.read(MEGATRON / run / ITERATION)
    assert read.format == "megatron" and read.world_size == 4
    assert read.metadata["megatron_legacy"] == {
        "tensor_parallel": 2,
        "pipeline_parallel": 2,
        "virtual_pipeline": 2 if run.endswith("vp2") else 1,
        "checkpoint_version": 3.0,
    }


@pytest.mark.parametrize("run", RUNS)
def test_to_hf_gives_megatrons_logits_with_the_config_of_the_runs_args(run, tmp_path):
    transformers = pytest.importorskip("transformers", exc_type=ImportError)
    truth = torch.load(MEGATRON / f"{run}_truth.pt")
    (done,) = run_many([["convert", MEGATRON / run, "--to", "hf", "-o", f"{tmp_path / 'hf'}/"]])
    assert done["code"] == 0, done["stderr"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"]) == (4, 31)
    assert config["tie_word_embeddings"] is truth["tied"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        logits = model.eval()(truth["tokens"]).logits
    assert (logits - truth["logits"][..., :31]).abs().max().item() <= 1e-5


def test_convert_and_merge_write_the_merged_state(tmp_path):
    from safetensors.torch import load_file

    run = MEGATRON / "legacy_tp2_pp2"
    merged = ckpttool.load(run)
    argvs = [
        ["convert", run, "--to", "safetensors", "-o", tmp_path / "m.safetensors"],
        ["merge", run / ITERATION, "-o", tmp_path / "all.pt"],
    ]
    done = run_many(argvs)
    assert [d["code"] for d in done] == [0, 0], [d["stderr"] for d in done]
    written = load_file(tmp_path / "m.safetensors")
    weights = {k: v for k, v in merged.items() if isinstance(v, torch.Tensor)}
    assert sorted(written) == sorted(weights)
    assert all(torch.equal(written[k], v) for k, v in weights.items())
    whole = torch.load(tmp_path / "all.pt", weights_only=True)
    assert sorted(whole) == [
        "args", "checkpoint_version", "iteration", "model",
        "num_floating_point_operations_so_far", "ranks",
    ]  # fmt: skip
    assert list(whole["model"]) == list(merged)
    assert sorted(whole["ranks"]) == RANKS  # each rank's RNG state, as it saved it
    rank = torch.load(run / ITERATION / RANKS[3] / "model_optim_rng.pt", weights_only=False)
    mine = whole["ranks"][RANKS[3]]["rng_state"][0]["torch_rng_state"]
    assert torch.equal(mine, rank["rng_state"][0]["torch_rng_state"])


def _copy(tmp_path):
    folder = tmp_path / "run" / ITERATION
    shutil.copytree(MEGATRON / "legacy_tp2_pp2" / ITERATION, folder)
    tracker = "latest_checkpointed_iteration.txt"
    shutil.copy(MEGATRON / "legacy_tp2_pp2" / tracker, folder.parent / tracker)
    return folder


def _rewrite(folder, rank, change):
    path = folder / rank / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)


def _missing(folder):
    shutil.rmtree(folder / "mp_rank_01_001")


def _other_iteration(folder):
    _rewrite(folder, "mp_rank_01_000", lambda s: s.update(iteration=4))


def _args_disagree(folder):
    _rewrite(
        folder, "mp_rank_00_000", lambda s: setattr(s["args"], "tensor_model_parallel_size", 4)
    )


def _unknown_tensor(folder):
    for rank in RANKS:
        _rewrite(folder, rank, lambda s: s["model"].update({"decoder.layers.0.x.w": torch.ones(2)}))


def _old_version(folder):
    for rank in RANKS:
        _rewrite(folder, rank, lambda s: s.update(checkpoint_version=1.0))


def _nan_version(folder):
    for rank in RANKS:
        _rewrite(folder, rank, lambda s: s.update(checkpoint_version=float("nan")))


def _uneven_slices(folder):
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    _rewrite(folder, "mp_rank_01_000", lambda s: s["model"].update({name: torch.ones(16, 8)}))


def _expert_ranks(folder):
    (folder / "mp_rank_00_000").rename(folder / "mp_rank_00_000_000")


def _layers_disagree(folder):
    _rewrite(folder, "mp_rank_00_000", lambda s: setattr(s["args"], "num_layers", 6))


BROKEN = {
    "missing rank": (_missing, "of 2 x 2 model-parallel ranks without mp_rank_01_001"),
    "other iteration": (_other_iteration, "Megatron rank of iteration 4 beside iteration 2"),
    "args disagree": (_args_disagree, "args say tensor_model_parallel_size=4, the folder holds 2"),
    "unknown tensor": (_unknown_tensor, "no rule says how Megatron splits 'decoder.layers.0.x.w'"),
    "old version": (_old_version, "Megatron checkpoint_version 1.0: its QKV rows are ordered"),
    "nan version": (_nan_version, "Megatron checkpoint_version nan: its QKV rows are ordered"),
    "uneven slices": (_uneven_slices, "mp_rank_01_000/model_optim_rng.pt: Megatron tensor "
                      "'decoder.layers.0.mlp.linear_fc2.weight': [16, 8] here, [16, 16] float32 "
                      "on tensor-parallel rank 0"),
    "expert ranks": (_expert_ranks, "Megatron expert-parallel rank folders (mp_rank_00_000_000)"),
    "layers disagree": (_layers_disagree, "args say num_layers=6, the stages hold 4 layers"),
}  # fmt: skip


@pytest.mark.parametrize("case", BROKEN)
def test_what_the_folders_contradict_is_refused_naming_it(tmp_path, case):
    folder = _copy(tmp_path)
    breaks, needle = BROKEN[case]
    breaks(folder)
    before = {p: sha256(folder / p) for p in tree_files(folder)}
    argvs = [
        ["inspect", folder],
        ["convert", folder, "--to", "safetensors", "-o", tmp_path / "out" / "m.safetensors"],
        ["merge", folder.parent, "-o", tmp_path / "out" / "all.pt"],
    ]
    for argv, done in zip(argvs, run_many(argvs), strict=True):
        check_error(completed(argv, done), 2, needle)
    assert not (tmp_path / "out").exists()
    assert {p: sha256(folder / p) for p in tree_files(folder)} == before


def test_pre_mcore_nested_names_without_a_pipeline(tmp_path):
    """The pre-mcore legacy model (``language_model`` -> ``embedding`` / ``encoder``
    nested, ``mp_rank_TT/`` without a pipeline stage) merges by the same rules: its
    state dicts as dotted names, ``dense_h_to_4h`` one projection where ``swiglu`` is
    False, ``dense`` along its columns. (Written here in that layout: no Megatron-LM that
    still builds it installs today.)"""
    import argparse

    args = argparse.Namespace(swiglu=False, tensor_model_parallel_size=2, num_layers=1)
    slices = []
    for t in range(2):
        layer = {
            "layers.0.input_norm.weight": torch.ones(2),
            "layers.0.mlp.dense_h_to_4h.weight": torch.full((4, 2), float(t)),
            "layers.0.self_attention.dense.weight": torch.full((2, 3), float(t)),
            "final_norm.weight": torch.ones(2),
        }
        embedding = {"word_embeddings": {"weight": torch.full((5, 2), float(t))}}
        model = {"language_model": {"embedding": embedding, "encoder": layer}}
        path = tmp_path / ITERATION / f"mp_rank_{t:02d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True)
        torch.save({"model": model, "args": args, "iteration": 2, "checkpoint_version": 3.0}, path)
        slices.append(layer | {"embedding": embedding["word_embeddings"]["weight"]})
    got = ckpttool.load(tmp_path / ITERATION)
    encoder = "language_model.encoder."
    assert list(got) == [
        "language_model.embedding.word_embeddings.weight",
        *(encoder + n for n in slices[0] if n != "embedding"),
    ]
    cat = torch.cat
    assert torch.equal(got["language_model.embedding.word_embeddings.weight"],
                       cat([s["embedding"] for s in slices]))  # fmt: skip
    fc1, proj = "layers.0.mlp.dense_h_to_4h.weight", "layers.0.self_attention.dense.weight"
    assert torch.equal(got[encoder + fc1], cat([s[fc1] for s in slices]))
    assert torch.equal(got[encoder + proj], cat([s[proj] for s in slices], dim=1))
    assert torch.equal(got[encoder + "final_norm.weight"], torch.ones(2))


def test_a_distributed_optimizers_files_are_kept_by_rank_never_dropped(tmp_path):
    """``distrib_optim.pt`` beside a rank's file (Megatron's distributed optimizer: flat
    buffers laid out by the model code's bucketing) is kept as stored under its rank."""
    folder = _copy(tmp_path)
    for rank in RANKS:  # (the layout get_parameter_state_dp_zero saves, in small)
        state = {
            "buckets_coalesced": True,
            0: {
                (torch.float32, torch.float32): [
                    {"param": torch.full((4,), float(len(rank))), "exp_avg": torch.zeros(4)}
                ]
            },
        }
        torch.save(state, folder / rank / "distrib_optim.pt")
    ckpt = ckpttool.read(folder)
    assert sorted(f for f in ckpt.files if f.endswith("distrib_optim.pt")) == sorted(
        str(folder / r / "distrib_optim.pt") for r in RANKS
    )
    (done,) = run_many([["merge", folder, "-o", tmp_path / "all.pt"]])
    assert done["code"] == 0, done["stderr"]
    whole = torch.load(tmp_path / "all.pt", weights_only=True)
    kept = whole["ranks"]["mp_rank_01_001"]["distrib_optim"]
    assert kept["buckets_coalesced"] is True
    assert torch.equal(kept[0][(torch.float32, torch.float32)][0]["param"], torch.full((4,), 14.0))
