"""The calls every reader makes on a path (``isdir``, ``listdir``, ``read``, ``join``...),
each picking the :class:`~ckpttool.sources.source.Source` the path belongs to by its URL
scheme; remote sources register on the first URL. Also what a name taken from a file
may be: a file name inside its folder (:func:`child`, :func:`is_contained`).
"""

from __future__ import annotations

import importlib
import os
import posixpath
import re
import urllib.parse
from collections.abc import Callable, Hashable

from ..errors import CkptError
from .source import HEAD_BYTES, LOCAL, URL_RE, Source

# scheme -> factory of its source, registered by the module that implements it (the
# remote module registers fsspec's protocols when it is imported)
_FACTORIES: dict[str, Callable[[str], Source]] = {}


_SOURCES: dict[str, Source] = {}


# the module that registers the URL schemes (None: no remote support built in yet)
_REMOTE_MODULE: str | None = "ckpttool.sources.remote"


def register(scheme: str, factory: Callable[[str], Source]) -> None:
    """Make ``scheme://`` paths read through the source ``factory(scheme)`` returns."""
    _FACTORIES[scheme.lower()] = factory


def forget(scheme: str) -> None:
    """Drop the source made for ``scheme``: the next path of that scheme makes a new one
    (its endpoint or credentials changed)."""
    _SOURCES.pop(scheme.lower(), None)


def unregister(scheme: str) -> None:
    """Remove ``scheme``'s factory and source (one registered for a while)."""
    _FACTORIES.pop(scheme.lower(), None)
    forget(scheme)


def scheme_of(path: str) -> str | None:
    """The URL scheme of a path (``s3``, ``https``...), or None for a local path."""
    match = URL_RE.match(path)
    return match.group(1).lower() if match else None


def is_url(path: str) -> bool:
    scheme = scheme_of(path)
    return scheme is not None and scheme != "file"


def strip_file_scheme(path: str) -> str:
    """``file:///data/x.pt`` -> ``/data/x.pt``; other paths unchanged."""
    return path[len("file://") :] if scheme_of(path) == "file" else path


def source_for(path: str) -> Source:
    """The source a path's bytes are read through.

    Raises:
        CkptError: A URL whose scheme no installed package reads (the hint names the
            extra to install).
    """
    scheme = scheme_of(os.fspath(path))
    if scheme is None or scheme == "file":
        return LOCAL
    source = _SOURCES.get(scheme)
    if source is None:
        factory = _FACTORIES.get(scheme)
        if factory is None and _REMOTE_MODULE is not None:
            # imported on first use: fsspec and its protocols cost nothing to local reads
            importlib.import_module(_REMOTE_MODULE)
            factory = _FACTORIES.get(scheme)
        if factory is None:
            raise CkptError(f"cannot read {scheme}:// paths", path=path)
        source = _SOURCES[scheme] = factory(scheme)
    return source


def transferred() -> tuple[int, int]:
    """(bytes, requests) read so far through every source this process made."""
    made = [LOCAL, *_SOURCES.values()]
    return sum(s.bytes_read for s in made), sum(s.requests for s in made)


def isdir(path: str) -> bool:
    return source_for(path).isdir(path)


def isfile(path: str) -> bool:
    return source_for(path).isfile(path)


def exists(path: str) -> bool:
    return source_for(path).exists(path)


def getsize(path: str) -> int:
    """The file's size.

    Raises:
        InputNotFoundError: No such file.
        CkptError: It cannot be read.
    """
    return source_for(path).size(path)


def listdir(path: str) -> list[str]:
    """Names of a folder's entries, sorted."""
    return source_for(path).listdir(path)


def glob(pattern: str) -> list[str]:
    """Paths matching a glob (its magic in the last part only, for URLs), sorted."""
    return source_for(pattern).glob(pattern)


def read(path: str, offset: int = 0, size: int | None = None) -> bytearray:
    """Exactly ``size`` bytes from ``offset`` (to the end if None), checked against the
    file's size before anything is allocated (see :meth:`Source.read`)."""
    return source_for(path).read(path, offset, size)


def read_head(path: str, size: int = HEAD_BYTES) -> bytes:
    """The first ``size`` bytes of a file, or all of it if it is shorter."""
    source = source_for(path)
    return bytes(source.read(path, 0, min(size, source.size(path))))


def read_small(path: str, limit: int) -> bytes | None:
    """A whole small file (a JSON index, a ``latest`` pointer), or None if it is larger
    than ``limit`` bytes or is no file: a file never makes us read what we don't need."""
    source = source_for(path)
    if not source.isfile(path):
        return None
    size = source.size(path)
    return None if size > limit else bytes(source.read(path, 0, size))


def local_path(path: str) -> str | None:
    """The local path for ``open``/``mmap`` fast paths, or None where bytes are remote."""
    return source_for(path).local_path(path)


def identity(path: str) -> Hashable:
    """A value that changes when the file does (caches key on it)."""
    return source_for(path).identity(path)


def join(folder: str, *names: str) -> str:
    return source_for(folder).join(folder, *names)


def split(path: str) -> tuple[str, str]:
    return source_for(path).split(path)


def dirname(path: str) -> str:
    return split(path)[0]


def basename(path: str) -> str:
    return split(path)[1]


def shown(path: str) -> str:
    """A path as ckpttool shows it (reports, messages): a URL without its user, password,
    query or fragment (pre-signed signatures, tokens); anything else as it is."""
    if not is_url(path):
        return path
    try:
        parts = urllib.parse.urlsplit(path)
    except ValueError:
        return "<url>"
    # user:password@ dropped (not with .hostname: it lowercases hf://User/...); in hf://
    # an @ marks a revision (hf://gpt2@main/...), and its token never is in the URL
    host = parts.netloc if parts.scheme == "hf" else parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}"  # (urlunsplit drops an empty host's //)


def input_name(path: str) -> str:
    """The last part of an input's path, to name outputs after (``ep3`` of
    ``s3://bucket/run/ep3/``, ``model.pt`` of ``https://host/model.pt?X-Amz-Signature=..``):
    never a URL's query or fragment, which may hold a signature."""
    path = strip_file_scheme(path)
    if is_url(path):
        path = urllib.parse.urlsplit(path).path
    return posixpath.basename(posixpath.normpath(path)) if path else ""


def child(folder: str, name: str, *, what: str = "file name", path: str | None = None) -> str:
    """``folder`` joined with a relative ``name`` that a file (an index, ``.metadata``, a
    ``latest`` tag) gives, refused when it could lead out of the folder.

    The check is on the string, never ``os.path.realpath`` (which would break a URL):
    no absolute path, no ``..`` or ``.`` part, no empty part, no scheme, no backslash,
    no NUL. Sub-folders (``zero/fc.weight/fp32.pt``) are allowed.

    Raises:
        CkptError: The name leaves the folder (exit 2); ``path`` is the file naming it.
    """
    if not is_contained(name):
        raise CkptError(f"{what} {name!r} leaves the checkpoint's folder", path=path or folder)
    return join(folder, name)


def is_file_name(name: str) -> bool:
    """True for one name of a file in its folder (a shard, a rank's data file, a tag):
    contained (see :func:`is_contained`) and no sub-folder either."""
    return is_contained(name) and "/" not in name


def is_contained(name: str) -> bool:
    """True for a relative name that stays inside its folder (see :func:`child`)."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    if name.startswith("/") or "://" in name or re.match(r"^[A-Za-z]:", name):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))
