"""Repeated numbered blocks shown once: 32 layers of a Llama are one row,
``model.layers.{0..31}.mlp.gate_proj.weight  bf16 [11008, 4096] ×32``.

Names are split on ``.``; every part that is a number (``0``, ``12``; not ``01`` or
``conv1``) may vary. Entries collapse when the rest of the name and their signature
(dtype and shape, a value's repr, ...) are the same, and only into rows that are exact:
a row ``a.{0..3}.b.{0,1}`` stands for all eight names and nothing else, so a model with
one layer missing or shaped differently gets a row of its own for it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

# more runs than this in one position: an arithmetic progression is shown by its
# first two and last values, anything else by its first three and last
MAX_RUNS = 3


@dataclass
class Row:
    """One line of output: ``name`` (with ``{0..31}`` where numbers vary) for ``members``,
    the indexes of the entries it stands for, in input order."""

    name: str
    members: list[int] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.members)


def is_number(part: str) -> bool:
    return part.isdigit() and part.isascii() and (part == "0" or not part.startswith("0"))


def collapse(entries: Iterable[tuple[str, Hashable]]) -> list[Row]:
    """Collapse ``(dotted name, signature)`` entries into rows, in order of first member.

    Args:
        entries: Names and what must be equal for two of them to share a row.

    Returns:
        Rows; an entry that repeats nothing is a row of its own under its own name.
    """
    buckets: dict[tuple, list[tuple[tuple[int, ...], int]]] = defaultdict(list)
    rows: list[Row] = []
    for index, (name, signature) in enumerate(entries):
        parts = name.split(".")
        numbers = tuple(int(p) for p in parts if is_number(p))
        if not numbers:
            rows.append(Row(name, [index]))
            continue
        template = tuple(None if is_number(p) else p for p in parts)
        buckets[(template, signature)].append((numbers, index))
    for (template, _), members in buckets.items():
        index_of = dict(members)
        if len(index_of) != len(members):  # the same name twice: nothing to collapse safely
            rows.extend(Row(_fill(template, [[n] for n in nums]), [i]) for nums, i in members)
            continue
        for sets, tuples in _products(list(index_of)):
            rows.append(Row(_fill(template, sets), sorted(index_of[t] for t in tuples)))
    rows.sort(key=lambda row: row.members[0])
    return rows


def _products(tuples: list[tuple[int, ...]]) -> list[tuple[list[list[int]], list[tuple]]]:
    """Split number tuples into blocks that are each a full cartesian product of the
    values per position: (sorted values per position, the tuples of the block)."""
    sets = [sorted({t[i] for t in tuples}) for i in range(len(tuples[0]))]
    if math.prod(len(s) for s in sets) == len(tuples):
        return [(sets, tuples)]
    # Not a product: group the prefixes by the set of last numbers they come with,
    # then split those prefixes the same way (one position fewer each time).
    lasts: dict[tuple[int, ...], set[int]] = defaultdict(set)
    for t in tuples:
        lasts[t[:-1]].add(t[-1])
    by_lasts: dict[frozenset[int], list[tuple[int, ...]]] = defaultdict(list)
    for prefix, values in lasts.items():
        by_lasts[frozenset(values)].append(prefix)
    out = []
    for last_values, prefixes in by_lasts.items():
        last = sorted(last_values)
        for sub_sets, sub_tuples in _products(prefixes):
            out.append(([*sub_sets, last], [(*p, v) for p in sub_tuples for v in last]))
    return out


def _fill(template: tuple, sets: Sequence[Sequence[int]]) -> str:
    numbers = iter(sets)
    return ".".join(part if part is not None else number_set(next(numbers)) for part in template)


def number_set(values: Sequence[int]) -> str:
    """``5``, ``{0..31}``, ``{0,2,5..7}``, ``{1,10,…,283}`` for sorted distinct ``values``."""
    if len(values) == 1:
        return str(values[0])
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    if len(runs) <= MAX_RUNS:
        return "{" + ",".join(_run(a, b) for a, b in runs) + "}"
    step = values[1] - values[0]
    if all(b - a == step for a, b in zip(values, values[1:], strict=False)):
        return f"{{{values[0]},{values[1]},…,{values[-1]}}}"
    return f"{{{values[0]},{values[1]},{values[2]},…,{values[-1]}}}"


def _run(a: int, b: int) -> str:
    if a == b:
        return str(a)
    return f"{a},{b}" if b == a + 1 else f"{a}..{b}"
