"""The ``torch.save`` tar container of PyTorch < 0.4: judged, not read.

``torch.load`` still tries it first on every file that is no zip: a tar holding
``storages`` (a pickled count, then per storage a pickled ``(key, location,
storage_type)`` and its raw bytes, then a pickled list of views), ``tensors`` (a
pickled count, then per tensor a pickled ``(key, storage_id, type)`` and its sizes and
strides as raw numbers) and ``pickle`` (the object, its tensors as persistent ids).
Every one of those pickles runs under ``torch.load(weights_only=False)``, in that
order, so each is judged here in that order, stopping where ``torch.load`` stops (a
missing member). A file none of whose pickles is refused is exit 2: not supported.
"""

from __future__ import annotations

import io
import struct
import tarfile
from typing import IO, Any

from .. import sources
from ..errors import CkptError, UnsafeError
from ..tree import StorageType
from ..unpickler import load_pickle

TAR_BLOCK = 512
MEMBERS = ("storages", "tensors", "pickle")
# A member torch.load reads is at most this large to be judged (they hold tensor bytes).
MAX_MEMBER_BYTES = 1 << 34
# A tar of more member headers than this is no torch file: each costs a header parse.
MAX_MEMBERS = 100_000


def is_tar(head: bytes) -> bool:
    """Whether ``head`` starts with a tar header ``tarfile`` accepts (what torch.load tries)."""
    if len(head) < TAR_BLOCK:
        return False
    try:
        tarfile.TarInfo.frombuf(head[:TAR_BLOCK], tarfile.ENCODING, "surrogateescape")
    except (tarfile.HeaderError, ValueError):
        return False
    return True


def judge_tar(path: str, *, permissive: bool = False) -> None:
    """Judge every pickle of a torch tar container, as ``torch.load`` would meet them.

    Raises:
        UnsafeError: A pickle references dangerous globals (or a member is a link:
            torch.load would unpickle what it points at).
        CkptError: Always otherwise: the container is judged, not read.
    """
    size = sources.getsize(path)
    with sources.open_input(path) as f:
        members = _members(f, path)
        seen: set[str] = set()
        judged = []
        for name in MEMBERS:
            info = members.get(name)
            if info is None:
                break  # torch.load stops here (KeyError), having run what came before
            if not info.isreg():
                raise UnsafeError([f"<tar member {name!r} is a link>"], path=path)
            if info.offset_data + info.size > size or info.size > MAX_MEMBER_BYTES:
                raise CkptError(f"tar member {name!r} runs past the end of the file", path=path)
            f.seek(info.offset_data)
            data = f.read(info.size)
            stream = io.BytesIO(data)
            if name == "storages":
                _judge_storages(stream, path, seen, permissive)
            elif name == "tensors":
                _judge_tensors(stream, path, seen, permissive)
            else:
                load_pickle(stream, path=path, seen=seen, permissive=permissive, scan_only=True)
            judged.append(name)
    what = "its pickles reference no dangerous global" if judged else "no torch member in it"
    raise CkptError(
        f"torch.save tar archive (PyTorch < 0.4) is not supported ({what})",
        path=path,
        hint="re-save it with a newer torch: torch.save(torch.load(f), f2)",
    )


def _members(f: IO[bytes], path: str) -> dict[str, tarfile.TarInfo]:
    """The last member of each name torch.load looks up (tarfile's ``getmember`` takes the
    last), walking the headers without keeping them."""
    try:
        tar = tarfile.open(fileobj=f, mode="r:", format=tarfile.PAX_FORMAT)
    except tarfile.TarError as exc:
        raise CkptError(f"corrupt tar archive ({exc})", path=path) from None
    found: dict[str, tarfile.TarInfo] = {}
    count = 0
    try:
        while (info := tar.next()) is not None:
            count += 1
            if count > MAX_MEMBERS:
                raise CkptError(f"tar archive of more than {MAX_MEMBERS} members", path=path)
            if info.name.rstrip("/") in MEMBERS:
                found[info.name.rstrip("/")] = info
            tar.members.clear()  # type: ignore[attr-defined]  # flat memory, however many headers
    except tarfile.TarError as exc:
        raise CkptError(f"corrupt tar archive ({exc})", path=path) from None
    return found


def _load(stream: IO[bytes], path: str, seen: set[str], permissive: bool) -> Any:
    return load_pickle(stream, path=path, seen=seen, permissive=permissive)


def _count(value: Any, stream: IO[bytes], path: str, what: str) -> int:
    """A pickled count, bounded by the bytes left (each item is a pickle and more)."""
    left = len(stream.getbuffer()) - stream.tell()  # type: ignore[attr-defined]
    if type(value) is not int or not 0 <= value <= left:
        raise CkptError(f"corrupt tar archive: {what} count {value!r:.40}", path=path)
    return value


def _judge_storages(stream: io.BytesIO, path: str, seen: set[str], permissive: bool) -> None:
    count = _count(_load(stream, path, seen, permissive), stream, path, "storage")
    for _ in range(count):
        args = _load(stream, path, seen, permissive)
        storage_type = args[2] if isinstance(args, tuple) and len(args) == 3 else None
        if not isinstance(storage_type, StorageType):
            raise CkptError("corrupt tar archive: a storage record", path=path)
        numel = struct.unpack("<q", _exactly(stream, 8, path))[0]
        if numel < 0:
            raise CkptError("corrupt tar archive: a negative storage size", path=path)
        stream.seek(numel * storage_type.dtype.itemsize, io.SEEK_CUR)
        if stream.tell() > len(stream.getbuffer()):
            raise CkptError("corrupt tar archive: a storage past its member", path=path)
    _load(stream, path, seen, permissive)  # the storage views


def _judge_tensors(stream: io.BytesIO, path: str, seen: set[str], permissive: bool) -> None:
    count = _count(_load(stream, path, seen, permissive), stream, path, "tensor")
    for _ in range(count):
        _load(stream, path, seen, permissive)
        ndim = struct.unpack("<i", _exactly(stream, 4, path))[0]
        if ndim < 0:
            raise CkptError("corrupt tar archive: a negative tensor rank", path=path)
        _exactly(stream, 4 + 16 * ndim + 8, path)


def _exactly(stream: IO[bytes], size: int, path: str) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise CkptError("corrupt tar archive: a member ends early", path=path)
    return data
