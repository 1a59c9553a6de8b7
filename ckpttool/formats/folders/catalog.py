"""Folders of several checkpoints: find them, never pick one silently, list them cheaply.

A folder is read as one checkpoint only by a documented rule (see :mod:`ckpttool.formats`
and :mod:`.run_folders`). A folder that holds several checkpoints instead (a trainer's
``ep0/ … ep11/``, a Trainer ``output_dir`` with ``checkpoint-3/`` and ``checkpoint-6/``,
DeepSpeed's ``global_stepN/`` without ``latest``, Megatron's ``iter_NNNNNNN/``, the rank
files of several epochs, or unrelated checkpoint files side by side) is refused naming
them (:class:`~ckpttool.errors.SeveralCheckpointsError`); ``ckpttool inspect`` lists them
with :func:`list_checkpoints`, one row each, from names, sizes, first bytes and folder
listings: no tensor data, and a pickle's globals scanned (never run) only to tell a
per-rank file of sharded tensors from a full copy.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ... import sources
from ...errors import CkptError, SeveralCheckpointsError

FolderFormat = Callable[[str], "str | None"]  # a sub-folder's format id, if a checkpoint
FileFormat = Callable[[str], "str | None"]  # a file's, from its first bytes

# What the number in a checkpoint's name counts: Composer ep3-ba120, Lightning
# epoch=3-step=120, torchtune epoch_3, the reference trainer ep3; HF Trainer
# checkpoint-600, DeepSpeed global_step20, Megatron iter_0000100.
EPOCH_IN_NAME = re.compile(r"(?:^|[^a-z])ep(?:och)?[_=-]?(\d{1,18})(?![\d])", re.IGNORECASE)
STEP_IN_NAME = re.compile(
    r"(?:global_step|checkpoint|step|iter|batch|ba)[_=-]?(\d{1,18})(?![\d])", re.IGNORECASE
)
# the reference trainer's marker (trainers/snapshot_io.py COMPLETE_MARKER): written by
# rank 0 after every rank's part is on disk, listing the files and their sizes
TRAINER_MARKER = re.compile(r"^ep(\d{1,18})\.complete$")
MAX_MARKER_BYTES = 1 << 20
# the rank of a DCP data file (__R_I.distcp), of a ZeRO optimizer partition
DCP_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
ZERO_PARTITION = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
# Hugging Face folders: the files beside the weights that are no checkpoint of their own
# (a Trainer's resume state; torchtune's copy of a PEFT adapter in its own format, which
# run_folders reads as a part of its own)
HF_COMPANIONS = re.compile(
    r"^(?:training_args\.bin|optimizer\.pt|optimizer\.bin|scheduler\.pt|scheduler\.bin"
    r"|scaler\.pt|rng_state(?:_\d+)?\.pth|adapter_model\.pt)$"
)
# shown in an error, at most (the oldest and newest kept, the middle counted)
MAX_NAMED = 8
# folders walked for a size: deep enough for a Trainer FSDP checkpoint-N/pytorch_model_fsdp_0/
MAX_SIZE_DEPTH = 3
MAX_SIZE_ENTRIES = 100_000


@dataclass
class Candidate:
    """One checkpoint in a folder.

    Attributes:
        name: As shown: ``ep3/`` (a folder), ``ep0-rank*.pt`` (rank files), ``a.pt``.
        kind: ``folder``, ``ranks`` or ``file``.
        paths: The folder, the file, or the rank files (lowest rank first).
        ranks: For rank files: rank -> path.
    """

    name: str
    kind: str
    paths: list[str]
    ranks: dict[int, str] = field(default_factory=dict)

    @property
    def epoch(self) -> int | None:
        m = EPOCH_IN_NAME.search(self.name)
        return int(m.group(1)) if m else None

    @property
    def step(self) -> int | None:
        m = STEP_IN_NAME.search(self.name)
        return int(m.group(1)) if m else None


def natural_key(name: str) -> tuple:
    """Sort key of names with numbers in them: ``ep2`` before ``ep10``."""
    return tuple(
        (0, int(part), part) if part.isdigit() else (1, 0, part.lower())
        for part in re.split(r"(\d+)", name)
        if part
    )


def is_hf_companion(name: str) -> bool:
    """A file of a Hugging Face / Trainer folder that is no checkpoint of its own."""
    return HF_COMPANIONS.match(name) is not None


def find_candidates(
    folder: str, names: list[str], rank_re: re.Pattern[str], folder_format: FolderFormat
) -> list[Candidate]:
    """The checkpoints a folder holds, in natural order: its checkpoint files (rank files
    of one checkpoint grouped), and its sub-folders that are checkpoints by their contents.

    Args:
        folder: The folder.
        names: Its entries whose names end with a checkpoint suffix (``.pt``, ...).
        rank_re: ``(prefix)(rank)(suffix)`` of a rank file's name.
        folder_format: A sub-folder's format id if it is a checkpoint, else None.
    """
    entries = sources.listdir(folder)
    names = _without_links_to_siblings(folder, names, entries)
    groups: dict[str, dict[int, str]] = {}
    out: list[Candidate] = []
    local = sources.local_path(folder) is not None
    for name in names:
        path = sources.join(folder, name)
        # a Lightning sharded .ckpt/, a Composer latest-rank0.pt link (local only: in an
        # object store, a request per name where most are files)
        if local and sources.isdir(path):
            if folder_format(path) is not None:
                out.append(Candidate(f"{name}/", "folder", [path]))
            continue
        m = rank_re.match(name)
        if m:
            groups.setdefault(f"{m.group(1)}*{m.group(3)}", {})[int(m.group(2))] = path
        else:
            out.append(Candidate(name, "file", [path]))
    for shown, ranks in groups.items():
        paths = [ranks[r] for r in sorted(ranks)]
        out.append(Candidate(shown, "ranks", paths, ranks))
    suffixed = set(names)
    for name in _without_links_to_siblings(folder, [n for n in entries if n not in suffixed], []):
        if name.startswith(".") or "." in name.strip("."):  # files by their look: a.json
            continue
        path = sources.join(folder, name)
        if sources.isdir(path) and folder_format(path) is not None:
            out.append(Candidate(f"{name}/", "folder", [path]))
    return _one_per_target(sorted(out, key=lambda c: natural_key(c.name)))


def _one_per_target(candidates: list[Candidate]) -> list[Candidate]:
    """One candidate per local file or folder, however many symlinks name it."""
    seen: set[tuple[str, ...]] = set()
    out = []
    for c in candidates:
        locals_ = [sources.local_path(p) for p in c.paths]
        key = tuple(
            os.path.realpath(p) if p is not None else q
            for p, q in zip(locals_, c.paths, strict=True)
        )
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _without_links_to_siblings(folder: str, names: list[str], others: list[str]) -> list[str]:
    """``names`` less the local symlinks to another entry of the folder: Composer's
    ``latest-rank0.pt`` beside the ``ep0-ba2-rank0.pt`` (or ``ep0-ba2/``) it names is one
    checkpoint under two names. Remote folders have no symlinks."""
    local = sources.local_path(folder)
    if local is None:
        return names
    everything = set(names) | set(others) | set(os.listdir(local))
    real = {
        os.path.realpath(os.path.join(local, n))
        for n in everything
        if not os.path.islink(os.path.join(local, n))
    }
    return [
        n
        for n in names
        if not (
            os.path.islink(os.path.join(local, n))
            and os.path.realpath(os.path.join(local, n)) in real
        )
    ]


def linked_from(folder: str, names: list[str], candidate: Candidate) -> bool:
    """Whether one of ``names`` is a local symlink to ``candidate``: Composer's
    ``latest-rank0.pt`` names the checkpoint folder its save folder holds."""
    local = sources.local_path(folder)
    target = sources.local_path(candidate.paths[0])
    if local is None or target is None:
        return False
    real = os.path.realpath(target)
    return any(
        os.path.islink(os.path.join(local, n)) and os.path.realpath(os.path.join(local, n)) == real
        for n in names
    )


def several_checkpoints(folder: str, candidates: list[Candidate]) -> SeveralCheckpointsError:
    """The error for a folder of several checkpoints: their names, newest last."""
    ordered = _newest_last(candidates)
    names = [c.name for c in ordered]
    if len(names) > MAX_NAMED:
        names = [*names[:3], f"… {len(names) - 7} more …", *names[-4:]]
    if len(ordered) == 1:
        what = f"folder holds a checkpoint in {names[0]}, and is not one itself"
    else:
        what = f"folder holds {len(ordered)} checkpoints ({', '.join(names)}; newest last)"
    return SeveralCheckpointsError(
        what,
        path=folder,
        hint="pass one of them; `ckpttool inspect FOLDER` lists them",
        candidates=[c.name for c in ordered],
    )


def _newest_last(candidates: list[Candidate]) -> list[Candidate]:
    """Natural order where every name is numbered (steps, epochs), else by time written."""
    if all(c.epoch is not None or c.step is not None for c in candidates):
        return sorted(candidates, key=lambda c: natural_key(c.name))
    return sorted(candidates, key=lambda c: (_mtime(c.paths), natural_key(c.name)))


def _mtime(paths: list[str]) -> float:
    times = []
    for path in paths:
        local = sources.local_path(path)
        if local is not None:
            try:
                times.append(os.stat(local).st_mtime)
            except OSError:
                pass
    return max(times, default=0.0)


# --- the rows `ckpttool inspect FOLDER` shows --------------------------------------------


def list_checkpoints(
    folder: str,
    candidates: Iterable[Candidate],
    folder_format: FolderFormat,
    file_format: FileFormat,
) -> list[dict[str, Any]]:
    """One row per checkpoint of ``folder``, in natural order; ``folder_format`` and
    ``file_format`` tell an entry's format id from its listing or first bytes.

    Each row: ``name``, ``path``, ``format`` (an id of the contract's table, or None),
    ``world_size``, ``nbytes`` (on disk), ``epoch``, ``step`` (where the name says),
    ``complete`` and, where it is not, ``missing`` (what is missing).
    """
    markers = _trainer_markers(folder)
    candidates = sorted(candidates, key=lambda c: natural_key(c.name))
    # a run's rank files of one step are as many as of any other: a group short of its
    # highest ranks is one whose last ranks are missing, which its names cannot say
    widest = max((max(c.ranks) + 1 for c in candidates if c.kind == "ranks"), default=0)
    rows = []
    for c in candidates:
        fmt, world_size, missing = _describe(c, widest, folder_format, file_format)
        epoch = c.epoch
        if markers is not None and epoch is not None and missing is None:
            missing = _marker_says(folder, markers.get(epoch), epoch)
        rows.append(
            {
                "name": c.name,
                "path": c.paths[0] if c.kind != "ranks" else sources.join(folder, c.name),
                "format": fmt,
                "world_size": world_size,
                "nbytes": sum(_size(p) for p in c.paths),
                "epoch": epoch,
                "step": c.step,
                "complete": missing is None,
                "missing": missing,
            }
        )
    return rows


def _describe(
    c: Candidate, widest: int, folder_format: FolderFormat, file_format: FileFormat
) -> tuple[str | None, int | None, str | None]:
    """(format, world size, what is missing or None) of one candidate; ``widest``: the
    most rank files of one checkpoint in its folder."""
    if c.kind == "file":
        return file_format(c.paths[0]), None, None
    if c.kind == "ranks":
        world_size = max(max(c.ranks) + 1, widest)
        gone = [r for r in range(world_size) if r not in c.ranks]
        missing = None
        if gone:
            shown = ", ".join(map(str, gone[:MAX_NAMED]))
            missing = f"rank{'s' if len(gone) > 1 else ''} {shown}"
        fmt = file_format(c.paths[0])
        if fmt == "torch-zip" and _holds_local_shards(c.paths[0]):
            fmt = "per-rank"
        return fmt, world_size, missing
    path = c.paths[0]
    fmt = folder_format(path)
    names = sources.listdir(path)
    ranks = {int(m.group(1)) for n in names if (m := DCP_DATA_FILE.match(n))}
    if fmt in ("dcp", "megatron") and (ranks or ".metadata" in names):  # (not a run folder's)
        missing = None if ".metadata" in names else ".metadata"
        return fmt, (max(ranks) + 1 if ranks else None), missing
    if fmt == "deepspeed":
        parts = {int(m.group(1)) for n in names if (m := ZERO_PARTITION.match(n))}
        return fmt, (max(parts) + 1 if parts else None), None
    return fmt, None, None


def _holds_local_shards(path: str) -> bool:
    """Whether a rank file's pickle names ShardedTensor or DTensor (its globals scanned,
    nothing rebuilt, nothing run)."""
    from ...unpickler import DTENSOR_CLASSES, SHARDED_TENSOR
    from ..torch_save.zip_pickle import ZipPickle

    seen: set[str] = set()
    try:
        with ZipPickle(path) as archive:
            archive.scan(permissive=True, seen=seen)
    except (OSError, CkptError):
        return False
    return SHARDED_TENSOR in seen or bool(seen & DTENSOR_CLASSES)


def _trainer_markers(folder: str) -> dict[int, str] | None:
    """epoch -> marker name, where the folder is the reference trainer's (it has markers)."""
    found = {
        int(m.group(1)): m.string for n in sources.listdir(folder) if (m := TRAINER_MARKER.match(n))
    }
    return found or None


def _marker_says(folder: str, marker: str | None, epoch: int) -> str | None:
    """What is missing from a trainer snapshot by its marker (None: complete)."""
    if marker is None:
        return f"ep{epoch}.complete"
    raw = sources.read_small(sources.join(folder, marker), MAX_MARKER_BYTES)
    try:
        files = json.loads(raw or b"")["files"]
        listed = {str(name): int(size) for name, size in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"a readable {marker}"
    for name, size in listed.items():
        if not sources.is_contained(name):
            return f"a readable {marker}"
        path = sources.join(folder, *name.split("/"))
        if not sources.isfile(path):
            return name
        if sources.getsize(path) != size:
            return f"{name} bytes ({sources.getsize(path)} of {size})"
    return None


def _size(path: str, depth: int = 0) -> int:
    """Bytes on disk of a file, or of a folder's files (a few levels down)."""
    try:
        if not sources.isdir(path):
            return sources.getsize(path)
        if depth >= MAX_SIZE_DEPTH:
            return 0
        local = sources.local_path(path)
        if local is not None and os.path.islink(local) and depth > 0:
            return 0
        names = sources.listdir(path)[:MAX_SIZE_ENTRIES]
        return sum(_size(sources.join(path, n), depth + 1) for n in names)
    except (OSError, CkptError):
        return 0


# --- a checkpoint of parts in several formats (a run folder) -------------------------

# the files a checkpoint of this format is made of, by their own first bytes
_OWN_FILE_FORMATS = {
    "safetensors-sharded": {"safetensors", "safetensors-sharded"},
    "dcp": {"dcp", "megatron"},
    "megatron": {"dcp", "megatron", "torch-zip"},
    "deepspeed": {"torch-zip", "torch-legacy"},
    "per-rank": {"torch-zip", "torch-legacy"},
}
MAX_PART_FILES = 64  # read the first bytes of this many files at most


def other_formats(
    fmt: str, files: list[str], file_format: FileFormat
) -> list[tuple[str, list[str]]]:
    """The files of a checkpoint whose own format is not ``fmt`` (a run folder's
    ``optimizer.pt`` beside its ``model.safetensors``): (format, file names), by format.
    Empty for a checkpoint of one format, or one of too many files to look at."""
    if len(files) < 2 or len(files) > MAX_PART_FILES:
        return []
    own = _OWN_FILE_FORMATS.get(fmt, {fmt})
    found: dict[str, list[str]] = {}
    for path in files:
        if sources.basename(path).endswith(".index.json"):
            continue
        part = file_format(path)
        if part is not None and part not in own:
            found.setdefault(part, []).append(sources.basename(path))
    return sorted(found.items())
