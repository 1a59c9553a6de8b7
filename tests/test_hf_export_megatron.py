"""``convert --to hf`` of megatron-core ``torch_dist`` checkpoints (issue 44): the Llama
layout (``megatron:gpt``) as ``LlamaForCausalLM``, checked against megatron's own forward.

The fixtures are megatron-core 0.16's own saves (``fixtures/make_megatron_llama_fixtures.py``:
its ``GPTModel`` with RMSNorm, SwiGLU, grouped-query attention and RoPE, tensor parallel 2
on gloo, saved by ``dist_checkpointing.save``); ``*_truth.pt`` holds megatron's forward
on fixed tokens and its ``load_plain_tensors``. Needs transformers (the ``interop`` extra).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import check_error, completed, fixture_path, run_many

transformers = pytest.importorskip("transformers", exc_type=ImportError)

MEGATRON = fixture_path("megatron")
RUNS = ("llama", "llama_tied")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def hf_logits(folder, tokens):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits


def export_argv(run, out, *more):
    config = MEGATRON / f"{run}_config.json"
    return ["convert", MEGATRON / run, "--to", "hf", "--config", config, *more, "-o", f"{out}/"]


@pytest.mark.parametrize("run", RUNS)
def test_megatron_gpt_to_hf_gives_megatrons_logits(run, tmp_path):
    truth = torch.load(MEGATRON / f"{run}_truth.pt")
    (done, dry) = run_many(
        [
            export_argv(run, tmp_path / "hf"),
            ["convert", MEGATRON / run, "--to", "hf", "--config", MEGATRON / f"{run}_config.json",
             "--dry-run", "--json"],
        ]
    )  # fmt: skip
    assert done["code"] == 0 and dry["code"] == 0, (done["stderr"], dry["stderr"])
    got = hf_logits(tmp_path / "hf", truth["tokens"])
    assert got.shape[-1] == 31  # (the config's vocabulary: megatron's padded row dropped)
    assert (got - truth["logits"][..., :31]).abs().max().item() <= 1e-5
    data = json.loads(dry["stdout"])
    assert data["mapping"] == "megatron:gpt" and data["architecture"] == "LlamaForCausalLM"
    transforms = {t["transform"] for t in data["tensors"]}
    assert transforms == {"vocab", "same", "layer", "qkv_q", "qkv_k", "qkv_v", "glu_gate", "glu_up"}
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["tie_word_embeddings"] is (run == "llama_tied")
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]


def test_each_tensor_is_megatrons_through_its_layout(tmp_path):
    """Every HF tensor is megatron's own ``load_plain_tensors`` tensor through the layout
    its code uses (per query group: its query heads, its key, its value; the gate's rows,
    then up's), bitwise: computed here independently of the spec."""
    from safetensors.torch import load_file

    truth = torch.load(MEGATRON / "llama_truth.pt")["tensors"]
    config = json.loads((MEGATRON / "llama_config.json").read_text())
    (done,) = run_many([export_argv("llama", tmp_path / "hf")])
    assert done["code"] == 0, done["stderr"]
    got = load_file(tmp_path / "hf" / "model.safetensors")
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config["hidden_size"] // heads
    ffn = config["intermediate_size"]
    vocab = config["vocab_size"]  # (31: megatron's padded row left out)
    want = {
        "model.embed_tokens.weight": truth["embedding.word_embeddings.weight"][:vocab],
        "model.norm.weight": truth["decoder.final_layernorm.weight"],
        "lm_head.weight": truth["output_layer.weight"][:vocab],
    }
    layer = "decoder.layers."
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        qkv = truth[layer + "self_attention.linear_qkv.weight"][i]
        grouped = qkv.view(groups, heads // groups + 2, hd, -1)
        fc1 = truth[layer + "mlp.linear_fc1.weight"][i]
        want |= {
            p + "self_attn.q_proj.weight": grouped[:, :-2].reshape(heads * hd, -1),
            p + "self_attn.k_proj.weight": grouped[:, -2].reshape(groups * hd, -1),
            p + "self_attn.v_proj.weight": grouped[:, -1].reshape(groups * hd, -1),
            p + "self_attn.o_proj.weight": truth[layer + "self_attention.linear_proj.weight"][i],
            p + "mlp.gate_proj.weight": fc1[:ffn],
            p + "mlp.up_proj.weight": fc1[ffn:],
            p + "mlp.down_proj.weight": truth[layer + "mlp.linear_fc2.weight"][i],
            p + "input_layernorm.weight": truth[
                layer + "self_attention.linear_qkv.layer_norm_weight"
            ][i],
            p + "post_attention_layernorm.weight": truth[
                layer + "mlp.linear_fc1.layer_norm_weight"
            ][i],
        }
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("swapped", [("qkv_k", "qkv_v"), ("glu_gate", "glu_up")])
def test_a_spec_that_splits_a_fused_tensor_wrongly_is_caught_by_the_logits(swapped, tmp_path):
    """Key rows taken as value rows, or the gate as up: every name and shape right, only
    the logits tell."""
    import dataclasses

    from ckpttool.convert import HfOptions, convert
    from ckpttool.mappings import specs

    truth = torch.load(MEGATRON / "llama_truth.pt")
    spec = specs.MEGATRON_GPT
    other = dict([swapped, swapped[::-1]])
    renames = tuple(
        dataclasses.replace(r, transform=other.get(r.transform, r.transform)) for r in spec.renames
    )
    options = HfOptions(config=str(MEGATRON / "llama_config.json"), check=True)
    saved = dict(specs.SPECS)
    specs.SPECS[spec.name] = dataclasses.replace(spec, renames=renames)
    try:
        convert([str(MEGATRON / "llama")], "hf", str(tmp_path / "wrong") + "/", hf=options)
    finally:
        specs.SPECS.clear()
        specs.SPECS.update(saved)
    got = hf_logits(tmp_path / "wrong", truth["tokens"])
    off = (got - truth["logits"][..., :31]).abs().max().item()
    assert off > 1e-3, off


def test_a_padded_vocabulary_is_trimmed_to_the_configs(tmp_path):
    """Megatron pads the vocabulary (``make_vocab_size_divisible_by`` x tensor parallel):
    a config of 31 tokens keeps the embedding's and head's first 31 rows, whose logits
    are megatron's for those tokens. Where the checkpoint holds no args (NeMo 2's
    weights), a config the tensors contradict is refused naming both; where it does, a
    config the run's args contradict is."""
    truth = torch.load(MEGATRON / "llama_truth.pt")
    config = json.loads((MEGATRON / "llama_config.json").read_text())
    changes = {"small": {"vocab_size": 31}, "large": {"vocab_size": 40},
               "deep": {"num_hidden_layers": 3}, "padded": {"vocab_size": 32}}  # fmt: skip
    for name, change in changes.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**config, **change}))
    nemo = MEGATRON / "nemo2_llama" / "model"
    argvs = [
        ["convert", source, "--to", "hf", "--config", tmp_path / f"{name}.json",
         "-o", f"{tmp_path / name}/"]
        for source, name in ((MEGATRON / "llama", "small"), (nemo, "large"), (nemo, "deep"),
                             (MEGATRON / "llama", "padded"))
    ]  # fmt: skip
    runs = [completed(a, r) for a, r in zip(argvs, run_many(argvs), strict=True)]
    small, large, deep, padded = runs
    assert small.returncode == 0, small.stderr
    got = hf_logits(tmp_path / "small", truth["tokens"])
    assert got.shape[-1] == 31
    assert (got - truth["logits"][..., :31]).abs().max().item() <= 1e-5
    check_error(
        large, 2,
        "the config says vocab_size 40, more than the checkpoint's 32 rows "
        "(embedding.word_embeddings.weight)",
    )  # fmt: skip
    check_error(
        deep, 2,
        "the config says num_hidden_layers 3, the checkpoint 2 "
        "(decoder.layers.self_attention.linear_qkv.weight)",
    )  # fmt: skip
    check_error(padded, 2, "the config says vocab_size 32, the run's args (vocab_size) 31")
    assert not any((tmp_path / n).exists() for n in ("large", "deep", "padded"))


def test_diff_pairs_the_megatron_checkpoint_with_its_export(tmp_path):
    (done,) = run_many([export_argv("llama", tmp_path / "hf")])
    assert done["code"] == 0, done["stderr"]
    argvs = [["diff", MEGATRON / "llama", tmp_path / "hf", "--arch", "megatron:gpt"]]
    (same,) = (completed(a, r) for a, r in zip(argvs, run_many(argvs), strict=True))
    assert same.returncode == 0, (same.stdout, same.stderr)
    assert "megatron:gpt" in same.stdout


@pytest.mark.parametrize("run", RUNS)
def test_the_config_comes_from_the_runs_own_args(run, tmp_path):
    """Without --config, the ``args`` Megatron-LM saved in ``common.pt`` give the model's
    config (its true vocabulary of 31: the padded row dropped), each value named with
    the argument it came from."""
    truth = torch.load(MEGATRON / f"{run}_truth.pt")
    done, dry = run_many(
        [
            ["convert", MEGATRON / run, "--to", "hf", "-o", f"{tmp_path / 'hf'}/"],
            ["convert", MEGATRON / run, "--to", "hf", "--dry-run", "--json"],
        ]
    )
    assert done["code"] == 0 and dry["code"] == 0, (done["stderr"], dry["stderr"])
    got = hf_logits(tmp_path / "hf", truth["tokens"])
    assert got.shape[-1] == 31
    assert (got - truth["logits"][..., :31]).abs().max().item() <= 1e-5
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["vocab_size"] == 31 and written["num_key_value_heads"] == 2
    assert written["tie_word_embeddings"] is (run == "llama_tied")
    came = json.loads(dry["stdout"])["config_from"]
    assert came["num_key_value_heads"] == "the run's args (num_query_groups)"
    assert came["vocab_size"] == "the run's args (vocab_size)"
    assert came["intermediate_size"] == "the run's args (ffn_hidden_size)"


@pytest.mark.parametrize(
    ("arg", "value", "wanted"),
    [("normalization", "LayerNorm", "'RMSNorm'"), ("use_rope_scaling", True, "False")],
)
def test_args_of_another_layout_are_refused_by_name(arg, value, wanted, tmp_path):
    """A run whose saved arguments say LayerNorm is no Llama-layout run, and one of a
    scaled RoPE would need a rope_scaling its args do not give: exit 2 naming the
    argument, nothing written (the fixture's own ``common.pt`` re-saved so)."""
    import shutil

    folder = tmp_path / "run"
    shutil.copytree(MEGATRON / "llama", folder)
    common = torch.load(folder / "common.pt", weights_only=False)  # (our own fixture)
    setattr(common["args"], arg, value)
    torch.save(common, folder / "common.pt")
    argv = ["convert", folder, "--to", "hf", "-o", f"{tmp_path / 'hf'}/"]
    (done,) = (completed(argv, r) for r in run_many([argv]))
    check_error(
        done, 2,
        f"the run's args say {arg}={value!r}: not the Llama layout megatron:gpt "
        f"maps ({arg}={wanted})",
    )  # fmt: skip
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow  # (two worker interpreters; the quick suite's --workers export is torchtitan's)
def test_the_same_folder_from_workers(tmp_path):
    """Unstacked layers and split fused tensors are row views like any: ``--workers 2``
    (units of 4 KiB: a layer's rows over several units) writes the bytes one process
    does."""
    import subprocess
    import sys

    from helpers import sha256, subprocess_env

    (one,) = run_many([export_argv("llama", tmp_path / "one")])
    assert one["code"] == 0, one["stderr"]
    argv = [str(a) for a in export_argv("llama", tmp_path / "two", "--workers", "2")]
    done = subprocess.run(
        [sys.executable, "-m", "ckpttool", *argv], capture_output=True, text=True,
        env=subprocess_env(CKPTTOOL_UNIT_BYTES="4096"), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sha256(tmp_path / "one") == sha256(tmp_path / "two")


def test_nemo2_weights_of_the_same_model_give_the_same_logits(tmp_path):
    """NeMo 2 keeps the same torch_dist folder as its ``weights/`` (the model under
    ``state_dict``, each key under ``module.``): given the checkpoint folder and the
    model's config, the export is megatron's model, logits and all."""
    truth = torch.load(MEGATRON / "llama_truth.pt")
    config = MEGATRON / "llama_config.json"
    argv = ["convert", MEGATRON / "nemo2_llama" / "model", "--to", "hf", "--config", config]
    (done,) = run_many([[*argv, "-o", f"{tmp_path / 'hf'}/"]])
    assert done["code"] == 0, done["stderr"]
    got = hf_logits(tmp_path / "hf", truth["tokens"])
    assert (got - truth["logits"][..., :31]).abs().max().item() <= 1e-5


def test_a_config_gives_what_the_runs_args_do_not_say(tmp_path):
    """The run's args win value by value (the contract: the checkpoint's own metadata
    first); a --config adds what they do not say (token ids), each value named with its
    source in --dry-run."""
    partial = tmp_path / "tokens.json"
    partial.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "model_type": "llama"}))
    (dry,) = run_many(
        [["convert", MEGATRON / "llama", "--to", "hf", "--config", partial, "--dry-run", "--json"]]
    )
    assert dry["code"] == 0, dry["stderr"]
    data = json.loads(dry["stdout"])
    came = data["config_from"]
    assert came["bos_token_id"] == came["eos_token_id"] == str(partial)
    assert came["num_key_value_heads"] == "the run's args (num_query_groups)"
    assert data["config"]["bos_token_id"] == 1 and data["config"]["vocab_size"] == 31


@pytest.mark.parametrize(
    ("arg", "value", "line"),
    [
        # (the tensors say 2 first: refused before anything loops)
        ("num_layers", 10**9, "the config says num_hidden_layers 1000000000, the checkpoint 2"),
        ("num_query_groups", 10**9, "the config's num_key_value_heads 1000000000 is past 16384"),
        ("ffn_hidden_size", "32", "the run's args' ffn_hidden_size is no number (str)"),
        ("norm_epsilon", float("nan"), "the run's args' norm_epsilon is no number (float)"),
    ],
)
def test_what_the_args_say_is_checked_before_it_is_used(arg, value, line, tmp_path):
    """The run's args are the file's: a count that would drive a loop past any model's
    and a value config.json could not hold are refused in one line, nothing written."""
    import shutil

    folder = tmp_path / "run"
    shutil.copytree(MEGATRON / "llama", folder)
    common = torch.load(folder / "common.pt", weights_only=False)  # (our own fixture)
    setattr(common["args"], arg, value)
    torch.save(common, folder / "common.pt")
    argv = ["convert", folder, "--to", "hf", "-o", f"{tmp_path / 'hf'}/"]
    (done,) = (completed(argv, r) for r in run_many([argv]))
    check_error(done, 2, line)
    assert not (tmp_path / "hf").exists()
