"""Hugging Face architectures as data: the tensors a config implies, named and shaped.

Each architecture lists, for a ``config.json``, every tensor ``from_pretrained`` expects
(its name and shape), so an export is checked to produce exactly those (nothing
missing, nothing more) before a byte is written; and which config values the tensors
themselves say (a hidden size, a vocabulary), so a ``--config`` they contradict is
refused naming both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CkptError


@dataclass(frozen=True)
class Architecture:
    """One HF architecture: its class, ``model_type`` and the tensors of a config."""

    name: str
    hf_class: str
    model_type: str
    tensors: Callable[[Mapping[str, Any]], dict[str, tuple[int, ...]]]
    embedding: str  # the input embedding's HF name (tied with the head)
    head: str  # the output projection's HF name
    # the config's names of the values ckpttool reads (GPT-2's config says n_embd...)
    keys: Mapping[str, str] = field(default_factory=dict)

    def key(self, name: str) -> str:
        """The config's name for ``name`` (``hidden_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``vocab_size``)."""
        return self.keys.get(name, name)


def _llama_tensors(c: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, layers = positive(c, "hidden_size"), positive(c, "num_hidden_layers")
    heads = positive(c, "num_attention_heads")
    kv = positive(c, "num_key_value_heads", heads)
    head_dim = positive(c, "head_dim", hidden // heads)
    ffn, vocab = positive(c, "intermediate_size"), positive(c, "vocab_size")
    out = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    if not c.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (vocab, hidden)
    return out


def _qwen3_tensors(c: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Llama's tensors and each layer's q and k norms (over a head)."""
    out = _llama_tensors(c)
    head_dim = int(
        c.get("head_dim") or positive(c, "hidden_size") // positive(c, "num_attention_heads")
    )
    for i in range(positive(c, "num_hidden_layers")):
        for norm in ("q_norm", "k_norm"):
            out[f"model.layers.{i}.self_attn.{norm}.weight"] = (head_dim,)
    return out


def _qwen2_tensors(c: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Llama's tensors and the q, k and v projections' biases."""
    out = _llama_tensors(c)
    for i in range(positive(c, "num_hidden_layers")):
        p = f"model.layers.{i}.self_attn."
        for proj in ("q_proj", "k_proj", "v_proj"):
            out[p + proj + ".bias"] = out[p + proj + ".weight"][:1]
    return out


def _gpt2_tensors(c: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """GPT-2's: ``Conv1D`` weights stored (in, out), learned positions, LayerNorms."""
    hidden, layers = positive(c, "n_embd"), positive(c, "n_layer")
    vocab, positions = positive(c, "vocab_size"), positive(c, "n_positions")
    inner = positive(c, "n_inner", 4 * hidden)
    out = {
        "transformer.wte.weight": (vocab, hidden),
        "transformer.wpe.weight": (positions, hidden),
        "transformer.ln_f.weight": (hidden,),
        "transformer.ln_f.bias": (hidden,),
    }
    for i in range(layers):
        p = f"transformer.h.{i}."
        out |= {
            p + "ln_1.weight": (hidden,), p + "ln_1.bias": (hidden,),
            p + "attn.c_attn.weight": (hidden, 3 * hidden), p + "attn.c_attn.bias": (3 * hidden,),
            p + "attn.c_proj.weight": (hidden, hidden), p + "attn.c_proj.bias": (hidden,),
            p + "ln_2.weight": (hidden,), p + "ln_2.bias": (hidden,),
            p + "mlp.c_fc.weight": (hidden, inner), p + "mlp.c_fc.bias": (inner,),
            p + "mlp.c_proj.weight": (inner, hidden), p + "mlp.c_proj.bias": (hidden,),
        }  # fmt: skip
    if not c.get("tie_word_embeddings", True):  # (GPT-2 ties by default)
        out["lm_head.weight"] = (vocab, hidden)
    return out


# what ckpttool loops over, a step for each: layers and heads. A config may come from the
# checkpoint itself (a Megatron run's args), so a count past this is refused, not looped.
MAX_COUNT = 1 << 14
COUNTS = frozenset(
    {"num_hidden_layers", "n_layer", "num_attention_heads", "n_head", "num_key_value_heads"}
)


def positive(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """``config[key]``, a positive integer (``default`` where the config leaves it out or
    null); a count of :data:`COUNTS` at most :data:`MAX_COUNT`.

    Raises:
        CkptError: It is missing, something else or past the bound (named).
    """
    value = config.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CkptError(f"the config has no {key} (a positive integer): got {value!r}"[:200])
    if key in COUNTS and value > MAX_COUNT:
        raise CkptError(f"the config's {key} {value} is past {MAX_COUNT}: no model has so many")
    return value


ARCHITECTURES = {
    "llama": Architecture(
        "llama", "LlamaForCausalLM", "llama", _llama_tensors,
        "model.embed_tokens.weight", "lm_head.weight",
    ),
    # Mistral's tensors are Llama's (its sliding window is the config's alone)
    "mistral": Architecture(
        "mistral", "MistralForCausalLM", "mistral", _llama_tensors,
        "model.embed_tokens.weight", "lm_head.weight",
    ),
    "qwen2": Architecture(
        "qwen2", "Qwen2ForCausalLM", "qwen2", _qwen2_tensors,
        "model.embed_tokens.weight", "lm_head.weight",
    ),
    "qwen3": Architecture(
        "qwen3", "Qwen3ForCausalLM", "qwen3", _qwen3_tensors,
        "model.embed_tokens.weight", "lm_head.weight",
    ),
    "gpt2": Architecture(
        "gpt2", "GPT2LMHeadModel", "gpt2", _gpt2_tensors,
        "transformer.wte.weight", "lm_head.weight",
        keys={"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
              "num_attention_heads": "n_head"},
    ),
}  # fmt: skip


def check_tensors(
    arch: Architecture, config: Mapping[str, Any], produced: Mapping[str, tuple[int, ...]]
) -> None:
    """``produced`` (HF name -> shape) is exactly what ``arch`` needs for ``config``.

    Raises:
        CkptError: A tensor missing, one more, or one of another shape: named.
    """
    wanted = arch.tensors(config)
    missing = sorted(set(wanted) - set(produced))
    extra = sorted(set(produced) - set(wanted))
    wrong = [
        f"{name} {list(produced[name])} (the config says {list(shape)})"
        for name, shape in wanted.items()
        if name in produced and tuple(produced[name]) != tuple(shape)
    ]
    for what, names in (("missing", missing), ("not in the architecture", extra),
                        ("shaped otherwise", wrong)):  # fmt: skip
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise CkptError(
                f"{arch.hf_class} of this config: {what}: {shown}",
                hint="check --config against the checkpoint (ckpttool inspect)",
            )
