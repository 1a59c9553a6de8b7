"""Where the model is inside a checkpoint, and what wraps its keys.

Training snapshots nest the model state dict beside optimizer, scheduler and RNG
state; DDP, DataParallel and ``torch.compile`` prefix every key (``module.``,
``_orig_mod.``). These functions find both on the lazy tree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..errors import CkptError
from .checkpoint import Checkpoint, children, get_path
from .leaves import KeyPath, Node, SparseRef, TensorRef, is_tensor
from .opaque import Opaque, is_module_state, module_entries

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
# DDP / DataParallel, torch.compile, and Lightning's wrapper around a LightningModule
# (a DeepSpeed engine's model states hold its keys as ``_forward_module.model...``)
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")
# Inside a pickled nn.Module (``torch.save(model)``) each layer keeps its own
# ``_parameters`` dict ("weight", "bias"): one layer's, never the model's state dict.
MODULE_INTERNALS = frozenset({"_parameters", "_buffers"})


def is_state_dict(node: Node) -> bool:
    """A mapping from string names to tensors (extra non-tensor entries allowed)."""
    if not isinstance(node, Mapping) or not node:
        return False
    if not all(isinstance(k, str) for k in node):
        return False
    tensors = sum(1 for v in node.values() if is_tensor(v))
    return tensors > 0 and tensors * 2 >= len(node)


def module_state_dict(node: Node) -> dict[str, Any] | None:
    """The state dict of a pickled ``nn.Module`` (``torch.save(model)``), read from its
    ``_parameters``, persistent ``_buffers`` and ``_modules`` without running its class.

    Its tensors are detached, as ``Module.state_dict()`` gives them: plain tensors, not
    ``nn.Parameter``s; a tensor shared by two modules (tied weights) stays one tensor.
    The module's plain-data record in ``merge`` output reads the same.
    """
    attrs = _module_attrs(node)
    if attrs is None:
        return None
    state: dict[str, Any] = {}
    detached: dict[int, Any] = {}

    def detach(value: Any) -> Any:
        if not isinstance(value, (TensorRef, SparseRef)):
            return value
        if id(value) not in detached:
            detached[id(value)] = dataclasses.replace(value, parameter=False, requires_grad=False)
        return detached[id(value)]

    def visit(a: Mapping[str, Any], prefix: str, ancestors: frozenset[int]) -> None:
        for name, value in module_entries(a):
            if is_tensor(value):
                state[f"{prefix}{name}"] = detach(value)
            elif (child := _module_attrs(value)) is not None and id(child) not in ancestors:
                # (a module that holds an ancestor is cut, as every walk cuts cycles)
                visit(child, f"{prefix}{name}.", ancestors | {id(child)})

    visit(attrs, "", frozenset({id(attrs)}))
    return state or None


def _module_attrs(node: Node) -> Mapping[str, Any] | None:
    """The attributes of a pickled ``nn.Module``, or of its plain-data record in ``merge`` output
    (``{"__class__": ..., "state": {...}}``); None for anything else."""
    if isinstance(node, Opaque):
        attrs: Any = node.attrs()
    elif isinstance(node, Mapping) and isinstance(node.get("__class__"), str):
        attrs = node.get("state")
    else:
        return None
    if isinstance(attrs, Mapping) and is_module_state(attrs):
        return attrs
    return None


def check_not_partitioned(root: Any, node: Node, source: str | None = None) -> None:
    """Refuse the model of DeepSpeed ZeRO-3 model states: each parameter there is an
    empty placeholder, its values partitioned over the ranks' optimizer states; written
    out it would be an empty model, silently.

    Raises:
        CkptError: ``param_shapes`` records a parameter with elements that ``node`` holds
            as an empty tensor.
    """
    if not isinstance(root, Mapping) or "ds_version" not in root or not isinstance(node, Mapping):
        return
    groups = root.get("param_shapes")
    for group in groups if isinstance(groups, list) else [groups]:
        for name, shape in group.items() if isinstance(group, Mapping) else ():
            tensor = node.get(name)
            if (
                tensor is not None
                and is_tensor(tensor)
                and tensor.numel == 0
                and isinstance(shape, tuple)
                and all(shape)
            ):
                raise CkptError(
                    f"DeepSpeed ZeRO-3 model states: {name!r} is an empty placeholder of "
                    f"shape {list(shape)}; the weights are partitioned over the "
                    "zero_pp_rank_*_optim_states.pt files",
                    path=source,
                    hint="pass the folder that holds them to rebuild the fp32 weights",
                )


def is_optimizer_state(node: Node) -> bool:
    """``torch.optim.Optimizer.state_dict()`` (also FSDP's, keyed by parameter name)."""
    return isinstance(node, Mapping) and "param_groups" in node and "state" in node


def is_nested_state_dict(node: Node) -> bool:
    """Dicts of dicts whose leaves are tensors (Megatron's ``language_model.encoder...``,
    or a snapshot's ``{"encoder": ..., "decoder": ...}``): the model, named by key paths.

    Subtrees that are never the model (optimizer or scheduler state) disqualify it.
    """
    if not isinstance(node, Mapping) or not node:
        return False
    tensors = others = 0
    stack = [node]
    while stack:
        mapping = stack.pop()
        if is_optimizer_state(mapping):
            return False
        for key, value in mapping.items():
            if not isinstance(key, str) or key in NON_MODEL_KEYS or key in MODULE_INTERNALS:
                return False
            if is_tensor(value):
                tensors += 1
            elif isinstance(value, Mapping) and value:
                stack.append(value)
            else:
                others += 1
    return tensors > 0 and tensors >= others


def model_state(node: Node) -> Mapping[str, Any] | None:
    """The state dict a node holds: itself (flat or nested), or the parameters and
    buffers of a pickled module."""
    if is_state_dict(node) or is_nested_state_dict(node):
        return node
    return module_state_dict(node)


# formats whose root is the model's state dict by construction, even an empty one (a
# TorchScript module without parameters: torch.jit.load(f).state_dict() is {})
STATE_DICT_FORMATS = frozenset({"safetensors", "safetensors-sharded", "torchscript"})


def model_key(ckpt: Checkpoint) -> KeyPath | None:
    """The path to the model state dict in ``ckpt`` (see :func:`find_model_key`)."""
    if ckpt.model_path is not None:  # the reader knows it from the layout
        return ckpt.model_path
    return () if ckpt.format in STATE_DICT_FORMATS else find_model_key(ckpt.root)


def find_model_key(root: Any) -> KeyPath | None:
    """The path to the model state dict (or pickled module): ``()`` for the root, ``None``
    when there is none, or when several state dicts could each be it."""
    if is_state_dict(root) or module_state_dict(root) is not None:
        return ()  # (a root holding a few state dicts is judged last, by what they are)
    if _ema_module_beside_model(root):
        return ("ema",)
    for path in MODEL_KEYS:
        try:
            node = get_path(root, path)
        except CkptError:
            continue
        if model_state(node) is not None:
            return path
    found = model_candidates(root)
    if len(found) == 1:
        return found[0]
    if found:  # one model split in parts ({"encoder", "decoder"}): the dict holding them
        common = _common_prefix(found)
        if is_nested_state_dict(get_path(root, common)):
            return common
    return None  # none, or several (a GAN's two nets, an EMA copy): never guess one


def _ema_module_beside_model(root: Any) -> bool:
    """YOLOv5's and Ultralytics' training checkpoints: pickled modules under both
    ``model`` and ``ema``; their loaders take ``ckpt.get("ema") or ckpt["model"]``,
    the averaged weights (plain state dicts under both keys stay ``model``'s)."""
    return (
        isinstance(root, Mapping)
        and module_state_dict(root.get("ema")) is not None
        and module_state_dict(root.get("model")) is not None
    )


def model_candidates(root: Any) -> list[KeyPath]:
    """Every flat state dict outside optimizer, scheduler and RNG state, in tree order;
    where there is none, every pickled module with parameters or buffers (Ultralytics'
    ``last.pt`` keeps its model only as ``ema``, beside ``"model": None``).

    Several of them with no one dict holding just them (a GAN's generator and
    discriminator beside their optimizers) leave the choice to ``--select``: taking
    the largest would make ``diff`` ignore the other one.
    """
    found: list[KeyPath] = []
    modules: list[KeyPath] = []
    stack: list[tuple[KeyPath, Any]] = [((), root)]
    while stack:
        path, node = stack.pop()
        if is_tensor(node) or is_optimizer_state(node):
            continue
        if path and (str(path[-1]) in NON_MODEL_KEYS or path[-1] in MODULE_INTERNALS):
            continue
        if path and module_state_dict(node) is not None:
            modules.append(path)
            continue
        if isinstance(node, Opaque):  # its attributes are no state dicts of their own
            continue
        if is_state_dict(node):
            found.append(path)
            continue
        if len(path) > 64:  # far deeper than any layout; a pathological pickle
            continue
        stack.extend((path + (k,), v) for k, v in reversed(list(children(node))))
    return found or modules


def _common_prefix(paths: list[KeyPath]) -> KeyPath:
    first = paths[0]
    n = 0
    while n < len(first) and all(len(p) > n and p[n] == first[n] for p in paths):
        n += 1
    return first[:n]


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


# A Lightning checkpoint (its version key at the root): its ``state_dict`` holds the
# LightningModule's keys, the wrapped network's under the attribute that holds it,
# ``model.`` by the convention of Lightning's docs and templates (``self.model = ...``)
LIGHTNING_VERSION_KEYS = ("pytorch-lightning_version", "lightning_version")
LIGHTNING_MODEL = "model."


def is_lightning_state_dict(root: Any, path: KeyPath | None) -> bool:
    """Whether ``path`` is the ``state_dict`` of a Lightning checkpoint ``root``."""
    return (
        path == ("state_dict",)
        and isinstance(root, Mapping)
        and any(key in root for key in LIGHTNING_VERSION_KEYS)
    )


def model_prefix(keys: list[str], lightning: bool = False) -> str | None:
    """The prefix ``--strip-prefix auto`` strips: the wrappers every key shares
    (:func:`detect_prefix`) and, in a Lightning checkpoint's ``state_dict``
    (``lightning``), the ``model.`` every key shares (its module's one network),
    with the wrappers inside it (``model._orig_mod.``)."""
    prefix = detect_prefix(keys) or ""
    if lightning and keys and all(k.startswith(prefix + LIGHTNING_MODEL) for k in keys):
        prefix += LIGHTNING_MODEL
        prefix += detect_prefix([k[len(prefix) :] for k in keys]) or ""
    return prefix or None


def strip_prefix(state: Mapping[str, Any], prefix: str | None) -> dict[str, Any]:
    """A new dict with ``prefix`` removed from the keys that have it (input untouched)."""
    if not prefix:
        return dict(state)
    return {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in state.items()}


def resolve_prefix(
    state: Mapping[str, Any], option: str | None, *, lightning: bool = False
) -> str | None:
    """``auto`` detects (:func:`model_prefix`; ``lightning``: the state is a Lightning
    checkpoint's ``state_dict``), ``none`` keeps keys, anything else is the prefix to strip.

    Raises:
        CkptError: A prefix that no key has (a typo would otherwise leave every key
            as it was, silently), naming the prefixes the keys do begin with.
    """
    if option is None or option == "none":
        return None
    keys = [k for k in state if isinstance(k, str)]
    if option == "auto":
        return model_prefix(keys, lightning)
    require_prefix(keys, option)
    return option


def require_prefix(keys: list[str], prefix: str) -> None:
    """Refuse ``--strip-prefix prefix`` where no key of ``keys`` starts with it.

    Raises:
        CkptError: Naming the first parts the keys share most (``model.`` (21 keys)).
    """
    if not keys or any(k.startswith(prefix) for k in keys):
        return
    counts: dict[str, int] = {}
    for key in keys:
        head, dot, _ = key.partition(".")
        counts[head + dot] = counts.get(head + dot, 0) + 1
    common = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:3]
    shown = ", ".join(f"{p!r} ({n} key{'s' * (n != 1)})" for p, n in common)
    raise NoSuchPrefixError(
        f"--strip-prefix {prefix!r} matches no key; the keys begin with {shown}",
        hint="pass one of those, or --strip-prefix auto",
    )


class NoSuchPrefixError(CkptError):
    """``--strip-prefix P`` where no key starts with ``P`` (exit 2)."""


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


def _items(node: Node) -> list[tuple[Any, Any]]:
    from .checkpoint import children

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
