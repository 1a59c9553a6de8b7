"""The run's ``argparse.Namespace`` (Megatron's ``args``) as the dict of its attributes,
for both Megatron readers: the config shows as plain values, and is read by name."""

from __future__ import annotations

from typing import Any

from ...tree import Node, Opaque
from ...unpickler import MAX_NESTING


def namespaces_as_dicts(node: Node, depth: int) -> Any:
    """The tree with each ``argparse.Namespace`` stand-in replaced by its attributes."""
    if depth > MAX_NESTING:
        return node
    if isinstance(node, Opaque) and node.class_name() == "argparse.Namespace":
        node = dict(node.attrs())
    if isinstance(node, dict):
        return {k: namespaces_as_dicts(v, depth + 1) for k, v in node.items()}
    if isinstance(node, list):
        return [namespaces_as_dicts(v, depth + 1) for v in node]
    return node
