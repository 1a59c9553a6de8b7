"""The zip container of torch.save (>= 1.6) and torch.jit.save.

Layout: ``<name>/data.pkl`` plus one ``<name>/data/<key>`` entry per storage.

DCP embeds the same container inside its ``.distcp`` files, so the reader works on
a span of a file too.

What is judged is what torch would load. torch's reader (miniz) finds ``data.pkl``
case-insensitively, picks one of several entries of that name by a binary search over
an unstable sort, reads its data where the local header places it, by the method the
central directory names, and checks no CRC-32. So a damaged or ambiguous container is
not refused outright: every pickle some reader could take from it (each entry of the
name, NUL-truncated twins, the bytes at the local header's offset and at the
directory's, stored or inflated, whatever the CRC says) is judged first, and a
dangerous one is exit 3; only then is the damage reported (exit 2).
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ... import sources
from ...errors import CkptError, TruncatedPickleError, UnsafeError
from ...sources import ByteSpan, DeflatedSpan, inflate
from ...tree import Device, StorageRef, check_storage_reference
from ...unpickler import load_pickle, split_seen, text_persistent_id
from .zip_container import (
    LOCAL_HEADER,
    ZIP_ERRORS,
    ZIP_MAGIC,
    FileSpan,
    central_directory,
    check_flags,
    check_local_header,
    directory_reads,
    entry_ends,
    folded,
    name_variants,
    raw_name,
)

if TYPE_CHECKING:
    from ..skeleton.shard_runs import Parsed

__all__ = ["ZIP_MAGIC", "ZipPickle", "central_directory"]

# A stored data.pkl: its bytes are in the file, which bounds it; real ones are KB to a few MB.
MAX_PICKLE_BYTES = 1 << 30
# A compressed entry (a re-zipped data.pkl, TorchScript code) is inflated at most this far:
# a few MB of deflate can declare gigabytes.
MAX_INFLATED_BYTES = 64 << 20
# A candidate pickle cut at one of these bounds whose judged part ends inside it
NOT_JUDGED = "<a data.pkl past what ckpttool judges: cannot be vouched for>"
# byteorder, version, .data/serialization_id: a word, a number, an id
SMALL_ENTRIES = (
    "byteorder",
    "version",
    ".format_version",
    ".storage_alignment",
    ".data/version",
    ".data/serialization_id",
)
SMALL_ENTRY_BYTES = 64
# A stored data.pkl this large may be a ShardedTensor rank file's, its every rank's shard
# metadata read as records (formats.skeleton.shard_runs); a smaller one is read as a whole
SHARD_RUNS_FROM = 64 << 10


class LocalHeaderCheck:
    """A zip entry's local header check, kept with its bytes until they are first read."""

    def __init__(self, info: zipfile.ZipInfo, name: bytes, path: str, end: int) -> None:
        self.info, self.name, self.path, self.end = info, name, path, end
        self.size = LOCAL_HEADER.size + len(name)

    def __call__(self, header: bytes) -> int:
        return check_local_header(header, self.info, self.name, self.path, self.end)


def _plain(seen: set[str]) -> bool:
    """No global of ``seen`` (as :func:`~ckpttool.unpickler.load_pickle` fills it) is
    dangerous or unverified."""
    _, dangerous, unverified = split_seen(seen)
    return not dangerous and not unverified


class ZipPickle:
    """An opened torch zip container: its entry names and a way to unpickle from it.

    The central directory is parsed by ``zipfile``; entries are read here, each from
    its local header checked against the directory (name, flags, method), within the
    sizes the directory declares and the bytes the file holds, inflated (where
    compressed) in bounded chunks, CRC-checked. Names are looked up as torch looks
    them up (:func:`~ckpttool.formats.torch_save.zip_container.folded`).

    Damage to the container (two entries of one name, a local header that disagrees,
    a CRC-32 mismatch, ...) is found on opening but raised by :meth:`load` and
    :meth:`scan` only once every pickle a reader could take is judged (see the module's
    docstring), and by :meth:`check` for readers that unpickle nothing.

    Args:
        path: The file.
        start, length: The span of the file that holds the zip (DCP chunks); whole file by default.
    """

    def __init__(self, path: str, start: int = 0, length: int | None = None):
        self.path = path
        self.start = start
        self._byteorder: bytes | bytearray | None = None  # read once (big_endian)
        size = sources.getsize(path)
        self.length = size - start if length is None else length
        if start < 0 or self.length < 0 or start + self.length > size:  # a DCP span, say
            raise CkptError(
                f"zip archive of {self.length} bytes at {start} runs past the end of the file "
                "(truncated?)",
                path=path,
            )
        # a local file is opened by zipfile itself (buffered); a span of one (DCP chunks)
        # or a remote file is read through the byte source, its edges cached
        local = sources.local_path(path) if not start and length is None else None
        self._stream: FileSpan | None = None if local else FileSpan(path, start, self.length)
        stream: Any = local if local else self._stream
        if self._stream is not None and not start and length is None:
            for offset, data in directory_reads(path):  # what detection read already
                self._stream.preload(offset, data)
        self._headers: dict[str, bytes] = {}
        # a remote file's local headers are checked when their bytes are first read (see
        # source()): one request per storage would make a remote inspect as slow as its
        # round trips, and a 4 GB file has a thousand storages
        self._remote = sources.local_path(path) is None
        try:
            self.zip = zipfile.ZipFile(stream)
            infos = self.zip.infolist()
        except ZIP_ERRORS as exc:
            if self._stream is not None:
                self._stream.close()
            raise CkptError(f"truncated or corrupt zip archive ({exc})", path=path) from None
        self.infos: dict[str, zipfile.ZipInfo] = {}
        # every entry under each name a reader may look it up by (folded)
        self._named: dict[str, list[zipfile.ZipInfo]] = {}
        for info in infos:
            self.infos.setdefault(info.filename, info)
            for name in name_variants(info):
                self._named.setdefault(name, []).append(info)
        self._ends: dict[str, int] = {}
        self.prefix = self._find_prefix(infos)
        self._damage: CkptError | None = None
        try:
            self._check_directory(infos)
        except CkptError as exc:
            self._damage = exc

    def _check_directory(self, infos: list[zipfile.ZipInfo]) -> None:
        """What makes readers disagree or costs more than a file holds, found before any
        read; raised once the pickles are judged (see :meth:`check`)."""
        for name, found in self._named.items():
            if len(found) > 1:
                shown = found[0].filename if len(set(map(id, found))) > 1 else name
                raise CkptError(
                    f"zip entry {shown!r} appears twice, under one name as torch's reader "
                    "compares them (readers disagree on which one counts)",
                    path=self.path,
                )
        for info in infos:
            self._check_entry(info)
        self._ends = entry_ends(infos, getattr(self.zip, "start_dir", self.length), self.path)
        if self.prefix is not None:
            for name in self.infos:
                if name.endswith(".pkl") and not folded(name).startswith(folded(self.prefix)):
                    raise CkptError(
                        f"zip entry {name!r} is a pickle outside the archive's folder "
                        f"{self.prefix!r}, which torch.load never reads: a second archive "
                        "or a disguised pickle",
                        path=self.path,
                    )
        if self._stream is not None and not self._remote:
            self._prefetch_headers(infos)
        for entry in SMALL_ENTRIES:  # read or not, none of them may be a bomb
            small = self._named.get(folded(f"{self.prefix or ''}{entry}"), [None])[0]
            if small is not None and small.file_size > SMALL_ENTRY_BYTES:
                raise CkptError(
                    f"zip entry {small.filename!r} declares {small.file_size} bytes; "
                    f"it holds at most {SMALL_ENTRY_BYTES}",
                    path=self.path,
                )

    def check(self) -> None:
        """Raise the container's damage, if any (for readers that unpickle nothing:
        :meth:`load` and :meth:`scan` judge the pickles first).

        Raises:
            CkptError: Damage found on opening.
        """
        if self._damage is not None:
            raise self._damage

    def _check_entry(self, info: zipfile.ZipInfo) -> None:
        """What the central directory says of an entry is possible, before any read."""
        check_flags(info.flag_bits, info, self.path)
        if info.header_offset + info.compress_size > self.length:
            raise CkptError("zip entry runs past the end of the file (truncated?)", path=self.path)
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise CkptError(
                f"corrupt zip entry {info.filename!r} (stored, yet {info.compress_size} bytes "
                f"stored and {info.file_size} declared)",
                path=self.path,
            )

    def _find_prefix(self, infos: list[zipfile.ZipInfo]) -> str | None:
        """The archive's folder: torch.load takes the first entry's (``archive/``); None
        when that holds no data.pkl. A pickle outside it (a second archive's data.pkl,
        one under another name) is refused (:meth:`_check_directory`): another reader
        could take it for this one."""
        first = infos[0].filename if infos else ""
        prefix = first[: first.index("/") + 1] if "/" in first else ""
        return prefix if folded(f"{prefix}data.pkl") in self._named else None

    def names(self) -> list[str]:
        self.check()
        return list(self.infos)

    def read_entry(
        self, name: str, limit: int = MAX_INFLATED_BYTES, *, check_crc: bool = True
    ) -> bytes | bytearray:
        """The bytes of entry ``name``, at most ``limit`` of them (else CkptError).

        Raises:
            CkptError: Missing, larger than ``limit``, corrupt (local header, CRC-32 where
                ``check_crc``, deflate stream), or compressed other than by deflate.
        """
        info = self._info(name)
        if info.file_size > limit:
            raise CkptError(
                f"zip entry {name!r} declares {info.file_size} bytes; it holds at most {limit}",
                path=self.path,
            )
        at = self._data_offset(info)
        data: bytes | bytearray
        if info.compress_type == zipfile.ZIP_STORED:
            data = self._read_at(at, info.file_size)
        elif info.compress_type == zipfile.ZIP_DEFLATED:
            data = self._inflate(info, at)
        else:
            raise self._method_error(info)
        if check_crc:
            self._check_crc(info, zlib.crc32(data))
        return data

    def _method_error(self, info: zipfile.ZipInfo) -> CkptError:
        # torch's reader (miniz) inflates deflate and reads stored entries, nothing else
        return CkptError(
            f"zip entry {info.filename!r} is compressed with method {info.compress_type} "
            "(torch reads stored and deflated entries only)",
            path=self.path,
            hint="unzip it and zip it again without compression (zip -0)",
        )

    def _check_crc(self, info: zipfile.ZipInfo, crc: int) -> None:
        """An entry's bytes, of CRC-32 ``crc``, are the ones its directory entry records."""
        # torch.save with ``config.save.compute_crc32 = False`` records every CRC as 0
        # (torch.load does not check them)
        if info.CRC and crc != info.CRC:
            raise CkptError(
                f"corrupt zip entry {info.filename!r} (CRC-32 mismatch)", path=self.path
            )

    def _info(self, name: str) -> zipfile.ZipInfo:
        found = self._named.get(folded(name))
        if not found:
            raise CkptError(
                f"missing zip entry {name!r} (truncated or corrupt file)", path=self.path
            )
        return found[0]

    def _read_at(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of the span (checked to lie inside it)."""
        fp = self.zip.fp
        if fp is None:
            raise CkptError("zip archive closed", path=self.path)
        if offset < 0 or size < 0 or offset + size > self.length:
            raise CkptError("zip entry ends early (truncated?)", path=self.path)
        fp.seek(offset)
        data = fp.read(size)
        if len(data) != size:
            raise CkptError("zip entry ends early (truncated?)", path=self.path)
        return data

    def _prefetch_headers(self, infos: list[zipfile.ZipInfo]) -> None:
        """Read the local headers of every storage entry of a span of a local file (a
        DCP chunk) at once: each is checked when its storage is referenced."""
        spans, wanted = [], []
        for info in infos:
            size = LOCAL_HEADER.size + len(raw_name(info))
            if info.filename.startswith(f"{self.prefix}data/") and (
                info.header_offset + size <= self.length
            ):
                buf = bytearray(size)
                spans.append((memoryview(buf), self.start + info.header_offset))
                wanted.append((info.filename, buf))
        if len(spans) > 1:
            sources.source_for(self.path).read_spans(self.path, spans)
            self._headers = {name: bytes(buf) for name, buf in wanted}

    def _data_offset(self, info: zipfile.ZipInfo) -> int:
        """Where an entry's bytes start in the span, from its checked local header."""
        name = raw_name(info)
        header = self._headers.get(info.filename)
        if header is None:
            header = self._read_at(info.header_offset, LOCAL_HEADER.size + len(name))
        end = self._ends.get(info.filename)
        return info.header_offset + check_local_header(header, info, name, self.path, end)

    def _inflate(self, info: zipfile.ZipInfo, at: int, limit: int | None = None) -> bytearray:
        """A deflated entry, inflated a chunk at a time and never past its declared size
        (nor ``limit``: then its first ``limit`` bytes)."""
        return inflate(
            lambda start, n: self._read_at(at + start, n),
            info.compress_size,
            info.file_size,
            name=info.filename,
            path=self.path,
            limit=limit,
        )

    def big_endian(self, *, check_crc: bool = True) -> bool:
        name = f"{self.prefix}byteorder"
        if folded(name) not in self._named:
            return False
        # read once (its CRC-32 is checked after the pickle's verdict, on the same bytes:
        # a remote file pays one request for it)
        data = self._byteorder
        if data is None:
            data = self._byteorder = self.read_entry(name, SMALL_ENTRY_BYTES, check_crc=False)
        if check_crc:
            self._check_crc(self._info(name), zlib.crc32(data))
        return data.strip() == b"big"

    def source(self, name: str) -> ByteSpan:
        info = self._info(name)
        deflated = None
        if info.compress_type == zipfile.ZIP_DEFLATED:
            # a re-zipped checkpoint (torch reads it): inflated when first read, within
            # what its stored bytes can hold (see sources.inflate)
            deflated = info.compress_size
        elif info.compress_type != zipfile.ZIP_STORED:
            raise self._method_error(info)
        header: dict[str, Any] = {}
        if self._remote:
            # checked on first read instead: inspect of a remote file fetches no header
            offset = 0
            header = {
                "zip_header_offset": self.start + info.header_offset,
                "zip_header_check": LocalHeaderCheck(
                    info, raw_name(info), self.path, self._ends.get(info.filename, self.length)
                ),
            }
        else:
            # the local header is checked now, not on first read: inspect, which reads no
            # tensor bytes, refuses a disguised entry as convert does
            offset = self.start + self._data_offset(info)
        if deflated is None:
            return ByteSpan(self.path, offset, info.file_size, **header)
        return DeflatedSpan(
            self.path, offset, info.file_size, deflated=deflated, name=info.filename, **header
        )

    def scan(self, *, permissive: bool = False, seen: set[str] | None = None) -> None:
        """Judge the globals of ``data.pkl`` without rebuilding anything (see GlobalsScanner)."""
        info = self._judged_pickle("data.pkl", permissive, seen)
        crcs: list[int] = []
        parsed = self._shard_runs(info, records=False, crcs=crcs)
        if parsed is not None:
            found: set[str] = set()
            try:
                load_pickle(parsed.skeleton, path=self.path, seen=found, scan_only=True)
            except CkptError:
                found.add("!")
            if _plain(found):
                if seen is not None:
                    seen.update(found)
                self._check_crcs(info, crcs)
                return
        data = self.read_entry(info.filename, self._pickle_limit(info), check_crc=False)
        load_pickle(data, path=self.path, permissive=permissive, seen=seen, scan_only=True)
        self._check_crcs(info, [zlib.crc32(data)])

    def _check_crcs(self, info: zipfile.ZipInfo, crcs: list[int]) -> None:
        """The CRC-32s of the entries read before the pickle's verdict (torch checks none:
        a mismatch is damage, reported after the verdict): the pickle's (its CRC-32 in
        ``crcs``, or read again) and the byte order's."""
        if crcs:
            self._check_crc(info, crcs[0])
        else:
            self.read_entry(info.filename, self._pickle_limit(info))
        self.big_endian()

    def _judged_pickle(
        self, entry: str, permissive: bool, seen: set[str] | None
    ) -> zipfile.ZipInfo:
        """The entry ``<prefix>/<entry>`` to unpickle, where the container is sound.

        Otherwise every pickle a reader could take is judged first (:meth:`_candidates`),
        then the damage raised.

        Raises:
            UnsafeError: A pickle some reader could take is dangerous (not ``permissive``).
            CkptError: No such pickle, or damage to the container.
        """
        info = self._pickle_info(entry)
        damage = self._damage
        if damage is None and info.file_size > self._pickle_limit(info):
            damage = CkptError(
                f"{entry} of {info.file_size} bytes is implausibly large", path=self.path
            )
        if damage is None and info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            damage = self._method_error(info)
        if damage is None:
            try:
                self._data_offset(info)
            except CkptError as exc:
                damage = exc
        if damage is None:
            return info
        self._judge_candidates(entry, permissive, seen)
        raise damage

    def _pickle_info(self, entry: str) -> zipfile.ZipInfo:
        """The entry ``<prefix>/<entry>`` (the first of its name: see :meth:`_judged_pickle`).

        Raises:
            CkptError: The archive holds no such pickle.
        """
        if self.prefix is None:
            if any(name.endswith("/archive_format") for name in self.infos):
                raise CkptError(
                    "a torch.export archive (.pt2): an exported program, not a checkpoint",
                    path=self.path,
                    hint="torch.export.load(path).state_dict holds its weights; torch.save "
                    "that and ckpttool reads it",
                )
            raise CkptError("zip archive without data.pkl: not a torch checkpoint", path=self.path)
        found = self._named.get(folded(f"{self.prefix}{entry}"))
        if not found:
            raise CkptError(f"missing {entry} in the archive", path=self.path)
        return found[0]

    def _judge_candidates(self, entry: str, permissive: bool, seen: set[str] | None) -> None:
        """Judge every distinct pickle of :meth:`_candidates` (globals only, nothing built).

        Raises:
            UnsafeError: One is dangerous (not ``permissive``).
        """
        import hashlib  # (a damaged archive only: OpenSSL is a few MB of every process)

        judged: set[bytes] = set()
        for data in self._candidates(entry):
            digest = hashlib.sha256(data).digest()
            if digest in judged:
                continue
            judged.add(digest)
            found: set[str] = set()
            try:
                load_pickle(data, path=self.path, permissive=permissive, seen=found, scan_only=True)
            except UnsafeError:
                raise
            except TruncatedPickleError:
                if len(data) in (MAX_PICKLE_BYTES, MAX_INFLATED_BYTES) and not permissive:
                    # cut at a bound, and the part judged ends inside a pickle: what the
                    # rest makes torch do cannot be vouched for (never exit 2)
                    raise UnsafeError(
                        [NOT_JUDGED], path=self.path, reasons={NOT_JUDGED: "not judged"}
                    ) from None
            except CkptError:
                pass  # not a pickle: no reader runs anything from it
            if seen is not None:
                seen.update(found)

    def _candidates(self, entry: str) -> Iterator[bytes | bytearray]:
        """Every pickle a reader could take for ``<prefix>/<entry>``: each entry of that
        name (case folded, or up to a NUL), and any other archive's ``data.pkl``; each
        read at the offset its local header gives (torch, ``zipfile``) and the one the
        directory's name length gives, by the directory's method and the local
        header's, of the directory's size and the local header's."""
        wanted = folded(f"{self.prefix}{entry}")
        infos: list[zipfile.ZipInfo] = []
        for name, found in self._named.items():
            if name == wanted or name.rsplit("/", 1)[-1] == "data.pkl":
                infos += [info for info in found if all(info is not i for i in infos)]
        for info in infos:
            yield from self._readings(info)

    def _readings(self, info: zipfile.ZipInfo) -> Iterator[bytes | bytearray]:
        """The bytes of ``info`` as each reader would read them (:meth:`_candidates`),
        each bounded (MAX_PICKLE_BYTES stored, MAX_INFLATED_BYTES inflated); what no
        reader could read (past the archive, not deflate) is left out."""
        name = raw_name(info)
        try:
            header = self._read_at(info.header_offset, LOCAL_HEADER.size)
        except CkptError:
            header = b""
        offsets, methods, sizes = [], [info.compress_type], [info.compress_size]
        extra = 0
        if header[:4] == ZIP_MAGIC:
            fields = LOCAL_HEADER.unpack_from(header)
            method, stored, name_len, extra = fields[3], fields[7], fields[9], fields[10]
            offsets.append(info.header_offset + LOCAL_HEADER.size + name_len + extra)
            methods.append(method)
            sizes.append(stored)
        offsets.append(info.header_offset + LOCAL_HEADER.size + len(name) + extra)
        for at in dict.fromkeys(offsets):
            for method in dict.fromkeys(methods):
                for stored in dict.fromkeys(sizes):
                    data = self._reading(info, at, method, stored)
                    if data is not None:
                        yield data

    def _reading(
        self, info: zipfile.ZipInfo, at: int, method: int, stored: int
    ) -> bytes | bytearray | None:
        """``stored`` bytes at ``at`` read by ``method``; None where they cannot be."""
        if stored <= 0 or at < 0 or at + stored > self.length:
            return None
        try:
            if method == zipfile.ZIP_STORED:
                return self._read_at(at, min(stored, MAX_PICKLE_BYTES))
            if method == zipfile.ZIP_DEFLATED:
                # the first MAX_INFLATED_BYTES: a verdict on what a bomb begins with
                return inflate(
                    lambda start, n: self._read_at(at + start, n),
                    stored,
                    None,
                    name=info.filename,
                    path=self.path,
                    limit=MAX_INFLATED_BYTES,
                )
        except CkptError:
            return None
        return None

    @staticmethod
    def _pickle_limit(info: zipfile.ZipInfo) -> int:
        stored = info.compress_type == zipfile.ZIP_STORED
        return MAX_PICKLE_BYTES if stored else MAX_INFLATED_BYTES

    def load(
        self, *, entry: str = "data.pkl", permissive: bool = False, seen: set[str] | None = None
    ) -> Any:
        """Unpickle ``<prefix>/<entry>`` with lazy storages from ``<prefix>/data/<key>``."""
        info = self._judged_pickle(entry, permissive, seen)
        big_endian = self.big_endian(check_crc=False)
        storages: dict[str, StorageRef] = {}

        def persistent_load(pid: Any) -> Any:
            pid = text_persistent_id(pid)  # (protocol 0 writes the tuple's text)
            if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
                raise CkptError(f"corrupt pickle: unknown persistent id {pid!r:.80}")
            _, storage_type, key, location, numel = pid[:5]
            check_storage_reference(storage_type, numel)
            key = str(key)
            if key not in storages:
                source = self.source(f"{self.prefix}data/{key}")
                ref = StorageRef(key, storage_type.dtype, numel, str(Device(location)), source)
                if source.length != ref.nbytes:
                    raise CkptError(
                        f"storage {key} holds {source.length} bytes, expected {ref.nbytes} "
                        "(truncated or corrupt file)",
                        path=self.path,
                    )
                ref.big_endian = big_endian
                storages[key] = ref
            return storages[key]

        crcs: list[int] = []
        parsed = self._shard_runs(info, crcs=crcs)
        if parsed is not None:
            found: set[str] = set()
            try:
                root = load_pickle(
                    parsed.skeleton, persistent_load, path=self.path, permissive=permissive,
                    seen=found,
                )  # fmt: skip
            except CkptError:
                root = None
            if root is not None and _plain(found) and parsed.resolve(root):
                if seen is not None:
                    seen.update(found)
                self._check_crcs(info, crcs)
                return root
            storages.clear()  # (anything else: the file is read as a whole)
        data = self.read_entry(info.filename, self._pickle_limit(info), check_crc=False)
        root = load_pickle(data, persistent_load, path=self.path, permissive=permissive, seen=seen)
        self._check_crcs(info, [zlib.crc32(data)])
        return root

    def _shard_runs(
        self, info: zipfile.ZipInfo, records: bool = True, crcs: list[int] | None = None
    ) -> Parsed | None:
        """``data.pkl`` with its runs of ShardMetadata as records (a ShardedTensor rank
        file's: see :mod:`~ckpttool.formats.skeleton.shard_runs`), read a window at a time;
        None for any other pickle. Its CRC-32 goes to ``crcs`` once its last byte is read.

        Its skeleton is read in place of the file only where that read finds nothing
        to say: a skeleton names every global the file does (a run names three, all
        safe, in the one way torch.save uses them), but an error, a dangerous or an
        unverified global is the whole file's to report, as every other file's is."""
        if info.compress_type != zipfile.ZIP_STORED or info.file_size < SHARD_RUNS_FROM:
            return None
        from ..skeleton import shard_runs

        return shard_runs.parse(self._entry_reader(info, crcs), records)

    def _entry_reader(
        self, info: zipfile.ZipInfo, crcs: list[int] | None = None
    ) -> Callable[[int], bytes]:
        """``read(n)`` of a stored entry from its start, ``n`` bytes at a time (fewer at
        its end); its CRC-32 goes to ``crcs`` as its last byte is read (checked after the
        verdict: see :meth:`_check_crcs`)."""
        at, size = self._data_offset(info), info.file_size
        done = crc = 0

        def read(n: int) -> bytes:
            nonlocal done, crc
            n = min(n, size - done)
            data = self._read_at(at + done, n) if n else b""
            done += n
            crc = zlib.crc32(data, crc)
            if n and done == size and crcs is not None:
                crcs.append(crc)
            return data

        return read

    def close(self) -> None:
        self.zip.close()
        if self._stream is not None:  # zipfile leaves a file object it was given open
            self._stream.close()

    def __enter__(self) -> ZipPickle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
