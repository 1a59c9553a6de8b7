"""Values the unpickler hands out, sealed against the pickle that asked for them."""

from __future__ import annotations

from typing import Any

from .errors import CkptError


class Sealed:
    """A value the unpickler hands out, which the pickle cannot change afterwards.

    Without a ``__setstate__`` of its own, a pickle's BUILD opcode writes straight into
    an object's ``__dict__`` (frozen dataclasses included): a file could rename the
    ``torch.float32`` it was given, and a writer would then name that in its output.
    """

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise CkptError(f"corrupt pickle: it rewrites the state of a {type(self).__name__}")
