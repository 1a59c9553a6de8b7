"""One weight, however many names: parameter counts as ``model.num_parameters()`` gives
them (storage shared once) and the names a safetensors output or a ``diff`` takes as
ties of another (as ``save_pretrained`` writes a tied embedding once)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

K = TypeVar("K")  # a tensor's name: a string, or a key path


def weight_key(ref: Any) -> tuple | None:
    """What makes two tensors one weight: the same stored bytes viewed the same way (the
    same storage, offset, shape, stride and dtype); None for a tensor that has no
    storage of its own to share (sharded, meta, sparse)."""
    storage = getattr(ref, "storage", None)
    if storage is None or not hasattr(ref, "stride"):
        return None
    return (id(storage), ref.offset, tuple(ref.shape), tuple(ref.stride), ref.dtype)


def count_parameters(refs: Iterable[Any]) -> int:
    """Elements of the tensors ``refs``, a tensor saved twice over one storage (a tied
    embedding: ``lm_head.weight`` and ``wte.weight``) counted once, as
    ``model.num_parameters()`` counts the one parameter. Sharded and storage-less
    tensors count each."""
    seen: set[tuple] = set()
    total = 0
    for ref in refs:
        view = weight_key(ref)
        if view is not None:
            if view in seen:
                continue
            seen.add(view)
        total += ref.numel
    return total


def tied_names(tensors: Mapping[K, Any]) -> dict[K, K]:
    """``{alias: name}`` for each tensor of ``tensors`` that is the same weight as one
    named before it (in their order: the input embedding before the output head that
    shares it, as a state dict lists them). A slice of another tensor's storage, or an
    equal copy, is no tie."""
    first: dict[tuple, K] = {}
    tied: dict[K, K] = {}
    for name, ref in tensors.items():
        view = weight_key(ref)
        if view is None:
            continue
        if view in first:
            tied[name] = first[view]
        else:
            first[view] = name
    return tied
