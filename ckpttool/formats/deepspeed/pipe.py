"""A DeepSpeed pipeline-parallel tag folder: each layer's ``state_dict()`` in a file of its own.

``PipelineModule.save_state_dict`` (deepspeed/runtime/pipe/module.py) writes
``layer_NN-model_states.pt`` for layer ``NN`` (``layer_NN-model_TT-model_states.pt`` where
the topology has a tensor-parallel axis: GPT-NeoX, Megatron-DeepSpeed), each saved by the
stage that holds the layer; beside them one ``mp_rank_SS_model_states.pt`` a stage with
``module`` None, and ``checkpoint_parallel_dimensions`` (``pp_degree``, ``tp_degree``) that
say how the run was split. The model is what ``PipelineModule`` names a one-stage model's
tensors: ``{layer}.{name}`` (its ``add_module(str(layer_idx), ...)``), layer by layer.

Tensor-parallel layer files hold slices whose layout only the model's code knows: they
are refused by name, as layer files the run's dimensions contradict. Each stage's model
states and ZeRO optimizer states are kept as stored, by file name (not merged).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ... import sources
from ...errors import CkptError
from ...tree import Checkpoint
from .tag_folder import MODEL_STATES, OPTIM_STATES, TagFolder

LAYER_FILE = re.compile(r"^layer_(\d{2,9})(?:-model_(\d{2,9}))?-model_states\.pt$")
MODEL_KEY = "module"


def is_pipeline(names: list[str]) -> bool:
    return any(LAYER_FILE.match(n) for n in names)


def read(folder: str, names: list[str], permissive: bool) -> Checkpoint:
    """The pipeline's layers as one model (see the module).

    Raises:
        CkptError: Tensor-parallel layer files, a layer missing, a layer file that is not
            a state dict, or dimensions the files contradict.
    """
    layers: dict[int, str] = {}
    for name in sorted(names):
        m = LAYER_FILE.match(name)
        if m is None:
            continue
        if int(m.group(2) or 0) > 0:
            raise CkptError(
                f"DeepSpeed pipeline layer files of several tensor-parallel ranks ({name}): "
                "their slices' layout is the model code's, not recorded in the files",
                path=folder,
                hint="pass one layer file to read it alone",
            )
        index = int(m.group(1))
        if index in layers:
            raise CkptError(
                f"DeepSpeed layer {index} in two files ({layers[index]}, {name}): two saves "
                "in one folder",
                path=folder,
            )
        layers[index] = name
    reader = TagFolder(folder, permissive)
    stages = sorted(n for n in names if MODEL_STATES.match(n))
    states = {n.removesuffix(".pt"): reader.load(n, f"the model states {n}") for n in stages}
    first = next(iter(states.values()), None)
    dims = first.get("checkpoint_parallel_dimensions") if isinstance(first, Mapping) else None
    if isinstance(dims, Mapping) and dims.get("tp_degree") not in (None, 1):
        raise CkptError(
            f"DeepSpeed pipeline checkpoint of tensor parallel {repr(dims.get('tp_degree'))[:40]}: "
            "its layers' slices are not merged",
            path=folder,
        )
    if isinstance(dims, Mapping) and dims.get("pp_degree") not in (None, len(stages)):
        raise CkptError(
            f"DeepSpeed pipeline checkpoint of {repr(dims.get('pp_degree'))[:40]} stages with "
            f"{len(stages)} stages' model states",
            path=folder,
        )
    model: dict[str, Any] = {}
    for index in sorted(layers):
        root = reader.load(layers[index], f"layer {index}")
        if not isinstance(root, Mapping) or not all(isinstance(k, str) for k in root):
            raise CkptError(
                "corrupt DeepSpeed layer file: not a state dict",
                path=sources.join(folder, layers[index]),
            )
        for key, value in root.items():
            model[f"{index}.{key}"] = value
    _check_shapes(states, model, folder)
    root_out: dict[str, Any] = {MODEL_KEY: model, "model_states": states}
    optim = sorted(n for n in names if OPTIM_STATES.match(n))
    if optim:
        root_out["optimizer_states"] = {
            n.removesuffix(".pt"): reader.load(n, f"the optimizer states {n}") for n in optim
        }
    return reader.checkpoint(root_out, len(stages) or None)


def _check_shapes(states: Mapping, model: Mapping, folder: str) -> None:
    """Every parameter the stages' ``param_shapes`` record is in the layer files, with its
    shape (a layer without parameters has no file: a gap in the numbers is no error)."""
    for name, state in states.items():
        shapes = state.get("param_shapes") if isinstance(state, Mapping) else None
        for group in shapes if isinstance(shapes, list) else []:
            for key, shape in group.items() if isinstance(group, Mapping) else []:
                have = model.get(key)
                if have is None:
                    raise CkptError(
                        f"DeepSpeed pipeline checkpoint without parameter {key!r}, which "
                        f"{name} records (a layer file missing?)",
                        path=folder,
                    )
                found = tuple(getattr(have, "shape", ()))
                if not isinstance(shape, tuple) or found != shape:
                    said = list(shape) if isinstance(shape, tuple) else repr(shape)[:40]
                    raise CkptError(
                        f"DeepSpeed layer tensor {key!r} {list(found)}, which {name} "
                        f"records as {said}",
                        path=folder,
                    )
