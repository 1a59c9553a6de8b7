"""Hostile containers, built byte by byte: zips, legacy torch streams and safetensors
headers that declare more than they hold, or that read differently depending on which
part of the file a reader believes.

Nothing here imports torch: the pickles are assembled from opcodes, the zip records from
``struct``. Each builder returns the file's bytes; :data:`CASES` says what ckpttool must
make of each (exit code, a phrase of its one stderr line). Used by
``tests/test_hostile_inputs.py``; ``python tests/support/hostile_zips.py DIR`` writes them all
for a look by hand.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GiB = 1 << 30

# ------------------------------------------------------------------ pickles, by opcode


def _str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])  # BININT1
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)  # BININT
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def tensor_pickle(tensors: dict[str, tuple[tuple, int]], storage: str = "FloatStorage") -> bytes:
    """``{name: torch._utils._rebuild_tensor_v2(storage, 0, shape, stride, False, {})}``
    as ``torch.save`` writes it; ``tensors`` maps a name to (persistent id tail, numel of
    the tensor). The persistent id is ``("storage", torch.<storage>, *tail)``."""
    out = b"\x80\x02}"  # PROTO 2, EMPTY_DICT
    for name, (pid_tail, numel) in tensors.items():
        pid = b"(" + _str("storage") + _global("torch", storage)
        for item in pid_tail:
            if isinstance(item, tuple):  # a legacy view: (view key, offset, size)
                pid += b"(" + b"".join(_str(v) if isinstance(v, str) else _int(v) for v in item)
                pid += b"t"
            elif item is None:  # a legacy storage that is no view
                pid += b"N"
            else:
                pid += _str(item) if isinstance(item, str) else _int(item)
        pid += b"tQ"  # TUPLE, BINPERSID
        out += _str(name) + _global("torch._utils", "_rebuild_tensor_v2")
        out += b"(" + pid + _int(0) + _int(numel) + b"\x85" + _int(1) + b"\x85"  # TUPLE1
        out += b"\x89" + _global("collections", "OrderedDict") + b")R"  # NEWFALSE, EMPTY_TUPLE
        out += b"tRs"  # TUPLE, REDUCE, SETITEM
    return out + b"."


# ------------------------------------------------------------------ zip records


@dataclass
class Entry:
    """One zip entry as the central directory and its local header describe it.

    ``data`` is what is stored (compressed already where ``method`` is 8). Everything
    else defaults to the truth and can be set to a lie.
    """

    name: str
    data: bytes
    method: int = 0
    crc: int | None = None  # default: the CRC-32 of the data (stored entries)
    size: int | None = None  # declared uncompressed size; default: len(data) (stored)
    flags: int = 0x808  # what torch writes: sizes in a data descriptor, UTF-8 names
    local_name: str | None = None
    local_flags: int | None = None
    local_extra: bytes = b""  # an extra field in the local header only (torch's padding)


def zip_bytes(entries: list[Entry]) -> bytes:
    """A zip file of ``entries`` in that order, with a central directory and end record."""
    body, directory = b"", b""
    for e in entries:
        crc = zlib.crc32(e.data) if e.crc is None else e.crc
        size = len(e.data) if e.size is None else e.size
        name = e.name.encode()
        local_name = (e.name if e.local_name is None else e.local_name).encode()
        local_flags = e.flags if e.local_flags is None else e.local_flags
        offset = len(body)
        body += struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 20, local_flags, e.method, 0, 0x21,
            crc, len(e.data), size, len(local_name), len(e.local_extra),
        ) + local_name + e.local_extra + e.data  # fmt: skip
        if local_flags & 0x8:  # the data descriptor torch writes after the data
            body += struct.pack("<IIII", 0x08074B50, crc, len(e.data), size)
        directory += struct.pack(
            "<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, e.flags, e.method, 0, 0x21,
            crc, len(e.data), size, len(name), 0, 0, 0, 0, 0, offset,
        ) + name  # fmt: skip
    end = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries),
        len(directory), len(body), 0,
    )  # fmt: skip
    return body + directory + end


def deflate_zeros(nbytes: int) -> bytes:
    """A raw deflate stream of ``nbytes`` zeros (a multiple of 1 MiB), about 1000x smaller.

    One MiB of zeros compressed and fully flushed is a self-contained piece of stream:
    repeated, it makes a bomb without ever holding its inflated size in memory.
    """
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    mib = bytes(1 << 20)
    c.compress(mib)
    c.flush(zlib.Z_FULL_FLUSH)
    piece = c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)
    return piece * (nbytes >> 20) + c.flush()


def deflate(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


def torch_entries(
    pickle: bytes | None = None, storages: dict[str, bytes] | None = None, prefix: str = "archive"
) -> list[Entry]:
    """The entries of a ``torch.save`` zip holding one float32 tensor ``w`` of 4 elements."""
    if storages is None:
        storages = {"0": struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)}
    if pickle is None:
        pickle = tensor_pickle({"w": (("0", "cpu", 4), 4)})
    return [
        Entry(f"{prefix}/data.pkl", pickle),
        Entry(f"{prefix}/byteorder", b"little"),
        *(Entry(f"{prefix}/data/{key}", data) for key, data in storages.items()),
        Entry(f"{prefix}/version", b"3\n"),
        Entry(f"{prefix}/.data/serialization_id", b"1234567890" * 4),
    ]


def overlapping_entries(count: int = 300, shared: int = 1 << 20, one_offset: bool = False) -> bytes:
    """``count`` storages whose stored data all run to the end of one ``shared`` block:
    each entry's bytes hold the local headers after it, then the block. A 1 MB file
    read as 300 MB of tensors (torch.load reads them too); it grows with count squared.
    ``one_offset``: the central directory names the first local header for every one."""
    names = [f"archive/data/{i}" for i in range(count)]
    block_end = sum(30 + len(name) for name in names) + shared
    records = []  # (name, stored bytes or None for a storage, declared size, offset)
    offset = 0
    for name in names:
        size = (block_end - offset - 30 - len(name)) // 4 * 4
        records.append((name, None, size, 0 if one_offset else offset))
        offset += 30 + len(name)
    offset = block_end
    tensors = {f"w{i}": ((str(i), "cpu", r[2] // 4), r[2] // 4) for i, r in enumerate(records)}
    for name, data in [
        ("archive/data.pkl", tensor_pickle(tensors)),
        ("archive/byteorder", b"little"),
        ("archive/version", b"3\n"),
    ]:
        records.append((name, data, len(data), offset))
        offset += 30 + len(name) + len(data)
    body, directory = b"", b""
    for name, data, size, at in records:
        crc = zlib.crc32(data) if data is not None else 0
        head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, size, size,
                           len(name), 0)  # fmt: skip
        body += head + name.encode() + (data or b"")
        if data is None and name == names[-1]:
            body += bytes(shared)
        directory += struct.pack(
            "<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21,
            crc, size, size, len(name), 0, 0, 0, 0, 0, at,
        ) + name.encode()  # fmt: skip
    end = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, len(records), len(records), len(directory), len(body), 0
    )
    return body + directory + end


def _replace(entries: list[Entry], suffix: str, **changes) -> list[Entry]:
    for e in entries:
        if e.name.endswith(suffix):
            for key, value in changes.items():
                setattr(e, key, value)
    return entries


def valid_zip() -> bytes:
    return zip_bytes(torch_entries())


def entry_bomb(suffix: str, inflated: int) -> Callable[[], bytes]:
    """A small entry (``byteorder``, ``version``...) deflated from ``inflated`` zeros."""

    def build() -> bytes:
        bomb = deflate_zeros(inflated)
        crc = zlib.crc32(bytes(1 << 20))  # any: the size is what must stop the read
        return zip_bytes(
            _replace(torch_entries(), suffix, data=bomb, method=8, size=inflated, crc=crc)
        )

    return build


def pickle_bomb() -> bytes:
    """``data.pkl`` deflated: 1 MiB stored, 1 GiB declared and inflated (zeros)."""
    return entry_bomb("/data.pkl", GiB)()


def pickle_inflates_past_declared() -> bytes:
    """``data.pkl`` declaring 1 MiB whose deflate stream holds 64 MiB: the directory's
    size is no promise."""
    bomb = deflate_zeros(64 << 20)
    return zip_bytes(
        _replace(torch_entries(), "/data.pkl", data=bomb, method=8, size=1 << 20, crc=1)
    )


def pickle_of_zeros_under_the_cap() -> bytes:
    """``data.pkl``: 60 MiB of zeros, deflated to 60 KB, truthful sizes and CRC: it is
    inflated (within the cap), then found not to be a pickle."""
    size = 60 << 20
    crc = 0
    for _ in range(60):
        crc = zlib.crc32(bytes(1 << 20), crc)
    bomb = deflate_zeros(size)
    entries = _replace(torch_entries(), "/data.pkl", data=bomb, method=8, size=size, crc=crc)
    return zip_bytes(entries)


def compressed_storage() -> bytes:
    """A storage entry deflated (re-zipped): torch reads it, inflated; so does ckpttool,
    within what deflate can hold."""
    data = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    return zip_bytes(
        _replace(torch_entries(), "/data/0", data=deflate(data), method=8, size=16,
                 crc=zlib.crc32(data))
    )  # fmt: skip


def compressed_pickle() -> bytes:
    """A valid ``data.pkl``, deflated (re-zipped with compression): read, exit 0."""
    pickle = tensor_pickle({"w": (("0", "cpu", 4), 4)})
    entries = torch_entries(pickle)
    return zip_bytes(
        _replace(entries, "/data.pkl", data=deflate(pickle), method=8, crc=zlib.crc32(pickle),
                 size=len(pickle))
    )  # fmt: skip


def crc0_declares_3gb() -> bytes:
    """A stored ``data.pkl`` with CRC 0 (as ``compute_crc32=False`` writes) declaring 3 GB."""
    return zip_bytes(_replace(torch_entries(), "/data.pkl", crc=0, size=3_000_000_000))


def storage_declares_3gb() -> bytes:
    """A storage entry of 8 stored bytes that declares 3 GB, as the pickle does too:
    ``inspect`` shows a 3 GB tensor, ``--stats`` would allocate it before reading."""
    numel = 750_000_000
    pickle = tensor_pickle({"w": (("0", "cpu", numel), numel)})
    entries = torch_entries(pickle, {"0": bytes(8)})
    return zip_bytes(_replace(entries, "/data/0", size=4 * numel))


def local_name_differs(suffix: str, crc0: bool = False) -> Callable[[], bytes]:
    """The central directory names an entry one way, its local header another (a reader
    that walks local headers sees different files than one that reads the directory)."""

    def build() -> bytes:
        entries = torch_entries()
        for e in entries:
            if e.name.endswith(suffix):
                e.local_name = e.name[:-4] + "xxxx"
                if crc0:
                    e.crc = 0
        return zip_bytes(entries)

    return build


def flag_bits(suffix: str, flags: int, local: bool = False) -> Callable[[], bytes]:
    def build() -> bytes:
        change = {"local_flags": flags} if local else {"flags": flags, "local_flags": flags}
        return zip_bytes(_replace(torch_entries(), suffix, **change))

    return build


def crc_mismatch(suffix: str) -> Callable[[], bytes]:
    def build() -> bytes:
        entries = torch_entries()
        for e in entries:
            if e.name.endswith(suffix):
                e.crc = zlib.crc32(e.data) ^ 0xFFFF
        return zip_bytes(entries)

    return build


def second_pickle_first() -> bytes:
    """Two archives in one zip: torch reads the pickle of the FIRST entry's folder, a
    reader that picks the shortest name reads another one."""
    inert = tensor_pickle({"w": (("0", "cpu", 4), 4)})
    other = torch_entries(inert, prefix="zz")
    return zip_bytes([*torch_entries(inert, prefix="archive_long_name"), *other])


def pickle_under_other_name() -> bytes:
    """The pickle stored as ``archive/data.pkl.bak`` and ``archive/model.pkl``: no data.pkl."""
    entries = torch_entries()
    entries[0].name = "archive/model.pkl"
    return zip_bytes(entries)


def pickle_outside_the_archive() -> bytes:
    """A pickle beside the archive's folder (``other/model.pkl``): torch.load never reads
    it, another tool may take it for the checkpoint."""
    entries = torch_entries()
    entries.append(Entry("other/model.pkl", tensor_pickle({})))
    return zip_bytes(entries)


def pickle_inside_the_archive() -> bytes:
    """A second pickle in the archive's folder, as TorchScript archives have
    (traced_inputs.pkl): valid, never read by torch.load."""
    entries = torch_entries()
    entries.append(Entry("archive/notes.pkl", tensor_pickle({})))
    return zip_bytes(entries)


def duplicate_entry() -> bytes:
    """``archive/data.pkl`` twice: which one a reader gets depends on the reader."""
    entries = torch_entries()
    return zip_bytes([entries[0], *entries[1:], Entry("archive/data.pkl", tensor_pickle({}))])


def stored_sizes_disagree() -> bytes:
    """A stored entry whose compressed and uncompressed sizes differ."""
    return zip_bytes(_replace(torch_entries(), "/byteorder", size=5_000_000))


# ------------------------------------------------------------------ legacy torch streams

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def legacy_bytes(pickle: bytes, storages: list[tuple[str, int, bytes]]) -> bytes:
    """A pre-1.6 ``torch.save`` stream: magic, version, sys info, ``pickle``, the key
    list, then each storage as (int64 element count, bytes)."""
    sys_info = (
        b"\x80\x02}(" + _str("protocol_version") + _int(1001) + _str("little_endian") + b"\x88"
        + _str("type_sizes") + b"}(" + _str("short") + _int(2) + _str("int") + _int(4)
        + _str("long") + _int(4) + b"uu."
    )  # fmt: skip
    keys = b"\x80\x02](" + b"".join(_str(k) for k, _, _ in storages) + b"e."  # APPENDS
    out = b"\x80\x02" + _int(LEGACY_MAGIC) + b"." + b"\x80\x02" + _int(1001) + b"."
    out += sys_info + pickle + keys
    for _, numel, data in storages:
        out += struct.pack("<q", numel) + data
    return out


def legacy_view(offset: int, size: int) -> Callable[[], bytes]:
    """A torch < 0.4 storage view of ``size`` elements at ``offset`` of a 4-element base."""

    def build() -> bytes:
        pickle = tensor_pickle({"w": (("0", "cpu", 4, ("v", offset, size)), size)})
        return legacy_bytes(pickle, [("0", 4, struct.pack("<4f", 1, 2, 3, 4))])

    return build


def legacy_valid() -> bytes:
    pickle = tensor_pickle({"w": (("0", "cpu", 4, None), 4)})
    return legacy_bytes(pickle, [("0", 4, struct.pack("<4f", 1, 2, 3, 4))])


# ------------------------------------------------------------------ safetensors headers


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data


def many_empty_tensors(count: int = 1_000_000) -> bytes:
    """``count`` tensors of shape [0]: a 60 MB header, no data."""
    entry = '{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    raw = ("{" + ",".join(f'"t{i}":{entry}' for i in range(count)) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def overlapping_tensors(count: int = 10_000) -> bytes:
    """``count`` tensors that all name the same 4 KiB: a 700 KB file that converts to
    40 MB (safetensors' own loader refuses overlapping offsets)."""
    entry = {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}
    return safetensors_bytes({f"t{i}": entry for i in range(count)}, bytes(4096))


def duplicate_safetensors_key() -> bytes:
    """The same name twice in the header: JSON parsers keep either one."""
    one = '"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    two = '"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
    raw = ("{" + one + "," + two + "}").encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + bytes(8)


def header_entry(entry: str, metadata: str = "") -> Callable[[], bytes]:
    """A header of one 16-byte tensor ``w`` given as raw JSON ``entry`` (and
    ``__metadata__``): what the safetensors library refuses that ``int()`` would take."""

    def build() -> bytes:
        raw = ("{" + metadata + '"w":' + entry + "}").encode()
        raw += b" " * (-len(raw) % 8)
        return len(raw).to_bytes(8, "little") + raw + bytes(16)

    return build


def deeply_nested_header() -> bytes:
    """A 200 KB header nested 100000 levels deep: json recurses once per level."""
    raw = b'{"w":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def deeply_nested_index() -> bytes:
    """A shard index (``*.safetensors.index.json``) nested 100000 levels deep."""
    return b'{"weight_map": {}, "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


# ------------------------------------------------------------------ the corpus


@dataclass(frozen=True)
class Case:
    build: Callable[[], bytes]
    code: int  # the exit code every command must give
    needle: str  # in its one stderr line (exit 2), or "" for a valid file
    suffix: str = ".pt"


CASES: dict[str, Case] = {
    "valid_zip": Case(valid_zip, 0, ""),
    "compressed_pickle": Case(compressed_pickle, 0, ""),
    "byteorder_bomb": Case(entry_bomb("/byteorder", 2 * GiB), 2, "byteorder"),
    # never read by ckpttool, but torch.load inflates them: no valid file has one
    "version_bomb": Case(entry_bomb("/version", 2 * GiB), 2, "'archive/version' declares"),
    "serialization_id_bomb": Case(
        entry_bomb("/.data/serialization_id", 2 * GiB), 2, "serialization_id' declares"
    ),
    "pickle_bomb": Case(pickle_bomb, 2, "data.pkl"),
    "pickle_inflates_past_declared": Case(pickle_inflates_past_declared, 2, "inflates past"),
    "pickle_of_zeros_under_the_cap": Case(pickle_of_zeros_under_the_cap, 2, "pickle"),
    "compressed_storage": Case(compressed_storage, 0, ""),
    "crc0_declares_3gb": Case(crc0_declares_3gb, 2, "data.pkl"),
    "storage_declares_3gb": Case(storage_declares_3gb, 2, "data/0"),
    "stored_sizes_disagree": Case(stored_sizes_disagree, 2, "byteorder"),
    "local_name_differs_pickle": Case(local_name_differs("data.pkl"), 2, "local header"),
    "local_name_differs_pickle_crc0": Case(
        local_name_differs("data.pkl", crc0=True), 2, "local header"
    ),
    "local_name_differs_storage": Case(local_name_differs("/data/0"), 2, "local header"),
    "encrypted_pickle": Case(flag_bits("data.pkl", 0x809), 2, "encrypted"),
    "encrypted_storage": Case(flag_bits("/data/0", 0x809), 2, "encrypted"),
    "encrypted_storage_local_only": Case(flag_bits("/data/0", 0x809, local=True), 2, "encrypted"),
    "patched_data_flag": Case(flag_bits("data.pkl", 0x828), 2, "flag"),
    "no_data_descriptor": Case(flag_bits("/data/0", 0x800), 0, ""),  # sizes in the header
    "crc_mismatch_pickle": Case(crc_mismatch("data.pkl"), 2, "CRC"),
    "crc_mismatch_byteorder": Case(crc_mismatch("/byteorder"), 2, "CRC"),
    "two_archives": Case(second_pickle_first, 2, "'zz/data.pkl'"),
    "pickle_under_other_name": Case(pickle_under_other_name, 2, "data.pkl"),
    "pickle_outside_the_archive": Case(pickle_outside_the_archive, 2, "'other/model.pkl'"),
    "pickle_inside_the_archive": Case(pickle_inside_the_archive, 0, ""),
    "duplicate_entry": Case(duplicate_entry, 2, "archive/data.pkl"),
    "overlapping_entries": Case(overlapping_entries, 2, "overlaps the next one"),
    "entries_at_one_offset": Case(
        lambda: overlapping_entries(3, 64, one_offset=True), 2, "overlaps the next one"
    ),
    "legacy_valid": Case(legacy_valid, 0, ""),
    "legacy_view_past_base": Case(legacy_view(1 << 28, 1 << 28), 2, "view"),
    "legacy_view_negative": Case(legacy_view(-8, 4), 2, "view"),
    "many_empty_tensors": Case(
        many_empty_tensors, 2, "more than any checkpoint file holds", ".safetensors"
    ),
    "overlapping_tensors": Case(overlapping_tensors, 2, "overlap", ".safetensors"),
    "duplicate_safetensors_key": Case(duplicate_safetensors_key, 2, "'w'", ".safetensors"),
    "deeply_nested_header": Case(deeply_nested_header, 2, "nested too deep", ".safetensors"),
    # sizes the library refuses (usize): int() takes true, 4.0, "4" and 4.5 (as 4)
    "shape_of_true": Case(
        header_entry('{"dtype":"F32","shape":[true,4],"data_offsets":[0,16]}'),
        2,
        "entry 'w'",
        ".safetensors",
    ),
    "shape_of_floats": Case(
        header_entry('{"dtype":"F32","shape":[4.5],"data_offsets":[0,16]}'),
        2,
        "entry 'w'",
        ".safetensors",
    ),
    "offsets_as_text": Case(
        header_entry('{"dtype":"F32","shape":[4],"data_offsets":["0","16"]}'),
        2,
        "entry 'w'",
        ".safetensors",
    ),
    "offset_of_5000_digits": Case(
        header_entry('{"dtype":"F32","shape":[4],"data_offsets":[0,1' + "0" * 5000 + "]}"),
        2,
        "corrupt safetensors header",
        ".safetensors",
    ),
    "metadata_not_text": Case(
        header_entry(
            '{"dtype":"F32","shape":[4],"data_offsets":[0,16]}', '"__metadata__":{"n":1},'
        ),
        2,
        "__metadata__ values must be strings",
        ".safetensors",
    ),
    "name_with_a_lone_surrogate": Case(  # an escape no UTF-8 text holds; outputs broke
        header_entry(
            '{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
            '"\\ud800":{"dtype":"F32","shape":[0],"data_offsets":[16,16]}'
        ),
        2,
        "not valid Unicode",
        ".safetensors",
    ),
    "metadata_with_a_lone_surrogate": Case(  # the library refuses the file
        header_entry(
            '{"dtype":"F32","shape":[4],"data_offsets":[0,16]}', '"__metadata__":{"n":"\\ud800"},'
        ),
        2,
        "not valid Unicode",
        ".safetensors",
    ),
    "deeply_nested_index": Case(
        deeply_nested_index, 2, "nested too deep", ".safetensors.index.json"
    ),
}


def main(folder: str) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name, case in CASES.items():
        (out / f"{name}{case.suffix}").write_bytes(case.build())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "hostile")
