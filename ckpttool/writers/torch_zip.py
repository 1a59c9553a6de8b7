"""Write a ``torch.save``-compatible zip, streaming one tensor at a time.

``torch.save`` needs the whole object in memory; this writer copies each tensor's
bytes into its own ``data/<key>`` entry as it goes and pickles the structure last,
with only allow-listed globals, so ``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from typing import Any

import torch

from ..materialize import to_torch, torch_dtype
from ..tree import STORAGE_CLASSES, DType
from . import Progress, iter_chunks, output_dtype

ARCHIVE = "archive"
ALIGNMENT = 64  # torch aligns tensor data to 64 bytes so torch.load(mmap=True) can map it
ZIP64_EXTRA = 20  # zipfile adds a zip64 extra field to local headers with force_zip64
PICKLE_PROTOCOL = 2
_STORAGE_FOR_DTYPE = {
    dtype: name for name, dtype in STORAGE_CLASSES.items() if name != "UntypedStorage"
}


class _Storage:
    def __init__(self, key: str, dtype: DType, numel: int, location: str):
        self.key, self.dtype, self.numel, self.location = key, dtype, numel, location


class _TensorStub:
    """Pickles as torch does: ``_rebuild_tensor_v2(storage, 0, size, stride, False, {})``."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: int) -> Any:
        stride, acc = [], 1
        for n in reversed(self.shape):
            stride.append(acc)
            acc *= max(n, 1)
        args = (
            self.storage,
            0,
            torch.Size(self.shape),
            tuple(reversed(stride)),
            False,
            collections.OrderedDict(),
        )
        if self.storage.dtype.name in _STORAGE_FOR_DTYPE:
            return (torch._utils._rebuild_tensor_v2, args)
        # dtypes without a typed storage class (fp8, uint16...) use v3 with an untyped storage
        return (torch._utils._rebuild_tensor_v3, (*args, torch_dtype(self.storage.dtype)))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            name = _STORAGE_FOR_DTYPE.get(obj.dtype.name)
            if name is None:
                storage_type, numel = torch.storage.UntypedStorage, obj.numel * obj.dtype.itemsize
            else:
                storage_type, numel = getattr(torch, name), obj.numel
            return ("storage", storage_type, obj.key, obj.location, numel)
        return None


class TorchZipWriter:
    """Stream tensors into a torch zip, then pickle the structure that refers to them."""

    def __init__(
        self,
        path: str,
        *,
        cast: DType | None = None,
        location: str = "cpu",
        progress: Progress | None = None,
    ):
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True)
        self.cast, self.location, self.progress = cast, location, progress
        self._count = 0

    def _aligned_info(self, name: str) -> zipfile.ZipInfo:
        info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        header_end = self.zip.fp.tell() + 30 + len(name.encode()) + ZIP64_EXTRA + 4
        info.extra = struct.pack("<HH", 0x4246, -header_end % ALIGNMENT) + b"Z" * (
            -header_end % ALIGNMENT
        )
        return info

    def add_tensor(self, leaf: Any) -> _TensorStub:
        """Write one tensor's bytes now; return what the pickle will hold for it."""
        key = str(self._count)
        self._count += 1
        dt = output_dtype(leaf, self.cast)
        with self.zip.open(
            self._aligned_info(f"{ARCHIVE}/data/{key}"), "w", force_zip64=True
        ) as out:
            for chunk in iter_chunks(leaf, self.cast):
                out.write(chunk)
                if self.progress:
                    self.progress(len(chunk))
        return _TensorStub(_Storage(key, dt, leaf.numel, self.location), tuple(leaf.shape))

    def convert(self, node: Any) -> Any:
        """The structure with every lazy tensor written and replaced by its stub."""
        return to_torch(node, self.add_tensor)

    def finish(self, structure: Any) -> None:
        data = io.BytesIO()
        _Pickler(data, protocol=PICKLE_PROTOCOL).dump(structure)
        self.zip.writestr(f"{ARCHIVE}/data.pkl", data.getvalue())
        self.zip.writestr(f"{ARCHIVE}/byteorder", "little")
        self.zip.writestr(f"{ARCHIVE}/version", "3\n")
        self.zip.writestr(f"{ARCHIVE}/.format_version", "1")
        self.zip.writestr(f"{ARCHIVE}/.storage_alignment", str(ALIGNMENT))
        self.zip.close()


def write_torch(
    path: str,
    root: Any,
    *,
    cast: DType | None = None,
    location: str = "cpu",
    progress: Progress | None = None,
) -> None:
    """Write ``root`` (a nested structure with lazy tensors) as a torch.save file."""
    writer = TorchZipWriter(path, cast=cast, location=location, progress=progress)
    try:
        writer.finish(writer.convert(root))
    finally:
        writer.zip.close()
