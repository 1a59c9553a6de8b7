"""Opt-in real ``torch.load`` for files you trust, with ShardedTensors that load anywhere.

Unlike everything else in ckpttool, :func:`torch_load` RUNS the pickle's code
(``weights_only=False``). Use it only on files you trust, when you need the real
Python objects (a custom class, real ``ShardedTensor`` objects).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def sharded_tensor_loadable() -> Iterator[None]:
    """Let ``ShardedTensor`` unpickle without the process group that saved it.

    ``ShardedTensor.__setstate__`` insists on an initialized process group with the
    saving rank and world size. Inside this context it only restores the local
    shards and metadata; ``_process_group`` is None. The original is put back on exit.
    """
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    original = ShardedTensor.__setstate__

    def setstate(self: Any, state: Any) -> None:
        self._sharded_tensor_id = None
        self._local_shards, self._metadata, _pg_state, self._sharding_spec, self._init_rrefs = state
        self._process_group = None

    ShardedTensor.__setstate__ = setstate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardedTensor.__setstate__ = original  # type: ignore[method-assign]


def torch_load(path: Any, map_location: Any = "cpu", **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=False)`` inside :func:`sharded_tensor_loadable`.

    Args:
        path: A torch.save file you trust: its pickle code runs.
        map_location: As in ``torch.load``; ``cpu`` by default so GPU-saved files load anywhere.
        **kwargs: Passed to ``torch.load`` (``mmap=True`` for example).
    """
    import torch

    with sharded_tensor_loadable():
        return torch.load(path, map_location=map_location, weights_only=False, **kwargs)
