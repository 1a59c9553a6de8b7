"""A real consumer: Hugging Face transformers loads what ``ckpttool convert`` writes.

A tiny GPT-2 (built from a config, nothing downloaded) is wrapped in DDP, its DDP state
dict (``module.`` keys, ``lm_head.weight`` tied to ``transformer.wte.weight``) saved with
``torch.save`` and converted to HF safetensors shards. ``from_pretrained`` must load them
with no missing or unexpected keys and give bitwise the same logits.

Needs the ``interop`` extra (``pip install -e .[interop]``); skipped cleanly without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_cli, tree_files

transformers = pytest.importorskip("transformers", exc_type=ImportError)


@pytest.fixture
def ddp_gpt2(tmp_path: Path, monkeypatch):
    """(the model, the path of its DDP state dict saved with torch.save)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not dist.is_initialized()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=100,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        state = DDP(model).state_dict()
    finally:
        dist.destroy_process_group()
    assert all(k.startswith("module.") for k in state)
    tied = state["module.lm_head.weight"], state["module.transformer.wte.weight"]
    assert tied[0].data_ptr() == tied[1].data_ptr()  # one storage under two names
    path = tmp_path / "ddp.pt"
    torch.save(state, path)
    return model, path


def test_from_pretrained_loads_converted_ddp_shards(ddp_gpt2, tmp_path: Path):
    model, path = ddp_gpt2
    folder = tmp_path / "hf"
    proc = run_cli("convert", path, "--to", "safetensors", "--max-shard-size", "20KB", "-o", folder)
    assert proc.returncode == 0, proc.stderr

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert tree_files(folder) == [*shards, "model.safetensors.index.json"]
    # the tied head written once, as save_pretrained writes it (from_pretrained ties it)
    names = [k.removeprefix("module.") for k in torch.load(path)]
    assert list(index["weight_map"]) == [k for k in names if k != "lm_head.weight"]
    model.config.save_pretrained(folder)

    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    loaded.eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()

    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_pytorch_model_bin_shards_from_huggingface_hub_convert_and_load(ddp_gpt2, tmp_path: Path):
    """The older HF layout, written by its real producer: ``huggingface_hub`` saves
    ``pytorch_model-0000k-of-0000n.bin`` (torch.save) shards and ``pytorch_model.bin.index.json``.
    ckpttool reads the folder as one checkpoint and converts it to one safetensors file
    that ``from_pretrained`` loads."""
    from huggingface_hub import save_torch_state_dict

    model, _ = ddp_gpt2
    state = model.state_dict()
    src = tmp_path / "bin"
    src.mkdir()
    save_torch_state_dict(
        state,
        src,
        safe_serialization=False,
        max_shard_size="20KB",
        shared_tensors_to_discard=["lm_head.weight"],
    )
    index = json.loads((src / "pytorch_model.bin.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3

    report = json.loads(run_cli("inspect", "--json", src).stdout)
    assert report["format"] == "torch-zip"
    assert report["files"][0] == str(src / "pytorch_model.bin.index.json")
    assert [t["key"][0] for t in report["tensors"]] == list(index["weight_map"])

    out = tmp_path / "hf"
    out.mkdir()
    proc = run_cli("convert", src, "--to", "safetensors", "-o", out / "model.safetensors")
    assert proc.returncode == 0, proc.stderr
    model.config.save_pretrained(out)
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    loaded.eval()
    for name, tensor in state.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
