"""``convert --to hf`` of a Llama-3-8B-shaped megatron-core ``torch_dist`` checkpoint, against
the copy floor, on sparse files.

The input is laid out as megatron-core's ``dist_checkpointing.save`` lays out a
Llama-layout ``GPTModel`` saved over tensor parallel 8 (``fixtures/megatron/llama/`` is
its real save at small size, which this follows): ``metadata.json``, ``common.pt`` (the
run's ``args``, ``checkpoint_version``, ``iteration``) and a DCP folder whose keys are
the stacked ShardedTensor keys (``decoder.layers.self_attention.linear_qkv.weight``
``[layers, 6144, 4096]``), one chunk per layer and tensor-parallel rank (``linear_fc1``:
a gate chunk and an up chunk per rank, as ``apply_swiglu_sharded_factory`` saves them),
each chunk ``torch.save``d by ``FileSystemWriter`` into its rank's ``__R_0.distcp``; the
``.metadata`` is torch's own ``Metadata`` pickled. The chunks are real ``torch.save``
records around holes (``make_dcp_scale.zip_template``: a zero tensor's bytes, never
written), so the input is a few MB on disk.

Timed, each a fresh process, in turn, ``--repeat`` times (medians), the outputs removed
and the disk synced before each:

- ``hf``: ``ckpttool convert IN --to hf -o OUT/`` (the config from the run's args): the
  layers unstacked, QKV split per query group, gate and up split, all row gathers;
- ``safetensors``: ``ckpttool convert IN --to safetensors -o OUT.safetensors``: the
  same bytes under the stored names, nothing mapped;
- ``floor``: ``baselines.py durable-write`` of as many bytes as ``hf`` wrote.

    .venv/bin/python benchmarks/megatron_hf.py --layers 4 --repeat 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_dcp_scale import ZIP_OVERHEAD, zip_template  # noqa: E402

LLAMA3_8B = {"hidden": 4096, "ffn": 14336, "heads": 32, "groups": 8, "vocab": 128256}
TP = 8


def build(out: Path, layers: int) -> int:
    """The checkpoint (see the module); returns the model's tensor bytes."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    s = LLAMA3_8B
    hd = s["hidden"] // s["heads"]
    qkv_rows = s["groups"] * (s["heads"] // s["groups"] + 2) * hd
    L = "decoder.layers."
    # name -> (global shape, [(offsets, sizes, rank)])
    tensors: dict[str, tuple[tuple, list]] = {}

    def add(name, shape, chunks):
        tensors[name] = (shape, chunks)

    def split(rows, cols, dim, stacked=True, base_rows=0, total_rows=None):
        out = []
        for i in range(layers if stacked else 1):
            for r in range(TP):
                if dim == 0:
                    per = rows // TP
                    off, size = (base_rows + r * per, 0), (per, cols)
                else:
                    per = cols // TP
                    off, size = (0, r * per), (rows, per)
                lead_o, lead_s = ((i,), (1,)) if stacked else ((), ())
                out.append((lead_o + off, lead_s + size, r))
        return out

    add(
        "embedding.word_embeddings.weight",
        (s["vocab"], s["hidden"]),
        split(s["vocab"], s["hidden"], 0, stacked=False),
    )
    add(
        L + "self_attention.linear_qkv.layer_norm_weight",
        (layers, s["hidden"]),
        [((i, 0), (1, s["hidden"]), 0) for i in range(layers)],
    )
    add(
        L + "self_attention.linear_qkv.weight",
        (layers, qkv_rows, s["hidden"]),
        split(qkv_rows, s["hidden"], 0),
    )
    add(
        L + "self_attention.linear_proj.weight",
        (layers, s["hidden"], s["hidden"]),
        split(s["hidden"], s["hidden"], 1),
    )
    add(
        L + "mlp.linear_fc1.layer_norm_weight",
        (layers, s["hidden"]),
        [((i, 0), (1, s["hidden"]), 0) for i in range(layers)],
    )
    add(
        L + "mlp.linear_fc1.weight",
        (layers, 2 * s["ffn"], s["hidden"]),
        split(s["ffn"], s["hidden"], 0) + split(s["ffn"], s["hidden"], 0, base_rows=s["ffn"]),
    )
    add(
        L + "mlp.linear_fc2.weight",
        (layers, s["hidden"], s["ffn"]),
        split(s["hidden"], s["ffn"], 1),
    )
    add("decoder.final_layernorm.weight", (s["hidden"],), [((0,), (s["hidden"],), 0)])
    add("output_layer.weight", (s["vocab"], s["hidden"]),
        split(s["vocab"], s["hidden"], 0, stacked=False))  # fmt: skip

    md, storage, sizes = {}, {}, [0] * TP
    holes: list[list[tuple[int, bytes, int, bytes]]] = [[] for _ in range(TP)]
    nbytes = 0
    for name, (shape, chunks) in tensors.items():
        props = TensorProperties(dtype=torch.bfloat16)
        entry = TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=[])
        md[name] = entry
        for offsets, csizes, rank in chunks:
            entry.chunks.append(
                ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(csizes))
            )
            head, gap, tail = zip_template(torch.bfloat16, tuple(csizes))
            if name == "output_layer.weight" and rank == 0:  # (untied: not the embedding's
                buf = io.BytesIO()  # bytes, which are zeros; ckpttool compares them)
                torch.save(torch.ones(csizes, dtype=torch.bfloat16), buf)
                head, gap, tail = buf.getvalue(), 0, b""
            key = MetadataIndex(name, torch.Size(offsets), len(entry.chunks) - 1)
            length = len(head) + gap + len(tail)
            storage[key] = _StorageInfo(f"__{rank}_0.distcp", sizes[rank], length)
            holes[rank].append((sizes[rank], head, gap, tail))
            sizes[rank] += length
            nbytes += gap or len(head) - ZIP_OVERHEAD
    meta = Metadata(
        state_dict_metadata=md, storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(out), save_id="generated", load_id=None),
        version="1.0.0",
    )  # fmt: skip
    out.mkdir(parents=True)
    for rank in range(TP):
        with open(out / f"__{rank}_0.distcp", "wb") as f:
            for at, head, gap, tail in holes[rank]:
                f.seek(at)
                f.write(head)
                f.seek(gap, os.SEEK_CUR)
                f.write(tail)
            f.truncate(sizes[rank])
    (out / ".metadata").write_bytes(pickle.dumps(meta))
    (out / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1,
    }))  # fmt: skip
    args = argparse.Namespace(
        num_layers=layers, hidden_size=s["hidden"], ffn_hidden_size=s["ffn"],
        num_attention_heads=s["heads"], group_query_attention=True,
        num_query_groups=s["groups"], kv_channels=hd, max_position_embeddings=8192,
        normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
        position_embedding_type="rope", rotary_base=500000, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, padded_vocab_size=s["vocab"],
        tensor_model_parallel_size=TP, ckpt_format="torch_dist",
    )  # fmt: skip
    buf = io.BytesIO()
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1000}, buf)
    (out / "common.pt").write_bytes(buf.getvalue())
    return nbytes


def timed(cmd: list[str]) -> float:
    os.sync()
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=str(HERE.parent / "bench-data" / "megatron-hf"))
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    source = work / "in"
    nbytes = build(source, args.layers)
    py = sys.executable
    outs = {"hf": work / "out-hf", "safetensors": work / "out.safetensors", "floor": work / "floor"}
    cmds = {
        "hf": [py, "-m", "ckpttool", "convert", str(source), "--to", "hf", "-q",
               "-o", f"{outs['hf']}/"],
        "safetensors": [py, "-m", "ckpttool", "convert", str(source), "--to", "safetensors",
                        "-q", "-o", str(outs["safetensors"])],
    }  # fmt: skip
    samples: dict[str, list[float]] = {k: [] for k in outs}
    for _ in range(args.repeat):
        for side in ("hf", "safetensors", "floor"):
            for path in outs.values():
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(
                    missing_ok=True
                )
            if side == "floor":  # as many bytes as the HF folder holds
                subprocess.run(cmds["hf"], check=True, stdout=subprocess.DEVNULL)
                written = work / "written.bin"
                size = sum(f.stat().st_size for f in outs["hf"].iterdir())
                with open(written, "wb") as f:
                    f.truncate(size)
                shutil.rmtree(outs["hf"])
                cmd = [
                    py,
                    str(HERE / "baselines.py"),
                    "durable-write",
                    str(written),
                    str(outs["floor"]),
                ]
                samples[side].append(timed(cmd))
                written.unlink()
            else:
                samples[side].append(timed(cmds[side]))
    median = {k: statistics.median(v) for k, v in samples.items()}
    gib = nbytes / 2**30
    print(f"\n{args.layers} layers of Llama-3-8B, tensor parallel 8: {gib:.2f} GiB of tensors")
    print("| command | wall s | vs safetensors | vs floor |")
    print("|---|---|---|---|")
    for side in ("hf", "safetensors", "floor"):
        print(f"| `{side}` | {median[side]:.2f} | {median[side] / median['safetensors']:.2f}x "
              f"| {median[side] / median['floor']:.2f}x |")  # fmt: skip
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
