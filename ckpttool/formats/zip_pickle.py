"""The zip container of torch.save (>= 1.6) and torch.jit.save.

Layout: ``<name>/data.pkl`` plus one ``<name>/data/<key>`` entry per storage.

DCP embeds the same container inside its ``.distcp`` files, so the reader works on
a span of a file too.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from typing import Any

from ..errors import CkptError
from ..stand_ins import Device, check_storage_reference
from ..tree import ByteSource, StorageRef
from ..unpickler import load_pickle

ZIP_MAGIC = b"PK\x03\x04"
# data.pkl holds structure, not tensor bytes; real ones are KB to a few MB.
MAX_PICKLE_BYTES = 1 << 30
# what zipfile raises on a damaged archive: NotImplementedError for flag bits or a
# version it does not know, RuntimeError for an "encrypted" entry (one flipped bit)
ZIP_ERRORS = (
    zipfile.BadZipFile,
    zlib.error,  # an entry marked compressed whose bytes are not
    OSError,
    EOFError,
    ValueError,
    NotImplementedError,
    RuntimeError,
)


def central_directory(path: str) -> bytes:
    """The raw central directory of a zip file (every entry's name), not parsed.

    For a cheap look at the names (is it TorchScript?) before the real read parses it.
    Empty when the file has no readable end record; the real read then says why.
    """
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        tail_start = max(0, size - _END.size - 0xFFFF)  # the end record, then a comment
        f.seek(tail_start)
        tail = f.read()
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or at + _END.size > len(tail):
            return b""
        cd_size, cd_offset = _END.unpack_from(tail, at)[5:7]
        locator = at - _ZIP64_LOCATOR.size
        if locator >= 0 and tail[locator : locator + 4] == b"PK\x06\x07":
            record_offset = _ZIP64_LOCATOR.unpack_from(tail, locator)[2]
            if record_offset + _ZIP64_END.size <= size:  # else damaged: the real read says so
                f.seek(record_offset)
                record = f.read(_ZIP64_END.size)
                if record[:4] == b"PK\x06\x06":
                    cd_size, cd_offset = _ZIP64_END.unpack(record)[8:10]
        if cd_offset + cd_size > size or cd_size > MAX_PICKLE_BYTES:
            return b""
        f.seek(cd_offset)
        return f.read(cd_size)


_END = struct.Struct("<IHHHHIIH")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")


class FileSpan(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of a file from ``start``.

    zipfile reads an archive in many small pieces: its directory from the end, each
    entry's header and the pickle from the start. A DCP folder holds a chunk archive
    per tensor block, thousands of them, so the first and last ``EDGE_BYTES`` of the
    span are read once and those small reads served from memory.
    """

    EDGE_BYTES = 4096

    def __init__(self, path: str, start: int, length: int):
        self._file = open(path, "rb", buffering=0)
        self._start = start
        self._length = length
        self._pos = 0
        edge = min(self.EDGE_BYTES, length)
        fd = self._file.fileno()
        self._head = os.pread(fd, edge, start)
        self._tail_at = length - edge
        self._tail = os.pread(fd, edge, start + self._tail_at)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        pos, end = self._pos, self._pos + n
        if end <= len(self._head):
            got = n
            buffer[:n] = self._head[pos:end]
        elif pos >= self._tail_at and end - self._tail_at <= len(self._tail):
            got = n
            buffer[:n] = self._tail[pos - self._tail_at : end - self._tail_at]
        else:
            got = os.preadv(self._file.fileno(), [memoryview(buffer)[:n]], self._start + pos)
        self._pos += got
        return got

    def close(self) -> None:
        self._file.close()
        super().close()


class ZipPickle:
    """An opened torch zip container: its entry names and a way to unpickle from it.

    Args:
        path: The file.
        start, length: The span of the file that holds the zip (DCP chunks); whole file by default.
    """

    def __init__(self, path: str, start: int = 0, length: int | None = None):
        self.path = path
        self.start = start
        size = os.path.getsize(path)
        self.length = size - start if length is None else length
        stream: Any = FileSpan(path, start, self.length) if (start or length is not None) else path
        try:
            self.zip = zipfile.ZipFile(stream)
            self.infos = {info.filename: info for info in self.zip.infolist()}
        except ZIP_ERRORS as exc:
            raise CkptError(f"truncated or corrupt zip archive ({exc})", path=path) from None
        for info in self.infos.values():
            if info.header_offset + info.compress_size > self.length:
                raise CkptError("zip entry runs past the end of the file (truncated?)", path=path)
        pickles = sorted((n for n in self.infos if n.endswith("/data.pkl")), key=len)
        self.prefix = pickles[0][: -len("data.pkl")] if pickles else None

    def names(self) -> list[str]:
        return list(self.infos)

    def read_entry(self, name: str) -> bytes:
        info = self.infos.get(name)
        if info is not None and info.CRC == 0 and info.file_size:
            # torch.save with ``config.save.compute_crc32 = False`` records every CRC as 0
            # (torch.load does not check them); read such an entry as stored
            source = self.source(name)
            return bytes(source.read(0, source.length))
        try:
            return self.zip.read(name)
        except ZIP_ERRORS as exc:
            raise CkptError(f"corrupt zip entry {name!r} ({exc})", path=self.path) from None

    def big_endian(self) -> bool:
        name = f"{self.prefix}byteorder"
        return name in self.infos and self.read_entry(name).strip() == b"big"

    def source(self, name: str) -> ByteSource:
        info = self.infos.get(name)
        if info is None:
            raise CkptError(
                f"missing zip entry {name!r} (truncated or corrupt file)", path=self.path
            )
        if info.compress_type != zipfile.ZIP_STORED:
            # torch never compresses entries; inflating one could be a zip bomb
            raise CkptError(
                f"compressed zip entry {name!r}: torch never compresses its entries "
                "(re-zipped?), and inflating one could be a zip bomb",
                path=self.path,
                hint="unzip it and zip it again without compression (zip -0)",
            )
        return ByteSource(
            self.path, length=info.file_size, zip_header_offset=self.start + info.header_offset
        )

    def scan(self, *, permissive: bool = False, seen: set[str] | None = None) -> None:
        """Judge the globals of ``data.pkl`` without rebuilding anything (see GlobalsScanner)."""
        data = self.read_entry(self._pickle_info("data.pkl").filename)
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
        if info.file_size > MAX_PICKLE_BYTES:
            raise CkptError(
                f"{entry} of {info.file_size} bytes is implausibly large", path=self.path
            )
        return info

    def load(
        self, *, entry: str = "data.pkl", permissive: bool = False, seen: set[str] | None = None
    ) -> Any:
        """Unpickle ``<prefix>/<entry>`` with lazy storages from ``<prefix>/data/<key>``."""
        info = self._pickle_info(entry)
        big_endian = self.big_endian()
        storages: dict[str, StorageRef] = {}

        def persistent_load(pid: Any) -> Any:
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

        data = self.read_entry(info.filename)
        return load_pickle(data, persistent_load, path=self.path, permissive=permissive, seen=seen)

    def close(self) -> None:
        self.zip.close()

    def __enter__(self) -> ZipPickle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
