"""What a DeepSpeed model states file records about the model: parameter shapes per
group, parameters no partition tracks, tied names, and the state dict ``zero_to_fp32``
assembles from them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import CkptError
from ...tree import TensorRef, check_shape, is_tensor
from .flat import as_float32


def mapping(value: Any) -> Mapping:
    """``value`` if it is a mapping, else an empty one (a field a file left out or garbled)."""
    return value if isinstance(value, Mapping) else {}


def param_shape(name: Any, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, int) and d >= 0 for d in shape
    ):
        raise CkptError(f"corrupt shape recorded for {name!r}: {shape!r:.80}")
    check_shape(tuple(shape))  # (its element count feeds the partition arithmetic)
    return tuple(shape)


def param_shapes(states: Mapping) -> list[dict[str, tuple]]:
    """The trainable parameters per group, in flat order (``param_shapes``)."""
    groups = states.get("param_shapes")
    groups = [groups] if isinstance(groups, Mapping) else groups
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise CkptError("the model states hold no param_shapes (not a ZeRO checkpoint?)")
    out = []
    for group in groups:
        out.append({str(name): param_shape(name, shape) for name, shape in group.items()})
    return out


def untracked_params(states: Mapping, params: Mapping) -> dict[str, Any]:
    """Stored tensors of the model that are neither buffers, trained nor tied parameters:
    frozen ones where the model states record none (zero_to_fp32 drops them there)."""
    stored = states.get("module")
    if not isinstance(stored, Mapping):
        return {}
    skip = {*_names(states.get("buffer_names")), *params, *mapping(states.get("shared_params"))}
    return {
        k: v
        for k, v in stored.items()
        if k not in skip and isinstance(v, TensorRef) and v.storage is not None and v.numel
    }


def _names(value: Any) -> list[str]:
    return [n for n in value if isinstance(n, str)] if isinstance(value, (list, tuple)) else []


def assemble(states: Mapping, params: Mapping, frozen: Mapping) -> dict[str, Any]:
    """The state dict zero_to_fp32 gives: buffers (floating ones as fp32), frozen and
    trainable parameters, and tied names pointing at the same tensor; in the order of
    the stored model's state dict."""
    stored = mapping(states.get("module"))
    found: dict[str, Any] = {}
    for name in _names(states.get("buffer_names")):
        if is_tensor(stored.get(name)):
            found[name] = as_float32(stored[name])
    found.update(frozen)
    found.update(params)
    for alias, source in mapping(states.get("shared_params")).items():
        if isinstance(source, str) and source in found:
            found[alias] = found[source]
    order = [k for k in stored if k in found] + [k for k in found if k not in stored]
    return {k: found[k] for k in order}
