"""Where an output goes when ``-o`` does not name it: beside the input, named after it
(``ep0-rank0.pt`` -> ``ep0.safetensors``; per-rank inputs drop their rank), or inside
``-o DIR/`` under that name; never over one of the inputs."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from .. import sources


def output_stem(inputs: Sequence[str]) -> tuple[str, str]:
    """(folder, stem) of the input an output is named after: ``/d/ep0-rank0.pt`` ->
    (``/d``, ``ep0``). Per-rank inputs drop their rank: one output for all ranks."""
    first = sources.strip_file_scheme(inputs[0])
    # the output is local: a URL input's goes in the current folder
    folder = "" if sources.is_url(first) else os.path.dirname(os.path.normpath(first))
    name = sources.input_name(first)
    stem = name.split(".", 1)[0] if not sources.isdir(first) else name
    return folder, re.sub(r"[-_]?rank\*?\d*$", "", stem) or stem


def unused_name(folder: str, stem: str, suffix: str, inputs: Sequence[str]) -> str:
    """``folder/stem.pt``, or ``folder/stem-suffix.pt`` where that is an input."""
    candidate = os.path.join(folder, f"{stem}.pt")
    local_inputs = [sources.strip_file_scheme(p) for p in inputs]
    real_inputs = {os.path.realpath(p) for p in local_inputs if not sources.is_url(p)}
    if os.path.realpath(candidate) not in real_inputs:
        return candidate
    return os.path.join(folder, f"{stem}-{suffix}.pt")


def default_output(inputs: Sequence[str], to: str, sharded: bool, folder: str | None = None) -> str:
    """A name beside the input: ``ep0.safetensors``, ``ep0-safetensors/``, ``ep0.pt``,
    ``ep0-dcp/``, ``ep0-hf/``.

    Per-rank inputs drop their rank (``ep0-rank0.pt`` -> ``ep0``): one output for all ranks.
    ``folder`` puts it there instead (``-o DIR/``).
    """
    beside, stem = output_stem(inputs)
    folder = beside if folder is None else folder
    if to in ("dcp", "hf"):
        return os.path.join(folder, f"{stem}-{to}")
    if to == "safetensors":
        return os.path.join(folder, f"{stem}-safetensors" if sharded else f"{stem}.safetensors")
    return unused_name(folder, stem, "converted", inputs)


def default_name(inputs: Sequence[str], folder: str) -> str:
    """The merged file's name in ``folder`` (``-o DIR/``): the input's, its rank dropped
    (``ep0-rank0.pt``, ``ep0/`` -> ``ep0.pt``); ``ep0-merged.pt`` where that is an input."""
    return os.path.basename(unused_name(folder, output_stem(inputs)[1], "merged", inputs))
