"""Megatron-core's stacked and fused layouts, undone as views of the stored bytes.

megatron-core's ``torch_dist`` checkpoints (``dist_checkpointing.save`` of a ``GPTModel``'s
``sharded_state_dict()``) keep each layer's weights stacked along a leading layer axis
(``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[layers, rows, hidden]``),
and fuse what Hugging Face keeps apart:

- ``linear_qkv``: per query group, that group's query heads, then its key head, then
  its value head, ``head_dim`` rows each (``SelfAttention.get_query_key_value_tensors``
  splits it so); HF's ``q_proj``, ``k_proj`` and ``v_proj`` are those rows gathered;
- ``linear_fc1`` under SwiGLU: the gate's rows, then the up projection's (saved
  tensor-parallel independent by ``apply_swiglu_sharded_factory``: all of the gate,
  then all of up);
- the word embeddings and output layer padded to a multiple of the vocabulary
  (Megatron-LM's ``make_vocab_size_divisible_by`` x tensor parallel): the config's
  ``vocab_size`` rows are kept.

Each is a row gather of a layer's view (:mod:`.rows`): no tensor is read at plan time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CkptError
from ..tree import Leaf
from .architectures import positive
from .rows import gather_rows, layer_of
from .spec import Transform

Pick = Callable[[Leaf, str], Leaf]


def transforms(config: Mapping[str, Any]) -> dict[str, Transform]:
    """The transforms of Megatron's layouts for a Llama-shaped ``config``.

    A layer transform returns one ``({"L": layer}, leaf)`` for each layer of the stack.
    """
    heads = positive(config, "num_attention_heads")
    groups = int(config.get("num_key_value_heads") or heads)
    hidden = positive(config, "hidden_size")
    head_dim = int(config.get("head_dim") or hidden // heads)
    ffn = positive(config, "intermediate_size")
    layers = positive(config, "num_hidden_layers")
    vocab = positive(config, "vocab_size")
    if heads % groups:
        raise CkptError(f"the config's {heads} heads are not in {groups} query groups")
    per_group = heads // groups
    group_rows = (per_group + 2) * head_dim
    qkv_runs = {
        "q": (0, per_group * head_dim),
        "k": (per_group * head_dim, head_dim),
        "v": ((per_group + 1) * head_dim, head_dim),
    }

    def per_layer(pick: Pick) -> Transform:
        def unstack(leaf: Leaf, _config: Any, name: str) -> list[tuple[dict, Leaf]]:
            if not leaf.shape or leaf.shape[0] != layers:
                raise CkptError(
                    f"tensor {name!r} {list(leaf.shape)} does not stack the config's "
                    f"{layers} layers"
                )
            return [({"L": str(i)}, pick(layer_of(leaf, i, name), name)) for i in range(layers)]

        return unstack

    def qkv(part: str) -> Pick:
        start, count = qkv_runs[part]

        def pick(layer: Leaf, name: str) -> Leaf:
            if layer.shape[0] != groups * group_rows:
                raise CkptError(
                    f"tensor {name!r}: {layer.shape[0]} rows are not {groups} query groups "
                    f"of {per_group} query heads, a key and a value head of {head_dim}"
                )
            return gather_rows(
                layer, [(g * group_rows + start, count) for g in range(groups)], name
            )

        return pick

    def glu(part: str) -> Pick:
        def pick(layer: Leaf, name: str) -> Leaf:
            if layer.shape[0] != 2 * ffn:
                raise CkptError(
                    f"tensor {name!r}: {layer.shape[0]} rows are not a gate and an up "
                    f"projection of {ffn}"
                )
            return gather_rows(layer, [(0 if part == "gate" else ffn, ffn)], name)

        return pick

    def vocab_rows(leaf: Leaf, _config: Any, name: str) -> Leaf:
        if leaf.shape[0] < vocab:
            raise CkptError(
                f"tensor {name!r}: {leaf.shape[0]} rows, the config's vocabulary {vocab}"
            )
        return leaf if leaf.shape[0] == vocab else gather_rows(leaf, [(0, vocab)], name)

    return {
        "layer": per_layer(lambda layer, _name: layer),
        "qkv_q": per_layer(qkv("q")),
        "qkv_k": per_layer(qkv("k")),
        "qkv_v": per_layer(qkv("v")),
        "glu_gate": per_layer(glu("gate")),
        "glu_up": per_layer(glu("up")),
        "vocab": vocab_rows,
    }
