"""``torch-legacy``: the pre-1.6 ``torch.save`` stream (``_use_new_zipfile_serialization=False``).

Layout: pickled magic number, protocol version and sys info, the main pickle
(storages as persistent ids), a pickled list of storage keys, then each storage
as an int64 element count followed by its raw bytes, in that order.
"""

from __future__ import annotations

import os
from typing import Any

from ... import sources
from ...errors import CkptError, UnsafeError
from ...sources import ByteSpan, SourceFile, open_input
from ...tree import Checkpoint, Device, StorageRef, check_storage_reference
from ...unpickler import is_pickle_start, load_pickle, text_persistent_id
from ..made import checkpoint
from .container_records import container_record, container_refusal

FORMAT = "torch-legacy"
MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
TAR_MAGIC_OFFSET = 257


# the magic number as pickle protocols 0 and 1 write it (torch.save(pickle_protocol=1))
TEXT_MAGIC = b"L%dL\n" % MAGIC_NUMBER


def detect(path: str, head: bytes) -> bool:
    """A legacy stream, the tar container before it, or any other pickle: torch.load
    unpickles the start of every file that is no zip, so every such file is judged."""
    if head[:1] == b"\x80" or head.startswith(TEXT_MAGIC):  # protocol 2 (default), or 0/1
        return True
    from .tar import is_tar

    return is_tar(head) or is_pickle_start(head, whole=len(head) < sources.HEAD_BYTES)


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    from .tar import is_tar, judge_tar

    if not is_tar(sources.read_head(path)):
        return _read_stream(path, permissive)
    try:
        judge_tar(path, permissive=permissive)  # refused, or not supported: raises
    except UnsafeError:
        raise
    except CkptError as unsupported:
        # Where torch's tar reader raises a TarError (a member cut short, a bad header
        # past the first), torch.load reads the file again from its start as a legacy
        # stream: the pickles it would meet there are judged too
        try:
            _read_stream(path, permissive)
        except UnsafeError:
            raise
        except CkptError:
            pass
        raise unsupported from None


def _read_stream(path: str, permissive: bool) -> Checkpoint:
    seen: set[str] = set()
    size = sources.getsize(path)
    with open_input(path) as f:
        try:
            magic = load_pickle(f, path=path, seen=seen)
        except UnsafeError as exc:
            exc.format = "pickle"  # the first pickle of a file: whatever it is, it runs
            raise
        if magic != MAGIC_NUMBER:
            raise CkptError(
                "a pickle that is not a torch checkpoint (no torch magic number); "
                "it references no dangerous global",
                path=path,
                hint="plain pickles are not read; if it is a torch file it is corrupt",
            )
        if load_pickle(f, path=path, seen=seen) != PROTOCOL_VERSION:
            raise CkptError("unsupported legacy torch protocol version", path=path)
        sys_info = load_pickle(f, path=path, seen=seen)
        little = not isinstance(sys_info, dict) or sys_info.get("little_endian", True)
        storages: dict[str, StorageRef] = {}
        views: list[tuple[StorageRef, str, int]] = []

        def persistent_load(pid: Any) -> Any:
            pid = text_persistent_id(pid)  # (protocol 0 writes the tuple's text)
            if isinstance(pid, tuple) and pid and pid[0] == "module":
                # ("module", cls, source_file, source): torch checks the source, then
                # hands back the class itself
                return container_record(pid[1:], refused)
            if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
                raise CkptError(f"corrupt pickle: unknown persistent id {pid!r:.80}")
            storage_type, key, location, numel = pid[1:5]
            view = pid[5] if len(pid) > 5 else None
            check_storage_reference(storage_type, numel)
            key = str(key)
            if key not in storages:
                storages[key] = StorageRef(
                    key, storage_type.dtype, numel, str(Device(location)), big_endian=not little
                )
            if view:  # storage views, torch < 0.4: (view_key, offset, size)
                view_key, offset, view_size = _view(view, numel, path)
                ref = StorageRef(
                    str(view_key),
                    storage_type.dtype,
                    view_size,
                    str(Device(location)),
                    big_endian=not little,
                )
                views.append((ref, key, offset))
                return ref
            return storages[key]

        refused: dict[str, str] = {}
        try:
            root = load_pickle(f, persistent_load, path=path, permissive=permissive, seen=seen)
        except CkptError as exc:
            if refused and not permissive:
                raise container_refusal(exc, refused, path) from None
            raise
        if refused and not permissive:
            raise container_refusal(None, refused, path)
        seen.update(f"!{name}" for name in refused)  # (--unsafe: listed as dangerous)
        keys = load_pickle(f, path=path, seen=seen)
        if not isinstance(keys, list):
            raise CkptError("corrupt legacy checkpoint: no storage key list", path=path)
        pos = f.tell()
        layout = []  # (key, storage, where its count is): each storage's data follows it
        for key in keys:
            ref = storages.get(str(key))
            if ref is None:
                raise CkptError(f"corrupt legacy checkpoint: unknown storage {key!r}", path=path)
            layout.append((key, ref, pos))
            pos += 8 + ref.nbytes
        counts = _read_counts(f, [at for _, _, at in layout], size)
        for (key, ref, at), count in zip(layout, counts, strict=True):
            if len(count) < 8:
                raise CkptError("file ends early (truncated)", path=path)
            numel = int.from_bytes(count, "little" if little else "big", signed=True)
            if numel != ref.numel:
                raise CkptError(f"corrupt storage {key}: size does not match", path=path)
            ref.source = ByteSpan(path, at + 8, ref.nbytes)
        if pos > size:
            raise CkptError(f"file ends {pos - size} bytes early (truncated)", path=path)
    for ref, base_key, offset in views:
        base = storages[base_key]
        if base.source is None:
            raise CkptError(f"corrupt legacy checkpoint: storage {base_key} has no data", path=path)
        start = base.source.offset + offset * base.dtype.itemsize
        ref.source = ByteSpan(path, start, ref.nbytes)
    for key, ref in storages.items():
        if ref.source is None:
            raise CkptError(f"corrupt legacy checkpoint: storage {key} has no data", path=path)
    return checkpoint(FORMAT, [path], root, seen)


def _read_counts(f: Any, positions: list[int], size: int) -> list[bytes]:
    """The 8-byte element count at each position of the file under ``f`` (past its
    buffer: each is followed by megabytes of data), empty where the file ends first.
    A remote file's are fetched together (:meth:`Source.read_spans`)."""
    raw = f.raw
    if not isinstance(raw, SourceFile):
        fd = raw.fileno()
        return [os.pread(fd, 8, at) if at + 8 <= size else b"" for at in positions]
    counts = [bytearray(8 if at + 8 <= size else 0) for at in positions]
    spans = [(memoryview(c), at) for c, at in zip(counts, positions, strict=True) if c]
    sources.source_for(raw.path).read_spans(raw.path, spans)
    return [bytes(c) for c in counts]


def _view(view: Any, base_numel: int, path: str) -> tuple[Any, int, int]:
    """A storage view's (key, offset, size), checked to lie inside its base storage:
    they come from the file, and the view's bytes are read from there."""
    if not (isinstance(view, tuple) and len(view) == 3):
        raise CkptError(f"corrupt storage view {view!r:.80}", path=path)
    view_key, offset, size = view
    if not (type(offset) is int and type(size) is int and 0 <= offset <= offset + size):
        raise CkptError(f"corrupt storage view {view!r:.80}", path=path)
    if offset + size > base_numel:
        raise CkptError(
            f"storage view {view_key!r} of {size} elements at {offset} lies outside its base "
            f"storage of {base_numel} (corrupt file)",
            path=path,
        )
    return view_key, offset, size
