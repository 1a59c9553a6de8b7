"""The tiny models and data sets the reference trainer trains on.

Kept apart from ``ddp_trainer.py`` the way pytorch/examples keeps ``datautils.py`` apart:
the trainer is about distributed training and snapshots, not about the model.

Both tasks are generated from fixed seeds, need no network and are small enough that an
epoch takes a fraction of a second on a CPU. Both use dropout on purpose: it consumes the
random number generator every step, so a resume that forgets to restore RNG state is
caught by the bitwise tests.
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

# 31 symbols: a prime, so the embedding and output layers (first dim = vocab size) shard
# unevenly over any world size from 2 to 30.
VOCAB = "\n !,.abcdefghijklmnopqrstuvwxyz"
BLOCK_SIZE = 32
CORPUS_SEED = 1234  # the data never depends on --seed; only init and dropout do
CORPUS_SAMPLES = 256

MLP_IN_FEATURES = 20
MLP_CLASSES = 5  # odd on purpose: fc2's first dim does not divide by 2 ranks
MLP_SAMPLES = 512

_WORDS = (
    "the a one every some model weight rank shard epoch snapshot optimizer step loss "
    "gradient tensor process group barrier resumes trains saves loads merges checks "
    "quickly slowly again never always exactly bitwise after before while"
).split()


def make_corpus(num_chars: int, seed: int = CORPUS_SEED) -> str:
    """Build a deterministic text of short sentences over ``VOCAB``."""
    rng = random.Random(seed)
    parts: list[str] = []
    length = 0
    while length < num_chars:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 9))]
        sentence = " ".join(words) + rng.choice([".", ".", ",", "!"]) + rng.choice([" ", "\n"])
        parts.append(sentence)
        length += len(sentence)
    return "".join(parts)[:num_chars]


class CharWindows(Dataset):
    """Non-overlapping windows of ``BLOCK_SIZE + 1`` characters: input and next-char target."""

    def __init__(self, text: str, block_size: int = BLOCK_SIZE):
        self.block_size = block_size
        self.data = torch.tensor([VOCAB.index(c) for c in text], dtype=torch.long)

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A nanoGPT-shaped character model (no weight tying, to keep state dicts plain)."""

    def __init__(self, dim: int = 32, layers: int = 2, heads: int = 2, dropout: float = 0.1):
        super().__init__()
        self.wte = nn.Embedding(len(VOCAB), dim)
        self.wpe = nn.Embedding(BLOCK_SIZE, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, len(VOCAB))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class MLP(nn.Module):
    """Two linear layers with dropout; the smallest model that still has an uneven shard."""

    def __init__(self, dim: int = 32, dropout: float = 0.1):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN_FEATURES, dim)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(dim, MLP_CLASSES)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.fc2(self.drop(F.relu(self.fc1(x))))
        return F.cross_entropy(logits, targets)


def synthetic_classification(seed: int = CORPUS_SEED) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(MLP_SAMPLES, MLP_IN_FEATURES, generator=g)
    teacher = torch.randn(MLP_IN_FEATURES, MLP_CLASSES, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def build_task(name: str, dim: int, layers: int) -> tuple[nn.Module, Dataset]:
    """Return ``(model, dataset)``; the model's ``forward(inputs, targets)`` returns the loss.

    Model weights come from the global torch RNG, so seed it first.
    """
    if name == "gpt":
        dataset = CharWindows(make_corpus(CORPUS_SAMPLES * BLOCK_SIZE + 1))
        return TinyGPT(dim=dim, layers=layers), dataset
    if name == "mlp":
        return MLP(dim=dim), synthetic_classification()
    raise ValueError(f"unknown model {name!r}: use gpt or mlp")
