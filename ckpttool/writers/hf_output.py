"""Hugging Face folders in, Hugging Face folders out.

Converting a Hugging Face model folder (``config.json`` beside its weights), or a
Trainer ``checkpoint-N/``, into a folder (``-o DIR/``) writes what ``from_pretrained``
reads: ``DIR/model.safetensors`` (or its shards and ``model.safetensors.index.json``;
``pytorch_model.bin`` for ``--to pt``) and, beside it, the small files it needs from the
input folder (:data:`CARRIED_FILES`). They are files of the output's plan
(:func:`model_folder`), bytes read when it is laid out, so every route that writes a
plan (one process, the ranks of a job, S3) writes the same folder: the weights (or
index) last, under the same ``--force`` rules as any folder output (an earlier output's
files are replaced with ``--force`` only, other files of DIR never).
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from collections.abc import Sequence

from .. import sources
from ..errors import CkptError
from .folder_layout import FolderLayout
from .plan import FilePlan, Piece, Plan

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
# much larger is not such a file. They are held in memory once the plan is made: all
# of them together stay within what a run may use
MAX_CARRIED_BYTES = 64 << 20
MAX_CARRIED_TOTAL = 128 << 20
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


def model_folder(
    plan: Plan,
    to: str,
    folder: str | None,
    names: list[str],
    made: dict[str, bytes] | None = None,
    more: Sequence[tuple[str, list[str]]] = (),
) -> Plan:
    """``plan`` (the weights) as a model folder: a single-file plan's file named as
    ``from_pretrained`` reads it, and :func:`carried_files`' ``names`` of ``folder``
    (and of each folder of ``more``) beside it, their bytes read now (the plan carries
    them to whatever writes it), and the files ``made`` here (a ``config.json``).

    Raises:
        CkptError: A carried file changed into something else since it was checked,
            or they are larger together than :data:`MAX_CARRIED_TOTAL`.
    """
    weights = [dataclasses.replace(f, name=f.name or weights_name(to)) for f in plan.files]
    carried, total = [], 0
    sources = [(folder, name) for name in names if folder is not None]
    sources += [(where, name) for where, listed in more for name in listed]
    files = {name: data for name, data in (made or {}).items()}
    for where, name in sources:
        if name not in files:
            files[name] = _read_carried(where, name)
    for name, data in files.items():
        total += len(data)
        if total > MAX_CARRIED_TOTAL:
            raise CkptError(
                f"the config and tokenizer files are over {MAX_CARRIED_TOTAL >> 20} MiB together",
                path=folder,
                hint="convert to -o FILE and copy them by hand",
            )
        carried.append(FilePlan(name, len(data), [Piece(0, len(data), data=data)]))
    return Plan([*carried, *weights], [*(plan.names or [weights_name(to)]), *files])


def _read_carried(folder: str, name: str) -> bytes:
    """The bytes of one carried file: a regular file (checked on the open descriptor,
    whatever the name points at by now), never more than :data:`MAX_CARRIED_BYTES`."""
    path = os.path.realpath(os.path.join(folder, name))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise CkptError(f"cannot read {name} ({exc.strerror})", path=folder) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CkptError(f"{name} is not a regular file", path=folder)
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(MAX_CARRIED_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CARRIED_BYTES:
        raise CkptError(
            f"{name} of over {MAX_CARRIED_BYTES} bytes is not a config or tokenizer file",
            path=folder,
        )
    return data
