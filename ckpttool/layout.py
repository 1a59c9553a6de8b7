"""Where the model is inside a checkpoint, and what wraps its keys.

Training snapshots nest the model state dict beside optimizer, scheduler and RNG
state; DDP, DataParallel and ``torch.compile`` prefix every key (``module.``,
``_orig_mod.``). These functions find both on the lazy tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import CkptError
from .tree import KeyPath, Opaque, get_path, is_tensor, iter_tensors, walk

# Keys that hold the model state dict in common snapshot layouts, most specific first:
# torchrun tutorial, Composer (state.model), Lightning/HF (state_dict), nanoGPT (model).
MODEL_KEYS: tuple[KeyPath, ...] = (
    ("MODEL_STATE",),
    ("state", "model"),
    ("model_state_dict",),
    ("model_state",),
    ("state_dict",),
    ("model",),
    ("module",),
    ("net",),
    ("network",),
    ("weights",),
    ("params",),
)
# Subtrees that hold tensors but are never the model (the fallback search skips them).
NON_MODEL_KEYS = frozenset(
    {
        "optimizer",
        "optimizers",
        "optimizer_state",
        "optimizer_state_dict",
        "optim",
        "OPTIMIZER_STATE",
        "optimizer_states",
        "scheduler",
        "schedulers",
        "lr_scheduler",
        "SCHEDULER_STATE",
        "rng",
        "RNG",
        "rng_state",
        "rng_states",
        "scaler",
        "grad_scaler",
    }
)
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# Inside a pickled nn.Module (``torch.save(model)``) each layer keeps its own
# ``_parameters`` dict ("weight", "bias"): one layer's, never the model's state dict.
MODULE_INTERNALS = frozenset({"_parameters", "_buffers"})


def is_state_dict(node: Any) -> bool:
    """A mapping from string names to tensors (extra non-tensor entries allowed)."""
    if not isinstance(node, Mapping) or not node:
        return False
    if not all(isinstance(k, str) for k in node):
        return False
    tensors = sum(1 for v in node.values() if is_tensor(v))
    return tensors > 0 and tensors * 2 >= len(node)


def module_state_dict(node: Any) -> dict[str, Any] | None:
    """The state dict of a pickled ``nn.Module`` (``torch.save(model)``), read from its
    ``_parameters``, persistent ``_buffers`` and ``_modules`` without running its class."""
    if not isinstance(node, Opaque):
        return None
    attrs = node.attrs()
    if not isinstance(attrs.get("_parameters"), Mapping) or not isinstance(
        attrs.get("_modules"), Mapping
    ):
        return None
    state: dict[str, Any] = {}

    def visit(module: Opaque, prefix: str) -> None:
        a = module.attrs()
        transient = a.get("_non_persistent_buffers_set") or ()
        for name, value in (a.get("_parameters") or {}).items():
            if is_tensor(value):
                state[prefix + name] = value
        for name, value in (a.get("_buffers") or {}).items():
            if is_tensor(value) and name not in transient:
                state[prefix + name] = value
        for name, child in (a.get("_modules") or {}).items():
            if isinstance(child, Opaque):
                visit(child, f"{prefix}{name}.")

    visit(node, "")
    return state or None


def model_state(node: Any) -> Mapping[str, Any] | None:
    """The state dict a node holds: itself, or the parameters and buffers of a pickled module."""
    return node if is_state_dict(node) else module_state_dict(node)


def find_model_key(root: Any) -> KeyPath | None:
    """The path to the model state dict (or pickled module): ``()`` for the root, ``None``
    when there is none."""
    if model_state(root) is not None:
        return ()
    for path in MODEL_KEYS:
        try:
            node = get_path(root, path)
        except CkptError:
            continue
        if model_state(node) is not None:
            return path
    return _largest_state_dict(root)


def _largest_state_dict(root: Any) -> KeyPath | None:
    best, best_size = None, 0
    for path, node in walk(root):
        if any(str(k) in NON_MODEL_KEYS for k in path) or isinstance(node, Opaque):
            continue
        if any(k in MODULE_INTERNALS for k in path):
            continue
        if is_state_dict(node):
            size = sum(t.numel for _, t in iter_tensors(node))
            if size > best_size:
                best, best_size = path, size
    return best


def detect_prefix(keys: list[str]) -> str | None:
    """The wrapper prefix every key shares (``module.``, ``_orig_mod.``, or a stack)."""
    if not keys:
        return None
    prefix = ""
    while True:
        for wrapper in WRAPPER_PREFIXES:
            candidate = prefix + wrapper
            if all(k.startswith(candidate) for k in keys):
                prefix = candidate
                break
        else:
            return prefix or None


def strip_prefix(state: Mapping[str, Any], prefix: str | None) -> dict[str, Any]:
    """A new dict with ``prefix`` removed from the keys that have it (input untouched)."""
    if not prefix:
        return dict(state)
    return {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in state.items()}


def resolve_prefix(state: Mapping[str, Any], option: str | None) -> str | None:
    """``auto`` detects, ``none`` keeps keys, anything else is the prefix to strip."""
    if option is None or option == "none":
        return None
    if option == "auto":
        return detect_prefix([k for k in state if isinstance(k, str)])
    return option


def parse_key_path(root: Any, dotted: str) -> KeyPath:
    """Split ``state.model`` into keys, allowing keys that themselves contain dots.

    At each level the longest key matching the start of what is left wins, so
    ``state.model.0.weight`` finds ``("state", "model", "0.weight")``.
    """
    path: list[Any] = []
    node, rest = root, dotted
    while rest:
        keys = [str(k) for k, _ in _items(node)]
        match = None
        for key in sorted(keys, key=len, reverse=True):
            if rest == key or rest.startswith(key + "."):
                match = key
                break
        if match is None:
            raise CkptError(
                f"no key {rest.split('.')[0]!r} under {'.'.join(map(str, path)) or 'the root'}",
                hint="see the tree with: ckpttool inspect",
            )
        real_key = next(k for k, _ in _items(node) if str(k) == match)
        path.append(real_key)
        node = get_path(node, (real_key,))
        rest = rest[len(match) + 1 :]
    return tuple(path)


def _items(node: Any) -> list[tuple[Any, Any]]:
    from .tree import children

    return list(children(node))


PLAIN_TYPES = (bool, int, float, str, bytes, type(None))


def is_plain(value: Any) -> bool:
    """A primitive, or a list/tuple of plain values (a ``betas`` pair, an RNG state tuple)."""
    if isinstance(value, PLAIN_TYPES):
        return True
    return isinstance(value, (list, tuple)) and all(is_plain(v) for v in value)


def plain_values(root: Any) -> list[tuple[KeyPath, Any]]:
    """Every non-tensor leaf (epoch, step, lr...) with its path; opaque objects included."""
    out: list[tuple[KeyPath, Any]] = []
    stack: list[tuple[KeyPath, Any]] = [((), root)]
    while stack:
        path, node = stack.pop()
        if is_tensor(node):
            continue
        if (
            is_plain(node)
            or isinstance(node, Opaque)
            or not isinstance(node, (Mapping, list, tuple))
        ):
            if path:
                out.append((path, node))
            continue
        kids = list(node.items()) if isinstance(node, Mapping) else list(enumerate(node))
        stack.extend((path + (k,), v) for k, v in reversed(kids))
    return out
