"""Write a Llama-2-7B-shaped safetensors file without its 12.6 GiB of data.

The header is real (names, dtypes, shapes, offsets, as ``save_file`` would write them:
sorted by name); the data is a hole in a sparse file, so ``ckpttool inspect`` shows
exactly what it shows for the real model, and the file takes a few KiB on disk. Used for
the inspect output in docs/cli.md (and the test that checks it, tests/test_inspect.py):

    python benchmarks/llama7b_shaped.py /tmp/llama2-7b.safetensors
    ckpttool inspect /tmp/llama2-7b.safetensors
"""

from __future__ import annotations

import json
import math
import struct
import sys

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 4096, 11008, 32, 32000


def shapes() -> dict[str, list[int]]:
    out = {"model.embed_tokens.weight": [VOCAB, HIDDEN], "lm_head.weight": [VOCAB, HIDDEN]}
    out["model.norm.weight"] = [HIDDEN]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"self_attn.{name}.weight"] = [HIDDEN, HIDDEN]
        out[p + "mlp.gate_proj.weight"] = [INTERMEDIATE, HIDDEN]
        out[p + "mlp.up_proj.weight"] = [INTERMEDIATE, HIDDEN]
        out[p + "mlp.down_proj.weight"] = [HIDDEN, INTERMEDIATE]
        out[p + "input_layernorm.weight"] = [HIDDEN]
        out[p + "post_attention_layernorm.weight"] = [HIDDEN]
    return out


def main(path: str) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in sorted(shapes().items()):
        size = math.prod(shape) * 2  # bf16
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)  # the tensor data: a hole


if __name__ == "__main__":
    main(sys.argv[1])
