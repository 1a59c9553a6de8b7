""":class:`Checkpoint` (a read checkpoint: its tree, format, files and the verdicts on its
pickles' globals) and the walks every command makes over a tree.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from ..errors import CkptError
from .leaves import KeyPath, Leaf, Node, is_tensor
from .opaque import Opaque

if TYPE_CHECKING:
    pass


def children(node: Node) -> Iterator[tuple[Any, Any]]:
    """The (key, child) pairs of a container node; nothing for a leaf."""
    if isinstance(node, Mapping):
        yield from node.items()
    elif isinstance(node, (list, tuple)):
        yield from enumerate(node)
    elif isinstance(node, Opaque):
        yield from node.children()


def walk(node: Node, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """Yield (key path, node) for every node, depth first, containers before children.

    Shared sub-objects are visited once per path; cycles are cut.
    """
    stack: list[tuple[KeyPath, Any, frozenset[int]]] = [(path, node, frozenset())]
    while stack:
        here, value, ancestors = stack.pop()
        yield here, value
        if is_tensor(value) or id(value) in ancestors:
            continue
        kids = list(children(value))
        if kids:
            inner = ancestors | {id(value)}
            stack.extend((here + (k,), v, inner) for k, v in reversed(kids))


def iter_tensors(node: Node, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Leaf]]:
    """Yield (key path, tensor leaf) for every tensor under ``node``, in order."""
    for here, value in walk(node, path):
        if is_tensor(value):
            yield here, value


def get_path(node: Node, path: KeyPath) -> Any:
    """Follow ``path`` from ``node``; raise CkptError naming the first missing key."""
    for i, key in enumerate(path):
        try:
            if isinstance(node, (list, tuple)):
                node = node[int(key)]
            elif isinstance(node, Opaque):
                node = dict(node.children())[key]
            else:
                node = node[key]
        except (KeyError, IndexError, ValueError, TypeError):
            shown = ".".join(str(k) for k in path[: i + 1])
            raise CkptError(f"no key {shown!r} in the checkpoint") from None
    return node


@dataclass(repr=False)
class Checkpoint(Mapping):
    """What a reader returns: the lazy tree plus what it learned on the way.

    A read-only mapping over its root, as ``torch.load`` would return it (``ckpt["model"]``,
    ``ckpt.keys()``), its values lazy: tensors are :class:`TensorRef` & co. until loaded.

    Attributes:
        format: A format id from the contract (``torch-zip``, ``dcp``, ...).
        files: The files read, in rank order for sharded inputs.
        root: The tree.
        world_size: Number of ranks for ``dcp`` / ``per-rank`` input, else None.
        globals: Every global the pickles referenced, sorted (``module.name``).
        dangerous: Those of them that are refused without ``--unsafe``.
        unverified: Those on none of ckpttool's allow-lists, read as inert stand-ins.
        metadata: Format-level metadata (the safetensors ``__metadata__``).
        model_path: Where the model state dict is, when the reader knows it from the
            layout (run folders, Megatron); None: found from the tree's content.
    """

    format: str
    files: list[str]
    root: Any
    world_size: int | None = None
    globals: list[str] = field(default_factory=list)
    dangerous: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    model_path: KeyPath | None = None

    def _container(self) -> Any:
        root = self.root
        return root if isinstance(root, Mapping) else dict(children(root))

    def __getitem__(self, key: Any) -> Any:
        return self._container()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._container())

    def __len__(self) -> int:
        return len(self._container())

    def __repr__(self) -> str:
        # short at any size: a 70B folder has thousands of tensors and dozens of files
        files = [os.path.basename(f) for f in self.files]
        shown_files = repr(files[:2])[:-1] + (
            f", ... +{len(files) - 2}]" if len(files) > 2 else "]"
        )
        keys = [str(k) for k in list(self._container())[: MAX_REPR_KEYS + 1]]
        shown_keys = ", ".join(
            repr(k if len(k) <= 40 else k[:39] + "…") for k in keys[:MAX_REPR_KEYS]
        )
        if len(keys) > MAX_REPR_KEYS:
            shown_keys += f", ... +{len(self) - MAX_REPR_KEYS}"
        tensors = sum(1 for _ in iter_tensors(self.root))
        world = f", world_size={self.world_size}" if self.world_size else ""
        return (
            f"Checkpoint(format={self.format!r}, files={shown_files}{world}, "
            f"tensors={tensors}, keys=[{shown_keys}])"
        )


MAX_REPR_KEYS = 6


class Verdicts(TypedDict):
    """The keyword arguments of :class:`Checkpoint` that judge its pickles' globals."""

    globals: list[str]
    dangerous: list[str]
    unverified: list[str]


def verdicts(*parts: Checkpoint) -> Verdicts:
    """``globals``, ``dangerous`` and ``unverified`` of several checkpoints read as one
    (keyword arguments for :class:`Checkpoint`)."""
    dangerous = {g for part in parts for g in part.dangerous}
    return {
        "globals": sorted({g for part in parts for g in part.globals}),
        "dangerous": sorted(dangerous),
        "unverified": sorted({g for part in parts for g in part.unverified} - dangerous),
    }
