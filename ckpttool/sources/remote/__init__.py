"""Checkpoints where they live: ``https://``, ``s3://``, ``hf://`` and other fsspec URLs.

Importing this package registers the URL schemes with :mod:`ckpttool.sources` (which
imports it on the first URL it meets, so local commands never load it, nor fsspec):

- ``http://`` and ``https://``: :class:`~ckpttool.sources.remote.http.HttpSource`, the standard
  library's ``http.client`` with every response checked (206 and a ``Content-Range``
  that matches the request, the full body, the same ETag / Last-Modified / size as at
  first contact); no extra package.
- ``s3://`` (``ckpttool[s3]``: s3fs), ``hf://`` (``ckpttool[hf]``: huggingface_hub),
  ``gs://`` (gcsfs), ``az://``/``abfs://`` (adlfs) and the other fsspec protocols:
  :class:`~ckpttool.sources.remote.store.StoreSource`, through fsspec, the file-system layer
  DCP and huggingface_hub use. A protocol whose package is missing says which to install.

Both share :class:`~ckpttool.sources.remote.base.RemoteSource`: a small block cache that turns
the many tiny reads of a zip directory or a pickle into a few ranged requests, large
reads straight into the caller's buffer, ``read_spans`` in parallel, bounded retries.
"""

from __future__ import annotations

from ... import sources
from .base import RemoteSource, TransientError, redact, with_retries
from .http import HttpSource
from .store import STORE_SCHEMES, StoreSource

__all__ = [
    "HttpSource",
    "RemoteSource",
    "StoreSource",
    "TransientError",
    "redact",
    "register_all",
    "with_retries",
]


def register_all() -> None:
    """Register every URL scheme this package reads with :func:`sources.register`."""
    for scheme in ("http", "https"):
        sources.register(scheme, HttpSource)
    for scheme in STORE_SCHEMES:
        sources.register(scheme, StoreSource)


register_all()
