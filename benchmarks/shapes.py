"""Transformer-like tensor layouts and deterministic contents for the benchmark inputs.

Shared by the single-process generator (``data.py``) and the torchrun worker
(``gen_distributed.py``). Every tensor is float32; a training snapshot holds the
model plus Adam's ``exp_avg`` and ``exp_avg_sq``, so it is about 3x the model.
"""

from __future__ import annotations

import math
import zlib

FLOAT32_BYTES = 4
MAX_HIDDEN = 1024
MAX_VOCAB = 16384  # 16384 x 1024 float32 = 64 MiB, the largest tensor at full scale
MAX_POSITIONS = 1024
ADAM_HYPERPARAMS = {
    "lr": 3e-4,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}


def _layer(i: int, h: int) -> list[tuple[str, tuple[int, ...]]]:
    p = f"transformer.h.{i}."
    return [
        (p + "ln_1.weight", (h,)),
        (p + "ln_1.bias", (h,)),
        (p + "attn.c_attn.weight", (3 * h, h)),
        (p + "attn.c_attn.bias", (3 * h,)),
        (p + "attn.c_proj.weight", (h, h)),
        (p + "attn.c_proj.bias", (h,)),
        (p + "ln_2.weight", (h,)),
        (p + "ln_2.bias", (h,)),
        (p + "mlp.c_fc.weight", (4 * h, h)),
        (p + "mlp.c_fc.bias", (4 * h,)),
        (p + "mlp.c_proj.weight", (h, 4 * h)),
        (p + "mlp.c_proj.bias", (h,)),
    ]


def nbytes(shape: tuple[int, ...]) -> int:
    return math.prod(shape) * FLOAT32_BYTES


def transformer_params(model_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """GPT-2-like parameter names and shapes adding up to about ``model_bytes``.

    Full scale keeps hidden 1024 and a 64 MiB embedding; small scales shrink both
    so that one layer stays below a quarter of the budget.
    """
    h = MAX_HIDDEN
    while h > 64 and 48 * h * h > model_bytes / 4:
        h //= 2
    vocab = max(64, min(MAX_VOCAB, int(model_bytes / 4 / (h * FLOAT32_BYTES))) // 64 * 64)
    params = [
        ("transformer.wte.weight", (vocab, h)),
        ("transformer.wpe.weight", (min(MAX_POSITIONS, vocab), h)),
    ]
    total = sum(nbytes(s) for _, s in params)
    i = 0
    while True:
        layer = _layer(i, h)
        size = sum(nbytes(s) for _, s in layer)
        if i > 0 and total + size > model_bytes:
            break
        params += layer
        total += size
        i += 1
    return params + [("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,))]


def largest_tensor_bytes(model_bytes: int) -> int:
    return max(nbytes(s) for _, s in transformer_params(model_bytes))


def seed_of(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def fill(shape: tuple[int, ...], *seed_parts: object, positive: bool = False):
    """A deterministic random float32 tensor (same seed parts -> same bytes)."""
    import torch

    g = torch.Generator().manual_seed(seed_of(*seed_parts))
    t = torch.empty(shape, dtype=torch.float32)
    if positive:
        return t.uniform_(0.0, 1e-4, generator=g)
    return t.normal_(0.0, 0.02, generator=g)


def chunk_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s block when ``rows`` are split like ``torch.chunk``."""
    size = -(-rows // world)
    start = min(rank * size, rows)
    return start, max(0, min(size, rows - start))
