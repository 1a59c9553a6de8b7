"""The mappings, one spec per (source layout, HF architecture): data, nothing else.

Sources, cited by the code whose names they are:

- ``torchtitan:llama3``: torchtitan 0.3's ``Llama3Model`` (``qkv_linear.wq``) and the
  earlier ``attention.wq`` names, as ``torchtitan/models/llama3/state_dict_adapter.py``
  maps them to ``LlamaForCausalLM``; q and k rows from Meta's interleaved RoPE layout to
  HF's halves (its ``_permute``).
- ``torchtitan:qwen3``: torchtitan 0.3's dense ``Qwen3Model``, as
  ``torchtitan/models/qwen3/state_dict_adapter.py`` maps it to ``Qwen3ForCausalLM``: the
  Llama names, the q and k norms, no permutation (its rotary layout is HF's).
- ``megatron:gpt``: megatron-core's ``GPTModel`` with the Llama layout (RMSNorm, SwiGLU,
  grouped-query attention, RoPE not interleaved: HF's), as its ``torch_dist`` checkpoint
  holds it (``dist_checkpointing.save``: layers stacked, QKV and gate/up fused, the
  vocabulary padded), mapped to ``LlamaForCausalLM`` as Megatron-Bridge's
  ``LlamaBridge`` maps it (its ``QKVMapping`` and ``GatedMLPMapping``): see
  :mod:`.megatron`.
- ``hf:llama``, ``hf:mistral``, ``hf:qwen2``: already ``LlamaForCausalLM``'s,
  ``MistralForCausalLM``'s or ``Qwen2ForCausalLM``'s names (an HF model saved through
  FSDP, DCP, accelerate or the Trainer): every tensor as it is. Llama's and Mistral's
  names are the same: the config's ``model_type`` tells them apart.
- ``hf:gpt2``: ``GPT2LMHeadModel``'s names (its ``Conv1D`` weights already (in, out)); the
  causal-mask buffers older saves keep are dropped.
"""

from __future__ import annotations

import dataclasses

from .spec import Drop, Rename, Spec

_LLAMA_LAYER = (
    ("attention.wo.weight", "self_attn.o_proj.weight", "same"),
    ("attention.wv.weight", "self_attn.v_proj.weight", "same"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight", "same"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight", "same"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight", "same"),
    ("attention_norm.weight", "input_layernorm.weight", "same"),
    ("ffn_norm.weight", "post_attention_layernorm.weight", "same"),
)
_TORCHTITAN_ATTENTION = (
    ("wq.weight", "self_attn.q_proj.weight", "rope_q"),
    ("wk.weight", "self_attn.k_proj.weight", "rope_k"),
    ("wv.weight", "self_attn.v_proj.weight", "same"),
)

TORCHTITAN_LLAMA3 = Spec(
    name="torchtitan:llama3",
    arch="llama",
    renames=(
        Rename("tok_embeddings.weight", "model.embed_tokens.weight"),
        Rename("norm.weight", "model.norm.weight"),
        # (the first rule of a target is the name the way back writes: torchtitan 0.3's)
        Rename("lm_head.weight", "lm_head.weight"),
        Rename("output.weight", "lm_head.weight"),  # (torchtitan before 0.2)
        *(
            Rename(f"layers.{{L}}.attention.{where}{src}", f"model.layers.{{L}}.{dst}", how)
            for where in ("qkv_linear.", "")
            for src, dst, how in _TORCHTITAN_ATTENTION
        ),
        *(
            Rename(f"layers.{{L}}.{src}", f"model.layers.{{L}}.{dst}", how)
            for src, dst, how in _LLAMA_LAYER
            if src != "attention.wv.weight"
        ),
    ),
    drops=(Drop(r".*\.freqs_cis|freqs_cis", "RoPE's table: computed by the model, not a weight"),),
    embedding="tok_embeddings.weight",
    head="lm_head.weight",
)

TORCHTITAN_QWEN3 = Spec(
    name="torchtitan:qwen3",
    arch="qwen3",
    # Llama 3's names (torchtitan 0.3's: no ``output.weight``) with nothing permuted,
    # and each layer's q and k norms
    renames=(
        *(
            dataclasses.replace(rule, transform="same")
            for rule in TORCHTITAN_LLAMA3.renames
            if rule.source != "output.weight"
        ),
        Rename("layers.{L}.attention.q_norm.weight", "model.layers.{L}.self_attn.q_norm.weight"),
        Rename("layers.{L}.attention.k_norm.weight", "model.layers.{L}.self_attn.k_norm.weight"),
    ),
    drops=TORCHTITAN_LLAMA3.drops,
    embedding="tok_embeddings.weight",
    head="lm_head.weight",
    requires=("layers.{L}.attention.q_norm.weight",),
)

_HF_LLAMA_NAMES = (
    "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
    *(f"model.layers.{{L}}.{n}" for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    )),
)  # fmt: skip

HF_LLAMA = Spec(
    name="hf:llama",
    arch="llama",
    renames=tuple(Rename(n, n) for n in _HF_LLAMA_NAMES),
    drops=(
        Drop(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", "RoPE's table: a buffer"),
        Drop(r"model\.rotary_emb\.inv_freq", "RoPE's table: a buffer"),
    ),
    embedding="model.embed_tokens.weight",
    head="lm_head.weight",
)

HF_MISTRAL = dataclasses.replace(HF_LLAMA, name="hf:mistral", arch="mistral")
HF_QWEN2 = dataclasses.replace(
    HF_LLAMA,
    name="hf:qwen2",
    arch="qwen2",
    renames=HF_LLAMA.renames
    + tuple(
        Rename(
            f"model.layers.{{L}}.self_attn.{proj}.bias", f"model.layers.{{L}}.self_attn.{proj}.bias"
        )
        for proj in ("q_proj", "k_proj", "v_proj")
    ),
    requires=("model.layers.{L}.self_attn.q_proj.bias",),
)

_HF_GPT2_NAMES = (
    "transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
    "transformer.ln_f.bias", "lm_head.weight",
    *(f"transformer.h.{{L}}.{n}.{w}" for n in (
        "ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj",
    ) for w in ("weight", "bias")),
)  # fmt: skip

HF_GPT2 = Spec(
    name="hf:gpt2",
    arch="gpt2",
    renames=tuple(Rename(n, n) for n in _HF_GPT2_NAMES),
    drops=(  # (older saves keep the causal mask as buffers)
        Drop(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)", "the causal mask: a buffer"),
    ),
    embedding="transformer.wte.weight",
    head="lm_head.weight",
)

_MEGATRON_LAYER = "decoder.layers."
_MEGATRON_GPT_LAYER = (
    # (Transformer Engine's fused norm names, which the local spec saves too)
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight", "layer"),
    ("input_layernorm.weight", "input_layernorm.weight", "layer"),
    ("self_attention.linear_qkv.weight", "self_attn.q_proj.weight", "qkv_q"),
    ("self_attention.linear_qkv.weight", "self_attn.k_proj.weight", "qkv_k"),
    ("self_attention.linear_qkv.weight", "self_attn.v_proj.weight", "qkv_v"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", "layer"),
    ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight", "layer"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", "layer"),
    ("mlp.linear_fc1.weight", "mlp.gate_proj.weight", "glu_gate"),
    ("mlp.linear_fc1.weight", "mlp.up_proj.weight", "glu_up"),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight", "layer"),
)
MEGATRON_GPT = Spec(
    name="megatron:gpt",
    arch="llama",
    renames=(
        Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight", "vocab"),
        Rename("decoder.final_layernorm.weight", "model.norm.weight"),
        Rename("output_layer.weight", "lm_head.weight", "vocab"),
        # stacked (torch_dist: "layer" unstacks), or one tensor a layer (a legacy
        # per-rank save merged: decoder.layers.{L}., the same transforms of one layer)
        *(
            Rename(_MEGATRON_LAYER + stacked + src, f"model.layers.{{L}}.{dst}", how)
            for stacked, of_layer in (("", ""), ("{L}.", "_of_layer"))
            for src, dst, how in (
                (src, dst, "same" if of_layer and how == "layer" else how + of_layer)
                for src, dst, how in _MEGATRON_GPT_LAYER
            )
        ),
    ),
    drops=(Drop(r"(.*\.)?_extra_state(/.*)?", "Transformer Engine's extra state: not a weight"),),
    embedding="embedding.word_embeddings.weight",
    head="output_layer.weight",
    requires=(
        (
            _MEGATRON_LAYER + "self_attention.linear_qkv.weight",
            _MEGATRON_LAYER + "{L}.self_attention.linear_qkv.weight",
        ),
    ),
    layers_axis=_MEGATRON_LAYER + "self_attention.linear_qkv.weight",
    padded_vocab=True,
)

SPECS = {
    spec.name: spec
    for spec in (
        TORCHTITAN_LLAMA3, TORCHTITAN_QWEN3, MEGATRON_GPT,
        HF_LLAMA, HF_MISTRAL, HF_QWEN2, HF_GPT2,
    )
}  # fmt: skip
