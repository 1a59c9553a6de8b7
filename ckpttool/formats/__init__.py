"""Format registry: pick a reader from the content of the input, never from its extension.

Each format module has ``FORMAT`` (the contract's id), ``detect(path, head)`` and
``read(path, permissive=...)`` returning a lazy :class:`~ckpttool.tree.Checkpoint`.
A checkpoint spread over several files of another format (per-rank ``torch.save``
files) comes from a module of :data:`MULTI_FILE_FORMATS`, which claims the first
file's tree, names its other files and combines them. Every byte is read through
:mod:`ckpttool.sources`, so a path may be a URL.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import glob
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from .. import sources
from ..errors import (
    CkptError,
    InputNotFoundError,
    SeparateCheckpointsError,
    UnsafeError,
    translate_errors,
)
from ..tree import Checkpoint
from ..unpickler import keep_allowed
from ..zip_records import ZIP_MAGIC
from . import safetensors_file
from .folders import (
    CHECKPOINT_SUFFIXES,
    catalog,
    hf_one_candidate,
    sharded_index,
    single_checkpoint_file,
)
from .prescan import Prescan


class FormatModule(Protocol):
    """What every format module has: its id, a content check and a lazy read."""

    FORMAT: str

    def detect(self, path: str, head: bytes) -> bool: ...

    def read(self, path: str, *, permissive: bool = False) -> Checkpoint: ...


class _OnFirstUse:
    """A format module imported when first needed, so that reading a file costs the
    imports of its own reader only: the pickle readers (the unpickler, its policy and
    tables) cost nothing to a safetensors file, nor DeepSpeed's to any file (~10 ms of
    start-up each).

    ``guards`` map a function of the module to a cheap condition its answer needs (a
    file's name or first bytes): where that fails, the call answers False unimported.
    """

    def __init__(self, name: str, **guards: Callable[..., bool]):
        self._name = name
        self._guards = guards

    def _module(self) -> Any:
        return importlib.import_module(f".{self._name}", __name__)

    def __getattr__(self, attr: str) -> Any:
        guard = self._guards.get(attr)
        if guard is None:
            return getattr(self._module(), attr)

        def guarded(*args: Any) -> bool:
            return guard(*args) and getattr(self._module(), attr)(*args)

        return guarded

    def __repr__(self) -> str:
        return f"<format module {__name__}.{self._name}, imported on first use>"


def _file_named(test: Callable[[str], bool]) -> Callable[[str, bytes], bool]:
    """A ``detect`` guard: a folder (no ``head``) goes to the reader, a file by its name."""
    return lambda path, head: not head or test(sources.basename(path))


def _zip_file(path: str, head: bytes) -> bool:
    return not head or head.startswith(ZIP_MAGIC)


def _dcp_part(name: str) -> bool:
    return name.endswith(".distcp") or name == ".metadata"  # (dcp.is_part_name)


# Each guard is implied by its module's own ``detect`` (or ``claims``) for a file.
megatron = _OnFirstUse(
    "megatron", detect=_file_named(lambda n: _dcp_part(n) or n == "metadata.json")
)
dcp = _OnFirstUse("dcp", detect=_file_named(_dcp_part))
dcp_hf = _OnFirstUse(  # its shard files are named shard-00001-model-00001-of-00001.safetensors
    "dcp.hf_storage",
    detect=_file_named(lambda n: n.startswith("shard-") and n.endswith(".safetensors")),
)
torchscript = _OnFirstUse("torch_save.torchscript", detect=_zip_file)
torch_zip = _OnFirstUse("torch_save.torch_zip", detect=_zip_file)
torch_legacy = _OnFirstUse("torch_save.legacy")
# rank files are torch.save files (per_rank.PART_FORMATS)
per_rank = _OnFirstUse(
    "per_rank", claims=lambda first: first.format in ("torch-zip", "torch-legacy")
)
deepspeed = _OnFirstUse("deepspeed")
run_folders = _OnFirstUse("folders.run_folders")
entry_formats = _OnFirstUse("entries")  # what a folder's entry is, for catalog's listings

# Order matters: TorchScript archives are zips too, so they are tried before torch-zip;
# a DCP folder's data files are read as their folder, so DCP comes first; a Megatron
# torch_dist folder is a DCP folder with more beside it, so it comes before DCP.
FOLDER_FORMATS: list[FormatModule] = [megatron, dcp, sharded_index, dcp_hf, deepspeed]
FILE_FORMATS: list[FormatModule] = [
    megatron,
    dcp,
    torchscript,
    torch_zip,
    sharded_index,
    dcp_hf,
    safetensors_file,
    torch_legacy,
]
# Formats of one checkpoint spread over several files of another format (per-rank
# torch.save files): each claims the tree of the first file read (``claims``), names
# the files that belong with it (``part_files``) and combines them (``read``).
MULTI_FILE_FORMATS = [per_rank]


def expand_paths(paths: Sequence[str]) -> list[str]:
    """Expand quoted globs; keep existing paths as they are."""
    out: list[str] = []
    for path in paths:
        path = sources.strip_file_scheme(os.fspath(path))
        if not sources.exists(path) and glob.has_magic(path):
            matches = sources.glob(path)
            if not matches:
                raise InputNotFoundError("no file matches this pattern", path=path)
            out.extend(matches)
        else:
            out.append(path)
    if not out:
        raise CkptError("no input given")
    return out


def is_output_file(path: str) -> bool:
    """A file of the kinds ckpttool writes as one output (safetensors, a ``torch.save``
    zip): what ``--force`` may replace, local or remote. False for anything else, an
    unreadable file included.
    """
    from .torch_save.zip_container import central_directory

    try:
        head = bytes(sources.read_head(path, 16))
        if safetensors_file.detect(path, head):
            return True
        return head.startswith(ZIP_MAGIC) and b"/data.pkl" in central_directory(path)
    except (OSError, CkptError):  # (sources say CkptError for most of what the OS refuses)
        return False


def require_inputs(paths: Sequence[str]) -> None:
    """Every input is there (a glob matches a file): what a run of several processes
    checks before it starts one, with the lines a read would say.

    Raises:
        InputNotFoundError: One is missing, named.
    """
    for path in expand_paths(paths):
        if not sources.exists(path):
            raise InputNotFoundError("no such file or directory", path=path)


@translate_errors
def read_checkpoint(paths: str | Sequence[str], *, unsafe: bool = False) -> Checkpoint:
    """Read one checkpoint (lazily) from one path, several rank files, or a glob.

    Args:
        paths: A file, a folder (DCP, sharded safetensors), several per-rank files or a glob.
        unsafe: Keep dangerous globals as inert stand-ins instead of refusing the file.

    Raises:
        UnsafeError: A pickle references dangerous globals (exit 3).
        CkptError: Missing, corrupt, truncated or unsupported input (exit 2).
    """
    with gc_paused():
        return _read_checkpoint(paths, unsafe)


def _read_checkpoint(
    paths: str | Sequence[str], unsafe: bool, *, run_folders_ok: bool = True
) -> Checkpoint:
    """``run_folders_ok``: a folder may be read by a framework's rule (see :func:`_read_one`)."""
    files = expand_paths([paths] if isinstance(paths, (str, os.PathLike)) else list(paths))
    if len(files) > 1:  # a shell-expanded shard list (hf-model/*.safetensors): its folder
        folder = sharded_index.folder_of_shards(files)
        files = [folder] if folder is not None else files
    # several files are most likely rank files: judge the others while reading the first
    with Prescan(files[1:], lambda p: _scan_one(p, unsafe)) as prescan:
        first = _read_one(files[0], unsafe, run_folders_ok=run_folders_ok)
        for fmt in MULTI_FILE_FORMATS:
            if fmt.claims(first):
                # (a rank read later, lazily, trusts what the user trusted now)
                read_part = keep_allowed(
                    functools.partial(_read_rank, unsafe=unsafe, run_folders_ok=run_folders_ok)
                )
                try:
                    return fmt.read(first, fmt.part_files(first, files), read_part, prescan.scan)
                except UnsafeError as exc:
                    exc.format = exc.format or fmt.FORMAT
                    raise
    if len(files) == 1:
        return first
    raise separate_checkpoints(first, files)


def separate_checkpoints(first: Checkpoint, files: list[str]) -> SeparateCheckpointsError:
    """The error for several inputs of which the first, ``first``, is a whole checkpoint
    (no sharded tensors to combine with the others'), saying what they are."""
    shown = ", ".join(sources.basename(f) or f for f in files[:4])
    if len(files) > 4:
        shown += f" and {len(files) - 4} more"
    ranks = [per_rank.RANK_RE.match(sources.basename(f)) for f in files]
    if first.format in per_rank.PART_FORMATS and all(ranks):
        stems = {(m.group(1), m.group(3)) for m in ranks if m}
        if len(stems) == 1:  # ep0-rank0.pt, ep0-rank1.pt: what DDP saves, one file per rank
            return SeparateCheckpointsError(
                f"{shown}: rank files without sharded tensors: each rank saved a full copy "
                "of the checkpoint (DDP), not a shard of it",
                files=files,
                hint="pass just one of them",
            )
    name = sources.basename(first.files[0]) if first.files else files[0]
    return SeparateCheckpointsError(
        f"{len(files)} separate checkpoints given ({shown}): {name} is a whole "
        f"{first.format} checkpoint, not one rank's part of a sharded one, so they are "
        "not read as one",
        files=files,
        hint="pass one of them; `ckpttool inspect` and `ckpttool verify` take several, "
        "each in turn",
    )


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a tree is built (or its tensors made).

    Unpickling a real checkpoint creates many thousands of containers, no cycles: each
    allocation-triggered collection would walk the young ones again for nothing
    (about a tenth of a per-rank inspect, 5% of loading 5,000 tensors). Reference
    counting still frees what is dropped, and the collector runs once when it is
    switched back on.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _scan_one(path: str, unsafe: bool) -> tuple[list[str], list[str], list[str]]:
    """(globals, dangerous, unverified) of a torch zip's pickle, judged without rebuilding."""
    from ..unpickler import split_seen
    from .torch_save.zip_pickle import ZipPickle

    if sources.read_head(path, len(ZIP_MAGIC)) != ZIP_MAGIC:
        # legacy rank files: rare, read them in full
        ckpt = _read_one(path, unsafe)
        return ckpt.globals, ckpt.dangerous, ckpt.unverified
    seen: set[str] = set()
    with ZipPickle(path) as archive:
        archive.scan(permissive=unsafe, seen=seen)
    return split_seen(seen)


def _read_rank(path: str, unsafe: bool, run_folders_ok: bool = True) -> Checkpoint:
    """Another rank's file, read when its blocks are first needed (after read_checkpoint)."""
    with gc_paused():
        return _read_one(path, unsafe, run_folders_ok=run_folders_ok)


def _refuse_special_file(path: str) -> None:
    """A local path that is no regular file (a device, a pipe, a socket: a link to
    ``/dev/zero``) is named as what it is: read, it would never end or block.

    Raises:
        CkptError: Naming the kind of file.
    """
    import stat

    local = sources.local_path(path)
    if local is None:
        return
    try:
        mode = os.stat(local).st_mode
    except OSError:
        return  # (read_head says what is wrong)
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    for test, kind in kinds:
        if test(mode):
            raise CkptError(f"{kind}, not a checkpoint file", path=path)


def _read_one(path: str, unsafe: bool, *, run_folders_ok: bool = True) -> Checkpoint:
    """One file or folder. A framework's run folder is read by its rule only where it is
    the input itself (or what the input points at), never as a part of another run
    folder: each part is one checkpoint of a known format. Rules inside rules would let
    a few symlinks (each level's model and optimizer linking to the next level) make a
    small folder a tree of 2**depth reads."""
    if not sources.exists(path):
        raise InputNotFoundError("no such file or directory", path=path)
    if sources.isdir(path):
        # a framework's run folder: its model by rule
        rule = run_folders.find_rule(path) if run_folders_ok else None
        if rule is not None:
            return run_folders.read(
                path,
                rule,
                lambda part: _read_checkpoint(part, unsafe, run_folders_ok=False),
                unsafe=unsafe,
            )
        for fmt in FOLDER_FORMATS:
            if fmt.detect(path, b""):
                return _read(fmt, path, unsafe)
        inner = single_checkpoint_file(path, entry_formats.folder_format)
        if inner is not None:
            return _read_one(inner, unsafe, run_folders_ok=run_folders_ok)
        raise CkptError(
            "folder holds no checkpoint ckpttool knows (no DCP .metadata, no "
            "*.index.json, not exactly one checkpoint file)",
            path=path,
        )
    _refuse_special_file(path)
    try:
        head = sources.read_head(path)
    except OSError as exc:
        raise CkptError(f"cannot read ({exc.strerror})", path=path) from None
    if not head:
        raise CkptError("empty file", path=path)
    for fmt in FILE_FORMATS:
        if fmt.detect(path, head):
            return _read(fmt, path, unsafe)
    raise CkptError(
        "not a checkpoint ckpttool knows (torch.save zip or legacy, TorchScript, "
        "safetensors, sharded safetensors index, DCP folder), nor a pickle",
        path=path,
    )


def folder_checkpoints(folder: str) -> list[dict]:
    """The checkpoints a folder holds, one row each in natural order (``ckpttool inspect``
    of a folder of several): see :func:`ckpttool.formats.folders.catalog.list_checkpoints`.

    Raises:
        CkptError: The folder cannot be listed.
    """
    entries = sources.listdir(folder)
    names = sorted(n for n in entries if n.endswith(CHECKPOINT_SUFFIXES))
    found = catalog.find_candidates(
        folder, hf_one_candidate(names), per_rank.RANK_RE, entry_formats.folder_format
    )
    return catalog.list_checkpoints(
        folder, found, entry_formats.folder_format, entry_formats.file_format
    )


def other_file_formats(fmt: str, files: list[str]) -> list[tuple[str, list[str]]]:
    """The files of a checkpoint of format ``fmt`` that are of another format (a run
    folder's ``optimizer.pt`` beside its ``model.safetensors``): (format, names)."""
    return catalog.other_formats(fmt, files, entry_formats.file_format)


def _read(fmt: FormatModule, path: str, unsafe: bool) -> Checkpoint:
    try:
        return fmt.read(path, permissive=unsafe)
    except UnsafeError as exc:
        exc.format = exc.format or fmt.FORMAT  # (inspect --json names it on exit 3)
        raise
    except CkptError:
        raise
    except MemoryError:
        raise CkptError("corrupt input: absurd sizes", path=path) from None
    except OSError as exc:
        raise CkptError(f"cannot read ({exc.strerror or exc})", path=path) from None
