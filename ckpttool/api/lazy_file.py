"""``ckpttool.open``: a lazy mapping of tensor names, in the spirit of ``safetensors.safe_open``.

Every format works the same: ``keys()``, ``metadata()``, ``get_tensor(name)`` and
``get_slice(name)[rows]``, which reads only the bytes of the rows asked for (also across
the shards of a sharded tensor). Nothing imports torch until a tensor is asked for.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from ..errors import CkptError, translate_errors
from ..tensors import LoadSession, activated
from ..tree import Checkpoint, ShardedRef, TensorRef

Ranges = list[range]


class LazyCheckpoint(Mapping):
    """Tensors of a checkpoint by name, read one at a time when asked for.

    Names are those :func:`ckpttool.load` would give (the model state dict, prefix
    stripped, by default). Use it as a context manager, or call :meth:`close`; tensors
    already returned stay valid after it is closed.

    Attributes:
        checkpoint: The lazy :class:`~ckpttool.tree.Checkpoint` it reads from.
    """

    def __init__(
        self, checkpoint: Checkpoint, tensors: dict[str, Any], map_location: Any, mmap: bool
    ) -> None:
        self.checkpoint = checkpoint
        self._tensors: dict[str, Any] | None = tensors
        self._map_location = map_location
        self._session = LoadSession(mmap)
        # files it keeps open are closed with it, also when it is never closed
        weakref.finalize(self, self._session.close)

    # -- the mapping ------------------------------------------------------------------

    def _leaves(self) -> dict[str, Any]:
        if self._tensors is None:
            raise CkptError("the checkpoint was closed", hint="open it again")
        return self._tensors

    def __getitem__(self, name: str) -> Any:
        return self.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._leaves())

    def __len__(self) -> int:
        return len(self._leaves())

    def __contains__(self, name: object) -> bool:
        return name in self._leaves()

    def __repr__(self) -> str:
        state = "closed" if self._tensors is None else f"{len(self._tensors)} tensors"
        return f"<ckpttool.open {self.checkpoint.format} {state}>"

    # -- safe_open's verbs ------------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        """The format's own metadata (safetensors ``__metadata__``, an index's ``metadata``)."""
        return dict(self.checkpoint.metadata)

    def leaf(self, name: str) -> Any:
        """The lazy tensor (``TensorRef``, ``ShardedRef``...) named ``name``: dtype, shape."""
        leaves = self._leaves()
        if name not in leaves:
            raise CkptError(f"no tensor {name!r} in the checkpoint", hint="see keys()")
        return leaves[name]

    @translate_errors
    def get_tensor(self, name: str) -> Any:
        """The tensor ``name``, mapped from its file where the format allows.

        Raises:
            CkptError: No such tensor, or its bytes are corrupt or missing.
        """
        from ..tensors import as_saved, load_leaf

        ref = self.leaf(name)
        try:
            with activated(self._session):
                return as_saved(load_leaf(ref, self._map_location), ref)
        finally:
            self._session.settle()
            self._session.maps.clear()  # each tensor its own private pages, as from load

    def get_slice(self, name: str) -> TensorSlice:
        """A handle whose ``[...]`` reads only the elements asked for (ints and slices)."""
        return TensorSlice(self, name, self.leaf(name))

    def close(self) -> None:
        """Forget the tree and free buffers; returned tensors stay valid."""
        self._tensors = None
        self._session.close()

    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorSlice:
    """One tensor of a :class:`LazyCheckpoint`, read in parts: ``f.get_slice(name)[:128]``."""

    def __init__(self, owner: LazyCheckpoint, name: str, ref: Any) -> None:
        self._owner = owner
        self.name = name
        self._ref = ref

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._ref.shape)

    @property
    def dtype(self) -> str:
        return self._ref.dtype.name

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype

    def __getitem__(self, key: Any) -> Any:
        ranges, squeeze = normalize_index(key, self.shape)  # IndexError: the caller's key
        return self._read(ranges, squeeze)

    @translate_errors
    def _read(self, ranges: Ranges, squeeze: list[bool]) -> Any:
        """The elements ``ranges`` picks (see :func:`normalize_index`); bytes of the file."""
        import torch

        from ..tensors import place, target_device

        session = self._owner._session
        try:
            with activated(session):
                out = _read_ranges(self._ref, ranges)
        finally:
            session.settle()
            session.maps.clear()
        if any(squeeze):
            out = out[tuple(0 if s else slice(None) for s in squeeze)]
        location = self._owner._map_location
        if callable(location) and not isinstance(location, (str, torch.device, dict)):
            location = "cpu"  # a storage callable does not apply to a slice: stay on the CPU
        return place(out, target_device(self._ref.device, location))


def normalize_index(key: Any, shape: tuple[int, ...]) -> tuple[Ranges, list[bool]]:
    """Per dimension, the indices ``key`` takes (a ``range``), and whether it was an int.

    Raises:
        IndexError: Too many indices, an int out of range, a step that is not positive,
            or a kind of index other than int, slice and ``...``.
    """
    items = list(key) if isinstance(key, tuple) else [key]
    ellipses = [i for i, k in enumerate(items) if k is Ellipsis]
    if len(ellipses) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if ellipses:
        at = ellipses[0]
        items[at : at + 1] = [slice(None)] * max(0, len(shape) - len(items) + 1)
    if len(items) > len(shape):
        raise IndexError(f"too many indices for a tensor of {len(shape)} dimensions")
    items += [slice(None)] * (len(shape) - len(items))
    ranges, squeeze = [], []
    for dim, (k, size) in enumerate(zip(items, shape, strict=True)):
        if isinstance(k, bool) or not isinstance(k, (int, slice)):
            if hasattr(k, "__index__") and not isinstance(k, bool):
                k = k.__index__()
            else:
                raise IndexError(f"only ints, slices and ... are supported, not {k!r}")
        if isinstance(k, int):
            i = k + size if k < 0 else k
            if not 0 <= i < size:
                raise IndexError(f"index {k} is out of bounds for dimension {dim} of size {size}")
            ranges.append(range(i, i + 1))
            squeeze.append(True)
        else:
            start, stop, step = k.indices(size)
            if step <= 0:
                raise IndexError("slice steps must be positive")
            ranges.append(range(start, stop, step))
            squeeze.append(False)
    return ranges, squeeze


def _read_ranges(ref: Any, ranges: Ranges) -> Any:
    """The elements of ``ref`` at ``ranges`` (one per dim), read as little as possible."""
    import torch

    from ..tensors import storage_bytes, torch_dtype

    out_shape = [len(r) for r in ranges]
    if isinstance(ref, TensorRef) and _plain(ref):
        dt = torch_dtype(ref.dtype)
        if 0 in out_shape:
            return torch.empty(out_shape, dtype=dt)
        itemsize = ref.dtype.itemsize
        first = ref.offset + sum(r[0] * s for r, s in zip(ranges, ref.stride, strict=True))
        last = ref.offset + sum(r[-1] * s for r, s in zip(ranges, ref.stride, strict=True))
        flat = storage_bytes(ref.storage, first * itemsize, (last - first + 1) * itemsize)
        strides = [s * r.step for r, s in zip(ranges, ref.stride, strict=True)]
        return torch.as_strided(flat.view(dt), out_shape, strides).contiguous()
    if isinstance(ref, ShardedRef):
        if ref.incomplete:
            raise CkptError(f"sharded tensor {ref.incomplete}")
        out = torch.empty(out_shape, dtype=torch_dtype(ref.dtype))
        for shard in ref.shards:
            local, placed = [], []
            for r, o, n in zip(ranges, shard.offsets, shard.sizes, strict=True):
                lo = max(0, -(-(o - r.start) // r.step))
                hi = min(len(r), -(-(o + n - r.start) // r.step))
                if lo >= hi:
                    break
                local.append(range(r[lo] - o, r[hi - 1] - o + 1, r.step))
                placed.append(slice(lo, hi))
            else:
                inner = shard.tensor.tensor_ref()
                if tuple(inner.shape) != tuple(shard.sizes):
                    raise CkptError(
                        f"shard at offsets {list(shard.offsets)} has shape "
                        f"{list(inner.shape)}, expected {list(shard.sizes)}"
                    )
                out[tuple(placed)] = _read_ranges(inner, local)
        return out
    from ..tensors import load_leaf

    whole = load_leaf(ref, "cpu")  # quantized, byte-swapped, sparse...: read it all, then index
    index = tuple(slice(r.start, r.stop, r.step) for r in ranges)
    return whole.to_dense()[index] if whole.layout != torch.strided else whole[index]


def _plain(ref: TensorRef) -> bool:
    return (
        ref.kind == "tensor"
        and not (ref.conj or ref.neg)
        and ref.storage is not None
        and not ref.storage.big_endian
        and all(s >= 0 for s in ref.stride)
    )


@translate_errors
def open_checkpoint(
    paths: Any | BinaryIO,
    *,
    select: str = "auto",
    strip_prefix: str | None = "auto",
    map_location: Any = "cpu",
    unsafe: bool = False,
    mmap: bool = True,
    allow: Any = None,
) -> LazyCheckpoint:
    """Open a checkpoint of any format lazily: structure now, tensor bytes on demand.

    >>> with ckpttool.open("ckpt/") as f:
    ...     w = f.get_tensor("layers.0.weight")
    ...     rows = f.get_slice("embed.weight")[:128]

    Args:
        paths: What :func:`ckpttool.load` takes: a file, a folder, rank files, a glob,
            a binary file object.
        select: ``auto`` (the model state dict), ``all`` (every tensor, named by its
            key path joined with ``.``) or a dotted key path.
        strip_prefix: ``auto``, ``none`` or a prefix to remove, as in ``load``.
        map_location: Where tensors go, as in ``load``.
        unsafe: Accept pickles that reference dangerous globals (still inert).
        mmap: Map tensor bytes from the file where the format allows (see ``load``).
        allow: Globals to trust (see :func:`ckpttool.read`).

    Returns:
        A :class:`LazyCheckpoint`.

    Raises:
        UnsafeError: The file references dangerous globals and ``unsafe`` is False.
        CkptError: Missing, corrupt, truncated or unsupported input.
    """
    from .reading import flatten_tensors, read, select_node

    ckpt = read(paths, unsafe=unsafe, allow=allow)
    path, node = select_node(ckpt, select, strip_prefix)
    name = str(path[-1]) if path else ""
    tensors = flatten_tensors(node, name)
    return LazyCheckpoint(ckpt, tensors, map_location, mmap)


open = open_checkpoint  # noqa: A001 - the public name, as safetensors' safe_open
