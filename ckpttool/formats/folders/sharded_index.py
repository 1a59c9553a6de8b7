"""Hugging Face sharded checkpoints: an ``*.index.json`` (``weight_map``) and its shard files.

``model.safetensors.index.json`` with safetensors shards is ``safetensors-sharded``.
The older ``pytorch_model.bin.index.json`` names ``torch.save`` shards; many published
models still come that way. Its shards are read by the torch readers, with the same
safety rules, and the checkpoint takes their format id (``torch-zip``, ``torch-legacy``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from ... import sources
from ...errors import CkptError
from ...tree import Checkpoint, TensorRef, verdicts
from .. import safetensors_file
from .catalog import natural_key

FORMAT = "safetensors-sharded"
INDEX_SUFFIX = ".index.json"
SAFETENSORS_INDEX_SUFFIX = ".safetensors" + INDEX_SUFFIX
# an index lists every tensor name once: a few MB for the largest models
MAX_INDEX_BYTES = 256 << 20


def detect(path: str, head: bytes) -> bool:
    if sources.isdir(path):
        return bool(_indexes(path))
    return path.endswith(".json") and head.lstrip()[:1] == b"{" and b"weight_map" in head


def _indexes(folder: str) -> list[str]:
    """The index files of a folder; safetensors ones only when there are any.

    A Hugging Face repo often holds both ``model.safetensors.index.json`` and
    ``pytorch_model.bin.index.json`` for the same weights; like ``from_pretrained``,
    prefer safetensors.
    """
    found = [
        sources.join(folder, n)
        for n in sources.listdir(folder)
        if n.endswith(INDEX_SUFFIX) and not n.startswith(".")  # as a glob "*" matches
    ]
    safetensors_indexes = [p for p in found if p.endswith(SAFETENSORS_INDEX_SUFFIX)]
    return safetensors_indexes or found


def folder_of_shards(files: list[str]) -> str | None:
    """The folder whose index names exactly these shard files (``hf-model/*.safetensors``
    expanded by the shell), or None when they are not a folder's shards.

    Raises:
        CkptError: Some, not all, of a folder's shards: naming the folder is the fix.
    """
    folders = {_absolute_folder(f) for f in files}
    if len(folders) != 1 or not all(f.endswith(".safetensors") for f in files):
        return None
    folder = folders.pop()
    found = [p for p in _indexes(folder) if p.endswith(SAFETENSORS_INDEX_SUFFIX)]
    if len(found) != 1:
        return None
    try:
        shard_names = {str(v) for v in _read_index(found[0])["weight_map"].values()}
    except CkptError:
        return None
    names = {sources.basename(f) for f in files}
    if names == shard_names:
        return sources.dirname(files[0]) or "."
    if names < shard_names:
        raise CkptError(
            f"{len(names)} of the {len(shard_names)} shards of {folder}",
            hint=f"pass the folder: ckpttool ... {sources.dirname(files[0]) or '.'}/",
        )
    return None


def _absolute_folder(path: str) -> str:
    """The folder of a file, absolute for a local path (a URL is absolute already)."""
    folder = sources.dirname(path)
    return folder if sources.is_url(path) else os.path.abspath(folder or ".")


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    index_path = path
    if sources.isdir(path):
        found = _indexes(path)
        if len(found) > 1:
            names = ", ".join(sources.basename(p) for p in found)
            raise CkptError(f"several index files: {names}", path=path, hint="pass one")
        index_path = found[0]
    index = _read_index(index_path)
    folder = sources.dirname(index_path)
    shards: dict[str, _Shard] = {}
    root = {}
    for name, shard_name in index["weight_map"].items():
        shard_name = str(shard_name)
        if not sources.is_file_name(shard_name):
            raise CkptError(f"shard name {shard_name!r} leaves the folder", path=index_path)
        shard_path = sources.join(folder, shard_name)
        if shard_path not in shards:
            if not sources.isfile(shard_path):
                raise CkptError(f"missing shard {shard_name}", path=index_path)
            shards[shard_path] = _Shard(shard_path, permissive)
        ref = shards[shard_path].tensor(name)
        if ref is None:
            raise CkptError(f"tensor {name!r} is not in {shard_name}", path=index_path)
        root[name] = ref
    for shard in shards.values():  # the tied names each shard records, after the rest
        safetensors_file.add_tied(root, shard.metadata)
    pickled = [s.checkpoint for s in shards.values() if s.checkpoint is not None]
    metadata = index.get("metadata")
    return Checkpoint(
        format=pickled[0].format if pickled else FORMAT,
        files=[index_path, *sorted(shards, key=natural_key)],  # shards in their order
        root=root,
        **verdicts(*pickled),
        metadata=dict(metadata) if isinstance(metadata, dict) else {},
    )


def _read_index(index_path: str) -> dict[str, Any]:
    try:
        raw = sources.read_small(index_path, MAX_INDEX_BYTES)
        if raw is None:
            raise TypeError
        index = json.loads(raw.decode("utf-8"))
        if not isinstance(index, dict) or not isinstance(index["weight_map"], dict):
            raise TypeError
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise CkptError("corrupt shard index (no weight_map)", path=index_path) from None
    except RecursionError:  # json recurses once per nesting level
        raise CkptError("corrupt shard index (nested too deep)", path=index_path) from None
    return index


class _Shard:
    """One shard file: a safetensors header, or a torch.save file read by the torch readers."""

    def __init__(self, path: str, permissive: bool):
        self.path = path
        self.checkpoint: Checkpoint | None = None
        self.metadata: dict[str, str] = {}
        head = sources.read_head(path)
        if safetensors_file.detect(path, head):
            header, start = safetensors_file.read_header(path)
            data_len = sources.getsize(path) - start
            self.metadata = header.pop("__metadata__", None) or {}
            self.refs = {
                name: safetensors_file.tensor_ref(path, name, info, start, data_len)
                for name, info in header.items()
            }
            safetensors_file.check_layout(self.refs, start, data_len, path)
            return
        from ..torch_save import legacy, torch_zip  # pickle readers, for .bin shards only

        for fmt in (torch_zip, legacy):
            if fmt.detect(path, head):
                self.checkpoint = fmt.read(path, permissive=permissive)
                return
        raise CkptError("shard is neither safetensors nor a torch.save file", path=path)

    def tensor(self, name: str) -> TensorRef | None:
        if self.checkpoint is None:
            return self.refs.get(name)
        root = self.checkpoint.root
        ref = root.get(name) if isinstance(root, dict) else None
        return ref if isinstance(ref, TensorRef) else None
