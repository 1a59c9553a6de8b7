"""The load group's programs: load a checkpoint, then use every byte (sum each tensor).

    python benchmarks/loaders.py COMMAND PATH [DEVICE]

    ckpttool-load            ckpttool.load(PATH, map_location=DEVICE)
    torch-mmap               torch.load(mmap=True, weights_only=True, map_location=DEVICE)
    safetensors              safetensors.torch.load_file(device=DEVICE)
    ckpttool-load-into       ckpttool.load_into an nn.Module of its shapes (on DEVICE)
    torch-load-state-dict    model.load_state_dict(torch.load(mmap=True, weights_only=True))
    model-only               the nn.Module alone (the RSS floor of the two above)
    ckpttool-load-all        ckpttool.load(select="all"), for a DCP folder
    ckpttool-load-into-all   ckpttool.load_into preallocated tensors of a DCP folder
    dcp-load                 dcp.load(no_dist=True) into preallocated tensors

Each is a fresh process (run.py measures it): imports count on both sides. Summing
touches every byte, so a loader that maps the file pays for the pages here.
"""

from __future__ import annotations

import sys

DDP_PREFIX = "module."


def use_every_byte(tensors) -> None:
    import torch

    total = 0.0
    for t in tensors:
        if t.is_floating_point():
            total += float(t.sum())
        else:
            total += float(t.sum(dtype=torch.float64))
    if any(t.device.type == "cuda" for t in tensors):
        torch.cuda.synchronize()


def _flatten(node) -> list:
    """Every tensor of a nested dict / list / tuple."""
    import torch

    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        node = list(node.values())
    if not isinstance(node, (list, tuple)):
        return []
    return [t for value in node for t in _flatten(value)]


def ckpttool_load(path: str, device: str = "cpu") -> int:
    import ckpttool

    use_every_byte(list(ckpttool.load(path, map_location=device).values()))
    return 0


def ckpttool_load_all(path: str) -> int:
    import ckpttool

    use_every_byte(_flatten(ckpttool.load(path, select="all")))
    return 0


def torch_mmap(path: str, device: str = "cpu") -> int:
    import torch

    loaded = torch.load(path, mmap=True, weights_only=True, map_location=device)
    use_every_byte(list(loaded.values()))
    return 0


def safetensors(path: str, device: str = "cpu") -> int:
    from safetensors.torch import load_file

    use_every_byte(list(load_file(path, device=device).values()))
    return 0


def _model(path: str, device: str = "cpu"):
    """An nn.Module whose parameters have the checkpoint's names and shapes, initialised
    (every page touched, as a real model's are)."""
    import torch

    import ckpttool

    with ckpttool.open(path) as f:
        shapes = {name: (f.leaf(name).shape, f.leaf(name).dtype.name) for name in f.keys()}
    root = torch.nn.Module()
    for name, (shape, dtype) in shapes.items():
        *parents, leaf = name.split(".")
        module = root
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        data = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
        module.register_parameter(leaf, torch.nn.Parameter(data, requires_grad=False))
    return root


def ckpttool_load_into(path: str, device: str = "cpu") -> int:
    import ckpttool

    model = _model(path, device)
    ckpttool.load_into(model, path)
    use_every_byte(list(model.parameters()))
    return 0


def torch_load_state_dict(path: str) -> int:
    import torch

    model = _model(path)
    sd = torch.load(path, mmap=True, weights_only=True)
    sd = {k.removeprefix(DDP_PREFIX): v for k, v in sd.items()}
    model.load_state_dict(sd)
    del sd
    use_every_byte(list(model.parameters()))
    return 0


def model_only(path: str, device: str = "cpu") -> int:
    use_every_byte(list(_model(path, device).parameters()))
    return 0


def _dcp_preallocated(path: str) -> dict:
    """A zeroed tensor per tensor of a DCP folder, named by its flattened key (as
    dcp.load(no_dist=True) wants a state dict to fill)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata()
    return {
        fqn: torch.zeros(entry.size, dtype=entry.properties.dtype)
        for fqn, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def dcp_load(path: str) -> int:
    import warnings

    import torch.distributed.checkpoint as dcp

    sd = _dcp_preallocated(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=path, no_dist=True)
    use_every_byte(list(sd.values()))
    return 0


def ckpttool_load_into_all(path: str) -> int:
    import ckpttool

    sd = _dcp_preallocated(path)
    result = ckpttool.load_into(sd, path, select="all", strict=False)
    if result.missing_keys:  # the names must match, or this would time nothing
        sys.exit(f"not loaded: {result.missing_keys[:5]}")
    use_every_byte(list(sd.values()))
    return 0


COMMANDS = {
    "ckpttool-load": ckpttool_load,
    "ckpttool-load-all": ckpttool_load_all,
    "torch-mmap": torch_mmap,
    "safetensors": safetensors,
    "ckpttool-load-into": ckpttool_load_into,
    "torch-load-state-dict": torch_load_state_dict,
    "model-only": model_only,
    "dcp-load": dcp_load,
    "ckpttool-load-into-all": ckpttool_load_into_all,
}

if __name__ == "__main__":
    sys.exit(COMMANDS[sys.argv[1]](*sys.argv[2:]))
