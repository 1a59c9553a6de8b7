"""The ``torch.save`` family: every container torch has written and how its pickles are read.

===========================  ================================================================
``zip_container``            the zip itself, read as ``torch.load`` reads it (names, offsets)
``zip_pickle``               a zip's ``data.pkl`` judged and rebuilt, storages as byte spans
``zip_stream``               a zip read front to back, for inputs that cannot seek
``torch_zip``                ``torch-zip``: the format module of torch >= 1.6 files
``torchscript``              ``torchscript``: a ``torch.jit.save`` archive, its code judged
``legacy``                   ``torch-legacy``: the pre-1.6 pickle stream (and its tar)
``tar``                      the pre-1.4 tar container
``container_records``        the legacy ``('module', cls, file, source)`` records, judged
===========================  ================================================================

One floor below the families made of torch.save files (DCP's non-tensor items, rank files,
DeepSpeed's and Megatron's pickles); it imports none of them. Its face, for the rest of
ckpttool: a zip's central directory (what ``--force`` checks) and the stream of every
byte (``verify``).
"""

from __future__ import annotations

from .zip_container import central_directory
from .zip_stream import stream_file, zip_tasks

__all__ = ["central_directory", "stream_file", "zip_tasks"]
