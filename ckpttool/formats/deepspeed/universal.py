"""DeepSpeed universal checkpoints (``ds_to_universal``), read as one checkpoint.

The folder holds the model states (copied from the ZeRO tag folder) and ``zero/``: one
folder per parameter with its full fp32 weight (``fp32.pt``) and Adam moments
(``exp_avg.pt``, ``exp_avg_sq.pt``; ``step.pt`` from ZeRO-1/2), each a tensor or a dict
``{"param": tensor, "cat_dim": ...}`` (ZeRO-3 stores them flat), and
``optimizer_state.pt`` with the param groups. The tree is the one
:mod:`.deepspeed` builds for a ZeRO tag folder.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ... import sources
from ...errors import CkptError
from ...tree import Checkpoint, TensorRef, contiguous_stride
from .model_states import assemble, mapping, param_shape, param_shapes, untracked_params
from .tag_folder import TagFolder
from .zero import RANK_LAYOUT_KEYS, int_value

OPTIMIZER_FILE = "optimizer_state.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")
# what optimizer_state.pt holds besides the param groups that only made sense per rank
FLAT_KEYS = frozenset(
    {"optimizer_state_dict", "fp32_flat_groups", "single_partition_of_fp32_groups"}
)


UNIVERSAL_DIR = "zero"  # ds_to_universal's zero/<param name>/fp32.pt, exp_avg.pt, ...


def read_universal(reader: TagFolder, model_files: dict) -> Checkpoint:
    """Read a universal checkpoint folder (``zero/<name>/fp32.pt`` ...) lazily.

    Raises:
        CkptError: A parameter's file is missing, or holds a tensor of another size.
    """
    if not model_files:
        raise CkptError("a universal checkpoint folder without model states", path=reader.folder)
    _, states = reader.model_states(model_files, 0, None)
    if not isinstance(states, Mapping):
        raise CkptError("model states are not a dict", path=reader.files[0])
    groups = param_shapes(states)
    optimizer_state = reader.load(
        f"{UNIVERSAL_DIR}/{OPTIMIZER_FILE}", "the universal checkpoint's optimizer state"
    )
    if not isinstance(optimizer_state, Mapping):
        raise CkptError("corrupt optimizer_state.pt (not a dict)", path=reader.files[-1])
    stage = int_value(optimizer_state.get("zero_stage"))
    params, state = {}, {}
    for shapes in groups:
        for name, shape in shapes.items():
            params[name] = _param_file(reader, name, "fp32", shape)
            state[name] = {key: _param_file(reader, name, key, shape) for key in MOMENTS}
            step = param_file(name, "step")
            if sources.isfile(sources.join(reader.folder, step)):
                state[name] = {"step": _value(reader.load(step, "")), **state[name]}
    frozen = {} if stage == 3 else untracked_params(states, params)
    world = int_value(states.get("dp_world_size")) or len(model_files)
    frozen_shapes = mapping(states.get("frozen_param_shapes"))
    stored = {str(name): param_file(str(name), "fp32") for name in frozen_shapes}
    if any(not sources.isfile(sources.join(reader.folder, p)) for p in stored.values()):
        # ds_to_universal writes frozen parameters only with --inject_missing_state: the
        # model states hold them (ZeRO-3: a fragment in each rank's model states)
        frozen.update(reader.frozen(states, model_files, stage or 2, world))
    for name, rel in stored.items():
        if sources.isfile(sources.join(reader.folder, rel)):
            frozen[name] = _param_file(reader, name, "fp32", param_shape(name, frozen_shapes[name]))
    param_groups = optimizer_state.get("param_groups")
    out_groups = []
    for k, shapes in enumerate(groups):
        group = param_groups[k] if isinstance(param_groups, list) and k < len(param_groups) else {}
        out_groups.append({**(group if isinstance(group, Mapping) else {}), "params": list(shapes)})
    extra = {
        k: (int_value(v) if k == "zero_stage" else v)
        for k, v in optimizer_state.items()
        if k not in RANK_LAYOUT_KEYS and k not in FLAT_KEYS and k != "param_groups"
    }
    root = {
        "module": assemble(states, params, frozen),
        "optimizer": {"state": state, "param_groups": out_groups, **extra},
        "model_states": states,
    }
    return reader.checkpoint(root, world)


def param_file(name: str, key: str) -> str:
    """``zero/<name>/<key>.pt``; a name that would lead outside ``zero/`` is refused."""
    if not sources.is_file_name(name):
        raise CkptError(f"parameter name {name!r} cannot name a folder of zero/")
    return f"{UNIVERSAL_DIR}/{name}/{key}.pt"


def _value(root: Any) -> Any:
    """What a universal file holds: a tensor, or ``{"param": tensor, ...}``."""
    return root.get("param") if isinstance(root, Mapping) and "param" in root else root


def _param_file(reader: TagFolder, name: str, key: str, shape: tuple) -> TensorRef:
    """``zero/<name>/<key>.pt`` as a tensor of the parameter's shape (ZeRO-3 stores it flat)."""
    rel = param_file(name, key)
    value = _value(reader.load(rel, f"{key} of parameter {name!r}"))
    path = sources.join(reader.folder, rel)
    if not isinstance(value, TensorRef):
        raise CkptError(f"holds no tensor for parameter {name!r}", path=path)
    if value.numel != math.prod(shape) or not value.is_contiguous():
        raise CkptError(
            f"holds {list(value.shape)} for parameter {name!r} of shape {list(shape)}", path=path
        )
    if tuple(value.shape) == shape:
        return value
    return dataclasses.replace(value, shape=shape, stride=contiguous_stride(shape))
