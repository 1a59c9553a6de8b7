"""``megatron``: a Megatron-core ``dist_checkpointing`` folder, ``torch_dist`` backend;
a legacy Megatron-LM iteration folder of several model-parallel ranks (:mod:`.legacy`).

The folder holds ``metadata.json`` (which backends wrote it), ``common.pt`` (a
``torch.save`` of everything that is not sharded: ``iteration``, the
``argparse.Namespace`` of the run's arguments, the optimizer's param groups...) and a
DCP checkpoint (``.metadata`` plus ``__R_K.distcp``) whose flat keys are the
ShardedTensor keys, global shapes. A NeMo 2 checkpoint keeps that folder as its
``weights/``, beside ``context/``.

Nothing of megatron is imported: both pickles go through the restricted unpickler,
so its classes stay inert stand-ins. The tree is ``common.pt``'s, with the stored
entries placed where Megatron's own load merges them: the model's under ``model``
(NeMo 2: ``state_dict``, Lightning's key) by their stored names, the optimizer's
(``optimizer.state.exp_avg.decoder...``) under ``optimizer`` so that their dotted path
is the stored name. Tensors that Megatron stacks along a leading layer or expert axis
(``decoder.layers.mlp.linear_fc1.weight`` of shape ``[layers, ...]``) are kept as
stored: unstacking them needs the model's code. An ``argparse.Namespace`` is read as
the dict of its attributes, so the run's config shows as plain values.
"""

from __future__ import annotations

import json
from typing import Any

from ... import sources
from ...errors import CkptError
from ...tree import Checkpoint, verdicts
from .. import dcp
from ..torch_save import torch_zip
from . import legacy
from .namespaces import namespaces_as_dicts

FORMAT = "megatron"
METADATA_JSON = "metadata.json"
COMMON_FILE = "common.pt"
# NeMo 2: <checkpoint>/weights/ is the torch_dist folder, <checkpoint>/context/ its config
NEMO_WEIGHTS = "weights"
NEMO_CONTEXT = "context"
SHARDED_BACKEND = "torch_dist"
# Where Megatron's load merges the model's entries: Megatron-LM's state dict, and the
# Lightning checkpoint dict NeMo 2 saves
MODEL_KEY = "model"
NEMO_MODEL_KEY = "state_dict"
OPTIMIZER_PREFIX = "optimizer."
OPTIMIZER_KEY = "optimizer"
MAX_METADATA_JSON = 1 << 20


def detect(path: str, head: bytes) -> bool:
    """A ``torch_dist`` folder (``metadata.json`` naming a sharded backend), a NeMo 2
    checkpoint folder holding one as ``weights/``, or a ``.distcp`` / ``.metadata`` /
    ``metadata.json`` file of such a folder (a file holds parts of tensors: the folder is
    read)."""
    return _folder(path) is not None


def _folder(path: str) -> str | None:
    if sources.isdir(path) and legacy.is_iteration(path):
        return path
    if not sources.isdir(path):
        name = sources.basename(path)
        if not (dcp.is_part_name(name) or name == METADATA_JSON):
            return None
        path = sources.dirname(path) or "."
    if _backend(path) is not None:
        return path
    weights = sources.join(path, NEMO_WEIGHTS)
    if sources.isdir(sources.join(path, NEMO_CONTEXT)) and _backend(weights) is not None:
        return weights
    return None


def _backend(folder: str) -> str | None:
    """The ``sharded_backend`` that ``metadata.json`` names, None if it is not Megatron's."""
    meta = _metadata(folder)
    backend = meta.get("sharded_backend") if meta else None
    return backend if isinstance(backend, str) else None


def _metadata(folder: str) -> dict | None:
    path = sources.join(folder, METADATA_JSON)
    try:
        raw = sources.read_small(path, MAX_METADATA_JSON)
        if raw is None:
            return None
        meta = json.loads(raw)
    except (OSError, CkptError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    """Read the folder lazily: ``common.pt``'s tree with the sharded entries placed in it.

    Raises:
        CkptError: Another backend than ``torch_dist`` (``zarr``), ``common.pt`` or the
            DCP ``.metadata`` missing, or entries that collide with ``common.pt``'s.
        UnsafeError: A pickle references dangerous globals.
    """
    folder = _folder(path) or path
    if legacy.is_iteration(folder):
        return legacy.read(folder, permissive=permissive)
    meta = _metadata(folder) or {}
    backend = meta.get("sharded_backend")
    if backend != SHARDED_BACKEND:
        raise CkptError(
            f"Megatron checkpoint with the {backend!r} backend: ckpttool reads only "
            f"{SHARDED_BACKEND!r}",
            path=sources.join(folder, METADATA_JSON),
            hint="convert it with Megatron's dist_checkpointing (torch_dist save strategy)",
        )
    for name in (COMMON_FILE, dcp.METADATA_FILE):
        if not sources.isfile(sources.join(folder, name)):
            raise CkptError(
                f"Megatron torch_dist checkpoint without its {name} (incomplete checkpoint)",
                path=sources.join(folder, name),
            )
    common_path = sources.join(folder, COMMON_FILE)
    common = torch_zip.read(common_path, permissive=permissive)
    sharded = dcp.read(folder, permissive=permissive)
    if not isinstance(common.root, dict):
        raise CkptError("corrupt common.pt: not a dict", path=common_path)
    parent, name = sources.split(folder.rstrip("/") or folder)
    nemo = name == NEMO_WEIGHTS and sources.isdir(sources.join(parent or ".", NEMO_CONTEXT))
    model_key = NEMO_MODEL_KEY if nemo else MODEL_KEY
    root = namespaces_as_dicts(common.root, 0)
    _place(root, sharded.root, model_key, common_path)
    return Checkpoint(
        format=FORMAT,
        files=[sources.join(folder, METADATA_JSON), common_path, *sharded.files],
        root=root,
        world_size=sharded.world_size,
        **verdicts(common, sharded),
        metadata=meta,
        model_path=(model_key,),
    )


def _place(root: dict, stored: Any, model_key: str, common_path: str) -> None:
    """Put each stored entry under the model's or the optimizer's dict, by stored name."""
    if not isinstance(stored, dict):
        raise CkptError("corrupt Megatron checkpoint: DCP keys are not flat", path=common_path)
    for name, value in stored.items():
        if isinstance(name, str) and name.startswith(OPTIMIZER_PREFIX):
            where, key = OPTIMIZER_KEY, name[len(OPTIMIZER_PREFIX) :]
        else:
            where, key = model_key, name
        target = root.setdefault(where, {})
        if not isinstance(target, dict) or key in target:
            raise CkptError(
                f"stored entry {name!r} collides with the value at {where!r} in common.pt "
                "(corrupt checkpoint)",
                path=common_path,
            )
        target[key] = value
