"""The nested structure of a checkpoint as indented text lines, numbered siblings collapsed.

Leaves are named, not valued: plain values have their own section and tensors their
table, so the tree shows what holds what (``state.{0..147}  dict of 3: step, exp_avg,
exp_avg_sq``) and nothing twice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..tree import Node
from .collapse import is_number, number_set
from .text import plural, printable

MAX_CHILDREN = 12
MAX_DEPTH = 6
# a container whose children are all leaves is one line naming them (this many at most)
MAX_INLINE_LEAVES = 8
MAX_WIDTH = 100  # (cli/fit.py): inline names that do not fit are counted


def _dotted(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def structure_lines(
    root: Any,
    model_key: tuple | None,
    model_label: str,
    pattern: re.Pattern | None = None,
    full: bool = False,
) -> list[str]:
    """Indented lines for the tree under ``root`` (the model state dict is one line).

    Args:
        root: The checkpoint's tree.
        model_key: Path to the model state dict, shown as one line ``model_label``.
        pattern: Only the branches leading to a tensor or value whose dotted key matches.
        full: No limit on children per container or on depth.
    """
    from ..tree import Opaque, children, is_tensor, iter_tensors

    def leaf_kind(value: Any) -> str | None:
        if is_tensor(value):
            return "tensor"
        if isinstance(value, Opaque):
            return None if list(value.children()) else printable(value.class_name())
        if isinstance(value, (Mapping, list, tuple)) and not _is_plain(value):
            return None
        return type(value).__name__

    def entries(node: Node, path: tuple, depth: int) -> list[tuple[Any, str, list]]:
        out: list[tuple[Any, str, list]] = []
        for key, value in children(node):
            here = (*path, key)
            if here == model_key:
                paths = [p for p, _ in iter_tensors(value, here)]
                if pattern:
                    paths = [p for p in paths if pattern.search(_dotted(p))]
                    if not paths:
                        continue
                out.append((key, model_label, []))
                continue
            kind = leaf_kind(value)
            if kind is not None:
                if pattern and not pattern.search(_dotted(here)):
                    continue
                out.append((key, kind, []))
                continue
            kids = entries(value, here, depth + 1)
            if pattern and not kids:
                continue
            out.append((key, _container(value, kids), [] if _inline(kids) else kids))
        return _collapse_siblings(out)

    def _container(value: Any, kids: list) -> str:
        kind = printable(value.class_name()) if isinstance(value, Opaque) else type(value).__name__
        size = len(value) if isinstance(value, (dict, list, tuple)) else len(kids)
        text = f"{kind} of {size}"
        if _inline(kids):
            names = [key for key, _, _ in kids]
            shown = names if full else names[:MAX_INLINE_LEAVES]
            head = text
            text += ": " + ", ".join(shown)
            if len(shown) < len(names):
                text += f", … {len(names) - len(shown)} more"
            inline[text] = (head, names)
        return text

    def _inline(kids: list) -> bool:
        return 0 < len(kids) and all(
            not sub and " " not in desc
            for _, desc, sub in kids  # leaves: a bare type name
        )

    lines: list[str] = []
    inline: dict[str, tuple[str, list[str]]] = {}  # text -> (kind of N, the names listed)

    def fitted(start: str, desc: str) -> str:
        """``desc`` with as many inline names as fit MAX_WIDTH after ``start``."""
        if full or len(start) + len(desc) <= MAX_WIDTH or desc not in inline:
            return desc
        head, names = inline[desc]
        text = f"{head}: {names[0]}"
        for i, name in enumerate(names[1:], start=1):
            tail = f", … {len(names) - i - 1} more" if i + 1 < len(names) else ""
            if len(start) + len(text) + len(f", {name}") + len(tail) > MAX_WIDTH:
                return f"{text}, … {len(names) - i} more"
            text += f", {name}"
        return text

    def emit(items: list, depth: int) -> None:
        shown = items if full else items[:MAX_CHILDREN]
        width = max((len(key) for key, _, _ in shown), default=0)
        for key, desc, sub in shown:
            start = f"{'  ' * (depth + 1)}{key.ljust(width)}  "
            lines.append(start + fitted(start, desc))
            if sub and (full or depth + 1 < MAX_DEPTH):
                emit(sub, depth + 1)
            elif sub:
                lines.append(f"{'  ' * (depth + 2)}… ({plural(len(sub), 'entry', 'entries')})")
        if len(shown) < len(items):
            more = len(items) - len(shown)
            lines.append(f"{'  ' * (depth + 1)}… {more} more (--full shows all)")

    if model_key == ():
        lines.append(f"  {model_label}")
    else:
        emit(entries(root, (), 0), 0)
    return lines


def _is_plain(value: Any) -> bool:
    from ..tree import is_plain

    return is_plain(value)


def _collapse_siblings(items: list[tuple[Any, str, list]]) -> list[tuple[str, str, list]]:
    """Siblings with number keys and the same description and subtree become one line."""
    out: list[tuple[str, str, list]] = []
    groups: dict[tuple, list[int]] = {}
    order: list[tuple] = []
    for key, desc, sub in items:
        text = str(key)
        if (isinstance(key, int) and not isinstance(key, bool) and key >= 0) or (
            isinstance(key, str) and is_number(key)
        ):
            signature = (desc, _freeze(sub))
            if signature not in groups:
                groups[signature] = []
                order.append(("group", signature))
            groups[signature].append(int(key))
        else:
            order.append(("one", (printable(text), desc, sub)))
    for kind, item in order:
        if kind == "one":
            out.append(item)
            continue
        desc, frozen = item
        numbers = sorted(set(groups[item]))
        sub = _thaw(frozen)
        label = number_set(numbers)
        if len(numbers) > 1:
            desc = f"{desc}  ×{len(numbers)}"
        out.append((label, desc, sub))
    return out


def _freeze(sub: list) -> tuple:
    return tuple((k, d, _freeze(s)) for k, d, s in sub)


def _thaw(frozen: tuple) -> list:
    return [(k, d, _thaw(s)) for k, d, s in frozen]
