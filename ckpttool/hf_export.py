"""``convert --to hf``: the selected model as a Hugging Face model folder.

The mapping (:mod:`ckpttool.mappings`) gives the tensors under the architecture's names,
the config to write and where each value came from; this writes them as every other
output is written (:func:`ckpttool.targets.publish`: one process, the ranks of a job,
``s3://``): ``model.safetensors`` or shards and their index, ``config.json``,
``generation_config.json`` and the tokenizer files where there are some, the weights'
file (or the index) last.
"""

from __future__ import annotations

import os
from typing import Any

from . import sources
from .errors import CkptError, UsageError
from .mappings import Export, export, load_config, merge_run_config
from .targets import Published, check_output, output_path, publish
from .writers import (
    CARRIED_FILES,
    WriteOptions,
    carried_files,
    default_output,
    layout_for,
    model_folder,
    writer_for,
)

# what is copied from --tokenizer (or the input's folder): its files, not its config
TOKENIZER_FILES = tuple(
    n for n in CARRIED_FILES if n not in ("config.json", "generation_config.json")
)


def convert_to_hf(
    ckpt: Any,
    tensors: dict[str, Any],
    inputs: list[str],
    named_after: list[str],
    out: str | None,
    options: WriteOptions,
    hf: Any,
    *,
    force: bool,
    progress: Any,
) -> tuple[str, list[str], int, Published | None, Export]:
    """Map, check and write (see the module): (output folder, its files, tensor bytes,
    what publishing did or None for a dry run, the mapping).

    Raises:
        UsageError: No config to be had, or a single-file ``-o``.
        CkptError: As :func:`ckpttool.mappings.export`; ``--check`` found a difference.
    """
    own = _input_folder(inputs)
    config_path = hf.config or (os.path.join(own, "config.json") if own else None)
    args = ckpt.root.get("args") if isinstance(ckpt.root, dict) else None
    given = config_path is not None and os.path.exists(config_path)
    if not given and not (ckpt.format == "megatron" and isinstance(args, dict)):
        raise UsageError(
            "--to hf needs the model's config: the checkpoint holds none",
            hint="pass --config (an HF config.json, or a folder holding one)",
        )
    config, config_file = load_config(config_path) if given and config_path else ({}, "")
    came: dict[str, str] | None = None
    if ckpt.format == "megatron" and isinstance(args, dict):
        # the run's own arguments, value by value; a --config gives what they do not say
        config, came = merge_run_config(config, config_file or "--config", args)
    mapping = export(
        tensors, config, arch=hf.arch, cast=options.cast, config_file=config_file, config_from=came
    )
    if hf.check:
        check_on_meta(mapping)
    out = (
        default_output(named_after, "hf", False)
        if out is None
        else output_path(out, "", folder_output=True)
    )
    if hf.dry_run:
        return out, [], sum(m.leaf.nbytes for m in mapping.mapped), None, mapping
    sharded = options.max_shard_size is not None
    layout = layout_for("safetensors", sharded)
    check_output(out, [*inputs, *ckpt.files], force=force, layout=layout)
    plan = writer_for("safetensors").plan(mapping.tensors(), options)
    tokenizer_dir = hf.tokenizer or own
    more = []
    if config_file:  # (its generation config beside it)
        config_dir = os.path.dirname(config_file)
        more.append((config_dir, _present(config_dir, ("generation_config.json",))))
    if tokenizer_dir:
        more.append((tokenizer_dir, _present(tokenizer_dir, TOKENIZER_FILES)))
    plan = model_folder(
        plan, "safetensors", None, [], made={"config.json": mapping.config_bytes()}, more=more
    )
    done = publish(
        plan, out, layout=layout, force=force, inputs=[*inputs, *ckpt.files], files=ckpt.files,
        progress=progress,
    )  # fmt: skip
    return out, plan.names, plan.total_bytes, done, mapping


def _input_folder(inputs: list[str]) -> str | None:
    """The input's local folder (the checkpoint's, or the file's), where its own config
    and tokenizer would be."""
    if len(inputs) != 1:
        return None
    local = sources.local_path(sources.strip_file_scheme(inputs[0]))
    if local is None:
        return None
    return local if os.path.isdir(local) else os.path.dirname(os.path.abspath(local))


def _present(folder: str, names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` that ``folder`` holds, checked as carried files are."""
    found = carried_files(folder)
    return [n for n in names if n in found]


def check_on_meta(mapping: Export) -> None:
    """``--check``: the architecture built by transformers from the config on the meta
    device has exactly these tensors, shapes and dtypes.

    Raises:
        UsageError: transformers is not installed.
        CkptError: A name, shape or dtype that differs (named).
    """
    try:
        import torch
        import transformers
    except ImportError:
        raise UsageError(
            "--check needs transformers", hint="pip install transformers, or drop --check"
        ) from None
    from .tensors import torch_dtype

    config = transformers.AutoConfig.for_model(**mapping.config)
    dtype = torch_dtype(mapping.mapped[0].leaf.dtype)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(dtype)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    if mapping.config.get("tie_word_embeddings"):
        expected.pop(mapping.arch.head, None)  # the tied head: written once, as the embedding
    written = {m.target: (tuple(m.leaf.shape), torch_dtype(m.leaf.dtype)) for m in mapping.mapped}
    missing, extra = sorted(set(expected) - set(written)), sorted(set(written) - set(expected))
    wrong = sorted(k for k in set(expected) & set(written) if expected[k] != written[k])
    if missing or extra or wrong:
        raise CkptError(
            f"--check: {type(model).__name__} of the written config differs: missing "
            f"{missing[:3]}, not in it {extra[:3]}, shaped or typed otherwise {wrong[:3]}"
        )
