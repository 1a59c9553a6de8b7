"""``convert --to hf --dry-run``: the mapping, as a table or (``--json``) as data."""

from __future__ import annotations

import sys
from typing import Any

from .render import dumps_json
from .text import columns, printable, short_dtype


def mapping_data(export: Any) -> dict[str, Any]:
    """The mapping as data: the spec, every tensor (source, HF name, transform, shape,
    dtype), the dropped ones and why, and the config with where each value came from."""
    return {
        "mapping": export.spec.name,
        "architecture": export.arch.hf_class,
        "tensors": [
            {
                "source": m.source,
                "target": m.target,
                "transform": m.transform,
                "shape": list(m.leaf.shape),
                "dtype": m.leaf.dtype.name,
            }
            for m in export.mapped
        ],
        "dropped": [{"source": name, "why": why} for name, why in export.dropped],
        "config": export.config,
        "config_from": export.config_from,
    }


def print_mapping(export: Any, as_json: bool) -> None:
    data = mapping_data(export)
    if as_json:
        sys.stdout.write(dumps_json(data) + "\n")
        return
    lines = [f"mapping: {data['mapping']} -> {data['architecture']} (nothing written)", ""]
    rows = [("source", "HF name", "transform", "shape", "dtype")]
    rows += [
        (printable(t["source"]), t["target"], t["transform"], str(t["shape"]),
         short_dtype(t["dtype"]))
        for t in data["tensors"]
    ]  # fmt: skip
    lines += columns(rows)
    for item in data["dropped"]:
        lines.append(f"dropped: {printable(item['source'])} ({item['why']})")
    lines.append("")
    lines.append("config:")
    for key, value in sorted(data["config"].items()):
        lines.append(f"  {key} = {value!r}  ({printable(data['config_from'].get(key, '-'))})")
    sys.stdout.write("\n".join(lines) + "\n")
