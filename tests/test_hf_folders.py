"""Hugging Face folders in, Hugging Face folders out (issue 32, item 4): converting a model
folder or a Trainer checkpoint-N/ with ``-o DIR/`` gives a folder ``from_pretrained``
loads, with identical logits. Real transformers outputs: a tiny GPT-2 built from a
config in tmp_path (nothing downloaded) and the Trainer checkpoints in
fixtures/transformers. Needs the ``interop`` extra; skipped cleanly without it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import check_error, completed, fixture_path, run_many, tree_files
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers", exc_type=ImportError)

CHECKPOINTS = fixture_path("transformers")
TOKENS = torch.tensor([[1, 5, 7, 2, 9, 3, 3, 0]])


@pytest.fixture
def bin_folder(tmp_path: Path, monkeypatch) -> tuple[torch.nn.Module, Path]:
    """A model folder as ``save_pretrained(safe_serialization=False)`` writes it (tied
    GPT-2, ``pytorch_model.bin``), with a tokenizer saved beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=12, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path / "gpt2-bin"
    model.save_pretrained(folder, safe_serialization=False)
    if not (folder / "pytorch_model.bin").exists():
        # transformers 5 writes safetensors only: write the .bin as 4.x did (torch.save of
        # the state dict; the tied lm_head shares wte's storage)
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the a model rank shard".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
        folder
    )
    return model, folder


def logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def test_bin_model_folder_to_a_folder_from_pretrained_loads(bin_folder, tmp_path: Path):
    model, folder = bin_folder
    with torch.no_grad():
        want = model(TOKENS).logits
    carried = sorted(
        n for n in os.listdir(folder) if n.endswith(".json") or n.startswith("tokenizer")
    )
    assert "config.json" in carried and "tokenizer.json" in carried
    single, sharded, pt = tmp_path / "st", tmp_path / "shards", tmp_path / "pt"
    runs = run_many(
        [
            ["convert", folder, "--to", "safetensors", "-o", f"{single}/"],
            ["convert", folder, "--to", "safetensors", "--max-shard-size", "2KB", "-o", sharded],
            ["convert", folder, "--to", "pt", "-o", f"{pt}/"],
        ]
    )
    assert [r["code"] for r in runs] == [0, 0, 0], [r["stderr"] for r in runs]
    assert tree_files(single) == sorted([*carried, "model.safetensors"])
    shards = [n for n in tree_files(sharded) if n.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in tree_files(sharded)
    assert tree_files(sharded) == sorted([*carried, *shards, "model.safetensors.index.json"])
    assert tree_files(pt) == sorted([*carried, "pytorch_model.bin"])
    for out in (single, sharded, pt):
        assert torch.equal(logits(out), want), out
        for name in carried:  # copied byte for byte, no links
            assert not (out / name).is_symlink()
            assert (out / name).read_bytes() == (folder / name).read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(single)
    assert tokenizer("the model rank")["input_ids"] == [1, 3, 4]
    # the weights are the model's own tensors, bitwise
    state = model.state_dict()
    got = load_file(single / "model.safetensors")
    # the tied head written once, as save_pretrained writes it (from_pretrained ties it)
    assert sorted(got) == sorted(k for k in state if k != "lm_head.weight")
    assert all(torch.equal(got[k], state[k]) for k in got)


@pytest.mark.parametrize("run", ["gpt2_tied", "gpt2_bin"])
def test_trainer_checkpoint_to_a_folder_from_pretrained_loads(run, tmp_path: Path, monkeypatch):
    """transformers' own Trainer checkpoint-2/ (safetensors, and 4.x's pytorch_model.bin):
    its model goes out as an HF folder; the optimizer, scheduler and RNG state do not."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    checkpoint = CHECKPOINTS / run / "checkpoint-2"
    out = tmp_path / "model"
    (run_,) = run_many([["convert", checkpoint, "--to", "safetensors", "-o", f"{out}/"]])
    assert run_["code"] == 0, run_["stderr"]
    assert tree_files(out) == ["config.json", "generation_config.json", "model.safetensors"]
    assert torch.equal(logits(out), logits(checkpoint))


def test_hf_folder_output_follows_the_force_rules(bin_folder, tmp_path: Path):
    """An earlier output's files are replaced with --force only; the folder's other files
    stay; a tokenizer file that is a link out of the model folder is refused, nothing
    written."""
    _, folder = bin_folder
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    outside = tmp_path / "secret.txt"
    outside.write_text("not for the output")
    runs = run_many(
        [
            ["convert", folder, "--to", "safetensors", "-o", out],
            ["convert", folder, "--to", "safetensors", "-o", out],
            ["convert", folder, "--to", "safetensors", "-o", out, "--force"],
        ]
    )
    assert runs[0]["code"] == 0 and runs[2]["code"] == 0, runs[0]["stderr"] + runs[2]["stderr"]
    check_error(completed([], runs[1]), 2, "output exists: the folder holds a Hugging Face model")
    assert (out / "README.md").read_text() == "my notes"
    assert "model.safetensors" in tree_files(out) and "config.json" in tree_files(out)
    (folder / "vocab.json").symlink_to(outside)
    (run_,) = run_many([["convert", folder, "--to", "safetensors", "-o", f"{tmp_path / 'new'}/"]])
    check_error(completed([], run_), 2, "vocab.json is a link that leaves the model's folder")
    assert not (tmp_path / "new").exists()
