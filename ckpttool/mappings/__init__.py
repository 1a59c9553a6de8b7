"""Hugging Face models out of training checkpoints: mappings as data (``convert --to hf``).

:func:`export` picks the spec whose source layout the tensors are (:mod:`.specs`, or the
one ``--arch`` names; two that fit are refused), checks the config against what the
tensors say, decides tied embeddings by comparing bytes, maps every tensor through the
spec (renames; q/k rows gathered into HF's RoPE layout, :mod:`.rows`) and checks that
the result is exactly the tensors the architecture needs for that config
(:mod:`.architectures`). Nothing is read but the two embeddings' bytes; the mapped
tensors stay lazy leaves that every output route writes as it writes any.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import DType
from ..errors import CkptError, UsageError
from . import megatron
from .architectures import ARCHITECTURES, Architecture, check_tensors, positive
from .megatron import merge_run_config
from .rows import rope_from_hf, rope_from_hf_rows, rope_to_hf
from .spec import Mapped, Spec, apply, name_pattern
from .specs import SPECS

__all__ = [
    "ARCHITECTURES",
    "SPECS",
    "Export",
    "export",
    "load_config",
    "merge_run_config",
    "pair_through",
    "rope_from_hf",
    "to_layout",
]


@dataclass
class Export:
    """A checkpoint's model as one HF architecture.

    Attributes:
        spec: The mapping used.
        arch: The architecture.
        config: The ``config.json`` written (``torch_dtype``, ``tie_word_embeddings``
            set from what is written).
        mapped: The HF tensors, in the source's order.
        dropped: (source name, why) of the tensors left out.
        config_from: Where each config value came from (``--config FILE``, or what
            ckpttool set and why).
    """

    spec: Spec
    arch: Architecture
    config: dict[str, Any]
    mapped: list[Mapped]
    dropped: list[tuple[str, str]] = field(default_factory=list)
    config_from: dict[str, str] = field(default_factory=dict)

    def tensors(self) -> dict[str, Any]:
        return {m.target: m.leaf for m in self.mapped}

    def config_bytes(self) -> bytes:
        return (json.dumps(self.config, indent=2, sort_keys=True) + "\n").encode()


def load_config(path: str) -> tuple[dict[str, Any], str]:
    """An HF ``config.json`` (or a folder holding one): its values and its path.

    Raises:
        UsageError: No such file, or not a JSON object.
    """
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, "rb") as f:
            data = f.read(1 << 20)
        config = json.loads(data)
    except OSError as exc:
        raise UsageError(f"cannot read the --config ({exc.strerror})", path=file) from None
    except ValueError as exc:
        raise UsageError(f"the --config is no JSON ({exc})", path=file) from None
    if not isinstance(config, dict):
        raise UsageError("the --config is no JSON object", path=file)
    return config, file


def export(
    tensors: Mapping[str, Any],
    config: Mapping[str, Any],
    *,
    arch: str = "auto",
    cast: DType | None = None,
    config_file: str = "--config",
    config_from: Mapping[str, str] | None = None,
) -> Export:
    """``tensors`` (the selected model state dict) as an HF model (see the module).

    Raises:
        CkptError: No spec fits, or two; a config value the tensors contradict; a
            tensor no rule maps; the result is not the architecture's tensors.
    """
    spec = _pick(list(tensors), arch, config)
    architecture = ARCHITECTURES[spec.arch]
    config = dict(config)
    sources = dict(config_from) if config_from is not None else {k: config_file for k in config}
    for key, source in _check_config(spec, tensors, config).items():
        sources[key] = f"the checkpoint ({source})"
    tied = spec.head not in tensors or _same_bytes(tensors[spec.embedding], tensors[spec.head])
    if config.get("tie_word_embeddings", tied) != tied:
        sources["tie_word_embeddings"] = (
            "the checkpoint: its head is the embedding's bytes"
            if tied
            else "the checkpoint: its head's bytes are not the embedding's"
        )
    config["tie_word_embeddings"] = tied
    selected = {k: v for k, v in tensors.items() if not (tied and k == spec.head)}
    heads = positive(config, architecture.key("num_attention_heads"))
    kv_heads = positive(config, "num_key_value_heads", heads)
    transforms = {
        "same": lambda leaf, _c, _n: leaf,
        "rope_q": lambda leaf, _c, n: rope_to_hf(leaf, heads, n),
        "rope_k": lambda leaf, _c, n: rope_to_hf(leaf, kv_heads, n),
    }
    if spec.layers_axis or spec.padded_vocab:
        transforms |= megatron.transforms(config)
    mapped, dropped = apply(spec, selected, config, transforms)
    if tied and spec.head in tensors:
        dropped.append((spec.head, "tied: the embedding's bytes (tie_word_embeddings)"))
    check_tensors(architecture, config, {m.target: tuple(m.leaf.shape) for m in mapped})
    dtype = cast or tensors[spec.embedding].dtype
    # transformers 4 reads torch_dtype, 5 reads dtype (and writes it): both say it
    for key in ("torch_dtype", "dtype"):
        if config.get(key) != dtype.name:
            sources[key] = "what is written"
        config[key] = dtype.name
    config["architectures"] = [architecture.hf_class]
    config.setdefault("model_type", architecture.model_type)
    return Export(spec, architecture, config, mapped, dropped, sources)


# the transforms the way back undoes, and the layouts made of them alone
_UNDONE = ("same", "rope_q", "rope_k")
_WAYS_BACK = [
    name
    for name, spec in SPECS.items()
    if not name.startswith("hf:") and all(r.transform in _UNDONE for r in spec.renames)
]


def to_layout(layout: str, tensors: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The way back: an HF model's ``tensors`` (its config ``config``) under the source
    layout ``layout`` names (``torchtitan:llama3``), each transform undone, as that
    framework's checkpoint holds them (a tied head under its own name again, one
    storage with the embedding, as the framework's state dict has it).

    Raises:
        UsageError: No such layout.
        CkptError: The tensors are not exactly the architecture's for the config.
    """
    if layout not in SPECS or layout not in _WAYS_BACK:
        raise UsageError(
            f"unknown --layout {layout!r}", hint=f"choose one of {', '.join(_WAYS_BACK)}"
        )
    spec = SPECS[layout]
    architecture = ARCHITECTURES[spec.arch]
    hf_drops = SPECS[f"hf:{spec.arch}"].drops if f"hf:{spec.arch}" in SPECS else ()
    kept = {
        k: v for k, v in tensors.items() if not any(re.fullmatch(d.pattern, k) for d in hf_drops)
    }
    check_tensors(architecture, config, {k: tuple(v.shape) for k, v in kept.items()})
    heads = positive(config, architecture.key("num_attention_heads"))
    kv_heads = positive(config, "num_key_value_heads", heads)
    undo = {
        "same": lambda leaf, n: leaf,
        "rope_q": lambda leaf, n: rope_from_hf_rows(leaf, heads, n),
        "rope_k": lambda leaf, n: rope_from_hf_rows(leaf, kv_heads, n),
    }
    first: dict[str, Any] = {}  # target pattern -> the first rule making it
    for rule in spec.renames:
        first.setdefault(rule.target, rule)
    rules = [(name_pattern(t), r) for t, r in first.items()]
    out: dict[str, Any] = {}
    for name, leaf in kept.items():
        for pattern, rule in rules:
            found = pattern.fullmatch(name)
            if found is not None:
                out[rule.source.format(**found.groupdict())] = undo[rule.transform](leaf, name)
                break
        else:
            raise CkptError(f"no rule of {spec.name} names {name!r} in its layout")
    if config.get("tie_word_embeddings") and spec.head not in out:
        out[spec.head] = out[spec.embedding]  # the framework's state dict names it too
    return out


def pair_through(
    given: tuple[Any, Any], ta: dict[str, Any], tb: dict[str, Any], arch: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """``diff --arch``: both sides' tensors (of the inputs ``given``), the one in a
    mapping's source layout mapped to the HF names (the other side, a Hugging Face model
    folder, gives the config), and which side went through which mapping.

    Raises:
        UsageError: Neither side is such a pair.
    """
    from ..writers import hf_source_folder

    for side, mine, theirs, other in (("a", ta, tb, given[1]), ("b", tb, ta, given[0])):
        paths = [
            os.fspath(p) for p in ([other] if isinstance(other, (str, os.PathLike)) else other)
        ]
        folder = hf_source_folder(paths, "auto")
        fits = [s for s in SPECS.values() if not s.name.startswith("hf:")
                and arch in (s.name, s.arch) and s.matches(list(mine))]  # fmt: skip
        if folder is None or len(fits) != 1:
            continue
        config, _ = load_config(folder)
        done = export(mine, config, arch=fits[0].name)
        mapped = done.tensors()
        note = {"side": side, "spec": fits[0].name, "architecture": done.arch.hf_class}
        return (mapped, theirs, note) if side == "a" else (theirs, mapped, note)
    raise UsageError(
        f"--arch {arch}: neither side is in a layout of its mappings beside a Hugging Face "
        "model folder (config.json beside the weights)",
        hint=f"mappings: {', '.join(s for s in SPECS if not s.startswith('hf:'))}",
    )


def _fits(names: list[str], arch: str) -> list[Spec]:
    return [s for s in SPECS.values() if arch in ("auto", s.name, s.arch) and s.matches(names)]


def _pick(names: list[str], arch: str, config: Mapping[str, Any]) -> Spec:
    """The one spec the tensors fit; where several do (Llama's names are Mistral's too),
    the one of the config's ``model_type``: what the config says, never a guess."""
    if arch != "auto" and arch not in SPECS and arch not in ARCHITECTURES:
        raise UsageError(
            f"unknown --arch {arch!r}",
            hint=f"choose auto, or one of {', '.join(sorted({*SPECS, *ARCHITECTURES}))}",
        )
    fits = _fits(names, arch)
    if not fits:
        shown = ", ".join(repr(n) for n in names[:3])
        raise CkptError(
            f"no mapping to a Hugging Face architecture knows these tensors ({shown}, …)",
            hint=f"mappings: {', '.join(SPECS)}; see `ckpttool inspect`",
        )
    typed = [s for s in fits if ARCHITECTURES[s.arch].model_type == config.get("model_type")]
    if len(fits) > 1 and len(typed) == 1:
        return typed[0]
    if len(fits) > 1:
        raise CkptError(
            f"the tensors fit {' and '.join(s.name for s in fits)}",
            hint="pass --arch to choose, or a --config whose model_type names one",
        )
    return fits[0]


def _check_config(spec: Spec, tensors: Mapping[str, Any], config: dict[str, Any]) -> dict[str, str]:
    """The config values the tensors say themselves agree with the config; those it
    lacks are set from the tensors (returned: key -> the tensor that says it).

    Raises:
        CkptError: Naming the tensor, the value it says and the config's.
    """
    embedding = tensors[spec.embedding].shape
    named = ARCHITECTURES[spec.arch].key  # (the config's own name of each value)
    said = {named("hidden_size"): (embedding[1], spec.embedding)}
    vocab = config.get(named("vocab_size"))
    if not spec.padded_vocab or vocab is None:
        said[named("vocab_size")] = (embedding[0], spec.embedding)
    elif not isinstance(vocab, int) or not 0 < vocab <= embedding[0]:
        raise CkptError(
            f"the config says vocab_size {vocab!r}, more than the checkpoint's "
            f"{embedding[0]} rows ({spec.embedding})",
            hint="pass the --config of this checkpoint's model",
        )
    if spec.layers_axis in tensors:
        said[named("num_hidden_layers")] = (tensors[spec.layers_axis].shape[0], spec.layers_axis)
    layers = set()
    for pattern, _ in spec.rules():  # (the {L} of the spec's source names)
        if "L" in pattern.groupindex:
            layers |= {int(m["L"]) for m in map(pattern.fullmatch, tensors) if m is not None}
    if layers:
        said[named("num_hidden_layers")] = (max(layers) + 1, "the layers' numbers")
    taken = {}
    for key, (value, source) in said.items():
        if config.get(key) is None:
            config[key] = value
            taken[key] = source
        elif config[key] != value:
            raise CkptError(
                f"the config says {key} {config[key]!r}, the checkpoint {value} ({source})",
                hint="pass the --config of this checkpoint's model",
            )
    return taken


def _same_bytes(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same bytes (one storage, or equal contents), read side
    by side and stopped at the first difference: an untied head costs a chunk, not a
    read of both tensors."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    from ..writers import iter_chunks

    left, right = iter_chunks(a, None), iter_chunks(b, None)
    mine, theirs = memoryview(b""), memoryview(b"")
    while True:
        if not mine:
            mine = memoryview(next(left, b"")).cast("B")
        if not theirs:
            theirs = memoryview(next(right, b"")).cast("B")
        if not mine or not theirs:
            return not mine and not theirs  # (both ended together: equal lengths)
        n = min(len(mine), len(theirs))
        if not _equal(mine[:n], theirs[:n]):
            return False
        mine, theirs = mine[n:], theirs[n:]


def _equal(a: memoryview, b: memoryview) -> bool:
    """Two byte runs of one length compared as 8-byte words (numpy: GB/s; a memoryview's
    own comparison goes a byte at a time, ~0.4 GB/s)."""
    import numpy as np

    whole = len(a) // 8 * 8
    words = np.array_equal(np.frombuffer(a[:whole], np.uint64), np.frombuffer(b[:whole], np.uint64))
    return words and a[whole:] == b[whole:]
