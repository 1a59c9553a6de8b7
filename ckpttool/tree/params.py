"""Parameter counts as ``model.num_parameters()`` gives them: storage shared once."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def count_parameters(refs: Iterable[Any]) -> int:
    """Elements of the tensors ``refs``, a tensor saved twice over one storage (a tied
    embedding: ``lm_head.weight`` and ``wte.weight``) counted once, as
    ``model.num_parameters()`` counts the one parameter. Sharded and storage-less
    tensors count each."""
    seen: set[tuple] = set()
    total = 0
    for ref in refs:
        storage = getattr(ref, "storage", None)
        if storage is not None:
            view = (id(storage), ref.offset, tuple(ref.shape), tuple(ref.stride), ref.dtype)
            if view in seen:
                continue
            seen.add(view)
        total += ref.numel
    return total
