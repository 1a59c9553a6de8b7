"""The zip container of torch.save (>= 1.6) and torch.jit.save.

Layout: ``<name>/data.pkl`` plus one ``<name>/data/<key>`` entry per storage.

DCP embeds the same container inside its ``.distcp`` files, so the reader works on
a span of a file too.
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import sources
from ..errors import CkptError
from ..sources import ByteSpan
from ..tree import Device, StorageRef, check_storage_reference
from ..unpickler import load_pickle, split_seen, text_persistent_id
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
    raw_name,
)

if TYPE_CHECKING:
    from .shard_opcodes import Parsed

__all__ = ["ZIP_MAGIC", "ZipPickle", "central_directory"]

# A stored data.pkl: its bytes are in the file, which bounds it; real ones are KB to a few MB.
MAX_PICKLE_BYTES = 1 << 30
# A compressed entry (a re-zipped data.pkl, TorchScript code) is inflated at most this far:
# a few MB of deflate can declare gigabytes.
MAX_INFLATED_BYTES = 64 << 20
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
INFLATE_CHUNK = 1 << 20
# A stored data.pkl this large may be a ShardedTensor rank file's, its every rank's shard
# metadata read as records (formats.shard_opcodes); a smaller one is read as a whole
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
    compressed) in bounded chunks, CRC-checked.

    Args:
        path: The file.
        start, length: The span of the file that holds the zip (DCP chunks); whole file by default.
    """

    def __init__(self, path: str, start: int = 0, length: int | None = None):
        self.path = path
        self.start = start
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
        self.infos = {info.filename: info for info in infos}
        if len(self.infos) != len(infos):
            twice = next(i.filename for i in infos if self.infos[i.filename] is not i)
            self.close()
            raise CkptError(
                f"zip entry {twice!r} appears twice (readers disagree on which one counts)",
                path=path,
            )
        try:
            for info in infos:
                self._check_entry(info)
            self._ends = entry_ends(infos, getattr(self.zip, "start_dir", self.length), path)
            self.prefix = self._find_prefix(infos)
            if self._stream is not None and not self._remote:
                self._prefetch_headers(infos)
            for entry in SMALL_ENTRIES:  # read or not, none of them may be a bomb
                small = self.infos.get(f"{self.prefix or ''}{entry}")
                if small is not None and small.file_size > SMALL_ENTRY_BYTES:
                    raise CkptError(
                        f"zip entry {small.filename!r} declares {small.file_size} bytes; "
                        f"it holds at most {SMALL_ENTRY_BYTES}",
                        path=path,
                    )
        except CkptError:
            self.close()
            raise

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
        one under another name) is refused: another reader could take it for this one."""
        first = infos[0].filename if infos else ""
        prefix = first[: first.index("/") + 1] if "/" in first else ""
        if f"{prefix}data.pkl" not in self.infos:
            return None
        for name in self.infos:
            if name.endswith(".pkl") and not name.startswith(prefix):
                raise CkptError(
                    f"zip entry {name!r} is a pickle outside the archive's folder "
                    f"{prefix!r}, which torch.load never reads: a second archive or a "
                    "disguised pickle",
                    path=self.path,
                )
        return prefix

    def names(self) -> list[str]:
        return list(self.infos)

    def read_entry(self, name: str, limit: int = MAX_INFLATED_BYTES) -> bytes | bytearray:
        """The bytes of entry ``name``, at most ``limit`` of them (else CkptError).

        Raises:
            CkptError: Missing, larger than ``limit``, corrupt (local header, CRC-32,
                deflate stream), or compressed other than by deflate.
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
            raise CkptError(
                f"zip entry {name!r} is compressed with method {info.compress_type} "
                "(torch writes stored entries)",
                path=self.path,
                hint="unzip it and zip it again without compression (zip -0)",
            )
        self._check_crc(info, zlib.crc32(data))
        return data

    def _check_crc(self, info: zipfile.ZipInfo, crc: int) -> None:
        """An entry's bytes, of CRC-32 ``crc``, are the ones its directory entry records."""
        # torch.save with ``config.save.compute_crc32 = False`` records every CRC as 0
        # (torch.load does not check them)
        if info.CRC and crc != info.CRC:
            raise CkptError(
                f"corrupt zip entry {info.filename!r} (CRC-32 mismatch)", path=self.path
            )

    def _info(self, name: str) -> zipfile.ZipInfo:
        info = self.infos.get(name)
        if info is None:
            raise CkptError(
                f"missing zip entry {name!r} (truncated or corrupt file)", path=self.path
            )
        return info

    def _read_at(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of the span (checked to lie inside it)."""
        fp = self.zip.fp
        if fp is None:
            raise CkptError("zip archive closed", path=self.path)
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
        end = self._ends[info.filename]
        return info.header_offset + check_local_header(header, info, name, self.path, end)

    def _inflate(self, info: zipfile.ZipInfo, at: int) -> bytearray:
        """A deflated entry, inflated a chunk at a time and never past its declared size."""
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        out = bytearray()
        left = info.compress_size
        try:
            while not inflater.eof:
                if not left:
                    raise CkptError(
                        f"corrupt zip entry {info.filename!r} (deflate stream ends early)",
                        path=self.path,
                    )
                chunk = self._read_at(at, min(INFLATE_CHUNK, left))
                at, left = at + len(chunk), left - len(chunk)
                out += inflater.decompress(chunk, info.file_size + 1 - len(out))
                if len(out) > info.file_size:
                    raise CkptError(
                        f"corrupt zip entry {info.filename!r} (inflates past the "
                        f"{info.file_size} bytes it declares)",
                        path=self.path,
                    )
        except zlib.error as exc:
            raise CkptError(
                f"corrupt zip entry {info.filename!r} ({exc})", path=self.path
            ) from None
        if len(out) != info.file_size:
            raise CkptError(
                f"corrupt zip entry {info.filename!r} (inflates to {len(out)} bytes, "
                f"declares {info.file_size})",
                path=self.path,
            )
        return out

    def big_endian(self) -> bool:
        name = f"{self.prefix}byteorder"
        return name in self.infos and self.read_entry(name, SMALL_ENTRY_BYTES).strip() == b"big"

    def source(self, name: str) -> ByteSpan:
        info = self._info(name)
        if info.compress_type != zipfile.ZIP_STORED:
            # torch never compresses entries; inflating one could be a zip bomb
            raise CkptError(
                f"compressed zip entry {name!r}: torch never compresses its entries "
                "(re-zipped?), and inflating one could be a zip bomb",
                path=self.path,
                hint="unzip it and zip it again without compression (zip -0)",
            )
        if self._remote:
            # checked on first read instead: inspect of a remote file fetches no header
            return ByteSpan(
                self.path,
                0,
                info.file_size,
                zip_header_offset=self.start + info.header_offset,
                zip_header_check=LocalHeaderCheck(
                    info, raw_name(info), self.path, self._ends[info.filename]
                ),
            )
        # the local header is checked now, not on first read: inspect, which reads no
        # tensor bytes, refuses a disguised entry as convert does
        offset = self.start + self._data_offset(info)
        return ByteSpan(self.path, offset, info.file_size)

    def scan(self, *, permissive: bool = False, seen: set[str] | None = None) -> None:
        """Judge the globals of ``data.pkl`` without rebuilding anything (see GlobalsScanner)."""
        info = self._pickle_info("data.pkl")
        parsed = self._shard_runs(info, records=False)
        if parsed is not None:
            found: set[str] = set()
            try:
                load_pickle(parsed.skeleton, path=self.path, seen=found, scan_only=True)
            except CkptError:
                found.add("!")
            if _plain(found):
                if seen is not None:
                    seen.update(found)
                return
        data = self.read_entry(info.filename, self._pickle_limit(info))
        load_pickle(data, path=self.path, permissive=permissive, seen=seen, scan_only=True)

    def _pickle_info(self, entry: str) -> zipfile.ZipInfo:
        if self.prefix is None:
            if any(name.endswith("/archive_format") for name in self.infos):
                raise CkptError(
                    "a torch.export archive (.pt2): an exported program, not a checkpoint",
                    path=self.path,
                    hint="torch.export.load(path).state_dict holds its weights; torch.save "
                    "that and ckpttool reads it",
                )
            raise CkptError("zip archive without data.pkl: not a torch checkpoint", path=self.path)
        info = self.infos.get(f"{self.prefix}{entry}")
        if info is None:
            raise CkptError(f"missing {entry} in the archive", path=self.path)
        if info.file_size > self._pickle_limit(info):
            raise CkptError(
                f"{entry} of {info.file_size} bytes is implausibly large", path=self.path
            )
        return info

    @staticmethod
    def _pickle_limit(info: zipfile.ZipInfo) -> int:
        stored = info.compress_type == zipfile.ZIP_STORED
        return MAX_PICKLE_BYTES if stored else MAX_INFLATED_BYTES

    def load(
        self, *, entry: str = "data.pkl", permissive: bool = False, seen: set[str] | None = None
    ) -> Any:
        """Unpickle ``<prefix>/<entry>`` with lazy storages from ``<prefix>/data/<key>``."""
        info = self._pickle_info(entry)
        big_endian = self.big_endian()
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

        parsed = self._shard_runs(info)
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
                return root
            storages.clear()  # (anything else: the file is read as a whole)
        data = self.read_entry(info.filename, self._pickle_limit(info))
        return load_pickle(data, persistent_load, path=self.path, permissive=permissive, seen=seen)

    def _shard_runs(self, info: zipfile.ZipInfo, records: bool = True) -> Parsed | None:
        """``data.pkl`` with its runs of ShardMetadata as records (a ShardedTensor rank
        file's: see :mod:`~ckpttool.formats.shard_opcodes`), read a window at a time;
        None for any other pickle.

        Its skeleton is read in place of the file only where that read finds nothing
        to say: a skeleton names every global the file does (a run names three, all
        safe, in the one way torch.save uses them), but an error, a dangerous or an
        unverified global is the whole file's to report, as every other file's is."""
        if info.compress_type != zipfile.ZIP_STORED or info.file_size < SHARD_RUNS_FROM:
            return None
        from . import shard_opcodes

        return shard_opcodes.parse(self._entry_reader(info), records)

    def _entry_reader(self, info: zipfile.ZipInfo) -> Callable[[int], bytes]:
        """``read(n)`` of a stored entry from its start, ``n`` bytes at a time (fewer at
        its end), its CRC-32 checked as its last byte is read (see :meth:`read_entry`)."""
        at, size = self._data_offset(info), info.file_size
        done = crc = 0

        def read(n: int) -> bytes:
            nonlocal done, crc
            n = min(n, size - done)
            data = self._read_at(at + done, n) if n else b""
            done += n
            crc = zlib.crc32(data, crc)
            if n and done == size:
                self._check_crc(info, crc)
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
