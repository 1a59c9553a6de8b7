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

The model's ``config.json`` comes from the run itself where Megatron-LM saved its
arguments (``args`` in ``common.pt``): :data:`ARGS_TO_LLAMA` names the argument of each
config value, and :data:`LLAMA_ARGS` the values that make the run the Llama layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CkptError
from ..tree import Leaf
from .architectures import positive
from .rows import gather_rows, layer_of
from .spec import Transform

Pick = Callable[[Leaf, str], Leaf]

# LlamaConfig key -> Megatron-LM's argument (megatron/training/arguments.py: --hidden-size,
# --ffn-hidden-size, --num-query-groups, --norm-epsilon, --rotary-base...), first found
ARGS_TO_LLAMA = {
    "hidden_size": ("hidden_size",),
    "intermediate_size": ("ffn_hidden_size",),
    "num_attention_heads": ("num_attention_heads",),
    "num_hidden_layers": ("num_layers",),
    "vocab_size": ("vocab_size", "padded_vocab_size"),  # (the true size, else the padded)
    "max_position_embeddings": ("max_position_embeddings", "seq_length"),
    "rms_norm_eps": ("norm_epsilon",),
    "rope_theta": ("rotary_base",),
    "head_dim": ("kv_channels",),
}
# the arguments of a run in the Llama layout, and what each must be (where the run
# says it): rotary embeddings over whole heads, not interleaved, not scaled (a scaled
# RoPE needs a rope_scaling no argument here gives: refused, never a silent drift)
LLAMA_ARGS = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding_type": "rope",
    "add_bias_linear": False,
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
    "use_rope_scaling": False,
}


def merge_run_config(
    given: Mapping[str, Any], given_from: str, args: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The config from the run's own ``args`` where they say a value, from ``given`` (a
    ``--config``) for the rest, and where each came from. The padded vocabulary is a
    bound, not the vocabulary: a given ``vocab_size`` takes its place.

    Raises:
        CkptError: The two disagree on a value (named, both), or the args are not a
            Llama-layout run's.
    """
    from_args, came = config_from_args(args)
    padded = came.get("vocab_size") == "the run's args (padded_vocab_size)"
    if padded and given.get("vocab_size") is not None:
        del from_args["vocab_size"], came["vocab_size"]
    config = dict(given)
    sources = dict.fromkeys(given, given_from)
    for key, value in from_args.items():
        if key in given and given[key] != value:
            raise CkptError(
                f"the config says {key} {given[key]!r}, {came[key]} {value!r}",
                hint="pass the --config of this run's model, or none",
            )
        config[key], sources[key] = value, came[key]
    return config, sources


def config_from_args(args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A ``LlamaConfig`` from a Megatron-LM run's arguments, and the argument each value
    came from.

    Raises:
        CkptError: The arguments are not a Llama-layout run's (named).
    """
    for name, wanted in LLAMA_ARGS.items():
        if name in args and args[name] != wanted:
            said = repr(args[name])  # (the file's value: a line never holds all of it)
            raise CkptError(
                f"the run's args say {name}={said if len(said) <= 40 else said[:40] + '…'}: "
                f"not the Llama layout megatron:gpt maps ({name}={wanted!r})",
                hint="megatron:gpt maps runs of the Llama layout only",
            )
    config: dict[str, Any] = {"model_type": "llama", "hidden_act": "silu"}
    came = dict.fromkeys(config, "the Llama layout the run's args say")
    for key, names in ARGS_TO_LLAMA.items():
        found = next((n for n in names if args.get(n) is not None), None)
        if found is not None:
            value = args[found]
            # (what the file says goes into config.json: a finite number, or refused)
            number = isinstance(value, int) and not isinstance(value, bool)
            if not number and not (isinstance(value, float) and math.isfinite(value)):
                raise CkptError(f"the run's args' {found} is no number ({type(value).__name__})")
            config[key], came[key] = value, f"the run's args ({found})"
    if args.get("group_query_attention") and args.get("num_query_groups"):
        config["num_key_value_heads"] = args["num_query_groups"]
        came["num_key_value_heads"] = "the run's args (num_query_groups)"
    if "untie_embeddings_and_output_weights" in args:
        config["tie_word_embeddings"] = not args["untie_embeddings_and_output_weights"]
        came["tie_word_embeddings"] = "the run's args (untie_embeddings_and_output_weights)"
    return config, came


def transforms(config: Mapping[str, Any]) -> dict[str, Transform]:
    """The transforms of Megatron's layouts for a Llama-shaped ``config``.

    A layer transform returns one ``({"L": layer}, leaf)`` for each layer of the stack;
    its ``_of_layer`` twin takes one layer's tensor (a merged legacy save's
    ``decoder.layers.{L}.`` names).
    """
    heads = positive(config, "num_attention_heads")
    groups = positive(config, "num_key_value_heads", heads)
    hidden = positive(config, "hidden_size")
    head_dim = positive(config, "head_dim", hidden // heads)
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

    def of_layer(pick: Pick) -> Transform:
        return lambda leaf, _config, name: pick(leaf, name)

    picks: dict[str, Pick] = {
        "layer": lambda layer, _name: layer,
        "qkv_q": qkv("q"),
        "qkv_k": qkv("k"),
        "qkv_v": qkv("v"),
        "glu_gate": glu("gate"),
        "glu_up": glu("up"),
    }
    # each of a stack (unstacked here), and "_of_layer" of one layer's own tensor
    return {
        **{name: per_layer(pick) for name, pick in picks.items()},
        **{f"{name}_of_layer": of_layer(pick) for name, pick in picks.items() if name != "layer"},
        "vocab": vocab_rows,
    }
