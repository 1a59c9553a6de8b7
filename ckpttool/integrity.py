"""Is a checkpoint whole? Two answers: one from metadata alone, one from every byte.

:func:`check_sizes` (``inspect``) reads no tensor data: every file the checkpoint
names exists and holds at least the bytes its metadata places in it. The readers
check most of this as they parse (a safetensors header against its file, a zip's
entries against its size, a legacy file's storage counts, per-rank files when their
globals are judged); what only the tree says, such as the spans DCP's ``.metadata``
places in its ``.distcp`` files, is checked here, for every format at once.

:func:`verify` (``ckpttool verify``) reads every byte of every file once, front to
back, and checks all that the formats record: each zip record's CRC-32, local header
and data descriptor (torch zips, DCP's stored items, TorchScript archives), each
block of a sharded tensor against the metadata placing it (its file's metadata is
read and its shape compared), the spans, shard coverage and torch's own size fields
the readers check. The first damage is named (file and what is wrong).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat
from typing import Any

from . import sources
from .dtypes import DType
from .errors import CkptError, SeparateCheckpointsError, UnsafeError, UsageError, translate_errors
from .progress import ProgressFactory
from .tree import Checkpoint, ShardedRef, SparseRef, TensorRef, iter_tensors
from .zip_records import ZIP_MAGIC

# (start, end, what lies there) of the bytes a file must hold, by file
Spans = dict[str, list[tuple[int, int, str]]]
# what a block that knows its span of a file holds (a DCP chunk: formats/dcp.DcpChunk)
SPAN_ATTRS = ("path", "offset", "length")


def stored_spans(ckpt: Checkpoint, *, resolve: bool = False) -> Spans:
    """The bytes each file must hold, as the checkpoint's tree places them.

    Args:
        ckpt: A checkpoint from :func:`ckpttool.read`.
        resolve: Also the blocks that another file's metadata places (the other rank
            files of a per-rank checkpoint, DCP's chunk archives): that metadata is
            read, and each block's shape compared with the shard it fills. Without
            it no byte is read.

    Raises:
        CkptError: (``resolve``) A block that does not match its shard, or metadata
            that cannot be read.
    """
    return _spans_of(iter_tensors(ckpt.root), resolve)


def _spans_of(leaves: Iterable[tuple[tuple, Any]], resolve: bool) -> Spans:
    """:func:`stored_spans` of the tensors ``leaves`` (key path, leaf)."""
    spans: Spans = {}

    def add(ref: TensorRef, name: str) -> None:
        source = ref.storage.source if ref.storage is not None else None
        if source is None or source.data is not None or source.path is None:
            return
        if resolve:
            source.resolve()  # (a remote zip entry's data offset, from its local header)
        spans.setdefault(source.path, []).append(
            (source.offset, source.offset + source.length, name)
        )

    for path, leaf in leaves:
        name = ".".join(map(str, path))
        if isinstance(leaf, TensorRef):
            add(leaf, name)
        elif isinstance(leaf, SparseRef):
            for part in leaf.parts:
                add(part, name)
        elif isinstance(leaf, ShardedRef):
            if not resolve and _add_spans_in_bulk(spans, leaf, name):
                continue  # (a 2048-rank DCP folder: millions of chunks)
            for shard in leaf.shards:
                block = shard.tensor
                if resolve:
                    add(_checked_block(leaf, name, shard), name)
                elif isinstance(block, TensorRef):
                    add(block, name)
                else:
                    # a DCP chunk knows its span of its .distcp file without reading it
                    file, start, length = (getattr(block, a, None) for a in SPAN_ATTRS)
                    if isinstance(file, str) and type(start) is int and type(length) is int:
                        spans.setdefault(file, []).append((start, start + length, name))
                    inner = getattr(block, "ref", None)  # a block read as another dtype
                    if isinstance(inner, TensorRef):
                        add(inner, name)
    return spans


_TENSOR = operator.attrgetter("tensor")
_END, _WHAT = operator.itemgetter(1), operator.itemgetter(2)
_SPAN = tuple(map(operator.attrgetter, SPAN_ATTRS))


def _add_spans_in_bulk(spans: Spans, leaf: ShardedRef, name: str) -> bool:
    """:func:`stored_spans` of a sharded tensor whose blocks all know their span and
    hold nothing else (DCP chunks), in C-speed passes; False where they are not such."""
    columns = getattr(leaf.shards, "block_spans", None)  # (DCP chunks kept as columns)
    if columns is not None:
        files, starts, lengths = columns()
    else:
        blocks = list(map(_TENSOR, leaf.shards))
        kinds = set(map(type, blocks))
        kind = kinds.pop() if len(kinds) == 1 else None
        if (
            kind is None
            or issubclass(kind, TensorRef)
            or not set(SPAN_ATTRS) <= set(getattr(kind, "__slots__", ()))
            or hasattr(kind, "ref")
            or any("__dict__" in vars(c) for c in kind.__mro__)  # (its objects hold no more)
        ):
            return False
        files, starts, lengths = (list(map(get, blocks)) for get in _SPAN)
    if set(map(type, files)) != {str} or set(map(type, itertools.chain(starts, lengths))) != {int}:
        return False
    ends = map(operator.add, starts, lengths)
    collections.deque(  # (a loop in C: spans[file].append((start, end, name)))
        map(
            list.append,
            map(spans.setdefault, files, map(list, repeat(()))),
            zip(starts, ends, repeat(name)),
        ),
        maxlen=0,
    )
    return True


def _checked_block(leaf: ShardedRef, name: str, shard: Any) -> TensorRef:
    """The stored tensor of a shard's block, its shape (and a DCP chunk's dtype) checked
    against the metadata that places it."""
    ref = shard.tensor.tensor_ref()
    if tuple(ref.shape) != tuple(shard.sizes):
        raise CkptError(
            f"tensor {name!r}: the block at offsets {list(shard.offsets)} holds shape "
            f"{list(ref.shape)}, the metadata places {list(shard.sizes)}",
            path=ref.storage.source.path if ref.storage and ref.storage.source else None,
        )
    saved = getattr(shard.tensor, "dtype", None)
    if leaf.kind == "dcp" and isinstance(saved, DType) and saved != ref.dtype:
        raise CkptError(
            f"tensor {name!r}: the chunk at offsets {list(shard.offsets)} holds "
            f"{ref.dtype.name}, .metadata says {saved.name}",
            path=getattr(shard.tensor, "path", None),
        )
    return ref


def check_sizes(ckpt: Checkpoint, spans: Spans | None = None) -> dict[str, int]:
    """Every file of the checkpoint exists and holds the bytes its tree places in it.

    Reads no data: one size per file (``inspect`` runs it on every checkpoint).

    Args:
        ckpt: A checkpoint from :func:`ckpttool.read`.
        spans: From :func:`stored_spans` (made here when None).

    Returns:
        Each file's size, the checkpoint's files first.

    Raises:
        CkptError: A missing file, or one shorter than what it must hold (naming it).
    """
    reach = _furthest(ckpt) if spans is None else _reach(spans)
    sizes: dict[str, int] = {}
    for file in [*ckpt.files, *sorted(set(reach) - set(ckpt.files))]:
        if file in sizes:
            continue
        try:
            sizes[file] = size = sources.getsize(file)
        except CkptError:
            if sources.exists(file):
                raise
            raise CkptError(
                "missing: the checkpoint names this file (incomplete copy?)", path=file
            ) from None
        end = reach.get(file)
        if end is not None and end > size:
            # (the greatest name whose bytes end there: the spans listed again, once)
            here = (stored_spans(ckpt) if spans is None else spans)[file]
            what = max(itertools.compress(map(_WHAT, here), map(end.__eq__, map(_END, here))))
            raise CkptError(
                f"file too short: {size:,} bytes, but the checkpoint places the bytes of "
                f"{what!r} up to byte {end:,} (truncated?)",
                path=file,
            )
    return sizes


def unreadable_besides(ckpt: Checkpoint, selected: Mapping[str, Any]) -> list[str]:
    """What a short or missing file costs a conversion of ``selected`` (output name ->
    leaf): nothing when every file is whole; the tensors outside the selection whose
    bytes are gone, one line per file, when the selected ones are whole.

    Raises:
        CkptError: A selected tensor's bytes lie past the end of its file, or in a
            missing one (named: nothing can be written).
    """
    try:
        check_sizes(ckpt)
        return []
    except CkptError as exc:
        whole = exc  # said as inspect says it, where the selection needs that file
    sizes: dict[str, int] = {}

    def size(file: str) -> int:
        if file not in sizes:
            sizes[file] = sources.getsize(file) if sources.exists(file) else -1
        return sizes[file]

    chosen = (((name,), leaf) for name, leaf in selected.items())
    for file, here in _spans_of(chosen, resolve=False).items():
        if any(end > size(file) for _, end, _ in here):
            raise whole
    lost = []
    for file, here in sorted(stored_spans(ckpt).items()):
        names = sorted({name for _, end, name in here if end > size(file)})
        if names:
            shown = ", ".join(repr(n) for n in names[:3]) + (
                f" and {len(names) - 3} more" if len(names) > 3 else ""
            )
            what = "missing" if size(file) < 0 else f"short ({size(file):,} bytes)"
            lost.append(f"{file} is {what}: {shown} cannot be read (not selected; not written)")
    return lost


def _reach(spans: Spans) -> dict[str, int]:
    """Each file's furthest byte (in C: a DCP file has thousands of spans)."""
    return {file: max(map(_END, here)) for file, here in spans.items() if here}


def _furthest(ckpt: Checkpoint) -> dict[str, int]:
    """:func:`_reach` of :func:`stored_spans`, without listing every span: the chunks
    of DCP tensors (``span_ends``: millions at 2048 ranks) reduced in numpy, a file's
    furthest end over every tensor at once; the other tensors' spans listed."""
    reach: dict[str, int] = {}
    others = []
    tables: dict[int, tuple[Sequence[str | None], Any]] = {}  # by chunk table: its files'
    for path, leaf in iter_tensors(ckpt.root):
        span_ends = getattr(getattr(leaf, "shards", None), "span_ends", None)
        if span_ends is None:
            others.append((path, leaf))
            continue
        import numpy as np  # (DCP chunks are read with it: imported already)

        files, file_ids, ends = span_ends()
        files_best = tables.get(id(files))
        if files_best is None:
            files_best = tables[id(files)] = (files, np.full(len(files), -1, np.int64))
        np.maximum.at(files_best[1], file_ids, ends)
    for files, best in tables.values():
        for i in (best >= 0).nonzero()[0].tolist():
            file = files[i]
            if file is not None:
                reach[file] = max(reach.get(file, 0), int(best[i]))
    for file, end in _reach(_spans_of(others, False)).items():
        reach[file] = max(reach.get(file, 0), end)
    return reach


def _zip_archives(path: str, size: int, dcp_spans: dict[str, list[tuple[int, int]]]) -> list:
    """(start, length) of each zip archive in a file: the whole file, or the spans of a
    DCP data file whose bytes start a zip (its stored items; a safetensors blob not)."""
    if path in dcp_spans:
        spans = [(start, length) for start, length in dcp_spans[path] if length >= 4]
        heads = [bytearray(4) for _ in spans]
        wanted = [(memoryview(h), start) for h, (start, _) in zip(heads, spans, strict=True)]
        if wanted:
            sources.source_for(path).read_spans(path, wanted)
        return [span for span, head in zip(spans, heads, strict=True) if head == ZIP_MAGIC]
    head = sources.read_head(path, len(ZIP_MAGIC)) if size >= len(ZIP_MAGIC) else b""
    return [(0, size)] if head == ZIP_MAGIC else []


def _dcp_spans(files: Sequence[str], unsafe: bool) -> dict[str, list[tuple[int, int]]]:
    """The spans of every DCP data file among ``files``, from the ``.metadata`` beside it."""
    from .formats import dcp

    found: dict[str, list[tuple[int, int]]] = {}
    folders = {sources.dirname(f) for f in files if sources.basename(f).endswith(".distcp")}
    for folder in sorted(folders):
        if sources.isfile(sources.join(folder, dcp.METADATA_FILE)):
            found.update(dcp.data_spans(folder, permissive=unsafe))
    return found


def _damage(exc: CkptError, fallback: str) -> dict[str, str]:
    reason = exc.message + (f" ({exc.hint})" if exc.hint else "")
    return {"file": sources.shown(exc.path or fallback), "reason": reason}


def verify(
    paths: Any, *, unsafe: bool = False, progress: ProgressFactory | None = None
) -> dict[str, Any]:
    """Read every byte of a checkpoint once and check everything its formats record.

    Args:
        paths: One checkpoint, as :func:`ckpttool.read` takes it (a file, a folder,
            per-rank files, a glob).
        unsafe: Accept pickles that reference dangerous globals (kept inert).
        progress: ``(total bytes, description) -> context manager`` yielding a callable
            told how many bytes were read (a progress bar).

    Returns:
        ``{"ok", "format", "files", "bytes_checked", "damage"}``: ``files`` lists each
        file (``file``, ``bytes``) with the zip records whose CRC-32 was compared
        (``crc_checked``; ``crc_unrecorded``: saved without one); ``bytes_checked``
        counts the bytes read; ``damage`` is None when the checkpoint is whole, else
        ``{"file", "reason"}`` of the first damage found (``ok`` is then False).

    Raises:
        UnsafeError: A pickle references dangerous globals and ``unsafe`` is False.
        SeparateCheckpointsError: Several inputs that are checkpoints of their own
            (verify each).
        UsageError: Arguments that make no sense.
    """
    result: dict[str, Any] = {
        "ok": False,
        "format": None,
        "files": [],
        "bytes_checked": 0,
        "damage": None,
    }
    try:
        _verify(paths, unsafe, progress, result)
    except (UnsafeError, UsageError, SeparateCheckpointsError):
        raise
    except CkptError as exc:
        first = paths if isinstance(paths, str) or not isinstance(paths, Sequence) else paths[0]
        result["damage"] = _damage(exc, str(first))
        return result
    result["ok"] = True
    return result


@translate_errors
def _verify(
    paths: Any, unsafe: bool, progress: ProgressFactory | None, result: dict[str, Any]
) -> None:
    """:func:`verify`'s reads and checks, filling ``result`` as they go."""
    from .api import read
    from .formats.torch_save import stream_file, zip_tasks
    from .sources import OpenFiles

    ckpt = read(paths, unsafe=unsafe)
    result["format"] = ckpt.format
    check_sizes(ckpt)  # what the tree places, before the blocks' own metadata is read
    sizes = check_sizes(ckpt, stored_spans(ckpt, resolve=True))
    dcp_spans = _dcp_spans(list(sizes), unsafe)
    bar = progress(sum(sizes.values()), "verifying") if progress else contextlib.nullcontext()

    def count(n: int) -> None:
        result["bytes_checked"] += n
        if advance is not None:
            advance(n)

    files = OpenFiles()
    with bar as advance, contextlib.closing(files):
        for file, size in sizes.items():
            entry = {"file": sources.shown(file), "bytes": size, "crc_checked": 0}
            entry["crc_unrecorded"] = 0
            result["files"].append(entry)
            tasks, counts = [], []
            for start, length in _zip_archives(file, size, dcp_spans):
                found, archive_counts = zip_tasks(file, start, length)
                tasks += found
                counts.append(archive_counts)
            try:
                stream_file(file, tasks, files, count)
            finally:
                entry["crc_checked"] = sum(c[0] for c in counts)
                entry["crc_unrecorded"] = sum(c[1] for c in counts)
