"""Where checkpoint bytes come from.

Local files and URLs sit behind one :class:`Source` interface (``source``); the
module-level calls every reader makes on a path (``sources.isdir``, ``sources.read``...)
pick the source by the path's URL scheme (``paths``); a :class:`ByteSpan` says where a
run of bytes lives and reads it into caller buffers (``spans``); a :class:`SourceFile`
is a seekable file over a source's bytes, for ``zipfile`` and the unpickler
(``file_view``). Remote sources (``remote/``) are imported on the first URL.
"""

from __future__ import annotations

from .file_view import OPEN_BLOCK_BYTES, SourceFile, open_input
from .paths import (
    basename,
    child,
    dirname,
    exists,
    forget,
    getsize,
    glob,
    identity,
    input_name,
    is_contained,
    is_file_name,
    is_url,
    isdir,
    isfile,
    join,
    listdir,
    local_path,
    read,
    read_head,
    read_small,
    register,
    scheme_of,
    shown,
    source_for,
    split,
    strip_file_scheme,
    transferred,
    unregister,
)
from .source import (
    HEAD_BYTES,
    LOCAL,
    MAX_OPEN_FILES,
    URL_RE,
    LocalSource,
    OpenFiles,
    Source,
    read_fd_into,
)
from .spans import (
    ByteSpan,
    DeflatedSpan,
    ZipHeaderCheck,
    inflate,
    local_fd,
    open_fd,
    read_at,
    read_span_into,
)

__all__ = [
    "HEAD_BYTES",
    "LOCAL",
    "MAX_OPEN_FILES",
    "OPEN_BLOCK_BYTES",
    "URL_RE",
    "ByteSpan",
    "DeflatedSpan",
    "LocalSource",
    "OpenFiles",
    "Source",
    "SourceFile",
    "ZipHeaderCheck",
    "basename",
    "child",
    "dirname",
    "exists",
    "forget",
    "getsize",
    "glob",
    "identity",
    "inflate",
    "input_name",
    "is_contained",
    "is_file_name",
    "is_url",
    "isdir",
    "isfile",
    "join",
    "listdir",
    "local_path",
    "open_fd",
    "open_input",
    "read",
    "read_at",
    "read_fd_into",
    "read_head",
    "read_small",
    "read_span_into",
    "register",
    "local_fd",
    "scheme_of",
    "shown",
    "source_for",
    "split",
    "strip_file_scheme",
    "transferred",
    "unregister",
]
