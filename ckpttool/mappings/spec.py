"""A mapping as data: how one source layout's tensors become one Hugging Face architecture's.

A :class:`Spec` is a list of :class:`Rename` rules (a source name pattern with ``{L}``
for a layer's number, the HF name it becomes, and the transform its tensor needs) and
:class:`Drop` rules (tensors left out, each for a stated reason). :func:`apply` maps a
state dict through one: every source tensor used exactly once or dropped by a named
rule, or the mapping is refused naming the rest. Adding a layout is a spec and a test.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CkptError

# transform name -> (leaf, config, source name) -> leaf of the HF tensor
Transform = Callable[[Any, Mapping[str, Any], str], Any]


@dataclass(frozen=True)
class Rename:
    """``source`` (``{L}``: a layer's number) is ``target`` after ``transform``."""

    source: str
    target: str
    transform: str = "same"


@dataclass(frozen=True)
class Drop:
    """Tensors named ``pattern`` are not part of the HF model, for ``reason``."""

    pattern: str
    reason: str


@dataclass(frozen=True)
class Spec:
    """One source layout's mapping to one HF architecture.

    Attributes:
        name: ``FRAMEWORK:ARCH`` (``torchtitan:llama3``), as ``--layout`` names it.
        arch: The HF architecture (a key of :data:`.architectures.ARCHITECTURES`).
        renames: The rules, in order.
        drops: What is left out, and why.
        embedding: The source name of the input embedding.
        head: The source name of the output projection (tied to the embedding when
            its bytes are the embedding's, or absent).
        requires: Source names (patterns) that must be there as well (a tuple: one of
            its names).
    """

    name: str
    arch: str
    renames: tuple[Rename, ...]
    drops: tuple[Drop, ...] = ()
    embedding: str = ""
    head: str = ""
    # source names that must be there too (what tells this layout from a smaller one);
    # an entry that is a tuple: one of its names
    requires: tuple[str | tuple[str, ...], ...] = ()
    # a source whose first axis stacks the layers (megatron-core's torch_dist): it
    # says how many there are
    layers_axis: str = ""
    # the embedding and head padded past the vocabulary (Megatron): the config's
    # vocab_size may be smaller than their rows, which are trimmed to it
    padded_vocab: bool = False
    # (the rules compiled once; not a field replace() copies: a spec made from another
    # by dataclasses.replace compiles its own rules)
    _compiled: list[tuple[re.Pattern[str], Rename]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def rules(self) -> list[tuple[re.Pattern[str], Rename]]:
        if not self._compiled:
            self._compiled.extend((name_pattern(r.source), r) for r in self.renames)
        return self._compiled

    def matches(self, names: list[str]) -> bool:
        """Every name is one of this spec's sources or dropped by it, and it names at
        least the embedding: the layout is this spec's."""
        drops = [re.compile(d.pattern) for d in self.drops]
        known = set()
        for name in names:
            if any(d.fullmatch(name) for d in drops):
                continue
            if not any(p.fullmatch(name) for p, _ in self.rules()):
                return False
            known.add(name)
        required = [[name_pattern(r)] if isinstance(r, str) else list(map(name_pattern, r))
                    for r in self.requires]  # fmt: skip
        present = all(any(p.fullmatch(n) for p in one for n in known) for one in required)
        return self.embedding in known and present


@dataclass
class Mapped:
    """One HF tensor: its name, where it came from and how."""

    target: str
    source: str
    transform: str
    leaf: Any


def apply(
    spec: Spec,
    tensors: Mapping[str, Any],
    config: Mapping[str, Any],
    transforms: Mapping[str, Transform],
) -> tuple[list[Mapped], list[tuple[str, str]]]:
    """The HF tensors of ``tensors`` through ``spec``, and the dropped ones (name, why).

    Raises:
        CkptError: A tensor no rule maps nor drops, or two mapped to one name.
    """
    mapped: list[Mapped] = []
    dropped: list[tuple[str, str]] = []
    unmapped: list[str] = []
    drops = [(re.compile(d.pattern), d.reason) for d in spec.drops]
    seen: dict[str, str] = {}
    for name, leaf in tensors.items():
        reason = next((why for p, why in drops if p.fullmatch(name)), None)
        if reason is not None:
            dropped.append((name, reason))
            continue
        # every rule naming the source makes its targets (a fused tensor feeds several)
        rules = [(m, rule) for p, rule in spec.rules() if (m := p.fullmatch(name)) is not None]
        if not rules:
            unmapped.append(name)
        for found, rule in rules:
            out = transforms[rule.transform](leaf, config, name)
            # (a stacked tensor's transform gives each layer: its fields and its leaf)
            for fields, part in out if isinstance(out, list) else [({}, out)]:
                target = rule.target.format(**found.groupdict(), **fields)
                if target in seen:
                    raise CkptError(f"{name!r} and {seen[target]!r} both map to {target!r}")
                seen[target] = name
                mapped.append(Mapped(target, name, rule.transform, part))
    if unmapped:
        shown = ", ".join(repr(n) for n in unmapped[:5]) + (
            f" and {len(unmapped) - 5} more" if len(unmapped) > 5 else ""
        )
        raise CkptError(
            f"no rule of {spec.name} maps {shown}",
            hint="check --arch, or --select the model's tensors",
        )
    return mapped, dropped


def name_pattern(source: str) -> re.Pattern[str]:
    """``layers.{L}.x`` as a regex capturing ``L`` (digits, no leading zero)."""
    parts = re.split(r"(\{L\})", source)
    body = "".join(r"(?P<L>0|[1-9]\d*)" if p == "{L}" else re.escape(p) for p in parts)
    return re.compile(body)
