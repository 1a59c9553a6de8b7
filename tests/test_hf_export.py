"""``convert --to hf`` (issue 44): a training checkpoint as a Hugging Face model folder that
``from_pretrained`` loads with the training framework's own logits.

Sources are checkpoints the frameworks wrote: torchtitan 0.3.0's Llama 3 model-only DCP
saves (``fixtures/make_torchtitan_fixtures.py``: torchtitan's own model, init and save
path; ``truth.pt`` holds torchtitan's own forward's logits), and an HF ``LlamaForCausalLM``
that transformers saved. Checked as a model: logits within 1e-5 of the framework's, no
missing or unexpected keys; and each transform shown to matter: a spec without it gives
other logits. Needs the ``interop`` extra (transformers); skipped cleanly without it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import check_error, completed, fixture_path, run_many, sha256, subprocess_env

transformers = pytest.importorskip("transformers", exc_type=ImportError)

TITAN = fixture_path("torchtitan")
RUNS = {  # fixture -> the HF class it becomes, tied or not
    "llama3": ("LlamaForCausalLM", False),
    "llama3_tied": ("LlamaForCausalLM", True),
    "qwen3": ("Qwen3ForCausalLM", True),
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def loaded(folder: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True
    )
    return model.eval(), info


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model, info = loaded(folder)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize(  # (the tied llama's logits in the slow suite: qwen3 is tied too)
    "run", [pytest.param(r, marks=pytest.mark.slow) if r == "llama3_tied" else r for r in RUNS]
)
def test_torchtitan_llama3_to_hf_gives_torchtitans_logits(run, tmp_path):
    source = TITAN / run
    out = tmp_path / "hf"
    (done,) = run_many(
        [["convert", source / "step-2", "--to", "hf", "--config", source / "config.json"]
         + ["-o", f"{out}/", "--check"]]
    )  # fmt: skip
    assert done["code"] == 0, done["stderr"]
    hf_class, tied = RUNS[run]
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:  # a tied head is never a copy
        written = list(f.keys())
    assert ("lm_head.weight" in written) is not tied
    assert done["stderr"].splitlines()[-1].startswith(f"wrote {out} ({len(written)} tensors, ")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    truth = torch.load(source / "truth.pt")
    got = hf_logits(out, truth["tokens"])
    assert (got - truth["logits"]).abs().max().item() <= 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert (config["torch_dtype"], config["architectures"]) == ("float32", [hf_class])
    assert type(loaded(out)[0]).__name__ == hf_class


@pytest.mark.parametrize("broken", ["rope_q", "rope_k"])
def test_a_spec_without_its_rope_permutation_is_caught_by_the_logits(broken, tmp_path):
    """The names and shapes of a wrong mapping are all right: only the logits tell."""
    from ckpttool.convert import HfOptions, convert
    from ckpttool.mappings import specs

    source = TITAN / "llama3"
    truth = torch.load(source / "truth.pt")
    spec = specs.TORCHTITAN_LLAMA3
    renames = tuple(
        r.__class__(r.source, r.target, "same" if r.transform == broken else r.transform)
        for r in spec.renames
    )
    wrong = spec.__class__(spec.name, spec.arch, renames, spec.drops, spec.embedding, spec.head)
    options = HfOptions(config=str(source / "config.json"), check=True)
    saved = dict(specs.SPECS)
    specs.SPECS[spec.name] = wrong
    try:
        convert([str(source / "step-2")], "hf", str(tmp_path / "wrong") + "/", hf=options)
    finally:
        specs.SPECS.clear()
        specs.SPECS.update(saved)
    convert([str(source / "step-2")], "hf", str(tmp_path / "right") + "/", hf=options)
    right = hf_logits(tmp_path / "right", truth["tokens"])
    assert (right - truth["logits"]).abs().max().item() <= 1e-5
    off = (hf_logits(tmp_path / "wrong", truth["tokens"]) - truth["logits"]).abs().max().item()
    assert off > 1e-3, off


def test_rope_rows_are_gathered_across_uneven_row_shards(tmp_path):
    """q rows as FSDP and DCP split them (along dim 0, unevenly): the gathered tensor
    is the permutation transformers' converter computes, from each shard's rows."""
    from ckpttool.api import read
    from ckpttool.mappings.rows import rope_from_hf, rope_to_hf, strided_rows
    from ckpttool.tensors import load_leaf
    from ckpttool.tree import Shard, ShardedRef

    heads, head_dim, cols = 3, 6, 5
    w = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(-1, cols)
    torch.save({"w": w}, tmp_path / "w.pt")
    ref = read(str(tmp_path / "w.pt")).root["w"]
    cuts = [0, 4, 5, 11, 18]  # uneven: a head's rows over two and three shards
    shards = [
        Shard((a, 0), (b - a, cols), strided_rows(ref, a, 1, b - a))
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    sharded = ShardedRef(ref.dtype, tuple(ref.shape), shards)
    want = w.view(heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(-1, cols)
    for source in (ref, sharded):
        got = load_leaf(rope_to_hf(source, heads, "w"))
        assert torch.equal(got, want)
        assert torch.equal(rope_from_hf(got, heads), w)  # the inverse, for the way back


def test_hf_named_llama_saved_by_transformers_is_completed(tmp_path):
    """An HF state dict (here transformers' own save) maps as it is (``hf:llama``): the
    folder gets its config with the dtype written, and the same logits."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=32, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "saved")
    tokens = torch.tensor([[1, 4, 9, 2, 30]])
    with torch.no_grad():
        want = model(tokens).logits
    runs = run_many(
        [
            ["convert", tmp_path / "saved", "--to", "hf", "-o", f"{tmp_path / 'out'}/"],
            ["convert", tmp_path / "saved", "--to", "hf", "--dry-run", "--json"],
            ["convert", tmp_path / "saved", "--to", "hf", "--dtype", "bf16", "-o",
             f"{tmp_path / 'bf16'}/", "--max-shard-size", "4KB"],
        ]
    )  # fmt: skip
    assert [r["code"] for r in runs] == [0, 0, 0], [r["stderr"] for r in runs]
    assert torch.equal(hf_logits(tmp_path / "out", tokens), want)
    data = json.loads(runs[1]["stdout"])
    assert data["mapping"] == "hf:llama" and data["architecture"] == "LlamaForCausalLM"
    assert {t["transform"] for t in data["tensors"]} == {"same"}
    assert len(data["tensors"]) == len(model.state_dict())
    bf16 = tmp_path / "bf16"
    names = sorted(os.listdir(bf16))
    assert "model.safetensors.index.json" in names and "config.json" in names
    assert len([n for n in names if n.startswith("model-")]) > 1
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(bf16, dtype="auto")
    assert reloaded.dtype == torch.bfloat16  # (the config's torch_dtype: what was written)
    assert not (tmp_path / "saved-hf").exists()  # the dry run wrote nothing


# HF architectures whose checkpoints come under their own names: (config class, kwargs)
LLAMA_LIKE = {
    "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 32,
    "max_position_embeddings": 64,
}  # fmt: skip
HF_NAMED = {
    "mistral": ("MistralConfig", {**LLAMA_LIKE, "sliding_window": 4}),
    "qwen2": ("Qwen2Config", {**LLAMA_LIKE, "tie_word_embeddings": True}),  # (q, k, v biases)
    "gpt2": (  # (Conv1D weights, learned positions, LayerNorm biases; tied)
        "GPT2Config",
        {"n_embd": 16, "n_layer": 2, "n_head": 4, "vocab_size": 32, "n_positions": 64,
         "bos_token_id": 0, "eos_token_id": 0},
    ),
}  # fmt: skip


@pytest.mark.parametrize("arch", HF_NAMED)
def test_hf_named_models_are_completed_with_their_own_logits(arch, tmp_path):
    """Mistral (Llama's names: the config's model_type decides), Qwen2 (q, k, v biases;
    tied) and GPT-2 (Conv1D, positions, LayerNorms; its old mask buffers dropped), each
    as transformers saves it and as a DDP training snapshot of it
    (``module.`` keys beside the step, the model's config passed): the folder loads with
    no missing or unexpected key and gives the model's own logits, bitwise."""
    name, extra = HF_NAMED[arch]
    torch.manual_seed(0)
    config = getattr(transformers, name)(**extra)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # (biases start at zero: give them values the logits show)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(tmp_path / "saved")
    state = model.state_dict()
    if arch == "gpt2":  # as older transformers saved GPT-2: the causal mask as buffers
        state |= {f"transformer.h.{i}.attn.bias": torch.ones(1, 1, 64, 64).tril() for i in (0, 1)}
    snapshot = {"model": {f"module.{k}": v for k, v in state.items()}, "step": 3}
    torch.save(snapshot, tmp_path / "snapshot.pt")
    tokens = torch.tensor([[1, 4, 9, 2, 30]])
    with torch.no_grad():
        want = model(tokens).logits
    config_file = tmp_path / "saved" / "config.json"
    runs = run_many(
        [
            ["convert", tmp_path / "saved", "--to", "hf", "-o", f"{tmp_path / 'a'}/"],
            ["convert", tmp_path / "snapshot.pt", "--to", "hf", "--config", config_file,
             "-o", f"{tmp_path / 'b'}/"],
            ["convert", tmp_path / "snapshot.pt", "--to", "hf", "--config", config_file,
             "--dry-run", "--json"],
        ]
    )  # fmt: skip
    assert [r["code"] for r in runs] == [0, 0, 0], [r["stderr"] for r in runs]
    for out in ("a", "b"):
        written = json.loads((tmp_path / out / "config.json").read_text())
        assert written["architectures"] == [model.__class__.__name__]
        assert written["model_type"] == arch
        assert torch.equal(hf_logits(tmp_path / out, tokens), want)
    data = json.loads(runs[2]["stdout"])
    assert data["mapping"] == f"hf:{arch}"
    assert data["architecture"] == model.__class__.__name__
    if arch == "gpt2":
        assert sorted(d["source"] for d in data["dropped"]) == [
            "lm_head.weight",  # (tied: the embedding's bytes)
            "transformer.h.0.attn.bias",
            "transformer.h.1.attn.bias",
        ]
    # (the generation config beside the --config comes along)
    assert sorted(os.listdir(tmp_path / "b")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_look_alike_names_without_a_model_type_are_not_guessed(tmp_path):
    """Llama's and Mistral's tensors have the same names: a config that does not say
    which (no model_type) is refused naming both, never a silent pick."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=32, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    untyped = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    (tmp_path / "untyped.json").write_text(json.dumps(untyped))
    argvs = [
        ["convert", tmp_path / "model.pt", "--to", "hf", "--config", tmp_path / "untyped.json",
         "-o", f"{tmp_path / 'x'}/"],
        ["convert", tmp_path / "model.pt", "--to", "hf", "--config", tmp_path / "untyped.json",
         "--arch", "mistral", "-o", f"{tmp_path / 'y'}/"],
    ]  # fmt: skip
    runs = [completed(a, r) for a, r in zip(argvs, run_many(argvs), strict=True)]
    check_error(runs[0], 2, "the tensors fit hf:llama and hf:mistral", "model_type")
    assert not (tmp_path / "x").exists()
    assert runs[1].returncode == 0, runs[1].stderr
    assert json.loads((tmp_path / "y" / "config.json").read_text())["model_type"] == "mistral"


def test_refusals_name_what_is_wrong(tmp_path):
    source = TITAN / "llama3"
    config = json.loads((source / "config.json").read_text())
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**config, "hidden_size": 32}))
    sd = {k: v for k, v in _titan_state(source).items() if k != "layers.1.feed_forward.w3.weight"}
    torch.save(sd, tmp_path / "partial.pt")
    torch.save({"encoder.w": torch.ones(3)}, tmp_path / "other.pt")
    headless = tmp_path / "headless.json"
    headless.write_text(json.dumps({k: v for k, v in config.items() if "heads" not in k}))
    argvs = [
        ["convert", source / "step-2", "--to", "hf", "--config", wrong, "-o", tmp_path / "a/"],
        ["convert", tmp_path / "partial.pt", "--to", "hf", "--config", source / "config.json"]
        + ["-o", tmp_path / "b/"],
        ["convert", tmp_path / "other.pt", "--to", "hf", "--config", source / "config.json"],
        ["convert", source / "step-2", "--to", "hf", "-o", tmp_path / "c/"],
        ["convert", source / "step-2", "--to", "safetensors", "--arch", "llama"],
        ["convert", source / "step-2", "--to", "hf", "--config", headless, "--dry-run"],
    ]
    runs = [completed(a, r) for a, r in zip(argvs, run_many(argvs), strict=True)]
    check_error(
        runs[0], 2,
        "the config says hidden_size 32, the checkpoint 16 (tok_embeddings.weight)",
    )  # fmt: skip
    check_error(
        runs[1], 2, "LlamaForCausalLM of this config: missing: model.layers.1.mlp.up_proj.weight"
    )
    check_error(runs[2], 2, "no mapping to a Hugging Face architecture knows these tensors")
    check_error(runs[3], 2, "--to hf needs the model's config", "pass --config")
    check_error(runs[4], 2, "--arch, --config, --tokenizer, --dry-run, --check and --json")
    check_error(runs[5], 2, "the config has no num_attention_heads (a positive integer)")
    assert sorted(os.listdir(tmp_path)) == ["headless.json", "other.pt", "partial.pt", "wrong.json"]


def test_the_same_folder_from_workers(tmp_path):
    """An export is an output like any: ``--workers 2`` writes the bytes one process does."""
    import subprocess
    import sys

    source = TITAN / "llama3"
    argv = ["convert", str(source / "step-2"), "--to", "hf"]
    argv += ["--config", str(source / "config.json")]
    (one,) = run_many([[*argv, "-o", f"{tmp_path / 'one'}/"]])
    assert one["code"] == 0, one["stderr"]
    done = subprocess.run(
        [sys.executable, "-m", "ckpttool", *argv, "-o", f"{tmp_path / 'two'}/", "--workers", "2"],
        capture_output=True, text=True, env=subprocess_env(CKPTTOOL_UNIT_BYTES="4096"),
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sha256(tmp_path / "one") == sha256(tmp_path / "two")


def _titan_state(source: Path) -> dict:
    """The torchtitan checkpoint's tensors, read by torch's own DCP loader."""
    return _titan_state_of(source / "step-2")


def test_fixture_is_as_its_script_says(tmp_path):
    """The committed torchtitan folders read back (by torch's own loader) as the model
    the truth's logits were computed from: every tensor of the HF output is the
    torchtitan tensor through the spec, bitwise."""
    from safetensors.torch import load_file

    source = TITAN / "llama3"
    state = _titan_state(source)
    (done,) = run_many(
        [["convert", source / "step-2", "--to", "hf", "--config", source / "config.json",
          "-o", f"{tmp_path / 'hf'}/"]]
    )  # fmt: skip
    assert done["code"] == 0, done["stderr"]
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(got["model.embed_tokens.weight"], state["tok_embeddings.weight"])
    assert torch.equal(
        got["model.layers.1.mlp.down_proj.weight"], state["layers.1.feed_forward.w2.weight"]
    )
    q = state["layers.0.attention.qkv_linear.wq.weight"]
    assert torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"],
        q.view(4, 2, 2, 16).transpose(1, 2).reshape(16, 16),
    )
    shutil.rmtree(tmp_path / "hf")


@pytest.mark.parametrize("run", ["llama3", "llama3_tied"])
def test_the_way_back_is_the_checkpoint_torchtitan_saved(run, tmp_path):
    """``--to dcp --layout torchtitan:llama3`` of the HF folder: torch's own DCP loader
    reads back every tensor torchtitan saved, under its names, bitwise (the RoPE rows
    put back), a tied head under its own name again."""
    source = TITAN / run
    hf, back = tmp_path / "hf", tmp_path / "back"
    runs = run_many(
        [
            ["convert", source / "step-2", "--to", "hf", "--config", source / "config.json"]
            + ["-o", f"{hf}/"],
            ["convert", hf, "--to", "dcp", "--layout", "torchtitan:llama3", "-o", f"{back}/"],
            ["convert", hf, "--to", "dcp", "--layout", "nosuch:arch", "-o", tmp_path / "x/"],
            ["convert", hf, "--to", "pt", "--layout", "torchtitan:llama3"],
        ]
    )
    assert [r["code"] for r in runs[:2]] == [0, 0], [r["stderr"] for r in runs]
    want = _titan_state(source)
    got = _titan_state_of(back)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert runs[2]["code"] == 2 and "unknown --layout 'nosuch:arch'" in runs[2]["stderr"]
    assert runs[3]["code"] == 2 and "--layout applies to --to dcp only" in runs[3]["stderr"]


def _titan_state_of(folder: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    meta = reader.read_metadata()
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def test_diff_across_the_mapping_pairs_a_checkpoint_with_its_export(tmp_path):
    """``diff TITAN HF --arch torchtitan:llama3``: bitwise through the spec (RoPE rows and
    all); a q projection left in Meta's layout is the one difference named."""
    from safetensors.torch import load_file, save_file

    source = TITAN / "llama3_tied"
    hf = tmp_path / "hf"
    (made,) = run_many(
        [["convert", source / "step-2", "--to", "hf", "--config", source / "config.json",
          "-o", f"{hf}/"]]
    )  # fmt: skip
    assert made["code"] == 0, made["stderr"]
    wrong = tmp_path / "wrong"
    shutil.copytree(hf, wrong)
    tensors = load_file(wrong / "model.safetensors")
    q = "model.layers.1.self_attn.q_proj.weight"
    tensors[q] = torch.from_numpy(  # HF's halves back to Meta's pairs: names and shapes the same
        tensors[q].view(4, 2, 2, 16).transpose(1, 2).reshape(16, 16).numpy().copy()
    )
    save_file(tensors, wrong / "model.safetensors", metadata={"format": "pt"})
    same, off, neither = run_many(
        [
            ["diff", source / "step-2", hf, "--arch", "torchtitan:llama3"],
            ["diff", source / "step-2", wrong, "--arch", "llama", "--json"],
            ["diff", source / "step-2", source / "step-2", "--arch", "llama"],
        ]
    )
    assert (same["code"], same["stdout"]) == (
        0,
        "equal: 20 tensors compared (bitwise); A mapped through torchtitan:llama3 to "
        "LlamaForCausalLM\n",
    )
    report = json.loads(off["stdout"])
    assert off["code"] == 1 and [d["name"] for d in report["different"]] == [q]
    assert report["mapping"] == {
        "side": "a", "spec": "torchtitan:llama3", "architecture": "LlamaForCausalLM"
    }  # fmt: skip
    assert neither["code"] == 2 and "neither side is in a layout" in neither["stderr"]
