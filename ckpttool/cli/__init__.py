"""The ``ckpttool`` command line: a thin layer that parses options, calls one library
function, renders the result. The only package that imports typer or rich."""

from __future__ import annotations

from . import convert, diff, inspect, merge, verify  # noqa: F401  (each registers its command)
from .entry import app, main

__all__ = ["app", "main"]
