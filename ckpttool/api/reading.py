"""The library's verbs: read a checkpoint lazily, select what a command works on, load tensors."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from os import PathLike
from typing import Any, BinaryIO

from ..errors import CkptError, translate_errors
from ..formats import gc_paused, read_checkpoint
from ..tensors import loading
from ..tree import (
    Checkpoint,
    KeyPath,
    Node,
    Opaque,
    ShardedRef,
    TensorRef,
    check_not_partitioned,
    get_path,
    is_lightning_state_dict,
    is_tensor,
    iter_tensors,
    model_candidates,
    model_key,
    module_state_dict,
    parse_key_path,
    resolve_prefix,
    strip_prefix,
)
from .file_inputs import FileInput, is_file_like

PathArg = str | PathLike | Sequence[str | PathLike]


@translate_errors
def read(
    paths: PathArg | BinaryIO | Checkpoint,
    *,
    unsafe: bool = False,
    allow: Iterable[Any] | None = None,
) -> Checkpoint:
    """Read a checkpoint's structure and tensor metadata; no tensor bytes are read.

    Args:
        paths: A file, a folder (DCP, sharded safetensors), per-rank files, a glob, a
            binary file object (``io.BytesIO``, an open file) as ``torch.load`` takes, or a
            :class:`Checkpoint` read before (returned as it is).
        unsafe: Accept pickles that reference dangerous globals (they stay inert).
        allow: Globals to trust, as ``torch.serialization.add_safe_globals`` takes them:
            names (``"pkg.mod.Class"``, ``"pkg.mod.*"``), the classes or functions
            themselves, or ``(object, "name")`` pairs. They may be called by the pickle
            and still come back as inert stand-ins. What the program registered with
            ``add_safe_globals`` / ``safe_globals`` counts too (where torch is imported).
            Dangerous families cannot be allowed.

    Returns:
        The lazy :class:`~ckpttool.tree.Checkpoint`.

    Raises:
        UnsafeError: The file references dangerous globals and ``unsafe`` is False.
        InputNotFoundError: The input does not exist (also a ``FileNotFoundError``).
        CkptError: Missing, corrupt, truncated or unsupported input, or an ``allow``
            entry that cannot be allowed.
    """
    if isinstance(paths, Checkpoint):  # read already: load, open and load_into take one too
        return paths
    with _allowing(allow):
        if is_file_like(paths):
            source = FileInput(paths)
            ckpt = read_checkpoint(source.path, unsafe=unsafe)
            source.keep_alive(ckpt.root)
            return ckpt
        return read_checkpoint(paths, unsafe=unsafe)  # type: ignore[arg-type]


def _allowing(allow: Iterable[Any] | None) -> AbstractContextManager[None]:
    """What ``allow`` and torch's registered safe globals trust, for one read."""
    if allow is None and "torch.serialization" not in sys.modules:
        return nullcontext()  # (nothing to ask, nothing imported)
    from ..unpickler import allowing, api_allow_list

    return allowing(api_allow_list(allow))


def select_node(
    ckpt: Checkpoint, select: str = "auto", strip: str | None = "auto"
) -> tuple[KeyPath | None, Any]:
    """Pick the part of the checkpoint a command works on.

    Args:
        ckpt: A checkpoint from :func:`read`.
        select: ``auto`` (the model state dict), ``all`` (the whole tree) or a
            dotted key path (``state.model``).
        strip: ``auto``, ``none`` or a prefix to remove from the selected state dict's keys.

    Returns:
        (path of the selection or None for ``all``, the selected subtree with prefix stripped).
    """
    if select == "all":
        node = ckpt.root
        if strip not in (None, "auto", "none") and isinstance(node, Mapping):
            node = strip_prefix(node, resolve_prefix(node, strip))
        require_data(node)
        return None, node
    if select == "auto":
        path = model_key(ckpt)
        if path is None:
            found = model_candidates(ckpt.root)
            what = (
                "several state dicts could each be the model ("
                + ", ".join(".".join(map(str, p)) or "(root)" for p in found[:6])
                + (", …" if len(found) > 6 else "")
                + ")"
                if len(found) > 1
                else "no model state dict found in the checkpoint"
            )
            raise CkptError(
                what,
                path=ckpt.files[0] if ckpt.files else None,
                hint="use --select all, or --select KEY.PATH from `ckpttool inspect`",
            )
    else:
        path = parse_key_path(ckpt.root, select)
    node = get_path(ckpt.root, path)
    node = module_state_dict(node) or node  # a pickled nn.Module: its state dict
    check_not_partitioned(ckpt.root, node, ckpt.files[0] if ckpt.files else None)
    if isinstance(node, Mapping) and all(isinstance(k, str) for k in node):
        lightning = is_lightning_state_dict(ckpt.root, path)
        node = strip_prefix(node, resolve_prefix(node, strip, lightning=lightning))
    require_data(node)
    return path, node


def require_data(node: Node) -> None:
    """Refuse, naming it, a tensor whose data is not all there: saved without data
    (``device="meta"``), or sharded with some ranks' shards never saved. There is
    nothing to load, write or compare. (``inspect`` shows such tensors.)"""
    for path, leaf in iter_tensors(node):
        name = ".".join(map(str, path))
        if isinstance(leaf, TensorRef) and leaf.storage is None:
            raise CkptError(
                f"tensor {name!r} has no stored data (saved on the meta device)",
                hint="--select other tensors",
            )
        if isinstance(leaf, ShardedRef) and leaf.incomplete:
            raise CkptError(f"tensor {name!r} {leaf.incomplete}", hint="--select other tensors")


def flatten_tensors(node: Node, name: str = "") -> dict[str, Any]:
    """Every tensor leaf under ``node``, named by its key path joined with ``.``;
    ``node`` itself a tensor is named ``name`` (its key, where it was selected)."""
    if is_tensor(node):
        return {name: node}
    out: dict[str, Any] = {}
    for path, leaf in iter_tensors(node):
        name = ".".join(str(k) for k in path)
        if name in out:
            raise CkptError(f"two tensors would both be named {name!r}")
        out[name] = leaf
    return out


def materialize(node: Node, map_location: Any = "cpu", *, mmap: bool = False) -> Any:
    """The same structure with every lazy tensor read (shards merged into full tensors).

    Tensors saved as ``nn.Parameter`` or with ``requires_grad`` come back so, as from
    ``torch.load``. Opaque objects become plain-data records (``{"__class__": ...,
    "state": ...}``), as in ``ckpttool merge`` output; a tensor referenced twice comes
    back as one tensor, tensors saved sharing a storage (tied weights, views) share one.

    Args:
        node: A lazy subtree (from :func:`select_node`).
        map_location: As in :func:`load`.
        mmap: Map tensor bytes from the file where the format allows (see :func:`load`).
    """
    from ..tensors import as_saved, load_leaf, shared_storage_tensors, to_torch

    loaded: dict[int, Any] = {}
    # the refs loaded are held while ``loaded`` is keyed by their ids: a storage saved on
    # its own comes as a flat tensor ref made for the call, and a freed one's id is
    # reused by the next (a second storage got the first one's tensor)
    held: list[Any] = []

    def leaf(ref: Any) -> Any:
        if id(ref) not in loaded:
            held.append(ref)
            loaded[id(ref)] = as_saved(load_leaf(ref, map_location), ref)
        return loaded[id(ref)]

    with gc_paused(), loading(mmap):
        by_storage: dict[int, list[TensorRef]] = {}
        for _, ref in iter_tensors(node):
            if isinstance(ref, TensorRef) and ref.storage is not None:
                group = by_storage.setdefault(id(ref.storage), [])
                if all(r is not ref for r in group):
                    group.append(ref)
        # one storage at a time: tensors keep their saved strides, tied ones share it
        for group in by_storage.values():
            loaded.update(shared_storage_tensors(group, map_location) or {})
        return to_torch(node, leaf)


@translate_errors
def load(
    paths: PathArg | BinaryIO,
    map_location: Any = "cpu",
    select: str = "auto",
    strip_prefix: str | None = "auto",
    unsafe: bool = False,
    mmap: bool = True,
    allow: Iterable[Any] | None = None,
) -> Any:
    """Load a checkpoint of any supported format, safely, as torch tensors.

    Args:
        paths: A file, a folder (DCP, sharded safetensors), per-rank files, a glob or a
            binary file object.
        map_location: As in ``torch.load``: a device string, ``torch.device``, a dict
            mapping saved locations, or a callable. Defaults to ``"cpu"``. ``cuda:N``
            reads through pinned buffers straight to the device, copies overlapping reads.
        select: ``auto`` returns the model state dict; ``all`` the whole nested
            structure; a dotted key path (``state.model``) that subtree.
        strip_prefix: ``auto`` strips wrapper prefixes (``module.``, ``_orig_mod.``),
            ``none`` keeps keys, any other string is stripped where present.
        unsafe: Accept files whose pickles reference dangerous globals (still inert).
        mmap: Map tensor bytes from the file (copy-on-write, as ``torch.load(mmap=True)``):
            torch-zip entries, safetensors, DCP chunks; nothing is read until used, and
            writing to a tensor never changes the file. Legacy files, byte-swapped data
            and sharded tensors are read once into the final tensor. ``False`` reads
            everything now (for files about to change, e.g. on a network file system).
        allow: Globals to trust (see :func:`read`).

    Returns:
        A dict of tensors (``auto``) or the nested structure, sharded tensors merged.
        Objects of classes that are not rebuilt are plain-data stand-ins
        (``{"__class__": "pkg.mod.Class", "state": {...}}``).

    Raises:
        UnsafeError: The file references dangerous globals and ``unsafe`` is False.
        CkptError: Missing, corrupt, truncated or unsupported input.
    """
    ckpt = read(paths, unsafe=unsafe, allow=allow)
    _, node = select_node(ckpt, select, strip_prefix)
    return materialize(node, map_location, mmap=mmap)


__all__ = [
    "Checkpoint",
    "CkptError",
    "Opaque",
    "flatten_tensors",
    "load",
    "materialize",
    "read",
    "select_node",
]
