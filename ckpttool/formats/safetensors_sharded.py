"""``safetensors-sharded``: ``*.safetensors.index.json`` (``weight_map``) and its shard files."""

from __future__ import annotations

import glob
import json
import os

from ..errors import CkptError
from ..tree import Checkpoint
from .safetensors_file import read_header, tensor_ref

FORMAT = "safetensors-sharded"
INDEX_SUFFIX = ".safetensors.index.json"


def detect(path: str, head: bytes) -> bool:
    if os.path.isdir(path):
        return bool(glob.glob(os.path.join(glob.escape(path), "*" + INDEX_SUFFIX)))
    return path.endswith(".json") and head.lstrip()[:1] == b"{" and b"weight_map" in head


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    index_path = path
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(glob.escape(path), "*" + INDEX_SUFFIX)))
        if len(found) > 1:
            raise CkptError(f"several index files: {', '.join(found)}", path=path, hint="pass one")
        index_path = found[0]
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise CkptError("corrupt safetensors index (no weight_map)", path=index_path) from None
    folder = os.path.dirname(index_path)
    headers = {}
    root = {}
    for name, shard in weight_map.items():
        shard_path = os.path.join(folder, str(shard))
        if os.path.basename(str(shard)) != str(shard):
            raise CkptError(f"shard name {shard!r} leaves the folder", path=index_path)
        if shard_path not in headers:
            if not os.path.isfile(shard_path):
                raise CkptError(f"missing shard {shard}", path=index_path)
            header, start = read_header(shard_path)
            headers[shard_path] = (header, start, os.path.getsize(shard_path) - start)
        header, start, data_len = headers[shard_path]
        if name not in header:
            raise CkptError(f"tensor {name!r} is not in {shard}", path=index_path)
        root[name] = tensor_ref(shard_path, name, header[name], start, data_len)
    metadata = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
    return Checkpoint(
        format=FORMAT, files=[index_path, *headers], root=root, metadata=dict(metadata)
    )
