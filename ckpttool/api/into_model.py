"""``ckpttool.load_into``: a checkpoint's tensors copied straight into a model, in place.

Each tensor's bytes are read from the page cache into the parameter or buffer that
receives them (on a GPU: through a few pinned buffers, reads overlapping the copies),
so the extra memory is at most one tensor, never the whole checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, BinaryIO, NamedTuple

from ..errors import CkptError, translate_errors

# wrapper prefixes a model's own keys may carry (a DDP- or torch.compile-wrapped model)
TARGET_PREFIXES = ("module.", "_orig_mod.")
MAX_NAMES_SHOWN = 12


class LoadResult(NamedTuple):
    """What ``nn.Module.load_state_dict`` reports: keys of the model the checkpoint lacks,
    and keys of the checkpoint the model lacks."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class StateMismatchError(CkptError):
    """The checkpoint does not fit the model: keys or shapes differ (exit 2)."""


class KeyMismatchError(StateMismatchError):
    """``strict=True`` and the checkpoint's keys do not match the model's (exit 2).

    Attributes:
        missing_keys: In the model, not in the checkpoint.
        unexpected_keys: In the checkpoint, not in the model.
    """

    def __init__(self, missing: list[str], unexpected: list[str], path: object = None):
        self.missing_keys = missing
        self.unexpected_keys = unexpected
        parts = []
        if missing:
            parts.append(f"missing key(s) in the checkpoint: {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected key(s) in the checkpoint: {_names(unexpected)}")
        hint = "pass strict=False to load the keys that match"
        shifted = one_prefix_apart(missing, unexpected)
        if shifted is not None:  # the same keys, one prefix apart: say which
            side, prefix = shifted
            parts.append(f"they differ by the prefix {prefix!r} every {side} key has")
            hint = (
                f"pass strip_prefix={prefix!r}"
                if side == "checkpoint"
                else f"the model's keys start with {prefix!r}: load into its inner module"
            )
        super().__init__("; ".join(parts), path=path, hint=hint)


def one_prefix_apart(missing: list[str], unexpected: list[str]) -> tuple[str, str] | None:
    """``("checkpoint", P)`` where every unexpected key is P + a missing key and every
    missing key is matched so (a Lightning checkpoint's ``model.``), ``("model", P)`` the
    other way round; None otherwise."""
    for side, longer, shorter in (
        ("checkpoint", unexpected, missing),
        ("model", missing, unexpected),
    ):
        if not longer or len(longer) != len(shorter):
            continue
        first, short = longer[0], set(shorter)
        for cut in range(1, len(first)):
            prefix = first[:cut]
            if first[cut:] in short and all(
                k.startswith(prefix) and k[cut:] in short for k in longer
            ):
                return side, prefix
    return None


def _names(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:MAX_NAMES_SHOWN])
    return shown + (
        f", … ({len(keys) - MAX_NAMES_SHOWN} more)" if len(keys) > MAX_NAMES_SHOWN else ""
    )


def _targets(target: Any) -> dict[str, Any]:
    import torch

    items: Iterable[tuple[Any, Any]]
    if isinstance(target, torch.nn.Module):
        items = target.state_dict(keep_vars=True).items()
    elif isinstance(target, Mapping):
        items = target.items()
    else:
        raise CkptError(
            f"load_into takes an nn.Module or a dict of tensors, not {type(target).__name__}"
        )
    return {str(k): v for k, v in items if isinstance(v, torch.Tensor)}


def _match_prefix(dest: dict[str, Any], source: Mapping[str, Any]) -> dict[str, Any]:
    """The model's keys without a wrapper prefix where the checkpoint's have none."""
    if not dest or any(k in source for k in dest):
        return dest
    for prefix in TARGET_PREFIXES:
        if all(k.startswith(prefix) for k in dest):
            return {k[len(prefix) :]: v for k, v in dest.items()}
    return dest


@translate_errors
def load_into(
    target: Any,
    paths: Any | BinaryIO,
    strict: bool = True,
    *,
    select: str = "auto",
    strip_prefix: str | None = "auto",
    unsafe: bool = False,
    allow: Any = None,
) -> LoadResult:
    """Copy a checkpoint's tensors into an existing model or state dict, in place.

    Like ``model.load_state_dict(ckpttool.load(path), strict)``, without ever holding the
    checkpoint in memory: every tensor is read straight into the parameter or buffer that
    receives it, whatever its device (CUDA: pinned buffers, reads overlapping copies).
    Tied weights stay tied. Values are cast to the receiving tensor's dtype.

    Args:
        target: An ``nn.Module`` (its ``state_dict`` keys) or a dict of tensors.
        paths: Anything :func:`ckpttool.load` takes.
        strict: Refuse, before changing anything, when keys are missing or unexpected.
        select: Which state dict of the checkpoint, as in ``load`` (``auto``: the model).
        strip_prefix: As in ``load``; a model wrapped in DDP has its own ``module.`` matched.
        unsafe: Accept pickles that reference dangerous globals (still inert).
        allow: Globals to trust (see :func:`ckpttool.read`).

    Returns:
        ``LoadResult(missing_keys, unexpected_keys)``, as ``load_state_dict`` returns.

    Raises:
        KeyMismatchError: ``strict`` and the keys differ (nothing was changed).
        StateMismatchError: A shape does not match (nothing was changed).
        CkptError: Bad input.
    """
    import torch

    from ..tensors import loading, read_into
    from .reading import flatten_tensors, read, select_node

    dest = _targets(target)
    ckpt = read(paths, unsafe=unsafe, allow=allow)
    where = ckpt.files[0] if ckpt.files else None
    path, node = select_node(ckpt, select, strip_prefix)
    source = flatten_tensors(node, str(path[-1]) if path else "")
    dest = _match_prefix(dest, source)
    missing = [k for k in dest if k not in source]
    unexpected = [k for k in source if k not in dest]
    if strict and (missing or unexpected):
        raise KeyMismatchError(missing, unexpected, where)
    for name, t in dest.items():
        leaf = source.get(name)
        if leaf is not None and tuple(leaf.shape) != tuple(t.shape):
            raise StateMismatchError(
                f"size mismatch for {name!r}: the checkpoint has {list(leaf.shape)}, "
                f"the model {list(t.shape)}",
                path=where,
            )
    copied: set[int] = set()
    with loading(mmap=False) as session, torch.no_grad():
        for name, t in dest.items():
            if name not in source or id(t) in copied:
                continue  # a tied weight is one tensor under two names: read it once
            copied.add(id(t))
            read_into(source[name], t.detach(), session)
    return LoadResult(missing, unexpected)
