"""The progress callbacks the core reports through (the CLI draws them; the core never prints)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

Progress = Callable[[int], None]
"""Called with the number of bytes just done."""

ProgressFactory = Callable[[int, str], AbstractContextManager[Progress | None]]
"""``factory(total_bytes, description)``: a context manager that yields a :data:`Progress`."""
