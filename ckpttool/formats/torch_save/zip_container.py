"""The zip container itself: its directory, spans of files, and the checks that make
every reader see the same entries.

A zip describes each entry twice: in the central directory (what ``zipfile`` and
``torch.load`` use) and in a local header before its bytes (what a streaming reader
uses). Anything that lets the two disagree, or that needs a password, is refused.

Names are compared as torch's reader compares them: miniz's ``mz_zip_reader_locate_file``
folds ASCII letters (``Data.pkl`` is ``data.pkl``) and stops at no NUL, where
``zipfile`` (and many a C reader) ends a name at its first NUL.
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Hashable

from ... import sources
from ...errors import CkptError
from ...sources import SourceFile
from ...zip_records import END as _END
from ...zip_records import LOCAL_HEADER, ZIP_MAGIC
from ...zip_records import ZIP64_END as _ZIP64_END
from ...zip_records import ZIP64_LOCATOR as _ZIP64_LOCATOR

# a central directory larger than this is not a checkpoint's (a few KB per thousand entries)
MAX_DIRECTORY_BYTES = 1 << 30
# the end of a zip read first: its end record (and zip64 records), and a small directory
TAIL_BYTES = 4096
# general-purpose flag bits that change how an entry's bytes must be read; torch writes
# bit 3 (sizes in a data descriptor, also in the central directory) and bit 11 (UTF-8)
REFUSED_FLAGS = {
    0x1: "encrypted",
    0x40: "encrypted (strong encryption)",
    0x20: "compressed patched data",
    0x2000: "encrypted central directory",
}
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

    For a cheap look at the names (is it TorchScript?) before the real read parses it:
    the last ``TAIL_BYTES`` (the end record, when the archive has no comment), all of
    the end record's reach (64 KiB of comment) only where that is not enough, then the
    directory where it is not inside what was read. Empty when the file has no
    readable end record; the real read then says why.
    """
    return _directory(path)[1]


def directory_reads(path: str) -> list[tuple[int, bytes]]:
    """What :func:`central_directory` read of a remote file, as (offset, bytes): the
    archive's reader serves its own reads of the end and directory from them."""
    return [] if sources.local_path(path) is not None else _directory(path)[0]


# remote files whose end and directory were read last: (path, identity) -> what
# _central_directory returns; only small directories are kept
_RECENT: dict[tuple[str, Hashable], tuple[list[tuple[int, bytes]], bytes]] = {}
RECENT_FILES = 8
RECENT_MAX_BYTES = 1 << 20


def _directory(path: str) -> tuple[list[tuple[int, bytes]], bytes]:
    if sources.local_path(path) is not None:  # a local read costs less than the lookup
        return _central_directory(path)
    key = (path, sources.identity(path))
    found = _RECENT.pop(key, None)
    if found is None:
        found = _central_directory(path)
        if sum(len(data) for _, data in found[0]) > RECENT_MAX_BYTES:
            return found
    _RECENT[key] = found  # the most recent last
    while len(_RECENT) > RECENT_FILES:
        del _RECENT[next(iter(_RECENT))]
    return found


def _central_directory(path: str) -> tuple[list[tuple[int, bytes]], bytes]:
    """(the ranges read, the raw central directory) of a zip (see central_directory)."""
    size = sources.getsize(path)
    tail_start = max(0, size - TAIL_BYTES)
    tail = bytes(sources.read(path, tail_start, size - tail_start))
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 and tail_start > 0:  # a comment after the end record
        tail_start = max(0, size - _END.size - 0xFFFF)
        tail = bytes(sources.read(path, tail_start, size - tail_start))
        at = tail.rfind(b"PK\x05\x06")
    reads: list[tuple[int, bytes]] = [(tail_start, tail)]
    if at < 0 or at + _END.size > len(tail):
        return reads, b""
    cd_size, cd_offset = _END.unpack_from(tail, at)[5:7]
    locator = at - _ZIP64_LOCATOR.size
    if locator >= 0 and tail[locator : locator + 4] == b"PK\x06\x07":
        record_offset = _ZIP64_LOCATOR.unpack_from(tail, locator)[2]
        if record_offset + _ZIP64_END.size <= size:  # else damaged: the real read says so
            record = _read(path, record_offset, _ZIP64_END.size, tail, tail_start)
            reads.append((record_offset, record))
            if record[:4] == b"PK\x06\x06":
                cd_size, cd_offset = _ZIP64_END.unpack(record)[8:10]
    if cd_offset + cd_size > size or cd_size > MAX_DIRECTORY_BYTES:
        return reads, b""
    directory = _read(path, cd_offset, cd_size, tail, tail_start)
    return [*reads, (cd_offset, directory)], directory


def _read(path: str, offset: int, size: int, tail: bytes, tail_start: int) -> bytes:
    """``size`` bytes at ``offset``: from the tail already read where it holds them."""
    if offset >= tail_start and offset + size <= tail_start + len(tail):
        return tail[offset - tail_start : offset - tail_start + size]
    return bytes(sources.read(path, offset, size))


class FileSpan(SourceFile):
    """A read-only, seekable view of ``length`` bytes of a file from ``start``.

    zipfile reads an archive in many small pieces: its directory from the end, each
    entry's header and the pickle from the start. A DCP folder holds a chunk archive
    per tensor block, thousands of them, so the first and last ``EDGE_BYTES`` of the
    span are read once and those small reads served from memory.
    """

    EDGE_BYTES = 4096

    def __init__(self, path: str, start: int = 0, length: int | None = None):
        super().__init__(path, start, length, edge=self.EDGE_BYTES)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def folded(name: str) -> str:
    """A name as torch's reader matches it: ASCII letters in either case (miniz's
    ``MZ_TOLOWER``; other letters as they are)."""
    return name.translate(_ASCII_LOWER)


def name_variants(info: zipfile.ZipInfo) -> set[str]:
    """The names some reader finds an entry under, folded: the whole name (torch's
    reader) and the name up to its first NUL (``zipfile``'s)."""
    return {folded(info.orig_filename), folded(info.filename)}


def raw_name(info: zipfile.ZipInfo) -> bytes:
    """An entry's name as the central directory stores it (UTF-8 with flag bit 11)."""
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


def check_flags(flags: int, info: zipfile.ZipInfo, path: str, where: str = "") -> None:
    """Refuse the flag bits that change how an entry must be read (REFUSED_FLAGS)."""
    for bit, what in REFUSED_FLAGS.items():
        if flags & bit:
            raise CkptError(
                f"corrupt zip entry {info.filename!r} ({what}: flag bit "
                f"{bit.bit_length() - 1}{where})",
                path=path,
            )


def entry_ends(infos: list[zipfile.ZipInfo], end: int, path: str) -> dict[str, int]:
    """Where each entry must end: where the next one (by offset) begins, or ``end`` (the
    central directory). Entries may not share bytes: a few dozen bytes of directory per
    entry could declare the same megabyte as a thousand storages (overlapping entries
    make the tensors of a small file grow with the square of its entry count).

    Raises:
        CkptError: Two entries overlap, by the least their local headers can take.
    """
    # by offset alone: entries at one offset (the directory may name a header twice)
    # must not be compared themselves
    spans = sorted(((info.header_offset, info) for info in infos), key=lambda span: span[0])
    ends: dict[str, int] = {}
    for index, (start, info) in enumerate(spans):
        limit = spans[index + 1][0] if index + 1 < len(spans) else end
        if start + LOCAL_HEADER.size + len(raw_name(info)) + info.compress_size > limit:
            raise CkptError(
                f"zip entry {info.filename!r} overlaps the next one (corrupt archive)", path=path
            )
        ends[info.filename] = limit
    return ends


def check_local_header(
    header: bytes, info: zipfile.ZipInfo, raw_name: bytes, path: str, end: int | None = None
) -> int:
    """Check an entry's local header against the central directory; return the offset of
    its data from the header. A reader that walks local headers must see the same entry
    (name, method) as one that reads the directory, and neither may need a password;
    its data ends by ``end`` (see :func:`entry_ends`).

    Raises:
        CkptError: A header that is missing or says otherwise.
    """
    if len(header) < LOCAL_HEADER.size or header[:4] != ZIP_MAGIC:
        raise CkptError(f"corrupt zip entry {info.filename!r} (no local header)", path=path)
    _, _, flags, method, _, _, _, _, _, name_len, extra_len = LOCAL_HEADER.unpack_from(header)
    check_flags(flags, info, path, " in its local header")
    name = header[LOCAL_HEADER.size : LOCAL_HEADER.size + name_len]
    if name != raw_name or method != info.compress_type:
        shown = name.decode("utf-8", "replace")
        raise CkptError(
            f"corrupt zip entry {info.filename!r} (its local header says {shown!r}, "
            f"method {method}: the central directory says otherwise)",
            path=path,
        )
    data = LOCAL_HEADER.size + name_len + extra_len
    if end is not None and info.header_offset + data + info.compress_size > end:
        raise CkptError(
            f"zip entry {info.filename!r} overlaps the next one (corrupt archive)", path=path
        )
    return data
