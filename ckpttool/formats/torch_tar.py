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
            # read in place (a member holds every storage's bytes): pickles are read
            # from the file, the data between them skipped
            member = _Member(f, info.offset_data, info.offset_data + info.size, path)
            if name == "storages":
                _judge_storages(member, seen, permissive)
            elif name == "tensors":
                _judge_tensors(member, seen, permissive)
            else:
                member.load(seen, permissive, scan_only=True)
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


class _Member:
    """A member of the tar, read in place from the file: its pickles in turn, its raw
    numbers and data checked against its end."""

    def __init__(self, f: IO[bytes], start: int, end: int, path: str):
        self.f, self.end, self.path = f, end, path
        f.seek(start)

    def left(self) -> int:
        return self.end - self.f.tell()

    def load(self, seen: set[str], permissive: bool, *, scan_only: bool = False) -> Any:
        value = load_pickle(
            self.f, path=self.path, seen=seen, permissive=permissive, scan_only=scan_only
        )
        if self.left() < 0:
            raise CkptError("corrupt tar archive: a pickle runs past its member", path=self.path)
        return value

    def read(self, size: int) -> bytes:
        if not 0 <= size <= self.left():
            raise CkptError("corrupt tar archive: a member ends early", path=self.path)
        return self.f.read(size)

    def skip(self, size: int) -> None:
        if not 0 <= size <= self.left():
            raise CkptError("corrupt tar archive: a storage past its member", path=self.path)
        self.f.seek(size, io.SEEK_CUR)

    def count(self, value: Any, what: str) -> int:
        """A pickled count, bounded by the bytes left (each item is a pickle and more)."""
        if type(value) is not int or not 0 <= value <= self.left():
            raise CkptError(f"corrupt tar archive: {what} count {value!r:.40}", path=self.path)
        return value


def _judge_storages(member: _Member, seen: set[str], permissive: bool) -> None:
    count = member.count(member.load(seen, permissive), "storage")
    for _ in range(count):
        args = member.load(seen, permissive)
        storage_type = args[2] if isinstance(args, tuple) and len(args) == 3 else None
        if not isinstance(storage_type, StorageType):
            raise CkptError("corrupt tar archive: a storage record", path=member.path)
        numel = struct.unpack("<q", member.read(8))[0]
        if numel < 0:
            raise CkptError("corrupt tar archive: a negative storage size", path=member.path)
        member.skip(numel * storage_type.dtype.itemsize)
    member.load(seen, permissive)  # the storage views


def _judge_tensors(member: _Member, seen: set[str], permissive: bool) -> None:
    count = member.count(member.load(seen, permissive), "tensor")
    for _ in range(count):
        member.load(seen, permissive)
        ndim = struct.unpack("<i", member.read(4))[0]
        if ndim < 0:
            raise CkptError("corrupt tar archive: a negative tensor rank", path=member.path)
        member.read(4 + 16 * ndim + 8)
