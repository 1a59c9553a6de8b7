"""Hugging Face folders in, Hugging Face folders out.

Converting a Hugging Face model folder (``config.json`` beside its weights), or a
Trainer ``checkpoint-N/``, into a folder (``-o DIR/``) writes what ``from_pretrained``
reads: ``DIR/model.safetensors`` (or its shards and ``model.safetensors.index.json``;
``pytorch_model.bin`` for ``--to pt``) and, beside it, the small files it needs from the
input folder (:data:`CARRIED_FILES`). They are written with the weights into one temp
folder and moved in with them, the weights (or index) last, under the same ``--force``
rules as any folder output: an earlier output's files are replaced with ``--force`` only,
other files of DIR never.
"""

from __future__ import annotations

import os
import re
import shutil

from .. import sources
from ..errors import CkptError
from .folder_layout import FolderLayout

CONFIG_FILE = "config.json"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PT_WEIGHTS = "pytorch_model.bin"
# What from_pretrained (model, generation config, tokenizer) reads from a model folder,
# besides the weights: configs, tokenizer files, chat templates
CARRIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
# The largest of these published (a 256K-token tokenizer.json) is ~35 MB: anything
# much larger is not such a file
MAX_CARRIED_BYTES = 64 << 20
HF_MODEL_FOLDER = FolderLayout(
    "a Hugging Face model",
    re.compile(
        r"model\.safetensors|model-\d+-of-\d+\.safetensors|model\.safetensors\.index\.json"
        r"|pytorch_model\.bin|" + "|".join(re.escape(n) for n in CARRIED_FILES)
    ),
    SAFE_INDEX,
)


def hf_source_folder(inputs: list[str], select: str) -> str | None:
    """The input's Hugging Face folder (local, ``config.json`` in it), where the model
    of one such folder is converted; else None."""
    if len(inputs) != 1 or select != "auto":
        return None
    local = sources.local_path(sources.strip_file_scheme(inputs[0]))
    if local is None or not os.path.isdir(local):
        return None
    return local if os.path.isfile(os.path.join(local, CONFIG_FILE)) else None


def layout_for(to: str, sharded: bool) -> FolderLayout:
    """The folder output's files, the one that makes it a model (moved in last) last."""
    last = SAFE_INDEX if sharded else SAFE_WEIGHTS if to == "safetensors" else PT_WEIGHTS
    return FolderLayout(HF_MODEL_FOLDER.kind, HF_MODEL_FOLDER.pattern, last)


def weights_name(to: str) -> str:
    return SAFE_WEIGHTS if to == "safetensors" else PT_WEIGHTS


def carried_files(folder: str) -> list[str]:
    """The files of :data:`CARRIED_FILES` that ``folder`` holds, checked: each a regular
    file (a symlink to one inside the folder, or to the Hugging Face cache's ``blobs/``
    that a snapshot folder's links point to) of at most :data:`MAX_CARRIED_BYTES`.

    Raises:
        CkptError: One is something else (a folder, a device, a link that leaves the
            folder, an implausibly large file): named, nothing written.
    """
    real_folder = os.path.realpath(folder)
    # huggingface_hub's cache: models--org--name/snapshots/REV/config.json -> ../../blobs/SHA
    blobs = os.path.join(os.path.dirname(os.path.dirname(real_folder)), "blobs")
    found = []
    for name in CARRIED_FILES:
        path = os.path.join(folder, name)
        if not os.path.lexists(path):
            continue
        real = os.path.realpath(path)
        inside = any(real.startswith(f"{root}{os.sep}") for root in (real_folder, blobs))
        if os.path.islink(path) and not inside:
            raise CkptError(
                f"{name} is a link that leaves the model's folder; it is not copied",
                path=folder,
                hint="copy it in as a file, or convert to -o FILE",
            )
        if not os.path.isfile(real):
            raise CkptError(f"{name} is not a regular file", path=folder)
        if os.path.getsize(real) > MAX_CARRIED_BYTES:
            raise CkptError(
                f"{name} of {os.path.getsize(real)} bytes is not a config or tokenizer file",
                path=folder,
            )
        found.append(name)
    return found


def copy_carried(folder: str, names: list[str], target: str) -> None:
    """Copy the files :func:`carried_files` found into ``target`` (a temp folder): their
    bytes, never a link, with the output's own permissions."""
    for name in names:
        shutil.copyfile(os.path.join(folder, name), os.path.join(target, name))
