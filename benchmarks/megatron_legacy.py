"""Merging a Llama-2-70B-shaped legacy Megatron-LM checkpoint of tensor parallel 8 x
pipeline parallel 4, against the copy floor, on sparse files.

The input is laid out as Megatron-LM's ``--ckpt-format torch`` saves a megatron-core
``GPTModel`` of the Llama layout (``fixtures/megatron/legacy_tp2_pp2/`` is its real save
at small size, by ``fixtures/make_megatron_legacy_fixtures.py``, which this follows):
``iter_0001000/mp_rank_TT_PPP/model_optim_rng.pt`` for each of the 32 ranks, a
``torch.save`` of ``{"args", "checkpoint_version": 3.0, "iteration", "model", ...}``
whose ``model`` is that rank's ``state_dict_for_save_checkpoint()``: its stage's layers
numbered from 0, each tensor its tensor-parallel slice (QKV, ``linear_fc1`` as
``[gate_r; up_r]``, the embedding and output rows; ``linear_proj`` and ``linear_fc2``
columns). Each file is ``torch.save``'s own output of zero tensors, written through a
file object that seeks over the zero blocks of 1 MiB and more instead of writing them
(the CRCs are torch's own): the input is a few MB on disk.

Timed, each a fresh process, ``--repeat`` times (medians; peak RSS the largest), outputs
removed and the disk synced between runs:

- ``merge``: ``ckpttool convert IN --to safetensors -o OUT.safetensors``: every tensor
  assembled from its 8 slices in 32 files, the layers renumbered;
- ``floor``: ``baselines.py durable-write`` of as many bytes as ``merge`` wrote.

    .venv/bin/python benchmarks/megatron_legacy.py --layers 8 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure import measure  # noqa: E402

LLAMA2_70B = {"hidden": 8192, "ffn": 28672, "heads": 64, "groups": 8, "vocab": 32000}
TP, PP = 8, 4
HOLE = 1 << 20  # a zero block this long or longer is skipped (a hole), not written


class HoleWriter:
    """A binary file that leaves long runs of zeros as holes (sparse)."""

    def __init__(self, path: Path):
        self.f = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.size = 0

    def write(self, data) -> int:
        import numpy as np

        view = memoryview(data).cast("B")
        n = len(view)
        if n >= HOLE and not np.frombuffer(view, np.uint8).any():
            self.f.seek(n, os.SEEK_CUR)
        else:
            self.f.write(view)
        self.size += n
        return n

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.f.truncate(self.size)
        self.f.close()


def rank_state(tp_rank: int, stage: int, layers: int) -> dict:
    """One rank's ``model`` (megatron-core's local-spec names, as its
    ``state_dict_for_save_checkpoint`` gives them)."""
    import torch

    s, bf16 = LLAMA2_70B, torch.bfloat16
    hd = s["hidden"] // s["heads"]
    qkv_rows = s["groups"] * (s["heads"] // s["groups"] + 2) * hd
    h = s["hidden"]
    model = {}
    if stage == 0:
        model["embedding.word_embeddings.weight"] = torch.zeros(s["vocab"] // TP, h, dtype=bf16)
    for i in range(layers // PP):
        at = f"decoder.layers.{i}."
        model[at + "input_layernorm.weight"] = torch.ones(h, dtype=bf16)
        model[at + "self_attention.linear_proj.weight"] = torch.zeros(h, h // TP, dtype=bf16)
        model[at + "self_attention.linear_proj._extra_state"] = None
        model[at + "self_attention.linear_qkv.weight"] = torch.zeros(qkv_rows // TP, h, dtype=bf16)
        model[at + "self_attention.linear_qkv._extra_state"] = None
        model[at + "pre_mlp_layernorm.weight"] = torch.ones(h, dtype=bf16)
        model[at + "mlp.linear_fc1.weight"] = torch.zeros(2 * s["ffn"] // TP, h, dtype=bf16)
        model[at + "mlp.linear_fc1._extra_state"] = None
        model[at + "mlp.linear_fc2.weight"] = torch.zeros(h, s["ffn"] // TP, dtype=bf16)
        model[at + "mlp.linear_fc2._extra_state"] = None
    if stage == PP - 1:
        model["decoder.final_layernorm.weight"] = torch.ones(h, dtype=bf16)
        # (untied: not the embedding's bytes)
        model["output_layer.weight"] = torch.ones(s["vocab"] // TP, h, dtype=bf16)
        model["output_layer._extra_state"] = None
    return model


def build(out: Path, layers: int) -> int:
    """The checkpoint (see the module); returns the model's tensor bytes."""
    import torch

    s = LLAMA2_70B
    args = argparse.Namespace(
        num_layers=layers, hidden_size=s["hidden"], ffn_hidden_size=s["ffn"],
        num_attention_heads=s["heads"], group_query_attention=True,
        num_query_groups=s["groups"], kv_channels=s["hidden"] // s["heads"],
        max_position_embeddings=4096, normalization="RMSNorm", norm_epsilon=1e-5,
        swiglu=True, position_embedding_type="rope", rotary_base=10000,
        add_bias_linear=False, untie_embeddings_and_output_weights=True,
        padded_vocab_size=s["vocab"], tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=PP, ckpt_format="torch",
    )  # fmt: skip
    nbytes = 0
    iteration = out / "iter_0001000"
    for stage in range(PP):
        for tp_rank in range(TP):
            model = rank_state(tp_rank, stage, layers)
            nbytes += sum(t.nbytes for t in model.values() if t is not None)
            folder = iteration / f"mp_rank_{tp_rank:02d}_{stage:03d}"
            folder.mkdir(parents=True)
            state = {"args": args, "checkpoint_version": 3.0, "iteration": 1000, "model": model}
            writer = HoleWriter(folder / "model_optim_rng.pt")
            torch.save(state, writer)
            writer.close()
    (out / "latest_checkpointed_iteration.txt").write_text("1000")
    return nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="a multiple of 4 (of 80)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=str(HERE.parent / "bench-data" / "megatron-legacy"))
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    source = work / "in"
    nbytes = build(source, args.layers)
    disk = sum(f.stat().st_blocks * 512 for f in source.rglob("*") if f.is_file())
    py = sys.executable
    out = work / "out.safetensors"
    merge = measure(
        [py, "-m", "ckpttool", "convert", str(source), "--to", "safetensors", "-q", "-o", str(out)],
        outputs=[out],
        repeat=args.repeat,
    )
    written = work / "written.bin"
    with open(written, "wb") as f:
        f.truncate(nbytes)  # (the header's few KB aside: the same bytes)
    floor_out = work / "floor"
    floor = measure(
        [py, str(HERE / "baselines.py"), "durable-write", str(written), str(floor_out)],
        outputs=[floor_out],
        repeat=args.repeat,
    )
    gib = nbytes / 2**30
    print(
        f"\n{args.layers} layers of Llama-2-70B, tensor parallel {TP} x pipeline {PP} "
        f"({TP * PP} rank files, {disk / 2**20:.1f} MiB on disk): {gib:.2f} GiB of tensors"
    )
    print("| command | wall s | peak RSS MiB | vs floor |")
    print("|---|---|---|---|")
    for name, m in (("merge", merge), ("floor", floor)):
        print(f"| `{name}` | {m.wall:.2f} | {m.rss_mib:.0f} | {m.wall / floor.wall:.2f}x |")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
