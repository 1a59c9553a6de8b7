"""The collapsing rule of inspect's tables, on the layer names of real model families,
and the plain-text helpers behind the human output (escaping, units, counts)."""

from __future__ import annotations

import itertools
import re

import pytest

from ckpttool.cli.collapse import collapse, number_set
from ckpttool.cli.text import columns, human_bytes, human_count, plural, printable


def expand(name: str) -> set[str]:
    """Every name a collapsed row stands for ({0..3}, {0,2,5..7}; no elisions)."""
    parts = []
    for part in re.split(r"\.(?![^{]*\})", name):  # not the dots of {0..31}
        m = re.fullmatch(r"\{(.*)\}", part)
        if not m:
            parts.append([part])
            continue
        values = []
        for item in m.group(1).split(","):
            a, _, b = item.partition("..")
            values += [str(v) for v in range(int(a), int(b or a) + 1)]
        parts.append(values)
    return {".".join(p) for p in itertools.product(*parts)}


def check_exact(names: list[str], signatures: list, rows) -> None:
    """Rows cover every entry once, and each row's name stands for exactly its members."""
    assert sorted(i for row in rows for i in row.members) == list(range(len(names)))
    for row in rows:
        assert expand(row.name) == {names[i] for i in row.members}, row
        assert len({signatures[i] for i in row.members}) == 1


def llama(layers: int = 32) -> list[tuple[str, tuple]]:
    out = [("model.embed_tokens.weight", (32000, 4096))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (4096, 4096)),
            (p + "self_attn.k_proj.weight", (4096, 4096)),
            (p + "self_attn.v_proj.weight", (4096, 4096)),
            (p + "self_attn.o_proj.weight", (4096, 4096)),
            (p + "mlp.gate_proj.weight", (11008, 4096)),
            (p + "mlp.up_proj.weight", (11008, 4096)),
            (p + "mlp.down_proj.weight", (4096, 11008)),
            (p + "input_layernorm.weight", (4096,)),
            (p + "post_attention_layernorm.weight", (4096,)),
        ]
    return out + [("model.norm.weight", (4096,)), ("lm_head.weight", (32000, 4096))]


def rows_of(entries):
    names = [n for n, _ in entries]
    signatures = [s for _, s in entries]
    rows = collapse(entries)
    check_exact(names, signatures, rows)
    return [(row.name, row.count) for row in rows]


def test_llama_layers_collapse_to_one_row_each():
    assert rows_of(llama()) == [
        ("model.embed_tokens.weight", 1),
        ("model.layers.{0..31}.self_attn.q_proj.weight", 32),
        ("model.layers.{0..31}.self_attn.k_proj.weight", 32),
        ("model.layers.{0..31}.self_attn.v_proj.weight", 32),
        ("model.layers.{0..31}.self_attn.o_proj.weight", 32),
        ("model.layers.{0..31}.mlp.gate_proj.weight", 32),
        ("model.layers.{0..31}.mlp.up_proj.weight", 32),
        ("model.layers.{0..31}.mlp.down_proj.weight", 32),
        ("model.layers.{0..31}.input_layernorm.weight", 32),
        ("model.layers.{0..31}.post_attention_layernorm.weight", 32),
        ("model.norm.weight", 1),
        ("lm_head.weight", 1),
    ]


def test_gpt2_blocks():
    entries = [("transformer.wte.weight", (50257, 768)), ("transformer.wpe.weight", (1024, 768))]
    for i in range(12):
        p = f"transformer.h.{i}."
        entries += [
            (p + "ln_1.weight", (768,)),
            (p + "attn.c_attn.weight", (768, 2304)),
            (p + "attn.c_attn.bias", (2304,)),
            (p + "attn.c_proj.weight", (768, 768)),
            (p + "mlp.c_fc.weight", (768, 3072)),
        ]
    entries.append(("transformer.ln_f.weight", (768,)))
    assert rows_of(entries) == [
        ("transformer.wte.weight", 1),
        ("transformer.wpe.weight", 1),
        ("transformer.h.{0..11}.ln_1.weight", 12),
        ("transformer.h.{0..11}.attn.c_attn.weight", 12),
        ("transformer.h.{0..11}.attn.c_attn.bias", 12),
        ("transformer.h.{0..11}.attn.c_proj.weight", 12),
        ("transformer.h.{0..11}.mlp.c_fc.weight", 12),
        ("transformer.ln_f.weight", 1),
    ]


def test_bert_encoder_layers():
    entries = [("bert.embeddings.word_embeddings.weight", (30522, 768))]
    for i in range(12):
        p = f"bert.encoder.layer.{i}."
        entries += [
            (p + "attention.self.query.weight", (768, 768)),
            (p + "attention.output.LayerNorm.weight", (768,)),
            (p + "intermediate.dense.weight", (3072, 768)),
        ]
    entries.append(("bert.pooler.dense.weight", (768, 768)))
    assert rows_of(entries) == [
        ("bert.embeddings.word_embeddings.weight", 1),
        ("bert.encoder.layer.{0..11}.attention.self.query.weight", 12),
        ("bert.encoder.layer.{0..11}.attention.output.LayerNorm.weight", 12),
        ("bert.encoder.layer.{0..11}.intermediate.dense.weight", 12),
        ("bert.pooler.dense.weight", 1),
    ]


def test_mixtral_experts_collapse_on_both_numbers():
    entries = []
    for i in range(32):
        entries.append((f"model.layers.{i}.block_sparse_moe.gate.weight", (8, 4096)))
        for e in range(8):
            p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            entries += [(p + "w1.weight", (14336, 4096)), (p + "w2.weight", (4096, 14336))]
    assert rows_of(entries) == [
        ("model.layers.{0..31}.block_sparse_moe.gate.weight", 32),
        ("model.layers.{0..31}.block_sparse_moe.experts.{0..7}.w1.weight", 256),
        ("model.layers.{0..31}.block_sparse_moe.experts.{0..7}.w2.weight", 256),
    ]


def test_rows_are_exact_when_a_block_is_missing_or_different():
    """Layer 3 lacks expert 7 and layer 5's w1 has another shape: no row may claim them."""
    entries = []
    for i in range(8):
        for e in range(8):
            if (i, e) == (3, 7):
                continue
            shape = (16, 8) if i != 5 else (32, 8)
            entries.append((f"layers.{i}.experts.{e}.w1", shape))
    rows = rows_of(entries)
    assert ("layers.{0..2,4,6,7}.experts.{0..7}.w1", 48) in rows
    assert ("layers.3.experts.{0..6}.w1", 7) in rows
    assert ("layers.5.experts.{0..7}.w1", 8) in rows
    assert len(rows) == 3


def test_only_plain_numbers_vary():
    """conv1/conv2 and zero-padded parts are names, not numbers."""
    entries = [("conv1.weight", (3,)), ("conv2.weight", (3,)), ("a.01.w", (1,)), ("a.1.w", (1,))]
    assert rows_of(entries) == [
        ("conv1.weight", 1),
        ("conv2.weight", 1),
        ("a.01.w", 1),
        ("a.1.w", 1),
    ]


@pytest.mark.parametrize(
    ("values", "text"),
    [
        ([5], "5"),
        ([0, 1], "{0,1}"),
        (list(range(32)), "{0..31}"),
        ([0, 2, 5, 6, 7], "{0,2,5..7}"),
        (list(range(1, 284, 9)), "{1,10,…,280}"),
        ([0, 2, 3, 7, 9, 20], "{0,2,3,…,20}"),
    ],
)
def test_number_sets(values, text):
    assert number_set(values) == text


def test_printable_escapes_what_could_move_the_cursor_or_start_a_line():
    assert printable("model.layers.0.weight") == "model.layers.0.weight"
    assert printable("a\nsecurity: ok") == "a\\nsecurity: ok"
    assert printable("\x1b[2J\x1b[31mred\r\t") == "\\x1b[2J\\x1b[31mred\\r\\t"
    assert printable("abc\u202edcba\u2028\x85") == "abc\\u202edcba\\u2028\\x85"
    assert printable("größe 重み") == "größe 重み"  # printable text stays as it is


def test_units_and_counts():
    assert human_bytes(336) == "336 B"
    assert human_bytes(13_476_839_424) == "12.6 GiB"
    assert human_count(6_738_415_616) == "6.74B"
    assert human_count(124_439_808) == "124M"
    assert human_count(68_976_648_192) == "69.0B"
    assert human_count(999_999_999) == "1.00B"
    assert human_count(84) == "84"
    assert plural(1, "tensor") == "1 tensor"
    assert plural(2, "tensor") == "2 tensors"
    assert plural(1024, "entry", "entries") == "1,024 entries"


def test_columns_never_cut_or_wrap():
    name = "model.layers.10.post_attention_layernorm.weight" * 3
    lines = columns([["name", "size"], [name, "8 B"], ["x", "16 B"]], right={1})
    assert lines == [
        "  name" + " " * (len(name) - 4) + "  size",
        f"  {name}   8 B",
        "  x" + " " * (len(name) - 1) + "  16 B",
    ]
