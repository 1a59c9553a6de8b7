"""Binary file objects as inputs (``io.BytesIO``, an open file), as ``torch.load`` takes them.

The readers work on paths (they map, ``pread`` and reopen files). An open file of a
regular file on disk is read through its own path; any other object's bytes, from its
current position, are copied once into a private temporary file that is deleted when
nothing read from it needs it any more.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from ..errors import CkptError
from ..tree import Node, ShardedRef, SparseRef, StorageRef, TensorRef, walk

COPY_CHUNK = 16 << 20


def is_file_like(obj: Any) -> bool:
    """A readable object that is not a path (``str``, ``os.PathLike``) nor a list of them."""
    return callable(getattr(obj, "read", None)) and not isinstance(obj, (str, bytes, os.PathLike))


class FileInput:
    """A file object's bytes under a path the readers can open.

    Attributes:
        path: The file's own path, or a temporary copy deleted with this object.
    """

    def __init__(self, fileobj: Any) -> None:
        own = _own_path(fileobj)
        if own is not None:
            self.path = own
            return
        import tempfile  # (imports random, shutil...: only for an in-memory input)

        fd, self.path = tempfile.mkstemp(prefix="ckpttool-", suffix=".input")
        # deleted when the last lazy tensor reading from it goes (see keep_alive)
        weakref.finalize(self, _unlink, self.path)
        try:
            with os.fdopen(fd, "wb") as out:
                while True:
                    chunk = fileobj.read(COPY_CHUNK)
                    if not chunk:
                        break
                    if not isinstance(chunk, (bytes, bytearray, memoryview)):
                        raise CkptError(
                            "the file object gives text, not bytes",
                            hint="open the file in binary mode ('rb')",
                        )
                    out.write(chunk)
        except OSError as exc:
            raise CkptError(f"cannot read the file object ({exc})") from None

    def keep_alive(self, root: Any) -> None:
        """Tie the temporary copy's life to every lazy tensor read from it."""
        for _, node in walk(root):
            for ref in _storage_refs(node):
                if ref.source is not None:
                    ref.source.keep = self  # type: ignore[attr-defined]


def _storage_refs(node: Node) -> list[StorageRef]:
    if isinstance(node, StorageRef):
        return [node]
    if isinstance(node, TensorRef):
        return [node.storage] if node.storage is not None else []
    if isinstance(node, SparseRef):
        return [p.storage for p in node.parts if p.storage is not None]
    if isinstance(node, ShardedRef):
        return [s for shard in node.shards for s in _storage_refs(shard.tensor)]
    return []


def _own_path(fileobj: Any) -> str | None:
    """The path of an open regular file read from its start, if it still names that file."""
    name = getattr(fileobj, "name", None)
    fileno = getattr(fileobj, "fileno", None)
    if not isinstance(name, str) or not callable(fileno):
        return None
    try:
        if fileobj.tell() != 0:
            return None
        here, there = os.fstat(fileno()), os.stat(name)
    except (OSError, ValueError, AttributeError):
        return None
    same = (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
    return os.path.abspath(name) if same and os.path.isfile(name) else None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
