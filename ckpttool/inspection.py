"""What ``inspect`` reports, as plain data in the contract's ``--json`` shape.

Only metadata is read, unless ``stats`` asks for min/max/mean/std and NaN/Inf counts.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

from . import sources
from .dtypes import DType
from .errors import CkptError, UnsafeError, translate_errors
from .progress import Progress, ProgressFactory
from .tree import (
    Checkpoint,
    Device,
    KeyPath,
    Leaf,
    Opaque,
    ShardedRef,
    SparseRef,
    StorageRef,
    TorchName,
    TorchSize,
    count_parameters,
    get_path,
    global_name,
    is_lightning_state_dict,
    iter_tensors,
    model_key,
    model_prefix,
    model_state,
    plain_values,
    tied_names,
)


def json_key(path: KeyPath) -> list[Any]:
    """A key path as JSON: strings and integers stay, other keys become strings."""
    return [k if isinstance(k, (str, int)) and not isinstance(k, bool) else str(k) for k in path]


def dotted(path: KeyPath) -> str:
    return ".".join(str(k) for k in path)


@translate_errors
def inspect_report(
    ckpt: Checkpoint,
    *,
    filter: str | None = None,
    stats: bool = False,
    progress: Progress | None = None,
    since: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    """Build the ``inspect --json`` object for a checkpoint.

    Args:
        ckpt: A lazily read checkpoint.
        filter: A regular expression; only tensors and values whose dotted key matches.
        stats: Read every tensor and add min/max/mean/std and NaN/Inf counts.
        progress: Called with the bytes of each tensor read for ``stats``.
        since: :func:`sources.transferred` when the command started: ``transfer``
            counts from there (from the start of the process by default).
    """
    try:
        pattern = re.compile(filter) if filter else None
    except re.error as exc:
        raise CkptError(f"bad --filter regular expression: {exc}") from None
    model_path = model_key(ckpt)
    model = model_state(get_path(ckpt.root, model_path)) if model_path is not None else None
    prefix = (
        model_prefix(
            [k for k in model if isinstance(k, str)],
            is_lightning_state_dict(ckpt.root, model_path),
        )
        if isinstance(model, Mapping)
        else None
    )

    tensors, nbytes = [], 0
    single_file = ckpt.files[0] if len(ckpt.files) == 1 else None
    listed = {
        path: ref
        for path, ref in iter_tensors(ckpt.root)
        if not pattern or pattern.search(dotted(path))
    }
    tied = tied_names(listed)  # one weight under two names: shown so, its bytes once
    for path, ref in listed.items():
        entry = tensor_entry(path, ref)
        if path in tied:
            entry["tied_to"] = json_key(tied[path])
        file = single_file or tensor_file(ref)
        entry["file"] = None if file is None else sources.shown(file)
        if stats:
            from .stats import tensor_stats  # (reads the tensor: imports torch)

            entry["stats"] = tensor_stats(ref)
            if progress:
                progress(ref.nbytes)
        tensors.append(entry)
        nbytes += 0 if path in tied else ref.nbytes
    # counted over the state dict itself: for a pickled module, its non-persistent
    # buffers are tensors in the file but not part of its state dict
    # (a tied embedding, one storage under two names, counts once: model.num_parameters())
    num_params = count_parameters(
        ref
        for path, ref in iter_tensors(model or {})
        if not pattern or pattern.search(dotted((*(model_path or ()), *path)))
    )

    values = [
        value_entry(path, value)
        for path, value in plain_values(ckpt.root)
        if not pattern or pattern.search(dotted(path))
    ]
    return {
        "format": ckpt.format,
        "files": [sources.shown(f) for f in ckpt.files],  # (a URL's secrets never shown)
        "world_size": ckpt.world_size,
        "prefix": prefix,
        "model_key": None if model_path is None else json_key(model_path),
        "tensors": tensors,
        "num_tensors": len(tensors),
        "num_params": num_params,
        "nbytes": nbytes,
        "values": values,
        # sorted: the safetensors writer stores __metadata__ in no particular order
        "metadata": json_value(dict(sorted(ckpt.metadata.items(), key=lambda kv: str(kv[0])))),
        "globals": list(ckpt.globals),
        "unverified": list(ckpt.unverified),
        "dangerous": list(ckpt.dangerous),
        "allowed": allowed_entry(ckpt.globals),
        "transfer": transfer_entry(since),
    }


STATS_PROGRESS_BYTES = 256 << 20  # --stats reads under a progress bar past this


def inspect_checkpoints(
    paths: list[str],
    *,
    unsafe: bool = False,
    filter: str | None = None,
    stats: bool = False,
    progress: ProgressFactory | None = None,
    since: tuple[int, int] | None = None,
) -> list[tuple[str, Checkpoint, dict[str, Any]]]:
    """``inspect`` as a library verb: the checkpoint the paths name (or each of several
    separate ones, not the rank files of one), read, its files' sizes checked, and its
    report (:func:`inspect_report`), which ``--json`` prints and the text view renders.

    Returns:
        (the path it was read from, the checkpoint, its report) for each checkpoint.

    Raises:
        UnsafeError / CkptError: As :func:`ckpttool.read`; a missing or short file.
        SeveralCheckpointsError: The one path is a folder of several checkpoints.
    """
    from .api import read
    from .errors import SeparateCheckpointsError
    from .formats import gc_paused
    from .integrity import check_sizes

    before = sources.transferred() if since is None else since
    with gc_paused():  # (the read builds millions of objects, none in a cycle)
        try:
            checkpoints = [(" ".join(paths), read(paths, unsafe=unsafe))]
        except SeparateCheckpointsError as exc:
            checkpoints = [(path, read(path, unsafe=unsafe)) for path in exc.files]
    found = []
    # no cyclic collection while the report is made: it would walk the whole tree (a
    # 2048-rank DCP folder: millions of chunks), and there are no cycles to find
    with gc_paused():
        for given, ckpt in checkpoints:
            check_sizes(ckpt)  # every file there, and as long as its metadata says
            total = sum(ref.nbytes for _, ref in iter_tensors(ckpt.root)) if stats else 0
            bar = (
                progress(total, "reading tensors")
                if progress is not None and stats and total > STATS_PROGRESS_BYTES
                else nullcontext(None)
            )
            with bar as advance:
                report = inspect_report(
                    ckpt, filter=filter, stats=stats, progress=advance, since=before
                )
            found.append((given, ckpt, report))
    return found


def allowed_entry(names: list[str]) -> list[str]:
    """The ``allowed`` field: globals read only because the user allowed them."""
    from .unpickler import ALLOWED

    if not ALLOWED.get():
        return []
    from .unpickler import allowed_globals

    return allowed_globals(names)


def refused_report(exc: UnsafeError, paths: list[str], since: tuple[int, int] = (0, 0)) -> dict:
    """The ``inspect --json`` object of a refused input (exit 3): the fields of
    :func:`inspect_report`, empty where nothing was read, the verdict filled in, and
    ``reasons``: how the pickle uses each dangerous global."""
    files = [exc.path] if exc.path else [str(p) for p in paths]
    return {
        "format": exc.format,
        "files": [sources.shown(f) for f in files],
        "world_size": None,
        "prefix": None,
        "model_key": None,
        "tensors": [],
        "num_tensors": 0,
        "num_params": 0,
        "nbytes": 0,
        "values": [],
        "metadata": {},
        "globals": list(exc.globals),
        "unverified": list(exc.unverified),
        "dangerous": list(exc.dangerous),
        "reasons": dict(exc.reasons),
        "allowed": allowed_entry(exc.globals),
        "refused": True,
        "transfer": transfer_entry(since),
    }


def transfer_entry(before: tuple[int, int] = (0, 0)) -> dict[str, int]:
    """The ``transfer`` field: bytes and requests read through the byte sources since
    ``before`` (a :func:`sources.transferred` taken when the command started)."""
    nbytes, requests = sources.transferred()
    return {"bytes": nbytes - before[0], "requests": requests - before[1]}


def tensor_entry(path: KeyPath, ref: Leaf) -> dict[str, Any]:
    entry = {
        "key": json_key(path),
        "dtype": ref.dtype.name,
        "shape": list(ref.shape),
        "device": ref.device,
        "nbytes": ref.nbytes,
        "sharded": isinstance(ref, ShardedRef),
    }
    if isinstance(ref, ShardedRef):
        entry["shards"] = len(ref.shards)
    if isinstance(ref, SparseRef):
        entry["layout"] = ref.layout
    return entry


def tensor_file(ref: Any) -> str | None:
    """The file that holds a tensor's bytes; None when they are spread over several
    (a sharded tensor's ranks) or were never saved."""
    if isinstance(ref, SparseRef):
        files = {tensor_file(part) for part in ref.parts}
    elif isinstance(ref, ShardedRef):
        if hasattr(ref.shards, "block_spans"):
            return None  # (DCP chunks as columns: millions at 2048 ranks, none a storage)
        blocks = list(map(_BLOCK, ref.shards))
        if not any(map(_may_hold_storage, set(map(type, blocks)))):
            return None  # (DCP chunks: a 2048-rank folder has millions)
        files = {tensor_file(block) for block in blocks}
    else:
        storage = getattr(ref, "storage", None)
        source = getattr(storage, "source", None)
        return getattr(source, "path", None)
    return files.pop() if len(files) == 1 else None


_BLOCK = operator.attrgetter("tensor")


def _may_hold_storage(kind: type) -> bool:
    """Whether objects of ``kind`` may have a ``storage`` (:func:`tensor_file` reads it):
    not where the class names none and its objects have no ``__dict__``."""
    return hasattr(kind, "storage") or any("__dict__" in vars(c) for c in kind.__mro__)


def value_entry(path: KeyPath, value: Any) -> dict[str, Any]:
    return {"key": json_key(path), "type": value_type(value), "value": json_value(value)}


def value_type(value: Any) -> str:
    if isinstance(value, Opaque):
        return "opaque"
    if isinstance(value, type) or global_name(value):  # a class or function saved by reference
        return "global"
    if isinstance(value, Device):
        return "device"
    if isinstance(value, DType):
        return "dtype"
    if isinstance(value, TorchName):
        return "torch"
    if isinstance(value, TorchSize):
        return "torch.Size"
    if isinstance(value, StorageRef):
        return "storage"
    return type(value).__name__


def json_value(value: Any) -> Any:
    """A JSON-safe rendering of a plain value."""
    if isinstance(value, Opaque):
        return repr(value)
    if isinstance(value, type):
        name = value.class_name() if issubclass(value, Opaque) else value.__qualname__
        module = "" if issubclass(value, Opaque) else f"{value.__module__}."
        return f"<global {module}{name}>"
    if global_name(value):
        return f"<global {global_name(value)}>"
    if isinstance(value, DType):
        return f"torch.{value.name}"
    if isinstance(value, StorageRef):
        return f"<storage {value.dtype.name} [{value.numel}]>"
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, Mapping):  # format metadata (a sharded index's may nest)
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, str) and len(value) > MAX_SHOWN_TEXT:
        # a file may hold one long string many times over: what is shown stays small
        return f"{value[:MAX_SHOWN_TEXT]}... <{len(value)} characters>"
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


# Characters of a string value a report shows (longer ones are cut, their length said).
MAX_SHOWN_TEXT = 1000
