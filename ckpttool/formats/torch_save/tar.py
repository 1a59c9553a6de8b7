"""The ``torch.save`` tar container of PyTorch < 0.4: judged, not read.

``torch.load`` still tries it first on every file that is no zip: a tar holding
``storages`` (a pickled count, then per storage a pickled ``(key, location,
storage_type)`` and its raw bytes, then a pickled list of views), ``tensors`` (a
pickled count, then per tensor a pickled ``(key, storage_id, type)`` and its sizes and
strides as raw numbers) and ``pickle`` (the object, its tensors as persistent ids).
Every one of those pickles runs under ``torch.load(weights_only=False)``, in that
order, so each is judged here in that order, stopping where ``torch.load`` stops (a
missing member). Within a member the walk goes as far as torch's loop could: a count is
no bound (torch loops until a load fails), and where ckpttool finds damage torch might
read past, the next member is judged all the same. The main pickle's persistent ids
that are tuples are container records (``(cls, source_file, source)``), judged by the
rule of :func:`.container_records.container_record`. A file none of whose pickles is
refused is exit 2: not supported (or damaged).
"""

from __future__ import annotations

import io
import struct
import tarfile
from typing import IO, Any, NoReturn

from ... import sources
from ...dtypes import DTYPES, STORAGE_CLASSES
from ...errors import CkptError, UnsafeError
from ...tree import Opaque, StorageType
from ...unpickler import load_pickle

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


def judge_tar(path: str, *, permissive: bool = False) -> NoReturn:
    """Judge every pickle of a torch tar container, as ``torch.load`` would meet them.

    Raises:
        UnsafeError: A pickle references dangerous globals (or a member is a link:
            torch.load would unpickle what it points at).
        CkptError: Always otherwise: the container is judged, not read.
    """
    size = sources.getsize(path)
    damage: CkptError | None = None
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
            try:
                _judge_member(f, info, name, size, path, seen, permissive)
            except UnsafeError:
                raise
            except CkptError as exc:
                # torch may stop here, or read on where ckpttool's checks are stricter:
                # the next member is judged all the same, the verdict before the damage
                damage = damage or exc
                continue
            judged.append(name)
    if damage is not None:
        raise damage
    what = "its pickles reference no dangerous global" if judged else "no torch member in it"
    raise CkptError(
        f"torch.save tar archive (PyTorch < 0.4) is not supported ({what})",
        path=path,
        hint="re-save it with a newer torch: torch.save(torch.load(f), f2)",
    )


def _judge_member(
    f: IO[bytes],
    info: tarfile.TarInfo,
    name: str,
    size: int,
    path: str,
    seen: set[str],
    permissive: bool,
) -> None:
    if info.offset_data + info.size > size or info.size > MAX_MEMBER_BYTES:
        raise CkptError(f"tar member {name!r} runs past the end of the file", path=path)
    # read in place (a member holds every storage's bytes): pickles are read from the
    # file, the data between them skipped
    member = _Member(f, info.offset_data, info.offset_data + info.size, path)
    if name == "storages":
        _judge_storages(member, seen, permissive)
    elif name == "tensors":
        _judge_tensors(member, seen, permissive)
    else:
        _judge_main(member, seen, permissive)


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

    def load(self, seen: set[str], permissive: bool, persistent_load: Any = None) -> Any:
        value = load_pickle(
            self.f, persistent_load, path=self.path, seen=seen, permissive=permissive
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
        """A pickled count, as torch's ``range(count)`` takes it: no bound from the bytes
        left (torch loops until a load fails; the caller's loop ends where the member
        does), at most one item per byte left all the same."""
        if not isinstance(value, int) or value < 0:
            raise CkptError(f"corrupt tar archive: {what} count {value!r:.40}", path=self.path)
        return min(value, self.left())


def _judge_storages(member: _Member, seen: set[str], permissive: bool) -> None:
    count = member.count(member.load(seen, permissive), "storage")
    for _ in range(count):
        if not member.left():
            return  # torch's next load fails at the end of the member: nothing more runs
        args = member.load(seen, permissive)
        storage_type = args[2] if isinstance(args, tuple) and len(args) == 3 else None
        itemsize = _element_size(storage_type)
        if itemsize is None:
            raise CkptError("corrupt tar archive: a storage record", path=member.path)
        numel = struct.unpack("<q", member.read(8))[0]
        if numel < 0:
            raise CkptError("corrupt tar archive: a negative storage size", path=member.path)
        member.skip(numel * itemsize)
    member.load(seen, permissive)  # the storage views


def _element_size(storage_type: Any) -> int | None:
    """The element size of a storage class as torch's ``storage_type._dtype`` gives it:
    ``torch.FloatStorage``, or ``torch.cuda.FloatStorage`` (a stand-in here: what GPUs
    saved before 0.4); None for anything else (torch fails on it)."""
    if isinstance(storage_type, StorageType):
        return storage_type.dtype.itemsize
    if isinstance(storage_type, type) and issubclass(storage_type, Opaque):
        if storage_type.module == "torch.cuda" and storage_type.qualname in STORAGE_CLASSES:
            return DTYPES[STORAGE_CLASSES[storage_type.qualname]].itemsize
    return None


def _judge_tensors(member: _Member, seen: set[str], permissive: bool) -> None:
    count = member.count(member.load(seen, permissive), "tensor")
    for _ in range(count):
        if not member.left():
            return
        member.load(seen, permissive)
        ndim = struct.unpack("<i", member.read(4))[0]
        if ndim < 0:
            raise CkptError("corrupt tar archive: a negative tensor rank", path=member.path)
        member.read(4 + 16 * ndim + 8)


def _judge_main(member: _Member, seen: set[str], permissive: bool) -> None:
    """The object's pickle, its persistent ids as torch's tar loader takes them: a tuple is
    a container record, anything else a tensor or storage key (an inert stand-in here)."""
    from .container_records import container_record, container_refusal

    refused: dict[str, str] = {}

    def persistent_load(pid: Any) -> Any:
        if isinstance(pid, tuple):
            return container_record(pid, refused)
        return None

    try:
        member.load(seen, permissive, persistent_load)
    except CkptError as exc:
        if refused and not permissive:
            raise container_refusal(exc, refused, member.path) from None
        raise
    if refused and not permissive:
        raise container_refusal(None, refused, member.path)
